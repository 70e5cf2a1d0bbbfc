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
    # a bare prefix is binary, as nvidia-smi, DeepSpeed and PyTorch count device memory
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str | int, /) -> int:
    """``"80GiB"`` -> bytes; the unit is required and says which powers: ``GB`` is 10**9, ``GiB`` 2**30.

    Units (any case): ``B``; ``kB``/``MB``/``GB``/``TB``, decimal (powers of 10, as disks and
    network links are sold); ``KiB``/``MiB``/``GiB``/``TiB``, binary (powers of 2, as device
    memory is counted: an "80 GB" A100 holds 80 GiB). A bare prefix (``"80G"``, ``"80g"``) is
    binary too, as ``nvidia-smi``, DeepSpeed's estimators and PyTorch mean it;
    :func:`describe_size` says which reading was taken. A number without a unit (``"80"``)
    is refused rather than guessed; an ``int`` counts bytes.

    Raises:
        ValueError: not a positive size with a unit; for a bare number the message names
            the binary and the decimal reading.

    Example:
        >>> parse_bytes("80GiB"), parse_bytes("1.5 GB"), parse_bytes("512B"), parse_bytes(4096)
        (85899345920, 1500000000, 512, 4096)
        >>> parse_bytes("80G") == parse_bytes("80g") == parse_bytes("80GiB")
        True
        >>> parse_bytes("80")
        Traceback (most recent call last):
        ValueError: '80' has no unit: write '80GiB' (80 * 2**30 bytes) or '80GB' (80 * 10**9 bytes), or '80B' for bytes
    """
    if isinstance(text, int) and not isinstance(text, bool):  # pyright: ignore[reportUnnecessaryIsInstance]
        if text <= 0:
            raise ValueError(f"a size must be positive, got {text}")
        return text
    m = _SIZE.fullmatch(str(text))
    unit = m.group(2).lower() if m else ""
    if m is not None and float(m.group(1)) > 0 and not unit:
        n = m.group(1)
        raise ValueError(
            f"{text!r} has no unit: write '{n}GiB' ({n} * 2**30 bytes) or '{n}GB' "
            f"({n} * 10**9 bytes), or '{n}B' for bytes"
        )
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(
            f"cannot read {text!r} as a size; write a positive number with a unit, like '80GiB' "
            f"(binary, 80 * 2**30 bytes), '40GB' (decimal, 40 * 10**9 bytes) or '512MiB'"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def describe_size(text: str | int, /) -> str:
    """How :func:`parse_bytes` reads ``text``, in words: the bytes, binary or decimal, in GiB.

    Example:
        >>> describe_size("80GB")
        '80GB = 80 * 10**9 bytes (decimal) = 74.51 GiB'
        >>> describe_size("80G")
        '80G = 80 * 2**30 bytes (binary, as nvidia-smi means G) = 80.00 GiB'
        >>> describe_size("80GiB")
        '80GiB = 80.00 GiB'
    """
    n = parse_bytes(text)
    m = _SIZE.fullmatch(str(text))
    unit = m.group(2) if m else "B"
    written = str(text).strip()
    if unit.lower() in ("kb", "mb", "gb", "tb"):
        power = {"k": 3, "m": 6, "g": 9, "t": 12}[unit[0].lower()]
        return f"{written} = {m.group(1) if m else n} * 10**{power} bytes (decimal) = {format_bytes(n)}"
    if len(unit) == 1 and unit.lower() != "b":
        power = {"k": 10, "m": 20, "g": 30, "t": 40}[unit.lower()]
        return (
            f"{written} = {m.group(1) if m else n} * 2**{power} bytes (binary, as nvidia-smi "
            f"means {unit.upper()}) = {format_bytes(n)}"
        )
    return f"{written} = {format_bytes(n)}"


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
