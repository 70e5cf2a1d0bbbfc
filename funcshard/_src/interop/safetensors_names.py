"""Which tensor of safetensors files each leaf reads: its names, the casts allowed, tied names.

A leaf may be stored under any of several names (a tied weight under one of them);
:func:`choose` picks the first present and checks its shape and dtype, and
:func:`check_ties` refuses a checkpoint that holds two of a leaf's names with different
values. Files are opened through :func:`opened` (``safetensors.safe_open``), one handle
per file.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import torch

from funcshard._src.dtypes import dtype_name
from funcshard._src.interop.safetensors_format import Entry

Pattern: TypeAlias = str | re.Pattern[str]  # a glob over dotted names, or a regex searched


def choose(
    entries: Mapping[str, Entry],
    wanted: Mapping[str, tuple[tuple[str, ...], tuple[int, ...], torch.dtype]],
    /,
    *,
    ignore: Sequence[Pattern] = (),
    known: set[str] | frozenset[str] = frozenset(),
    hint: str = "",
) -> dict[str, str]:
    """The tensor name read for every label of ``wanted`` (its names, shape and dtype).

    The first of a label's names in ``entries`` is read. Names in ``known`` are no
    leaf's but not unexpected either.

    Raises:
        ValueError: a label none of whose names is there (``hint`` says the fix), a
            shape mismatch or a dtype that does not cast, or a tensor of ``entries``
            that no label names, in ``known`` or matches ``ignore``.
    """
    keys: dict[str, str] = {}
    missing: list[str] = []
    wrong: list[str] = []
    for label, (names, shape, dtype) in wanted.items():
        key = next((n for n in names if n in entries), None)
        if key is None:
            missing.append(f"{label} (as {' or '.join(map(repr, names))})")
            continue
        entry = entries[key]
        if entry.shape != shape:
            wrong.append(
                f"{key!r} is {list(entry.shape)} in the files, but {label} is {list(shape)}"
            )
        elif not _castable(entry.dtype, dtype):
            wrong.append(
                f"{key!r} is {dtype_name(entry.dtype)} in the files, but {label} stores "
                f"{dtype_name(dtype)}: only floating dtypes cast (or integer to integer)"
            )
        keys[label] = key
    if missing:
        raise ValueError(
            f"the checkpoint lacks {_listing(missing)} ({len(entries)} tensors, in "
            f"{sorted({e.file.name for e in entries.values()})[:3]}); {hint}"
        )
    if wrong:
        raise ValueError(f"the checkpoint does not fit: {_listing(wrong)}; {hint}")
    named = {n for names, _, _ in wanted.values() for n in names} | set(known)
    unexpected = [k for k in entries if k not in named and not matches(k, ignore)]
    if unexpected:
        raise ValueError(
            f"the checkpoint holds tensors that no leaf is named by: {_listing(unexpected)}; "
            f"pass ignore_unexpected=[{unexpected[0]!r}, ...] (globs) to skip them, or {hint}"
        )
    return keys


def check_ties(entries: Mapping[str, Entry], names: Mapping[str, Sequence[str]], /) -> None:
    """Refuses a label two of whose names the files hold with different values.

    A tied weight is one leaf; when a checkpoint holds it under two names (the
    embedding and the head, say) they must be equal: ``from_pretrained`` would make
    two parameters of two values, funcshard would keep one and drop the other.
    Compares the tensors in blocks of at most :data:`TIE_BLOCK_BYTES`.

    Raises:
        ValueError: the label, both names, and the fix.
    """
    for label, candidates in names.items():
        present = [n for n in dict.fromkeys(candidates) if n in entries]
        for other in present[1:]:
            a, b = entries[present[0]], entries[other]
            if (
                a.shape != b.shape
                or a.dtype != b.dtype
                or not _same_values(present[0], a, other, b)
            ):
                raise ValueError(
                    f"{label}: the checkpoint holds both {present[0]!r} and {other!r}, which the "
                    f"model ties into one leaf, with different values; from_pretrained would untie "
                    f"them into two parameters. Untie the module (tie_word_embeddings=False in its "
                    f"config, then functionalize it again) or drop one of them from the checkpoint"
                )


TIE_BLOCK_BYTES = 64 << 20


def _same_values(key_a: str, a: Entry, key_b: str, b: Entry) -> bool:
    rows = a.shape[0] if a.shape else 1
    per_row = max(1, math.prod(a.shape[1:]) * a.dtype.itemsize)
    step = max(1, TIE_BLOCK_BYTES // per_row)
    with opened() as handle:
        sa, sb = handle(a.file).get_slice(key_a), handle(b.file).get_slice(key_b)
        if not a.shape:
            return bool(torch.equal(sa[...], sb[...]))
        for start in range(0, rows, step):
            if not torch.equal(sa[start : start + step], sb[start : start + step]):
                return False
    return True


@contextlib.contextmanager
def opened() -> Iterator[Callable[[Path], Any]]:
    """A function opening each file once (``safetensors.safe_open``), closed on exit."""
    try:
        import safetensors  # pyright: ignore[reportMissingImports]
    except ImportError:
        raise ImportError(
            "reading safetensors needs the package: pip install safetensors"
        ) from None
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(file: Path) -> Any:
            if file not in handles:
                handles[file] = stack.enter_context(safetensors.safe_open(str(file), "pt"))
            return handles[file]

        yield handle


def _castable(source: torch.dtype, target: torch.dtype) -> bool:
    if source == target or (source.is_floating_point and target.is_floating_point):
        return True
    integer = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
    return source in integer and target in integer


def matches(name: str, patterns: Sequence[Pattern], /) -> bool:
    """Whether ``name`` matches a glob (``fnmatch``) or is found by a regex of ``patterns``."""
    return any(
        p.search(name) is not None if isinstance(p, re.Pattern) else fnmatch.fnmatchcase(name, p)
        for p in patterns
    )


def _listing(items: Sequence[str]) -> str:
    more = f" and {len(items) - 5} more" if len(items) > 5 else ""
    return ", ".join(items[:5]) + more
