"""What every rank of ``funcshard verify script.py`` runs: the script's ``verify_config()``, then ``fs.verify``.

Started by torchrun as ``python -m funcshard._src.verify.worker script.py [args...]``.
The script is run as a module named ``__funcshard_verify__`` (its
``if __name__ == "__main__":`` block does not run) with ``sys.argv`` set to
``[script.py, args...]``, after ``fs.init()``; then its ``verify_config()`` is
called on every rank and must return ``fs.verify``'s arguments (see
:func:`arguments`). Rank 0 prints the report. The exit status is 0 for a
pass, 1 for a fail and 2 for a configuration that cannot be verified; under the
command line, rank 0 writes it to the file named by ``FUNCSHARD_VERIFY_STATUS``
and every rank exits 0, so that torchrun reports no crash for a failed verdict.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from funcshard._src.comm.lifecycle import init
from funcshard._src.comm.runtime import rank
from funcshard._src.verify.verify import verify

STATUS_ENV = "FUNCSHARD_VERIFY_STATUS"
CONFIG_FN = "verify_config"
POSITIONAL = ("loss_fn", "params", "plan", "batch")
OPTIONS = (
    "steps",
    "optimizer",
    "mixed_precision",
    "prefetch",
    "has_aux",
    "cost",
    "rtol",
    "atol",
)
EXAMPLE = (
    "def verify_config():\n"
    "    return {'loss_fn': loss_fn, 'params': params, 'plan': plan, 'batch': batch}"
)


class ConfigError(ValueError):
    """The script's configuration cannot be verified; the message says why and how to fix it."""


def arguments(config: object, script: str, /) -> dict[str, Any]:
    """``fs.verify``'s arguments from what ``verify_config()`` returned.

    ``config`` is a mapping with the keys ``loss_fn``, ``params``, ``plan`` and
    ``batch`` and optionally any keyword of ``fs.verify`` (``steps``,
    ``optimizer``, ``mixed_precision``, ``prefetch``, ``has_aux``, ``cost``,
    ``rtol``, ``atol``), or the tuple ``(loss_fn, params, plan, batch)``.

    Raises:
        ConfigError: anything else, naming what is missing or unknown.

    Example:
        >>> sorted(arguments(("f", "p", "plan", "b"), "script.py"))
        ['batch', 'loss_fn', 'params', 'plan']
    """
    if isinstance(config, tuple) and len(config) == len(POSITIONAL):
        config = dict(zip(POSITIONAL, config))
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"{script}: {CONFIG_FN}() returned a {type(config).__name__}; return a dict of "
            f"fs.verify's arguments:\n{EXAMPLE}"
        )
    given: dict[str, Any] = {str(k): v for k, v in config.items()}  # pyright: ignore[reportUnknownVariableType]
    missing = [k for k in POSITIONAL if k not in given]
    unknown = sorted(set(given) - set(POSITIONAL) - set(OPTIONS))
    if missing or unknown:
        parts = ([f"lacks {missing}"] if missing else []) + (
            [f"has unknown keys {unknown} (fs.verify takes {list(OPTIONS)})"] if unknown else []
        )
        raise ConfigError(f"{script}: the dict {CONFIG_FN}() returned " + " and ".join(parts))
    return given


def load(script: str, argv: Sequence[str], /) -> dict[str, Any]:
    """Runs ``script`` as a module, calls its ``verify_config()`` and returns ``fs.verify``'s arguments.

    Raises:
        ConfigError: no ``verify_config`` function, or what it returned is unusable.
    """
    path = Path(script).resolve()
    sys.argv = [str(path), *argv]
    sys.path.insert(
        0, str(path.parent)
    )  # the script's own imports, as `python script.py` finds them
    namespace = runpy.run_path(str(path), run_name="__funcshard_verify__")
    make = namespace.get(CONFIG_FN)
    if not callable(make):
        raise ConfigError(f"{script} defines no {CONFIG_FN}() function; add one:\n{EXAMPLE}")
    return arguments(make(), script)


def main(argv: Sequence[str] | None = None) -> int:
    """Verifies the script named in ``argv`` on this rank; returns the exit status (see the module)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m funcshard._src.verify.worker script.py [args...]", file=sys.stderr)
        return 2
    init()
    try:
        config = load(args[0], args[1:])
        positional = [config.pop(k) for k in POSITIONAL]
        report = verify(*positional, **config)
    except (ConfigError, ValueError, TypeError) as e:
        if not isinstance(e, ConfigError) and not str(e).startswith("fs.verify:"):
            raise  # a bug in the script: its traceback helps more than a line
        if rank() == 0:
            print(f"funcshard verify: error: {e}", file=sys.stderr)
        status = 2
    else:
        if rank() == 0:
            print(report, flush=True)
        status = 0 if report.ok else 1
    target = os.environ.get(STATUS_ENV)
    if target is None:
        return status
    if rank() == 0:
        Path(target).write_text(f"{status}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
