"""``python -m bench.all_gather``: gloo all-gather algorithms timed against each other on CPU.

See ``bench/collective_timing.py`` for how; the speed-up is over ``native`` (gloo's
``all_gather_into_tensor``), which is what funcshard ran on gloo before. Sizes are
of one rank's input (``flat``); the output is ``W`` times that.
"""

from __future__ import annotations

from bench import collective_timing

ALGORITHMS = ("native", "ring", "ring_overlapped", "direct", "shm")
SIZES_KIB = (256, 1024, 4096, 12288, 49152)  # per rank


def main() -> None:
    collective_timing.main(
        description=(__doc__ or "").splitlines()[0],
        collective="all_gather",
        algorithms=ALGORITHMS,
        sizes_kib=SIZES_KIB,
        baseline="native",
        size_label="per rank",
    )


if __name__ == "__main__":
    main()
