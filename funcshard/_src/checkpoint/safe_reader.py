"""Reading torch.distributed.checkpoint metadata without running code from the file.

DCP stores its ``.metadata`` as a pickle, and a pickle can name any callable.
:class:`SafeReader` unpickles it with an allowlist of exactly the classes DCP
metadata is made of; anything else is refused before it is imported or called.
Tensor data is read by DCP itself with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asked to load something a checkpoint never contains."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"the checkpoint's DCP metadata refers to {module}.{name}, which checkpoint metadata never "
            f"contains; refusing to load it (the file may carry a malicious payload)"
        )


def safe_unpickle(data: bytes, /) -> Any:
    """Unpickles DCP metadata with the allowlist; raises :class:`UnsafeCheckpointError` otherwise."""
    return _Unpickler(io.BytesIO(data)).load()


class SafeReader(FileSystemReader):
    """A DCP ``FileSystemReader`` whose metadata is unpickled with an allowlist."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as stream:
            metadata = safe_unpickle(stream.read())
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(
                f"{path} holds a {type(metadata).__name__}, not DCP metadata"
            )
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
