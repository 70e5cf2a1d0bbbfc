"""A 200-step soak with saves at W=2: resident memory, file descriptors and threads stay flat.

``python -m tests.stress_soak [--steps 200]`` runs ``tests/soak_train.py`` under
torchrun and compares each rank's figures after 20 steps with those at the end:
memory may grow by at most 8 MiB, file descriptors and threads not at all. The
job must exit 0 and leave exactly the two newest checkpoints.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_RSS_GROWTH_MIB = 8.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="funcshard-soak-") as tmp:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "tests" / "soak_train.py"),
            tmp,
            str(args.steps),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stdout[-2000:], done.stderr[-4000:])
            return 1
        figures: dict[tuple[int, int], tuple[float, int, int]] = {}
        for rank, step, rss, fds, threads in re.findall(
            r"soak rank (\d+) step (\d+): ([\d.]+) (\d+) (\d+)", done.stdout
        ):
            figures[(int(rank), int(step))] = (float(rss), int(fds), int(threads))
        failures = 0
        for rank in (0, 1):
            (rss0, fds0, threads0), (rss1, fds1, threads1) = (
                figures[(rank, 20)],
                figures[(rank, args.steps)],
            )
            ok = rss1 - rss0 <= MAX_RSS_GROWTH_MIB and fds1 == fds0 and threads1 == threads0
            failures += not ok
            print(
                f"rank {rank}: RSS {rss0:.1f} -> {rss1:.1f} MiB ({rss1 - rss0:+.1f}), file descriptors "
                f"{fds0} -> {fds1}, threads {threads0} -> {threads1}: {'ok' if ok else 'FAILED'}"
            )
        kept = sorted(p.name for p in Path(tmp).iterdir())
        expected = [f"step{args.steps - 10:04d}", f"step{args.steps:04d}"]
        if kept != expected:
            print(f"checkpoints left: {kept}, expected {expected}: FAILED")
            failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
