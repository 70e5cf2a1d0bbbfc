"""``python -m bench.reduce_scatter``: gloo reduce-scatter algorithms timed against each other on CPU.

See ``bench/collective_timing.py`` for how; the speed-up is over ``all_reduce``,
which is what funcshard ran on gloo before. Sizes are of the whole input ``(W, n)``.
"""

from __future__ import annotations

from bench import collective_timing

ALGORITHMS = ("native", "all_reduce", "all_to_all", "ring", "ring_pipelined", "shm")
SIZES_KIB = (256, 4096, 16384, 65536)


def main() -> None:
    collective_timing.main(
        description=(__doc__ or "").splitlines()[0],
        collective="reduce_scatter",
        algorithms=ALGORITHMS,
        sizes_kib=SIZES_KIB,
        baseline="all_reduce",
        size_label="input",
    )


if __name__ == "__main__":
    main()
