"""Every stress run at W=2: resume after SIGKILL (``resume_matrix``), kills in the middle of saves
(``stress_save_kills``) and a soak with saves (``stress_soak``). Minutes, not seconds: ``nox -s stress``.

``python -m tests.stress [--repeat 10] [--kills 32] [--steps 200]``; exits 1 if any part failed.
"""

from __future__ import annotations

import argparse
import sys

from tests import resume_matrix, stress_save_kills, stress_soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10, help="runs per kill point and victim")
    parser.add_argument("--kills", type=int, default=32, help="kills in the middle of saves")
    parser.add_argument("--steps", type=int, default=200, help="steps of the soak")
    args = parser.parse_args(argv)
    failed = resume_matrix.main(["--repeat", str(args.repeat)])
    failed |= stress_save_kills.main(["--kills", str(args.kills)])
    failed |= stress_soak.main(["--steps", str(args.steps)])
    return failed


if __name__ == "__main__":
    sys.exit(main())
