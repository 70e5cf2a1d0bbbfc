"""``python -m bench.paired``: two modes in the same processes, their steps alternated, compared step by step.

A run of ``python -m bench`` times each mode in its own processes, a few steps
a round; on a shared machine a mode's median moves by a fifth or more between
rounds (``docs/performance.md``), more than the few percent some targets are
about. Here every rank builds both modes from the same parameters, in one
process and one process group, and runs their steps in turns (A B, then B A,
...), so both see the same machine at the same moment. The figure is the
median over steps of the paired ratio (or difference) of step times, each pair
taken a step apart; the medians of each mode are shown beside it.

Peak memory is not measured here (both modes share a process); ``python -m
bench`` gives it.

Command: ``python -m bench.paired --size 34m --modes funcshard/no_shard,ddp``
writes ``bench/results/paired/<size>-w<W>-<a>-vs-<b>.json`` and ``.md``.
``--size deep --world-size 1 --modes funcshard/full_shard,plain`` gives the
per-unit overhead over plain PyTorch: the median paired difference over the
units.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import model as gpt
from bench.modes import MODES
from bench.report import provenance


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.paired", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--size", default="34m", choices=list(gpt.SIZES))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--modes", required=True, help="two modes, comma-separated: A,B (A / B is shown)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each mode first")
    p.add_argument("--steps", type=int, default=20, help="timed steps of each mode")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--tiny", action="store_true", help="the shrunk model: a smoke run")
    p.add_argument("--out", default="bench/results/paired")
    p.add_argument("--timeout", type=float, default=3600)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if len(modes) != 2 or unknown:
        raise SystemExit(f"--modes needs two of {sorted(MODES)}; got {args.modes!r}")
    cfg = (gpt.TINY_SIZES if args.tiny else gpt.SIZES)[args.size]
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    started = time.time()
    ranks = _spawn(modes, cfg, args)
    times = ranks[0]["times"]  # the step is collective: every rank's times are alike
    a, b = (times[m] for m in modes)
    ratio = [x / y for x, y in zip(a, b)]
    units = ranks[0]["units"]
    summary: dict[str, Any] = {
        **provenance("python -m bench.paired", argv, started),
        "size": args.size,
        "config": cfg.to_json(),
        "world_size": args.world_size,
        "threads": args.threads,
        "warmup": args.warmup,
        "steps": args.steps,
        "modes": modes,
        "median_step_s": {m: statistics.median(times[m]) for m in modes},
        "median_ratio": statistics.median(ratio),
        "ratio_quartiles": _quartiles(ratio),
        "units": units,
        # against plain torch (or the floor), the difference is each unit's own cost
        "per_unit_us": {
            m: 1e6 * statistics.median(x - y for x, y in zip(times[m], b)) / n
            for m, n in units.items()
            if n and m != modes[1] and modes[1] in ("plain", "floor")
        },
        "times": times,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.size}-w{args.world_size}-{_slug(modes[0])}-vs-{_slug(modes[1])}"
    if not args.tiny:
        (out / f"{stem}.json").write_text(json.dumps(summary, indent=1) + "\n")
        (out / f"{stem}.md").write_text(markdown(summary))
    print(markdown(summary))
    return summary


def markdown(s: dict[str, Any]) -> str:
    """One paired run as Markdown."""
    a, b = s["modes"]
    q1, q3 = s["ratio_quartiles"]
    lines = [
        f"# Paired: {a} against {b}, {s['size']}, W={s['world_size']}",
        "",
        f"- command: `{s['command']}`",
        f"- date: {s['date']} ({s['duration_s']} s)",
        f"- machine: {s['machine']['cpus']} CPUs, {s['machine']['platform']}, Python "
        f"{s['machine']['python']}, torch {s['machine']['torch']}",
        f"- {s['threads']} thread(s) per rank, glibc's default allocator; both modes built on every "
        f"rank from the same parameters, {s['warmup']} untimed + {s['steps']} timed steps of each, "
        "alternated A B, B A, ...",
        "",
        "| mode | median step (s) |",
        "|---|---|",
        *(f"| {m} | {s['median_step_s'][m]:.4f} |" for m in (a, b)),
        "",
        f"- **{a} / {b}, median of the paired step ratios: {s['median_ratio']:.3f}** "
        f"(quartiles {q1:.3f} to {q3:.3f})",
    ]
    for mode, us in s["per_unit_us"].items():
        lines.append(
            f"- per-unit overhead of {mode} over {b}, median paired difference / "
            f"{s['units'][mode]} units: {us:,.0f} us"
        )
    return "\n".join(lines) + "\n"


def _quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def _slug(mode: str) -> str:
    return mode.replace("/", "-")


def _spawn(modes: list[str], cfg: gpt.Config, args: argparse.Namespace) -> list[dict[str, Any]]:
    tmp = tempfile.mkdtemp(prefix="funcshard-paired-")
    ctx = mp.get_context("spawn")
    spec = {"warmup": args.warmup, "steps": args.steps, "threads": args.threads}
    procs = []
    try:
        for rank in range(args.world_size):
            out = os.path.join(tmp, f"rank{rank}.json")
            proc = ctx.Process(
                target=worker,
                args=(
                    modes,
                    cfg.to_json(),
                    args.world_size,
                    rank,
                    os.path.join(tmp, "store"),
                    spec,
                    out,
                ),
            )
            proc.start()
            procs.append((proc, out))
        deadline = time.monotonic() + args.timeout
        for proc, _ in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        failed = [(i, p.exitcode) for i, (p, _) in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise SystemExit(f"paired run: rank(s) {failed} (rank, exit code) failed or timed out")
        return [json.loads(Path(out).read_text()) for _, out in procs]
    finally:
        for proc, _ in procs:
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def worker(
    modes: list[str],
    cfg_json: dict[str, int],
    world: int,
    rank: int,
    store: str,
    spec: dict[str, Any],
    out: str,
) -> None:
    """One rank: builds both modes, alternates their steps, writes its step times to ``out``."""
    import torch
    import torch.distributed as dist

    from bench.modes import build

    torch.set_num_threads(spec["threads"])
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),  # pyright: ignore[reportPrivateImportUsage]
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    cfg = gpt.Config(**cfg_json)
    device = torch.device("cpu")
    trainers = {m: build(m, cfg, gpt.init_params(cfg), device) for m in modes}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(spec["warmup"] + spec["steps"]):
        tokens, targets = gpt.batch(cfg, i, rank)
        for mode in modes if i % 2 == 0 else modes[::-1]:
            dist.barrier()
            start = time.perf_counter()
            trainers[mode].step(tokens, targets)
            dist.barrier()
            if i >= spec["warmup"]:
                times[mode].append(time.perf_counter() - start)
    units = {m: trainers[m].units or 0 for m in modes}
    Path(out).write_text(json.dumps({"times": times, "units": units}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
