"""Sizes as people write and read them: ``80GiB`` to bytes and back, and plain-text tables."""

from __future__ import annotations

import re
from collections.abc import Sequence

GiB = 2**30
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int, /) -> int:
    """``"80GiB"`` -> bytes. Units: B, kB/MB/GB/TB (powers of 10), KiB/MiB/GiB/TiB (of 2).

    Raises:
        ValueError: not a positive size with a known unit.

    Example:
        >>> parse_bytes("80GiB"), parse_bytes("1.5 GB"), parse_bytes(4096)
        (85899345920, 1500000000, 4096)
    """
    if isinstance(text, int) and not isinstance(text, bool):  # pyright: ignore[reportUnnecessaryIsInstance]
        if text <= 0:
            raise ValueError(f"a size must be positive, got {text}")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or (unit and unit not in _UNITS) or float(m.group(1)) <= 0:
        raise ValueError(
            f"cannot read {text!r} as a size; write a positive number with a unit, like '80GiB', "
            f"'40GB' or '512MiB'"
        )
    return int(float(m.group(1)) * _UNITS[unit or "b"])


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], /) -> str:
    """A plain-text table with left-aligned columns.

    Example:
        >>> print(table(["a", "bb"], [["xyz", "1"]]))
        a    bb
        ---  --
        xyz  1
    """
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in rows]
    return "\n".join(line.rstrip() for line in out)


def format_bytes(n: float, /) -> str:
    """``1536`` -> ``'1.50 KiB'``.

    Example:
        >>> format_bytes(3 * 2**30)
        '3.00 GiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def shape_text(shape: Sequence[int], /) -> str:
    """``(4,)`` for one dim, ``(2, 3)`` for two: a shape as Python prints a tuple."""
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
