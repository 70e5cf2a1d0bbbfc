"""``python -m bench``: every mode, at every size, under each allocator, interleaved over rounds.

Command: ``python -m bench`` (or ``nox -s bench``) writes ``bench/results/``:
``results.json`` (every run, with the allocator it used), ``results.md`` (its
header states the command, machine, date and allocators) and ``results.png``.
``python -m bench --size deep --world-size 1`` gives the per-unit overhead over
plain PyTorch; ``python -m bench --tiny`` is a smoke run in seconds.

Each run of a mode starts fresh processes (one per rank) so that peak RSS is
that mode's own. ``--malloc both`` (the default) runs each mode twice a round:
under glibc's default allocator, which the headline step times and tokens/s
come from, and with ``MALLOC_MMAP_THRESHOLD_=65536``, which returns freed
memory to the system at once so that peak RSS is reproducible (see
``bench/allocator.py``); the memory table shows both. Modes run in turn within
each round, so drift of the machine hits all alike.

``floor`` is one rank's work alone: its batch (the global batch / W), one
process, one thread a rank (``--threads``), no communication, the plain
``nn.Module`` and ``torch.optim.AdamW(fused=True)``; the report gives every
mode's median step as a multiple of it (``1.12x floor``).

``--tiny`` is a smoke run, and a spawned tiny run is nearly all imports: torch
on every rank, and for PyTorch's modes ``torch._dynamo`` (which
``torch.optim.AdamW`` imports) and FSDP, 4 to 7 s a run against a tenth of a
second of training. Its ranks fork instead from one server that imported those
once (``forkserver``): every mode's peak RSS then counts them, and is not
comparable with a full run's. To stay well under 30 s it runs under glibc's
default allocator only unless ``--malloc`` says otherwise (``tests/test_bench.py``
runs both), and a mode whose ranks must spawn (DDP) runs under the first
allocator only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.forkserver
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import allocator
from bench import model as gpt
from bench.modes import MODES
from bench.report import provenance, write_report

# what --tiny's fork server imports: what every mode does, then what PyTorch's modes do
TINY_PRELOAD = ["bench.worker", "torch._dynamo", "torch.distributed.fsdp"]
DEFAULT_MODES = [
    "funcshard/full_shard",
    "fsdp2",
    "funcshard/shard_grad_op",
    "fsdp2/no_reshard",
    "funcshard/no_shard",
    "ddp",
    "fsdp1",
    "floor",
    "single",
    "funcshard/hybrid_shard",
]
# the deep model measures each unit's fixed cost: the sharded modes against plain torch
DEFAULT_MODES_DEEP = ["funcshard/full_shard", "fsdp2", "floor", "plain"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__.splitlines()[0] if __doc__ else None
    )
    p.add_argument("--world-size", type=int, default=2, help="ranks (1: a 1-rank process group)")
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated, from {sorted(MODES)} (default: {','.join(DEFAULT_MODES)}; "
        f"for --size deep: {','.join(DEFAULT_MODES_DEEP)})",
    )
    p.add_argument(
        "--size",
        action="append",
        default=None,
        help=f"model size, repeatable or comma-separated, from {list(gpt.SIZES)} "
        "(default 34m; --tiny: 34m,deep, shrunk)",
    )
    p.add_argument(
        "--malloc",
        default=None,
        choices=[*allocator.ALLOCATORS, "both"],
        help="glibc's default allocator (headline times), MALLOC_MMAP_THRESHOLD_=65536 "
        "(reproducible peak RSS), or both, interleaved (default; --tiny: default)",
    )
    p.add_argument("--rounds", type=int, default=None, help="default 3 (--tiny: 1)")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps at the start of every run (the first two are the slowest)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (4; --tiny: 2)")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--tiny", action="store_true", help="tiny models: a smoke run in seconds")
    for name, value in gpt.Config().to_json().items():
        p.add_argument(
            f"--{name}", type=int, default=None, help=f"override every size's (34m: {value})"
        )
    p.add_argument(
        "--out",
        default=None,
        help="directory for results.json, results.md, results.png (default bench/results; "
        "--tiny: a temporary directory, so a smoke run never replaces the measured results)",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.rounds is None:
        args.rounds = 1 if args.tiny else 3
    if args.steps is None:
        args.steps = 2 if args.tiny else 4
    if args.malloc is None:
        args.malloc = "default" if args.tiny else "both"
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="funcshard-bench-") if args.tiny else "bench/results"
    sizes = _sizes(args.size or (["34m,deep"] if args.tiny else ["34m"]))
    table = gpt.TINY_SIZES if args.tiny else gpt.SIZES
    overrides = {
        k: v for k, v in vars(args).items() if k in gpt.Config().to_json() and v is not None
    }
    configs = {size: replace(table[size], **overrides) for size in sizes}
    modes = {size: _modes(args.modes, size, args.world_size) for size in sizes}
    passes = allocator.passes(args.malloc)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    spec = {
        "backend": args.backend,
        "threads": args.threads,
        "warmup": args.warmup,
        "steps": args.steps,
        "timeout_s": args.timeout,
        "preload": TINY_PRELOAD if args.tiny else None,  # None: spawn fresh interpreters
    }
    runs: list[dict[str, Any]] = []
    started = time.time()
    for round_ in range(args.rounds):
        for size in sizes:
            for mode in _rotate(modes[size], round_):  # no mode always first
                for malloc in _rotate(list(passes), round_):  # nor allocator
                    if args.tiny and not MODES[mode].forkable and malloc != passes[0]:
                        continue  # a spawned tiny run is seconds of imports: once is enough
                    t0 = time.perf_counter()
                    per_rank = _run(
                        mode, configs[size], args.world_size, spec, malloc, args.timeout
                    )
                    runs.append(
                        {
                            "round": round_,
                            "size": size,
                            "mode": mode,
                            "malloc": malloc,
                            "ranks": per_rank,
                        }
                    )
                    times = sorted(t for r in per_rank for t in r["step_times_s"])
                    print(
                        f"round {round_ + 1}/{args.rounds} {size:<5} {mode:<24} {malloc:<7} "
                        f"median step {times[len(times) // 2]:.3f} s ({time.perf_counter() - t0:.0f} s)",
                        flush=True,
                    )
    meta = {
        **provenance("python -m bench", argv, started),
        "malloc": list(passes),
        "env": {
            "MALLOC_MMAP_THRESHOLD_": f"unset (default), {allocator.MMAP_THRESHOLD} (mmap)",
            "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],
        },
        "world_size": args.world_size,
        "tiny": args.tiny,
        "sizes": {size: cfg.to_json() for size, cfg in configs.items()},
        "spec": spec,
    }
    summary = write_report(runs, meta, Path(args.out))
    print(f"results written to {args.out}")
    return summary


def _sizes(values: list[str]) -> list[str]:
    sizes = list(dict.fromkeys(s.strip() for v in values for s in v.split(",") if s.strip()))
    unknown = [s for s in sizes if s not in gpt.SIZES]
    if unknown or not sizes:
        raise SystemExit(f"unknown size(s) {unknown}; choose from {list(gpt.SIZES)}")
    return sizes


def _modes(requested: str | None, size: str, world: int) -> list[str]:
    if requested is None:
        names = DEFAULT_MODES_DEEP if size == "deep" else DEFAULT_MODES
    else:
        names = list(dict.fromkeys(m.strip() for m in requested.split(",") if m.strip()))
    unknown = [m for m in names if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {sorted(MODES)}")
    if "funcshard/hybrid_shard" in names and (world < 4 or world % 2):
        names = [m for m in names if m != "funcshard/hybrid_shard"]
        print(
            "skipping funcshard/hybrid_shard: it needs a world size of 4 or more (2 x W/2)",
            file=sys.stderr,
        )
    return names


def _rotate(items: list[str], by: int) -> list[str]:
    return items[by % len(items) :] + items[: by % len(items)]


def _run(
    mode: str, cfg: gpt.Config, world: int, spec: dict[str, Any], malloc: str, timeout: float
) -> list[dict[str, Any]]:
    from bench import worker

    tmp = tempfile.mkdtemp(prefix="funcshard-bench-")
    if spec["preload"] is None or not MODES[mode].forkable:
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(spec["preload"])
        # the server starts once, after main() set OMP_NUM_THREADS, and never with the
        # allocator variable: its forked mmap ranks set it with mallopt (bench/allocator.py)
        with allocator.environment("default"):
            multiprocessing.forkserver.ensure_running()
    procs = []
    try:
        with allocator.environment(malloc):  # what a spawned rank inherits
            for rank in range(MODES[mode].processes(world)):
                out = os.path.join(tmp, f"rank{rank}.json")
                proc = ctx.Process(
                    target=worker.main,
                    args=(
                        mode,
                        cfg.to_json(),
                        world,
                        rank,
                        os.path.join(tmp, "store"),
                        spec,
                        malloc,
                        out,
                    ),
                )
                proc.start()
                procs.append((proc, out))
        deadline = time.monotonic() + timeout
        for proc, _ in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        failed = [(i, p.exitcode) for i, (p, _) in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise SystemExit(
                f"{mode} ({malloc}): rank(s) {failed} (rank, exit code) failed or timed out after {timeout:.0f} s"
            )
        results = []
        for _, out in procs:
            with open(out) as f:
                results.append(json.load(f))
        return results
    finally:
        for proc, _ in procs:
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
