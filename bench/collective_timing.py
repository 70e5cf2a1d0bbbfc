"""Timing gloo collective algorithms against each other on CPU: the harness of
``python -m bench.reduce_scatter`` and ``python -m bench.all_gather``.

Spawns ``W`` ranks (gloo, a ``FileStore`` in a temporary directory: no network).
Every round times each (size, algorithm) once, in an order rotated by round so
that drift of a shared machine hits every algorithm alike; each timing starts
after a barrier and ends when rank 0's ``wait()`` returns. Prints the median
(and the spread) over rounds, in milliseconds, and each algorithm's speed-up
over a baseline: what funcshard ran on gloo before.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp


def _calls(
    collective: str, rank: int, world: int, sizes: list[int]
) -> Callable[[int, str, Any], Any]:
    """``call(kib, algorithm, group)`` starting one ``collective`` of ``kib`` KiB; inputs made here."""
    import torch

    from funcshard._src.comm import transport

    ag, rs = transport.ALL_GATHER, transport.REDUCE_SCATTER

    gen = torch.Generator().manual_seed(rank)
    if collective == "reduce_scatter":  # sizes: the whole input, (W, n)
        rows = {kib: torch.randn(world, kib * 256 // world, generator=gen) for kib in sizes}

        def reduce_scatter(kib: int, algorithm: str, group: Any) -> Any:
            mine = rows[kib].clone()  # the algorithms overwrite rows
            out = torch.empty(mine.shape[1])
            return lambda: rs.start(algorithm, mine, out, group)  # pyright: ignore[reportArgumentType]

        return reduce_scatter
    flat = {kib: torch.randn(kib * 256, generator=gen) for kib in sizes}  # sizes: per rank
    outputs = {kib: torch.empty(world, kib * 256) for kib in sizes}  # reused, as in a prefetch

    def all_gather(kib: int, algorithm: str, group: Any) -> Any:
        return lambda: ag.start(algorithm, flat[kib], outputs[kib], group)  # pyright: ignore[reportArgumentType]

    return all_gather


def _rank(
    rank: int,
    world: int,
    store_path: str,
    collective: str,
    algorithms: Sequence[str],
    sizes: list[int],
    rounds: int,
    queue: Any,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)  # pyright: ignore[reportPrivateImportUsage]
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    group = dist.distributed_c10d._get_default_group()
    prepare = _calls(collective, rank, world, sizes)
    times: dict[tuple[int, str], list[float]] = {}
    cases = [(kib, a) for kib in sizes for a in algorithms]
    for r in range(rounds + 1):  # round 0 warms up and is dropped
        shift = r % len(cases)
        for kib, algorithm in cases[shift:] + cases[:shift]:
            start = prepare(kib, algorithm, group)
            dist.barrier()
            t0 = time.perf_counter()
            start().wait()
            elapsed = time.perf_counter() - t0
            if r:
                times.setdefault((kib, algorithm), []).append(elapsed)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(times)


def main(
    *,
    description: str,
    collective: str,
    algorithms: Sequence[str],
    sizes_kib: Sequence[int],
    baseline: str,
    size_label: str,
) -> None:
    """Parses ``--world-size --rounds --sizes-kib``, times every algorithm and prints the table."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=list(sizes_kib))
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix=f"funcshard-bench-{collective}-") as tmp:
        procs = [
            ctx.Process(
                target=_rank,
                args=(
                    r,
                    args.world_size,
                    os.path.join(tmp, "store"),
                    collective,
                    tuple(algorithms),
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
        f"{collective.replace('_', '-')} on gloo, W={args.world_size}, float32, median (min-max) "
        f"ms over {args.rounds} rounds; speed-up vs {baseline}"
    )
    print(f"| {size_label} | {' | '.join(algorithms)} |")
    print(f"|---|{'---|' * len(algorithms)}")
    for kib in args.sizes_kib:
        base = statistics.median(times[(kib, baseline)])
        cells = []
        for a in algorithms:
            t = times[(kib, a)]
            m = statistics.median(t)
            cells.append(f"{m * 1e3:.2f} ({min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}) x{base / m:.2f}")
        size = f"{kib // 1024} MiB" if kib >= 1024 else f"{kib} KiB"
        print(f"| {size} | {' | '.join(cells)} |")
