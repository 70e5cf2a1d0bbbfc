"""``python -m bench.all_gather``: gloo all-gather algorithms timed against each other on CPU.

Spawns ``W`` ranks (gloo, a ``FileStore`` in a temporary directory: no network).
Every round times each (size, algorithm) once, in an order rotated by round so
that drift of a shared machine hits every algorithm alike; each timing starts
after a barrier and ends when rank 0's ``wait()`` returns. Prints the median
(and the spread) over rounds, in milliseconds, and each algorithm's speed-up
over ``native`` (gloo's ``all_gather_into_tensor``), which is what funcshard ran on
gloo before. Sizes are of one rank's input (``flat``); the output is ``W`` times that.
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
    from funcshard._src.comm.all_gather import Algorithm

ALGORITHMS: tuple[Algorithm, ...] = ("native", "ring", "ring_overlapped")
SIZES_KIB = (256, 1024, 4096, 12288, 49152)  # per rank


def _rank(
    rank: int, world: int, store_path: str, sizes: list[int], rounds: int, queue: Any
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from funcshard._src.comm import all_gather as ag

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)  # pyright: ignore[reportPrivateImportUsage]
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    group = dist.distributed_c10d._get_default_group()
    gen = torch.Generator().manual_seed(rank)
    times: dict[tuple[int, Algorithm], list[float]] = {}
    cases: list[tuple[int, Algorithm]] = [(kib, a) for kib in sizes for a in ALGORITHMS]
    inputs = {kib: torch.randn(kib * 256, generator=gen) for kib in sizes}
    outputs = {kib: torch.empty(world, kib * 256) for kib in sizes}  # reused, as in a prefetch
    for r in range(rounds + 1):  # round 0 warms up and is dropped
        shift = r % len(cases)
        for kib, algorithm in cases[shift:] + cases[:shift]:
            dist.barrier()
            t0 = time.perf_counter()
            ag.start(algorithm, inputs[kib], outputs[kib], group).wait()
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
    with tempfile.TemporaryDirectory(prefix="funcshard-bench-ag-") as tmp:
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
        f"all-gather on gloo, W={args.world_size}, float32, median (min-max) ms over "
        f"{args.rounds} rounds; speed-up vs native"
    )
    print(f"| per rank | {' | '.join(ALGORITHMS)} |")
    print(f"|---|{'---|' * len(ALGORITHMS)}")
    for kib in args.sizes_kib:
        base = statistics.median(times[(kib, "native")])
        cells = []
        for a in ALGORITHMS:
            t = times[(kib, a)]
            m = statistics.median(t)
            cells.append(f"{m * 1e3:.2f} ({min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}) x{base / m:.2f}")
        size = f"{kib // 1024} MiB" if kib >= 1024 else f"{kib} KiB"
        print(f"| {size} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
