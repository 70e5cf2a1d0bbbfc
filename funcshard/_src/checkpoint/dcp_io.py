"""Reading and writing one rank's chunks in torch.distributed.checkpoint's file format, safely.

Each rank writes its chunks with ``dcp.save(..., no_dist=True)`` into its own
sub-directory: DCP's format, none of DCP's collectives (funcshard coordinates
the ranks itself, under its timeouts). Reading does not go through DCP's load
planner, which would ``torch.load(weights_only=False)`` any entry the metadata
declares as bytes: :func:`read_chunks` unpickles ``.metadata`` with an
allowlist once its opcodes pass ``check_pickle`` (see [Note: pickles checked before
they are unpickled] in ``funcshard/_src/untrusted_pickle.py``), checks every entry it
will use against the manifest (tensor storage only, the dtype and size the manifest
says, a byte range inside the data file that holds at least the chunk's bytes and
overlaps no other chunk's, so that what a leaf declares is no more than the files
hold), and reads each chunk from a file opened once, through no symlink (``open_plain``), with
``load_tensor``, which refuses a ``torch.save`` archive whose records would allocate
more than it holds or whose pickle is a bomb, loads it with
``torch.load(weights_only=True)`` and proves the tensor it gets (a plain dense CPU
tensor of the dtype and shape the manifest says whose storage holds exactly its bytes)
before anything reads its values (with ``verify``, the SHA-256 of its contents).

A rank's ``.metadata`` holds one entry per chunk that rank saved: a 70B model with AdamW
state has about 2900 tensors, whose metadata takes about 240 bytes each (0.7 MB).
:data:`MAX_METADATA_BYTES` and :data:`MAX_ENTRIES` leave over 10x that.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.filesystem import _StorageInfo  # pyright: ignore[reportPrivateUsage]
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from funcshard._src.checkpoint.chunks import Chunk, check_own_bytes
from funcshard._src.checkpoint.dcp_files import (
    DCP_CLASSES,
    KEY_CLASSES,
    AllowlistUnpickler,
    SafeIndex,
)
from funcshard._src.checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError
from funcshard._src.checkpoint.manifest import file_digest, rank_dir
from funcshard._src.shard.digest import tensor_digest
from funcshard._src.untrusted import open_plain
from funcshard._src.untrusted_pickle import check_pickle
from funcshard._src.untrusted_tensor import load_tensor

DATA_FILE = "__0_0.distcp"
METADATA_FILE = ".metadata"
SERIALIZATION_SLACK = 64 << 10  # bytes torch.save adds around a tensor's data, at most
MAX_METADATA_BYTES = 8 << 20  # one rank's .metadata; a 70B model's with AdamW: 0.7 MB
MAX_ENTRIES = 1 << 15  # chunks one rank saved; a 70B model's with AdamW: about 2900
# what a rank's own .metadata may hold: DCP's classes, less BytesStorageMetadata (a rank
# writes only tensors)
_ALLOWED: dict[str, frozenset[str]] = {
    module: names - {"BytesStorageMetadata"} for module, names in DCP_CLASSES.items()
}


def write_chunks(directory: Path, chunks: dict[str, torch.Tensor], /) -> dict[str, dict[str, Any]]:
    """Writes ``chunks`` (DCP key -> CPU tensor) to ``directory`` in DCP's format; mutates the disk.

    Returns:
        The files written, ``{name: {"size": bytes}}`` (``.metadata`` also with its SHA-256).
    """
    directory.mkdir(parents=True, exist_ok=True)
    writer = dcp.FileSystemWriter(directory, sync_files=True)
    save_local = getattr(state_dict_saver, "_save_state_dict", None)
    if save_local is not None:  # no warning to silence: safe in a background thread
        save_local(chunks, storage_writer=writer, no_dist=True)
    else:  # pragma: no cover - a torch without it
        with _single_process_is_intended():
            dcp.save(chunks, storage_writer=writer, no_dist=True)
    files: dict[str, dict[str, Any]] = {}
    for name in (METADATA_FILE, DATA_FILE):
        info: dict[str, Any] = {"size": (directory / name).stat().st_size}
        if name == METADATA_FILE:
            info["sha256"] = file_digest(directory / name)
        files[name] = info
    return files


def read_chunks(
    root: Path,
    files: dict[str, Any],
    wanted: list[tuple[Chunk, torch.dtype, str]],
    /,
    *,
    verify: bool,
) -> dict[str, torch.Tensor]:
    """The tensors of ``wanted`` chunks ``(chunk, dtype, sha256)``, read from checkpoint ``root``.

    Raises:
        CorruptCheckpointError: a file is missing, truncated or differs from the
            manifest, or an entry disagrees with it.
        UnsafeCheckpointError: the metadata names anything but tensor storage, or a
            file resolves to a path outside ``root``.
    """
    out: dict[str, torch.Tensor] = {}
    by_writer: dict[int, list[tuple[Chunk, torch.dtype, str]]] = {}
    for item in wanted:
        by_writer.setdefault(item[0].writer, []).append(item)
    for writer, items in sorted(by_writer.items()):
        sub = rank_dir(writer)
        metadata = _read_metadata(root, sub, files)
        data_path = root / sub / DATA_FILE
        expected = files[f"{sub}/{DATA_FILE}"]["size"]
        with _open_inside(root, f"{sub}/{DATA_FILE}") as stream:
            size = os.fstat(stream.fileno()).st_size
            if size != expected:
                raise CorruptCheckpointError(
                    f"{data_path}: {size} bytes, saved {expected}; the file is truncated or was "
                    f"replaced"
                )
            infos = [
                (item, _storage_of(metadata, item[0], item[1], data_path, expected))
                for item in items
            ]
            check_own_bytes(
                (
                    (DATA_FILE, i.offset, i.offset + i.length, repr(item[0].key))
                    for item, i in infos
                ),
                metadata=data_path.parent / METADATA_FILE,
            )
            for (chunk, dtype, sha256), info in infos:
                stream.seek(info.offset)
                blob = stream.read(info.length)
                tensor = load_tensor(
                    blob,
                    dtype=dtype,
                    shape=chunk.sizes,
                    where=f"{data_path}, chunk {chunk.key!r}",
                    declared_by="the manifest",
                    error=CorruptCheckpointError,
                )
                if verify and tensor_digest(tensor) != sha256:
                    raise CorruptCheckpointError(
                        f"{data_path}, chunk {chunk.key!r}: its contents differ from what was "
                        f"saved (SHA-256); the checkpoint is corrupted"
                    )
                out[chunk.key] = tensor
    return out


def _read_metadata(root: Path, sub: str, files: dict[str, Any]) -> Metadata:
    name = f"{sub}/{METADATA_FILE}"
    path = root / name
    expected = files[name]
    with _open_inside(root, name) as f:
        size = os.fstat(f.fileno()).st_size
        if size != expected["size"]:
            raise CorruptCheckpointError(
                f"{path}: {size} bytes, saved {expected['size']}; the file is truncated or was "
                f"replaced"
            )
        if size > MAX_METADATA_BYTES:
            raise CorruptCheckpointError(
                f"{path}: {size} bytes, more than MAX_METADATA_BYTES ({MAX_METADATA_BYTES}) that "
                f"one rank's metadata takes; the checkpoint was crafted"
            )
        data = f.read(size + 1)
    if len(data) != expected["size"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CorruptCheckpointError(
            f"{path}: its contents differ from what was saved (size or SHA-256); the checkpoint "
            f"is corrupted"
        )
    check_pickle(data, what=str(path), error=CorruptCheckpointError, key_classes=KEY_CLASSES)
    try:
        metadata = metadata_unpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{path}: {e}") from None
    except Exception as e:  # whatever a damaged pickle raises
        raise CorruptCheckpointError(
            f"{path}: unreadable DCP metadata ({type(e).__name__}: {str(e)[:200]}); the "
            f"checkpoint is corrupted"
        ) from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    for field in ("state_dict_metadata", "storage_data"):
        value = getattr(metadata, field, None)
        count = len(value) if isinstance(value, dict) else 0  # pyright: ignore[reportUnknownArgumentType]
        if count > MAX_ENTRIES:
            raise CorruptCheckpointError(
                f"{path}: {field} has {count} entries, more than MAX_ENTRIES ({MAX_ENTRIES}) "
                f"chunks one rank saves; the checkpoint was crafted"
            )
    return metadata


def _storage_of(
    metadata: Metadata, chunk: Chunk, dtype: torch.dtype, path: Path, file_size: int
) -> _StorageInfo:
    """The checked storage entry of ``chunk``: tensor storage as the manifest says, inside the file.

    Any field the unpickled objects lack or hold in another type makes the entry
    corrupt: the allowlist admits DCP's classes, not objects built as DCP builds them.
    """
    where = f"{path.parent / METADATA_FILE}, entry {chunk.key!r}"
    entries = getattr(metadata, "state_dict_metadata", None)
    entry = entries.get(chunk.key) if isinstance(entries, dict) else None
    if not isinstance(entry, TensorStorageMetadata):
        kind = "missing" if entry is None else f"a {type(entry).__name__}, not tensor storage"
        error = CorruptCheckpointError if entry is None else UnsafeCheckpointError
        raise error(f"{where}: {kind}; the checkpoint is corrupted or was crafted")
    if not _describes(entry, chunk.sizes, dtype):
        raise CorruptCheckpointError(
            f"{where}: does not describe one {dtype} tensor of shape {chunk.sizes} as the manifest "
            f"does; the checkpoint is corrupted"
        )
    storage = getattr(metadata, "storage_data", None)
    info = _lookup(storage, chunk) if isinstance(storage, dict) else None
    if not isinstance(info, _StorageInfo):
        raise CorruptCheckpointError(f"{where}: no storage entry; the checkpoint is corrupted")
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    nbytes = chunk.numel * dtype.itemsize
    if (
        getattr(info, "relative_path", None) != DATA_FILE
        or getattr(info, "transform_descriptors", None)
        or not isinstance(offset, int)
        or not isinstance(length, int)
        or offset < 0
        or length <= 0
        or offset + length > file_size
        or not nbytes <= length <= nbytes + SERIALIZATION_SLACK
    ):
        raise UnsafeCheckpointError(
            f"{where}: storage {getattr(info, 'relative_path', None)!r} [{offset}, +{length}) is not "
            f"a byte range of {path.name} ({file_size} bytes) holding the {nbytes} bytes of that "
            f"tensor; the checkpoint is corrupted or was crafted"
        )
    return info


def _lookup(storage: dict[Any, Any], chunk: Chunk) -> Any:
    """``storage``'s entry of ``chunk``; ``None`` if absent or if its keys are malformed objects."""
    try:
        return storage.get(SafeIndex(chunk.key, torch.Size([0] * len(chunk.sizes))))
    except (TypeError, ValueError, AttributeError):  # a key without its fields
        return None


def _describes(entry: TensorStorageMetadata, sizes: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether ``entry`` is one whole tensor of ``sizes`` and ``dtype`` (any malformed field: no)."""
    try:
        (only,) = entry.chunks
        return (
            isinstance(entry.properties, TensorProperties)
            and entry.properties.dtype == dtype
            and tuple(entry.size) == sizes
            and isinstance(only, ChunkStorageMetadata)
            and tuple(only.offsets) == (0,) * len(sizes)
            and tuple(only.sizes) == sizes
        )
    except (TypeError, ValueError, AttributeError):
        return False


def _open_inside(root: Path, name: str) -> BinaryIO:
    """``root / name`` opened once, a regular file reached through no symlink (a checkpoint holds none)."""
    return open_plain(root, name, unsafe=UnsafeCheckpointError, missing=_MissingError)


class _MissingError(CorruptCheckpointError):
    def __init__(self, message: str) -> None:
        super().__init__(f"{message}; the checkpoint is incomplete")


def metadata_unpickler(file: BinaryIO, /) -> AllowlistUnpickler:
    """An unpickler of a rank's own ``.metadata``: only the classes such metadata is made of."""
    return AllowlistUnpickler(file, _ALLOWED, "checkpoint metadata")


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """DCP warns on every call without a process group; for a rank's own files that is deliberate."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield
