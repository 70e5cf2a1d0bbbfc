"""``funcshard verify script.py --nproc N``: the script's configuration verified on N local ranks under torchrun."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import funcshard._src.verify as package

WORKER = "funcshard._src.verify.worker"
STATUS_ENV = "FUNCSHARD_VERIFY_STATUS"  # the worker's; see worker.py
CONFIG_FN = "verify_config"


class ScriptError(ValueError):
    """The script or the process count cannot be used; the message says which and how to fix it."""


def check_script(script: str, /) -> None:
    """Refuses, before any process starts, a script that is missing or defines no ``verify_config``.

    Raises:
        ScriptError: no such file, a syntax error, or no top-level ``def verify_config``.
    """
    path = Path(script)
    if not path.is_file():
        raise ScriptError(
            f"{script}: no such file; give the path of a Python script that defines {CONFIG_FN}()"
        )
    try:
        module = ast.parse(path.read_text(), filename=script)
    except (SyntaxError, UnicodeDecodeError, OSError) as e:
        raise ScriptError(f"{script}: cannot read it as Python ({e})") from None
    if not any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == CONFIG_FN
        for node in module.body
    ):
        raise ScriptError(
            f"{script} defines no top-level {CONFIG_FN}() function; add one that returns "
            f"fs.verify's arguments, e.g. {{'loss_fn': loss_fn, 'params': params, 'plan': plan, "
            f"'batch': batch}} (see docs/verify.md)"
        )


def command(script: str, args: Sequence[str], /, *, nproc: int) -> list[str]:
    """The torchrun command line that starts ``nproc`` verify workers on this machine.

    Example:
        >>> command("s.py", ["--small"], nproc=2)[1:8]
        ['-m', 'torch.distributed.run', '--standalone', '--nnodes', '1', '--nproc-per-node', '2']
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--local-addr",
        "127.0.0.1",
        "-m",
        WORKER,
        script,
        *args,
    ]


def launch(script: str, args: Sequence[str], /, *, nproc: int) -> int:
    """Verifies ``script``'s configuration on ``nproc`` local ranks; returns 0 (pass), 1 (fail) or 2.

    Rank 0 prints the report. The ranks run with ``OMP_NUM_THREADS=1`` unless it
    is set. A run that crashes (a traceback on some rank) returns 1.

    Raises:
        ScriptError: the script is unusable (:func:`check_script`) or ``nproc < 1``.
    """
    check_script(script)
    if nproc < 1:
        raise ScriptError(f"--nproc {nproc}: give at least 1 process")
    source = str(Path(package.__file__).resolve().parents[3])  # the tree funcshard is imported from
    with tempfile.TemporaryDirectory(prefix="funcshard-verify-") as tmp:
        status = Path(tmp) / "status"
        env = {**os.environ, STATUS_ENV: str(status)}
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
        done = subprocess.run(command(script, args, nproc=nproc), env=env, check=False)
        if status.exists():
            return int(status.read_text())
    print(
        f"funcshard verify: the ranks did not finish (torchrun exited with {done.returncode}); "
        f"see the errors above",
        file=sys.stderr,
    )
    return 1
