"""SIGKILL one or both ranks in the middle of saves, many times: only complete checkpoints are ever listed.

``python -m tests.stress_save_kills [--kills 32]`` runs ``tests/resume_train.py``
at W=2 without restarts, killing the victims at a point inside a save (after
writing their data, after the manifest, after the rename, in the middle of
rotating), at a different step each time. After every kill, every checkpoint
the directory lists must load and equal, bit for bit, the checkpoint of the
same step from an undisturbed run; ``latest()`` must name the newest of them.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.resume_matrix import torchrun

PHASES = [
    ("save:write", 1),
    ("save:write", -1),
    ("save:write", 0),
    ("mid_save", -1),
    ("save:manifest", 0),
    ("save:committed", 0),
    ("save:rotating", 0),
    ("save:rotating", -1),
]


def main(argv: list[str] | None = None) -> int:
    import funcshard as fs
    from funcshard._src import tree

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kills", type=int, default=32)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="funcshard-save-kills-") as tmp:
        root = Path(tmp)
        reference = torchrun(root / "reference", "--keep", "0")
        if reference.returncode != 0:
            print(reference.stderr[-4000:])
            return 1
        expected = {
            d.name: fs.checkpoint.load_full(d)
            for d in (root / "reference" / "checkpoints").iterdir()
        }
        failures = 0
        combos = [
            (phase, step)
            for phase in PHASES
            for step in (
                (6, 8) if phase[0] == "save:rotating" else (4, 6, 8)
            )  # step 4 rotates nothing
        ]
        cases = itertools.islice(itertools.cycle(combos), args.kills)
        for i, ((point, victim), step) in enumerate(cases):
            directory = root / f"kill{i}"
            start = time.monotonic()
            done = torchrun(
                directory,
                "--kill-at",
                str(step),
                "--kill-rank",
                str(victim),
                "--kill-point",
                point,
                "--keep",
                "2",
                max_restarts=0,
            )
            problem = None if done.returncode != 0 else "the job was not killed"
            listed = sorted(  # staging directories (".<name>.tmp-...") are never checkpoints
                d.name
                for d in (directory / "checkpoints").iterdir()
                if (d / "manifest.json").is_file() and ".tmp-" not in d.name
            )
            for name in listed:
                loaded = fs.checkpoint.load_full(directory / "checkpoints" / name)
                if any(
                    not (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
                    for a, b in zip(tree.leaves(loaded), tree.leaves(expected[name]))
                ):
                    problem = f"{name} differs from the undisturbed run's"
            newest = fs.checkpoint.latest(directory / "checkpoints")
            if listed and (newest is None or newest.name != listed[-1]):
                problem = f"latest() is {newest}, the newest complete checkpoint {listed[-1]}"
            if not listed:
                problem = "no checkpoint is left"
            status = "ok" if problem is None else f"FAILED: {problem}"
            victims = "both ranks" if victim == -1 else f"rank {victim}"
            print(
                f"kill {i + 1:2d}: {point:15s} {victims:10s} step {step}: kept {listed} {status} ({time.monotonic() - start:.0f} s)",
                flush=True,
            )
            failures += problem is not None
        print(
            f"{args.kills - failures} of {args.kills} kills left only complete, exact checkpoints"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
