"""A DCP checkpoint's files, opened as untrusted input: regular files inside it, never through a link.

See [Note: reading DCP files] in ``dcp_metadata.py``. A data file's name must be
``__<rank>_<n>.distcp``; every file is opened with ``O_NOFOLLOW`` (and ``O_NONBLOCK``,
so that a FIFO cannot stall the open) and checked to be a regular file once it is open,
so that neither a symlink nor a file swapped in between leads outside the checkpoint.
Both ``.metadata`` readers unpickle DCP's ``MetadataIndex`` as :class:`SafeIndex`, whose
hash the file cannot steer.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from funcshard._src.checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError
from funcshard._src.untrusted import open_file

KEY_CLASSES = ("torch.distributed.checkpoint.metadata.MetadataIndex",)  # see SafeIndex
DCP_CLASSES: dict[str, frozenset[str]] = {  # what DCP's .metadata is made of
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
}


DATA_FILE = re.compile(r"__(0|[1-9][0-9]{0,6})_(0|[1-9][0-9]{0,6})\.distcp")


def open_regular(path: Path, /) -> BinaryIO:
    """``path`` opened for reading, if it is a regular file and not a symlink.

    Raises:
        UnsafeCheckpointError: ``path`` is a symlink or not a regular file.
        CorruptCheckpointError: it is missing or unreadable.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "f"
        >>> _ = path.write_bytes(b"data")
        >>> with open_regular(path) as f:
        ...     f.read()
        b'data'
    """
    return open_file(path, unsafe=UnsafeCheckpointError, missing=_MissingFileError)


def read_regular(path: Path, limit: int, /, *, limit_name: str = "the limit") -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes (see :func:`open_regular`).

    Raises:
        UnsafeCheckpointError: ``path`` is a symlink or not a regular file.
        CorruptCheckpointError: it is missing, unreadable or larger than ``limit``.
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CorruptCheckpointError(
                f"{path}: {size} bytes, more than {limit_name} of {limit}; no real checkpoint's "
                f"file is that large, so it is refused before it is read"
            )
        return f.read(limit + 1)


def data_files(root: Path, /) -> tuple[dict[str, int], set[str]]:
    """The data files directly in ``root``: the size of each regular one, and the names of links."""
    files: dict[str, int] = {}
    links: set[str] = set()
    with os.scandir(root) as listing:
        for item in listing:
            if DATA_FILE.fullmatch(item.name) is None:
                continue
            if item.is_symlink():
                links.add(item.name)
            elif item.is_file(follow_symlinks=False):
                files[item.name] = item.stat(follow_symlinks=False).st_size
    return files, links


class SafeIndex(MetadataIndex):
    """DCP's ``MetadataIndex`` with a hash no file can steer: keyed string hashes only.

    ``MetadataIndex`` hashes ``(fqn, offset)``; integers and tuples of them hash without a
    key, so a file can hold 200k offsets of one hash and make building ``storage_data``
    quadratic. This hash is that of strings (keyed per process), and refuses (``TypeError``,
    which the readers report as corruption) what no index holds: a ``fqn`` that is not a
    string, offsets that are not at most 64 integers in ``[0, 2**62)``.

    Example:
        >>> import torch
        >>> SafeIndex("w", torch.Size([0, 4])) == SafeIndex("w", [0, 4])
        True
    """

    def __hash__(self) -> int:
        fqn, offset = getattr(self, "fqn", None), getattr(self, "offset", None)
        if type(fqn) is not str or not (offset is None or _is_offset(offset)):
            raise TypeError("a MetadataIndex whose fqn or offset is malformed")
        return hash((fqn, repr(tuple(offset)) if offset is not None else ""))

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled again (a test's tampering, a copy) it is DCP's own class
        return (MetadataIndex, (self.fqn, self.offset, self.index))


_V = TypeVar("_V")


class ChunkMap(Mapping[tuple[str, tuple[int, ...]], _V]):
    """A mapping keyed by ``(fqn, offsets)`` whose hashes a file cannot steer (see :class:`SafeIndex`).

    Example:
        >>> m = ChunkMap({("w", (0, 4)): "a"})
        >>> m[("w", (0, 4))], len(m), ("w", (0, 0)) in m
        ('a', 1, False)
    """

    def __init__(self, items: Mapping[tuple[str, tuple[int, ...]], _V] = {}, /) -> None:
        self._items: dict[tuple[str, str], tuple[tuple[str, tuple[int, ...]], _V]] = {}
        for key, value in items.items():
            self.add(key, value)

    def add(self, key: tuple[str, tuple[int, ...]], value: _V, /) -> None:
        """Adds ``key``; mutates this map (built once, while the index is read)."""
        self._items[(key[0], repr(key[1]))] = (key, value)

    def __getitem__(self, key: tuple[str, tuple[int, ...]], /) -> _V:
        return self._items[(key[0], repr(tuple(key[1])))][1]

    def __iter__(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        return (key for key, _ in self._items.values())

    def __len__(self) -> int:
        return len(self._items)


def _is_offset(value: object) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) <= 64  # pyright: ignore[reportUnknownArgumentType]
        and all(type(x) is int and 0 <= x < 1 << 62 for x in value)  # pyright: ignore[reportUnknownVariableType]
    )


class _MissingFileError(CorruptCheckpointError):
    def __init__(self, message: str) -> None:
        tail = "; the checkpoint is incomplete" if message.endswith("missing") else ""
        super().__init__(message + tail)


class AllowlistUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` allowing only the classes ``allowed`` names (module -> names).

    ``what`` names the metadata in the refusal: "checkpoint metadata" (funcshard's own
    rank files) or "DCP's metadata" (a standard DCP checkpoint). A ``MetadataIndex``
    becomes a :class:`SafeIndex`, whose hash the file cannot steer.
    """

    def __init__(self, file: BinaryIO, allowed: Mapping[str, frozenset[str]], what: str, /) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._what = what

    def find_class(self, module: str, name: str) -> Any:
        dtype = vars(torch).get(name) if module == "torch" else None
        if isinstance(dtype, torch.dtype):  # vars(): a name never reaches torch's lazy imports
            return dtype
        if module == MetadataIndex.__module__ and name == "MetadataIndex":
            return SafeIndex  # a hash the file cannot steer
        if name in self._allowed.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"the metadata refers to {module}.{name}, which {self._what} never contains; "
            f"refusing to load it (the file may carry a malicious payload)"
        )


def dcp_unpickler(file: BinaryIO, /) -> AllowlistUnpickler:
    """An unpickler of a standard DCP ``.metadata``: only the classes DCP's metadata is made of."""
    return AllowlistUnpickler(file, DCP_CLASSES, "DCP's metadata")
