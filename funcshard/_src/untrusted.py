"""Reading files that funcshard does not trust: strict JSON, no symlinks, tensors proven before use.

[Note: reader discipline]
Checkpoint manifests and metadata, plans, hardware files, Hugging Face configs,
safetensors headers and indexes and Orbax ``_METADATA`` are untrusted input: a file may
be damaged, or crafted by someone who recomputes every digest. Every reader goes through
this module, or for pickles through ``untrusted_pickle.py`` and for ``torch.save`` blobs
through ``untrusted_tensor.py``. Two libraries then open a checked file again by path
to read its data: ``safetensors.safe_open`` (which checks the header itself again) and
TensorStore (an Orbax checkpoint's arrays, under names its checked ``_METADATA`` gives).

- **JSON** (:func:`loads_json`, :func:`read_json`): at most ``max_bytes``, nested at most
  ``max_depth`` deep, no ``NaN``/``Infinity`` literal, no number that overflows to
  infinity (``1e400``), no key twice in one object. A failure raises the caller's error
  class naming the file and the field (``leaves[3].shape``), never a bare ``ValueError``
  or ``RecursionError`` from ``json``.
- **Files** (:func:`open_file`, :func:`open_plain`): opened once, with ``O_NONBLOCK``
  (a FIFO in a file's place cannot stall the open) and ``O_NOFOLLOW`` where a symlink is
  refused, and checked to be a regular file on the open descriptor (``fstat``), never
  re-opened by path: what was checked is what is read, even if the path is swapped. A
  name read from a file (:func:`open_plain`) is relative, has no ``..``, and is walked
  one directory descriptor at a time: every component below the root a real directory,
  the last a regular file, no symlink anywhere, so nothing outside the root is read.
- **Pickles and tensors** (``check_pickle`` in ``untrusted_pickle.py``, ``load_tensor`` in
  ``untrusted_tensor.py``):
  a pickle's opcodes are bounded before it is unpickled (no memo-reuse bomb that hashes
  for hours; see [Note: pickles checked before they are unpickled] in ``untrusted_pickle.py``); before
  ``torch.load``, the blob is a zip archive of stored entries whose sizes add up to at
  most the blob (nothing is allocated beyond what the file holds); after it, the result
  is a plain dense CPU tensor of the declared dtype and shape holding exactly its bytes.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

MAX_DEPTH = 64  # no file funcshard reads nests deeper (a manifest's tree: its own depth)
MAX_JSON_BYTES = 64 << 20


class _Bad:
    """A literal that strict JSON refuses, kept in place to find the field that holds it."""

    def __init__(self, token: str) -> None:
        self.token = token


def loads_json(
    raw: bytes | str,
    /,
    *,
    what: str,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_DEPTH,
    error: type[Exception] = ValueError,
) -> Any:
    """``raw`` parsed as strict JSON (see [Note: reader discipline]).

    Args:
        raw: the text.
        what: the file (or thing) it came from, for messages.
        max_bytes: the most bytes accepted.
        max_depth: the deepest nesting of arrays and objects accepted.
        error: the exception class raised (a ``ValueError`` subclass, say).

    Raises:
        error: too large, nested too deeply, not JSON, a ``NaN``/``Infinity`` or
            out-of-range number, or a duplicate key; the message names ``what``
            and the field.

    Example:
        >>> loads_json('{"a": [1, 2.5]}', what="x.json")
        {'a': [1, 2.5]}
        >>> loads_json('{"a": {"b": 1e400}}', what="x.json")
        Traceback (most recent call last):
        ...
        ValueError: x.json: a.b is 1e400, not a finite number; the file is damaged or was crafted
    """
    data = raw.encode() if isinstance(raw, str) else raw
    if len(data) > max_bytes:
        raise error(f"{what}: {len(data)} bytes, more than the {max_bytes} such a file may have")
    try:
        value = json.loads(
            data, object_pairs_hook=_unique, parse_constant=_refuse, parse_float=_finite
        )
    except RecursionError:
        raise error(
            f"{what}: nested more than {max_depth} arrays or objects deep (near byte "
            f"{_deep_at(data, max_depth)}); the file is damaged or was crafted"
        ) from None
    except _RefusedError:
        found = _find_bad(json.loads(data, parse_constant=_Bad, parse_float=_float_or_bad))
        field, token = found if found is not None else ("a field", "a non-finite number")
        raise error(
            f"{what}: {field} is {token}, not a finite number; the file is damaged or was crafted"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, duplicate keys, huge ints
        raise error(f"{what}: not valid JSON ({e}); the file is damaged or was crafted") from None
    deep = _too_deep(value, max_depth)
    if deep is not None:
        raise error(
            f"{what}: {deep} is nested more than {max_depth} arrays or objects deep; the file is "
            f"damaged or was crafted"
        )
    return value


def read_json(
    path: str | os.PathLike[str],
    /,
    *,
    what: str | None = None,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_DEPTH,
    error: type[Exception] = ValueError,
    symlinks: bool = True,
    missing: type[Exception] | None = None,
) -> Any:
    """The strict JSON of the file at ``path`` (see :func:`loads_json`), opened once (:func:`open_file`).

    Args:
        path: the file.
        what: how messages name it (default: the path).
        max_bytes, max_depth, error: as :func:`loads_json`.
        symlinks: whether ``path`` itself may be a symlink (a user's own file may be;
            a file inside a checkpoint may not).
        missing: raised when it is missing or unreadable (default: ``error``).

    Raises:
        error: missing, unreadable, not a regular file (or a symlink when refused),
            or not strict JSON.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "hw.json"
        >>> _ = p.write_text('{"name": "x"}')
        >>> read_json(p)
        {'name': 'x'}
    """
    label = what or str(path)
    opened = open_file(path, what=label, symlinks=symlinks, unsafe=error, missing=missing or error)
    with opened as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise error(f"{label}: {size} bytes, more than the {max_bytes} such a file may have")
        raw = f.read(max_bytes + 1)
    return loads_json(raw, what=label, max_bytes=max_bytes, max_depth=max_depth, error=error)


def open_file(
    path: str | os.PathLike[str],
    /,
    *,
    what: str | None = None,
    symlinks: bool = False,
    unsafe: type[Exception] = ValueError,
    missing: type[Exception] = ValueError,
) -> BinaryIO:
    """``path`` opened once for reading, if it is a regular file (see [Note: reader discipline]).

    Args:
        path: the file.
        what: how messages name it (default: the path).
        symlinks: whether ``path`` itself may be a symlink (a user's own file may be).
        unsafe: raised for a symlink (when refused) or anything but a regular file.
        missing: raised when it is missing or unreadable.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "fifo"
        >>> os.mkfifo(p)  # a FIFO: opened without waiting for a writer, then refused
        >>> open_file(p, what="x.json")
        Traceback (most recent call last):
        ...
        ValueError: x.json: not a regular file (a fifo); refusing to read it
    """
    label = what or str(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise missing(f"{label}: missing") from None
    except OSError as e:
        if not symlinks and os.path.islink(path):
            raise unsafe(f"{label}: a symlink; refusing to follow it") from None
        raise missing(f"{label}: cannot read it ({e.strerror})") from None
    return _regular(fd, label, unsafe)


def open_plain(
    root: Path,
    relative: str,
    /,
    *,
    unsafe: type[Exception] = ValueError,
    missing: type[Exception] = ValueError,
) -> BinaryIO:
    """``root / relative`` opened once, if it is a regular file reached through real directories only.

    Each component is opened relative to the directory before it (``dir_fd``) with
    ``O_NOFOLLOW``: no symlink is followed, and nothing checked can be swapped before it
    is read.

    Raises:
        unsafe: ``relative`` is absolute or has ``..``, or a component is a symlink
            or not a directory (the last: not a regular file).
        missing: the file is not there.

    Example:
        >>> import tempfile, pathlib
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> (root / "a").mkdir(); _ = (root / "a" / "f").write_text("x")
        >>> with open_plain(root, "a/f") as f:
        ...     f.read()
        b'x'
        >>> (root / "l").symlink_to(root / "a")
        >>> open_plain(root, "l/f")
        Traceback (most recent call last):
        ...
        ValueError: .../l/f: .../l is a symlink; refusing to follow it (nothing outside ... is read)
    """
    parts = relative.split("/")
    label = root / relative
    if os.path.isabs(relative) or any(p in ("", ".", "..") for p in parts):
        raise unsafe(f"{label}: {relative!r} is not a plain relative name; refusing")
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise missing(f"{label}: cannot read it ({e.strerror})") from None
    here = root
    for i, part in enumerate(parts):
        here = here / part
        last = i == len(parts) - 1
        flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_NONBLOCK if last else os.O_DIRECTORY)
        try:
            sub = os.open(part, flags, dir_fd=fd)
        except OSError as e:
            problem = _why_not(part, fd, last, e)
            os.close(fd)
            if problem is None:
                raise missing(f"{label}: missing") from None
            if problem == "":
                raise missing(f"{label}: cannot read it ({e.strerror})") from None
            if "symlink" in problem:
                problem += f" (nothing outside {root} is read)"
            raise unsafe(f"{label}: {here} {problem}") from None
        os.close(fd)
        fd = sub
    return _regular(fd, str(label), unsafe, f"{label}: {here} is not a regular file")


def _regular(fd: int, label: str, unsafe: type[Exception], message: str | None = None) -> BinaryIO:
    """The stream of ``fd`` if ``fstat`` finds a regular file; else closes it and raises."""
    stream = os.fdopen(fd, "rb")
    mode = os.fstat(stream.fileno()).st_mode
    if not stat.S_ISREG(mode):
        stream.close()
        kind = (
            "a fifo" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "special"
        )
        raise unsafe(message or f"{label}: not a regular file ({kind}); refusing to read it")
    return stream


def _why_not(part: str, fd: int, last: bool, e: OSError) -> str | None:
    """Why opening ``part`` failed: ``None`` (missing), ``""`` (unreadable) or what it is instead."""
    if isinstance(e, FileNotFoundError):
        return None
    try:
        mode = os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode
    except OSError:
        return ""
    if stat.S_ISLNK(mode):
        return "is a symlink; refusing to follow it"
    if not last and not stat.S_ISDIR(mode):
        return "is not a directory"
    return ""


class _RefusedError(ValueError):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def _refuse(token: str) -> Any:
    raise _RefusedError(token)


def _finite(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):
        raise _RefusedError(token)
    return value


def _float_or_bad(token: str) -> float | _Bad:
    value = float(token)
    return value if math.isfinite(value) else _Bad(token)


def _walk(value: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every node with its path, depth first, without recursion."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack:
        path, node = stack.pop()
        yield path, node
        if isinstance(node, dict):
            stack.extend(((*path, k), v) for k, v in node.items())  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
        elif isinstance(node, list):
            stack.extend(((*path, i), v) for i, v in enumerate(node))  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]


def field_name(path: tuple[Any, ...], /) -> str:
    """A JSON field's path as messages write it: ``leaves[3].shape``.

    Example:
        >>> field_name(("leaves", 3, "shape"))
        'leaves[3].shape'
    """
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return (out or "the top level")[:200]


def _find_bad(value: Any) -> tuple[str, str] | None:
    for path, node in _walk(value):
        if isinstance(node, _Bad):
            return field_name(path), node.token
    return None


def _too_deep(value: Any, limit: int) -> str | None:
    """The field nested more than ``limit`` deep, or ``None`` (containers only are visited)."""
    if type(value) is not dict and type(value) is not list:
        return None
    stack: list[tuple[int, Any]] = [(1, value)]
    while stack:  # depths only; the path is found again on the error path
        depth, node = stack.pop()
        if depth > limit:
            path = next(p for p, n in _walk(value) if n is node)
            return field_name(path[:4]) + "..." if len(path) > 4 else field_name(path)
        for child in node.values() if type(node) is dict else node:
            if type(child) is dict or type(child) is list:
                stack.append((depth + 1, child))
    return None


def _deep_at(data: bytes, limit: int) -> int:
    """The byte where nesting first passes ``limit`` (strings skipped); only on the error path."""
    text = re.sub(rb'"(?:[^"\\]|\\.)*"', lambda m: b"_" * len(m.group()), data)
    depth = 0
    for i, c in enumerate(text):
        depth += (c in b"[{") - (c in b"]}")
        if depth > limit:
            return i
    return len(data)
