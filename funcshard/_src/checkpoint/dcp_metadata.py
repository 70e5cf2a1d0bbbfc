"""The index of a standard DCP checkpoint (``dcp.save``'s ``.metadata``), read without trusting it.

A checkpoint that ``torch.distributed.checkpoint.save`` wrote (an FSDP2 or
torchtitan run's) is a directory with one ``.metadata`` (a pickle of DCP's
``Metadata``: every key, tensor entries' dtypes, sizes and chunks, and where each
chunk's bytes lie) and data files ``__<rank>_<n>.distcp``. The file is untrusted
input (see [Note: reading DCP files]): :func:`read_index` unpickles it with an
allowlist of the classes DCP's metadata is made of, records which keys hold
tensors and which hold bytes (pickled objects, which funcshard never reads), and
lists the data files; :func:`stored_tensor` checks one tensor entry completely
before anything reads its bytes.

[Note: reading DCP files]
No string from the file reaches a path unless it is one of the names
``__<rank>_<n>.distcp``; no file is opened through a symlink (``dcp_files.py``);
every shape, dtype, chunk and byte range
is checked against the entry and the data file's size before memory is
allocated; chunks must tile their tensor exactly (a gap would load as zeros), and
the chunks one load reads share no byte (:func:`check_read_once`). ``.metadata`` is
unpickled only once its opcodes pass ``check_pickle`` (no hash bomb; see
[Note: pickles checked before they are unpickled] in ``untrusted_pickle.py``), and each chunk is read with
``load_tensor``, as funcshard's own chunks are.
Entries stored as bytes are never unpickled: DCP's own loader would
``torch.load(weights_only=False)`` them, which runs any code the file names.
Sizes are capped before any work (see :data:`MAX_METADATA_BYTES`).
"""

from __future__ import annotations

import hashlib
import io
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo  # pyright: ignore[reportPrivateUsage]
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from funcshard._src.checkpoint.chunks import Chunk, check_own_bytes, check_tiling, chunk_key
from funcshard._src.checkpoint.dcp_files import (
    DATA_FILE,
    KEY_CLASSES,
    ChunkMap,
    SafeIndex,
    data_files,
    dcp_unpickler,
    read_regular,
)
from funcshard._src.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NotACheckpointError,
    UnsafeCheckpointError,
)
from funcshard._src.dtypes import MAX_ELEMENTS
from funcshard._src.untrusted_pickle import check_pickle

METADATA_FILE = ".metadata"
# A 70B model with AdamW state: ~2900 keys (723 tensors, exp_avg, exp_avg_sq, step); saved
# by 32 ranks, 92k chunks at 144 bytes each (measured on dcp.save's pickle): 13 MB.
MAX_METADATA_BYTES = 128 << 20
MAX_KEYS = 1 << 16  # state_dict_metadata entries
MAX_CHUNKS = 1 << 20  # storage_data entries
SERIALIZATION_SLACK = 64 << 10  # bytes torch.save adds around a tensor's data, at most
MAX_DIMS = 64


@dataclass(frozen=True)
class StoredChunk:
    """One saved piece of a tensor: its box in the tensor and its bytes in a data file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # a data file's name, __<rank>_<n>.distcp
    offset: int
    length: int


@dataclass(frozen=True)
class StoredTensor:
    """A checked tensor entry: global shape, dtype, and the non-empty chunks that tile it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[StoredChunk, ...]


@dataclass(frozen=True, eq=False)
class DcpIndex:
    """What a DCP checkpoint's ``.metadata`` says, with its data files; see [Note: reading DCP files]."""

    directory: Path
    digest: str  # SHA-256 of .metadata: ranks compare it to know they read one checkpoint
    kinds: Mapping[str, str]  # every key: "tensor" or "bytes"
    files: Mapping[str, int]  # data file name -> size, regular files only
    links: frozenset[str]  # data file names that are symlinks (refused when used)
    entries: Mapping[str, TensorStorageMetadata]
    storage: Mapping[tuple[str, tuple[int, ...]], _StorageInfo]  # a ChunkMap: hashes unsteered


def read_index(directory: str | os.PathLike[str], /) -> DcpIndex:
    """The index of the DCP checkpoint at ``directory``: its keys, their kinds and its data files.

    Raises:
        NotACheckpointError: no such directory, or no ``.metadata`` in it.
        CorruptCheckpointError: an unreadable, oversized or malformed ``.metadata``.
        UnsafeCheckpointError: ``.metadata`` names a class DCP's metadata never holds,
            or is a symlink.

    Example:
        >>> import tempfile, funcshard as fs
        >>> p = {"w": torch.ones(2, 3)}
        >>> path = fs.checkpoint.save_dcp(f"{tempfile.mkdtemp()}/c", fs.shard(p, fs.plan(p, fs.Mesh({"x": 1}))))
        >>> dict(read_index(path).kinds)
        {'w': 'tensor'}
    """
    root = Path(directory)
    if not root.is_dir():
        raise NotACheckpointError(f"{root}: no such checkpoint directory")
    path = root / METADATA_FILE
    if not os.path.lexists(path):
        hint = (
            "it is a funcshard checkpoint: load it with fs.checkpoint.load"
            if (root / "manifest.json").is_file()
            else "dcp.save writes one, last; the save may not have finished"
        )
        raise NotACheckpointError(f"{root}: no {METADATA_FILE}, not a DCP checkpoint ({hint})")
    data = read_regular(path, MAX_METADATA_BYTES, limit_name="MAX_METADATA_BYTES")
    check_pickle(data, what=str(path), error=CorruptCheckpointError, key_classes=KEY_CLASSES)
    try:
        metadata = dcp_unpickler(io.BytesIO(data)).load()
    except CheckpointError as e:
        raise type(e)(f"{path}: {e}") from None
    except Exception as e:  # whatever a damaged pickle raises
        raise CorruptCheckpointError(
            f"{path}: unreadable DCP metadata ({type(e).__name__}: {_short(e)}); the checkpoint "
            f"is corrupted"
        ) from None
    if type(metadata) is not Metadata:
        raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    for field, limit in (("state_dict_metadata", MAX_KEYS), ("storage_data", MAX_CHUNKS)):
        value = getattr(metadata, field, None)
        if isinstance(value, dict) and len(value) > limit:  # pyright: ignore[reportUnknownArgumentType]
            raise CorruptCheckpointError(
                f"{path}: {field} has {len(value)} entries, more than the {limit} funcshard reads "  # pyright: ignore[reportUnknownArgumentType]
                f"(a 70B model's from 32 ranks has 2900 keys and 92k chunks)"
            )
    kinds, entries = _entries(path, getattr(metadata, "state_dict_metadata", None))
    files, links = data_files(root)
    return DcpIndex(
        directory=root,
        digest=hashlib.sha256(data).hexdigest(),
        kinds=kinds,
        files=files,
        links=frozenset(links),
        entries=entries,
        storage=_storage(path, getattr(metadata, "storage_data", None)),
    )


def stored_tensor(index: DcpIndex, key: str, /) -> StoredTensor:
    """The checked tensor entry ``key`` of ``index``: everything needed to read it, in bounds.

    Raises:
        CorruptCheckpointError: a malformed entry, chunks that do not tile the tensor,
            a missing data file or a byte range outside it.
        UnsafeCheckpointError: ``key`` is stored as bytes (a pickle), its storage names
            a path that is not a data file of the checkpoint, or a symlink.
        CheckpointError: the entry uses DCP storage extensions (compression), which
            funcshard does not read.
    """
    where = f"{index.directory / METADATA_FILE}, entry {key!r}"
    kind = index.kinds.get(key)
    if kind == "bytes":
        raise UnsafeCheckpointError(
            f"{where}: stored as bytes (a pickled object), not as a tensor; funcshard never "
            f"unpickles checkpoint entries (the checkpoint was written from another state dict, "
            f"or crafted)"
        )
    if kind is None:
        raise CorruptCheckpointError(f"{where}: missing")
    entry = index.entries[key]
    try:
        shape, dtype, boxes = _described(entry)
    except (TypeError, ValueError, AttributeError, OverflowError) as e:
        raise CorruptCheckpointError(
            f"{where}: not a tensor entry DCP writes ({_short(e)}); the checkpoint is corrupted"
        ) from None
    problem = check_tiling(key, shape, [Chunk(chunk_key(key, o), o, s, 0) for o, s in boxes])
    if problem is not None:
        raise CorruptCheckpointError(f"{where}: {problem}; the checkpoint is corrupted")
    stored = tuple(_chunk(index, where, key, dtype, o, s) for o, s in boxes)
    return StoredTensor(key, shape, dtype, stored)


def check_read_once(index: DcpIndex, tensors: Iterable[StoredTensor], /) -> None:
    """Refuses ``tensors`` (those one load reads) if two of their chunks share bytes of a file.

    As funcshard's own reader (``dcp_io``): every chunk read has bytes of its own, so no
    entry reads another's (``exp_avg_sq`` pointed at ``exp_avg``'s bytes). A tensor that
    ``save_dcp`` writes once under several keys (tied weights) is read under one of them.

    Raises:
        UnsafeCheckpointError: two chunks overlap; the message names both entries.
    """
    check_own_bytes(
        {
            (c.file, c.offset, c.offset + c.length, f"{t.key!r} at {c.offsets}")
            for t in tensors
            for c in t.chunks
        },
        metadata=index.directory / METADATA_FILE,
    )


# -- checks ----------------------------------------------------------------------


def _entries(path: Path, raw: object) -> tuple[dict[str, str], dict[str, TensorStorageMetadata]]:
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(
            f"{path}: state_dict_metadata is a {type(raw).__name__}, not a mapping of keys"
        )
    kinds: dict[str, str] = {}
    entries: dict[str, TensorStorageMetadata] = {}
    for key, entry in raw.items():  # pyright: ignore[reportUnknownVariableType]
        if not isinstance(key, str):
            raise CorruptCheckpointError(f"{path}: a key is a {type(key).__name__}, not a string")
        if type(entry) is TensorStorageMetadata:
            kinds[key] = "tensor"
            entries[key] = entry
        elif type(entry) is BytesStorageMetadata:
            kinds[key] = "bytes"
        else:
            raise CorruptCheckpointError(
                f"{path}, entry {key!r}: a {type(entry).__name__}, neither tensor nor bytes storage"
            )
    return kinds, entries


def _storage(path: Path, raw: object) -> ChunkMap[_StorageInfo]:
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(
            f"{path}: storage_data is a {type(raw).__name__}, not a mapping of chunks to bytes"
        )
    out: ChunkMap[_StorageInfo] = ChunkMap()
    for index, info in raw.items():  # pyright: ignore[reportUnknownVariableType]
        fqn = getattr(index, "fqn", None)
        offset = getattr(index, "offset", None)
        if type(index) is not SafeIndex or not isinstance(fqn, str):
            raise CorruptCheckpointError(
                f"{path}: storage_data has a {type(index).__name__} key, not a key and offsets; "
                f"the checkpoint is corrupted"
            )
        if type(info) is not _StorageInfo:
            raise CorruptCheckpointError(
                f"{path}: the storage of {fqn!r} is a {type(info).__name__}, not where a chunk's "
                f"bytes lie; the checkpoint is corrupted"
            )
        if offset is None:
            continue  # bytes entries: never read
        if not isinstance(offset, tuple) or not all(_is_int(x) for x in offset):
            raise CorruptCheckpointError(
                f"{path}: the storage of {fqn!r} has malformed offsets; the checkpoint is corrupted"
            )
        out.add((fqn, tuple(offset)), info)  # pyright: ignore[reportUnknownArgumentType]
    return out


def _described(
    entry: TensorStorageMetadata,
) -> tuple[tuple[int, ...], torch.dtype, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The shape, dtype and non-empty chunk boxes of ``entry``; raises on anything malformed."""
    properties = entry.properties
    if type(properties) is not TensorProperties or not isinstance(properties.dtype, torch.dtype):
        raise TypeError("its properties name no dtype")
    shape = _ints(entry.size, "its size")
    if len(shape) > MAX_DIMS or math.prod(shape) >= MAX_ELEMENTS:
        raise ValueError(f"size {shape} is not a tensor funcshard allocates")
    if not isinstance(entry.chunks, list):
        raise TypeError("its chunks are not a list")
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for c in entry.chunks:  # pyright: ignore[reportUnknownVariableType]
        if type(c) is not ChunkStorageMetadata:
            raise TypeError(f"a chunk is a {type(c).__name__}")
        offsets, sizes = _ints(c.offsets, "chunk offsets"), _ints(c.sizes, "chunk sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise ValueError(
                f"a chunk's offsets have {len(offsets)} dims and its sizes {len(sizes)}, the "
                f"tensor {len(shape)}"
            )
        if any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise ValueError(f"chunk {offsets} + {sizes} sticks out of {shape}")
        if math.prod(sizes) > 0:
            boxes.append((offsets, sizes))
    return shape, properties.dtype, boxes


def _chunk(
    index: DcpIndex,
    where: str,
    key: str,
    dtype: torch.dtype,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
) -> StoredChunk:
    info = index.storage.get((key, offsets))
    if info is None:
        raise CorruptCheckpointError(
            f"{where}: the chunk at {offsets} has no storage entry; the checkpoint is corrupted"
        )
    name = getattr(info, "relative_path", None)
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(
            f"{where}: stored with DCP storage extensions (compression), which funcshard does not "
            f"read; save without extensions, or convert the checkpoint with DCP first"
        )
    if not isinstance(name, str) or DATA_FILE.fullmatch(name) is None:
        raise UnsafeCheckpointError(
            f"{where}: its storage names {str(name)[:80]!r}, not a data file __<rank>_<n>.distcp "
            f"of the checkpoint; refusing to read it"
        )
    if name in index.links:
        raise UnsafeCheckpointError(
            f"{index.directory / name}: a symlink; a checkpoint's files are regular files, "
            f"refusing to follow it"
        )
    if name not in index.files:
        raise CorruptCheckpointError(
            f"{index.directory / name}: missing (entry {key!r} is stored there); the checkpoint is "
            f"incomplete"
        )
    size = index.files[name]
    if (
        not isinstance(offset, int)
        or not isinstance(length, int)
        or isinstance(offset, bool)
        or isinstance(length, bool)
        or offset < 0
        or length <= 0
        or offset + length > size
        # torch.save stores a tensor's bytes uncompressed: a chunk's bytes hold its data, so
        # no entry can make a reader allocate more than the files hold
        or not math.prod(sizes) * dtype.itemsize <= length
        or length > math.prod(sizes) * dtype.itemsize + SERIALIZATION_SLACK
    ):
        raise CorruptCheckpointError(
            f"{where}: the chunk at {offsets} claims bytes [{offset}, +{length}) of {name} "
            f"({size} bytes), which cannot hold it; the checkpoint is corrupted or was crafted"
        )
    return StoredChunk(offsets, sizes, name, offset, length)


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(_is_int(x) and x >= 0 for x in value):
        raise TypeError(f"{what}: not integers >= 0")
    return tuple(value)  # pyright: ignore[reportUnknownArgumentType]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _short(e: BaseException) -> str:
    return str(e)[:200]
