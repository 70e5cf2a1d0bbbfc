"""``python -m bench``: every mode, interleaved over several rounds, in one invocation.

Each run of a mode starts fresh processes (one per rank) so that peak RSS is
that mode's own; ``MALLOC_MMAP_THRESHOLD_`` is set alike for every mode so
that freed memory returns to the system at once and RSS is reproducible.
Modes run in turn within each round, so drift of the machine hits all alike.

``--tiny`` is a smoke run, and a spawned tiny run is nearly all imports: torch
on every rank, and for PyTorch's modes ``torch._dynamo`` (which
``torch.optim.AdamW`` imports) and FSDP, 4 to 7 s a run against a tenth of a
second of training. Its ranks fork instead from one server that imported those
once (``forkserver``): every mode's peak RSS then counts them, and is not
comparable with a full run's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import model as gpt
from bench.modes import MODES
from bench.report import write_report

# what --tiny's fork server imports: what every mode does, then what PyTorch's modes do
TINY_PRELOAD = ["bench.worker", "torch._dynamo", "torch.distributed.fsdp"]
DEFAULT_MODES = [
    "funcshard/full_shard", "fsdp2", "funcshard/shard_grad_op", "fsdp2/no_reshard",
    "funcshard/no_shard", "ddp", "fsdp1", "single", "funcshard/hybrid_shard",
]  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__.splitlines()[0] if __doc__ else None
    )
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, from {sorted(MODES)}"
    )
    p.add_argument("--rounds", type=int, default=None, help="default 3 (--tiny: 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of every run")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (4; --tiny: 2)")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--tiny", action="store_true", help="a tiny model: a smoke run in seconds")
    for name, value in gpt.Config().to_json().items():
        p.add_argument(f"--{name}", type=int, default=None, help=f"model size (default {value})")
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
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="funcshard-bench-") if args.tiny else "bench/results"
    cfg = gpt.TINY if args.tiny else gpt.Config()
    cfg = replace(
        cfg, **{k: v for k, v in vars(args).items() if k in cfg.to_json() and v is not None}
    )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {sorted(MODES)}")
    if "funcshard/hybrid_shard" in modes and (args.world_size < 4 or args.world_size % 2):
        modes.remove("funcshard/hybrid_shard")
        print(
            "skipping funcshard/hybrid_shard: it needs a world size of 4 or more (2 x W/2)",
            file=sys.stderr,
        )
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
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
        order = (
            modes[round_ % len(modes) :] + modes[: round_ % len(modes)]
        )  # rotate: no mode always first
        for mode in order:
            ranks = 1 if mode == "single" else args.world_size
            t0 = time.perf_counter()
            per_rank = _run(mode, cfg, args.world_size, ranks, spec, args.timeout)
            runs.append({"round": round_, "mode": mode, "ranks": per_rank})
            times = sorted(t for r in per_rank for t in r["step_times_s"])
            print(
                f"round {round_ + 1}/{args.rounds} {mode:<24} median step {times[len(times) // 2]:.3f} s "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    meta = {
        "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "duration_s": round(time.time() - started),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": _torch_version(),
        },
        "env": {
            "MALLOC_MMAP_THRESHOLD_": os.environ["MALLOC_MMAP_THRESHOLD_"],
            "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],
        },
        "world_size": args.world_size,
        "config": cfg.to_json(),
        "spec": spec,
    }
    summary = write_report(runs, meta, Path(args.out))
    print(f"results written to {args.out}")
    return summary


# DDP's ranks forked from the server hang in about half of the runs (its reducer's
# threads and gloo after fork): they start as fresh interpreters even with --tiny
SPAWNED = ("ddp",)


def _run(
    mode: str, cfg: gpt.Config, world: int, ranks: int, spec: dict[str, Any], timeout: float
) -> list[dict[str, Any]]:
    from bench import worker

    tmp = tempfile.mkdtemp(prefix="funcshard-bench-")
    if spec["preload"] is None or mode in SPAWNED:
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        # the server starts on the first run, after main() set the environment it inherits
        ctx.set_forkserver_preload(spec["preload"])
    procs = []
    try:
        for rank in range(ranks):
            out = os.path.join(tmp, f"rank{rank}.json")
            proc = ctx.Process(
                target=worker.main,
                args=(mode, cfg.to_json(), world, rank, os.path.join(tmp, "store"), spec, out),
            )
            proc.start()
            procs.append((proc, out))
        deadline = time.monotonic() + timeout
        for proc, _ in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        failed = [(i, p.exitcode) for i, (p, _) in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise SystemExit(
                f"{mode}: rank(s) {failed} (rank, exit code) failed or timed out after {timeout:.0f} s"
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


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
