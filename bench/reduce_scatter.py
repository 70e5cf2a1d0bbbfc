"""``python -m bench.reduce_scatter``: gloo reduce-scatter algorithms timed against each other on CPU.

Spawns ``W`` ranks (gloo, a ``FileStore`` in a temporary directory: no network).
Every round times each (size, algorithm) once, in an order rotated by round so
that drift of a shared machine hits every algorithm alike; each timing starts
after a barrier and ends when rank 0's ``wait()`` returns. Prints the median
(and the spread) over rounds, in milliseconds, and each algorithm's speed-up
over ``all_reduce``, which is what funcshard ran on gloo before.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any

import torch.multiprocessing as mp

if TYPE_CHECKING:
    from funcshard._src.comm.reduce_scatter import Algorithm

ALGORITHMS: tuple[Algorithm, ...] = ("native", "all_reduce", "all_to_all", "ring", "ring_pipelined")
SIZES_KIB = (256, 4096, 16384, 65536)


def _rank(
    rank: int, world: int, store_path: str, sizes: list[int], rounds: int, queue: Any
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from funcshard._src.comm import reduce_scatter as rs

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)  # pyright: ignore[reportPrivateImportUsage]
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    group = dist.distributed_c10d._get_default_group()
    gen = torch.Generator().manual_seed(rank)
    times: dict[tuple[int, Algorithm], list[float]] = {}
    cases: list[tuple[int, Algorithm]] = [(kib, a) for kib in sizes for a in ALGORITHMS]
    inputs = {kib: torch.randn(world, kib * 256 // world, generator=gen) for kib in sizes}
    for r in range(rounds + 1):  # round 0 warms up and is dropped
        shift = r % len(cases)
        for kib, algorithm in cases[shift:] + cases[:shift]:
            rows = inputs[kib].clone()  # the algorithms overwrite rows
            out = torch.empty(rows.shape[1])
            dist.barrier()
            t0 = time.perf_counter()
            rs.start(algorithm, rows, out, group).wait()
            elapsed = time.perf_counter() - t0
            if r:
                times.setdefault((kib, algorithm), []).append(elapsed)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=list(SIZES_KIB))
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="funcshard-bench-rs-") as tmp:
        procs = [
            ctx.Process(
                target=_rank,
                args=(
                    r,
                    args.world_size,
                    os.path.join(tmp, "store"),
                    args.sizes_kib,
                    args.rounds,
                    queue,
                ),
            )
            for r in range(args.world_size)
        ]
        for p in procs:
            p.start()
        times = queue.get()
        for p in procs:
            p.join()
    print(
        f"reduce-scatter on gloo, W={args.world_size}, float32, median (min-max) ms over "
        f"{args.rounds} rounds; speed-up vs all_reduce"
    )
    print(f"| input | {' | '.join(ALGORITHMS)} |")
    print(f"|---|{'---|' * len(ALGORITHMS)}")
    for kib in args.sizes_kib:
        base = statistics.median(times[(kib, "all_reduce")])
        cells = []
        for a in ALGORITHMS:
            t = times[(kib, a)]
            m = statistics.median(t)
            cells.append(f"{m * 1e3:.2f} ({min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}) x{base / m:.2f}")
        size = f"{kib // 1024} MiB" if kib >= 1024 else f"{kib} KiB"
        print(f"| {size} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
