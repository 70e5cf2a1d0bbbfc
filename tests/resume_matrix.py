"""Resume after SIGKILL at every kill point, each rank as the victim, N times in a row.

``python -m tests.resume_matrix [--repeat 10] [--points ...] [--victims 0 1]``
runs ``tests/resume_train.py`` under ``torchrun --max-restarts 1`` once
undisturbed, then once per (point, victim, repeat) with a SIGKILL, and checks
that every disturbed job exits 0, that the victim was killed, that its final
parameters equal the undisturbed run's bit for bit, and that exactly the two
newest checkpoints remain (nothing lost, no leftovers). Prints one line per
run and a summary; exits 1 if any run failed. CI runs a subset
(``tests/test_resume.py``); ``nox -s stress`` runs all of it, ten times.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
POINTS = ("after_update", "mid_forward", "mid_backward", "mid_save")
STEPS = 8
KILL_AT = {"after_update": 5, "mid_forward": 5, "mid_backward": 5, "mid_save": 6}


def torchrun(
    directory: Path, *extra: str, max_restarts: int = 1
) -> subprocess.CompletedProcess[str]:
    """One job of ``resume_train.py`` on two CPU ranks under torchrun (one restart by default)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(max_restarts),
        str(ROOT / "tests" / "resume_train.py"),
        str(directory),
        str(STEPS),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("FUNCSHARD_RUN", None)
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def final_params(directory: Path) -> dict[str, torch.Tensor]:
    import funcshard as fs

    return fs.checkpoint.load_full(directory / "final")["params"]


def check(directory: Path, calm: object, point: str, victim: int) -> str | None:
    """Runs one disturbed job; returns what went wrong, or ``None``."""
    import funcshard as fs
    from funcshard._src import tree

    done = torchrun(
        directory,
        "--kill-at",
        str(KILL_AT[point]),
        "--kill-rank",
        str(victim),
        "--kill-point",
        point,
    )
    if done.returncode != 0:
        return f"exit code {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    if "exitcode: -9" not in done.stderr:
        return "the victim was not killed"
    ours, theirs = tree.leaves(final_params(directory)), tree.leaves(calm)
    if any(not torch.equal(a, b) for a, b in zip(ours, theirs)):
        return "the final parameters differ from the undisturbed run's"
    kept = sorted(p.name for p in (directory / "checkpoints").iterdir())
    if kept != ["step0006", "step0008"]:
        return f"checkpoints left: {kept} (expected the two newest)"
    fs.checkpoint.load_full(directory / "checkpoints" / "step0008")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--points", nargs="+", choices=POINTS, default=list(POINTS))
    parser.add_argument("--victims", nargs="+", type=int, default=[0, 1])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="funcshard-resume-") as tmp:
        root = Path(tmp)
        calm_run = torchrun(root / "calm")
        if calm_run.returncode != 0:
            print(calm_run.stderr[-4000:])
            return 1
        calm = final_params(root / "calm")
        failures = 0
        for point in args.points:
            for victim in args.victims:
                for i in range(args.repeat):
                    start = time.monotonic()
                    problem = check(root / f"{point}-{victim}-{i}", calm, point, victim)
                    status = "ok" if problem is None else "FAILED"
                    print(
                        f"{point:13s} victim rank {victim} run {i + 1:2d}: {status} ({time.monotonic() - start:.0f} s)",
                        flush=True,
                    )
                    if problem is not None:
                        failures += 1
                        print(problem, flush=True)
        total = len(args.points) * len(args.victims) * args.repeat
        print(f"{total - failures} of {total} disturbed runs resumed bit-exactly")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
