"""An attacker's tools for checkpoint tests: rewrite a checkpoint's files so that they still look sound.

A damaged file fails its digest; a *crafted* one comes with digests recomputed,
so that only funcshard's checks of the contents stand between it and the
reader. These helpers do what such an attacker would.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from funcshard._src.checkpoint import manifest as manifest_module


def read(directory: Path) -> dict[str, Any]:
    """The manifest as JSON data, unchecked."""
    return json.loads((directory / "manifest.json").read_text())


def write(directory: Path, manifest: dict[str, Any], *, fix_digest: bool = True) -> None:
    """Writes ``manifest`` back; with ``fix_digest``, with its self-digest recomputed."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    if fix_digest:
        body["digest"] = manifest_module._digest(body)  # pyright: ignore[reportPrivateUsage]
    elif "digest" in manifest:
        body["digest"] = manifest["digest"]
    (directory / "manifest.json").write_text(json.dumps(body))


def edit(directory: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Applies ``change`` to the manifest in place and writes it back with a valid digest."""
    manifest = read(directory)
    change(manifest)
    write(directory, manifest)


def replace_file(directory: Path, name: str, data: bytes) -> None:
    """Replaces ``rank<r>/<file>`` and fixes its size (and SHA-256) in the manifest."""
    (directory / name).write_bytes(data)

    def fix(manifest: dict[str, Any]) -> None:
        info: dict[str, Any] = {"size": len(data)}
        if name.endswith(".metadata"):
            info["sha256"] = hashlib.sha256(data).hexdigest()
        manifest["files"][name] = info

    edit(directory, fix)


def read_blobs(directory: Path, rank: int) -> dict[str, bytes]:
    """Every chunk's ``torch.save`` blob in rank ``rank``'s data file, by DCP key."""
    from funcshard._src.checkpoint.dcp_io import metadata_unpickler

    with open(directory / f"rank{rank}/.metadata", "rb") as f:
        metadata = metadata_unpickler(f).load()
    data = (directory / f"rank{rank}/__0_0.distcp").read_bytes()
    return {
        index.fqn: data[info.offset : info.offset + info.length]
        for index, info in metadata.storage_data.items()
    }


def write_blobs(
    directory: Path,
    rank: int,
    blobs: dict[str, tuple[bytes, torch.dtype, tuple[int, ...]]],
    *,
    digests: dict[str, str] | None = None,
) -> None:
    """Writes rank ``rank``'s files anew: each key's blob, declared as a tensor of that dtype and
    shape, as DCP's metadata describes it; fixes the manifest's sizes and digests (and sets the
    chunk digests given), as an attacker who controls every byte would."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    data = b""
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for key, (blob, dtype, shape) in blobs.items():
        size = torch.Size(shape)
        state[key] = TensorStorageMetadata(
            TensorProperties(dtype=dtype),
            size,
            [ChunkStorageMetadata(torch.Size([0] * len(shape)), size)],
        )
        storage[MetadataIndex(key, torch.Size([0] * len(shape)), 0)] = _StorageInfo(
            "__0_0.distcp", len(data), len(blob)
        )
        data += blob
    (directory / f"rank{rank}/__0_0.distcp").write_bytes(data)
    metadata = pickle.dumps(Metadata(state, storage_data=storage))
    (directory / f"rank{rank}/.metadata").write_bytes(metadata)

    def fix(manifest: dict[str, Any]) -> None:
        manifest["files"][f"rank{rank}/__0_0.distcp"] = {"size": len(data)}
        manifest["files"][f"rank{rank}/.metadata"] = {
            "size": len(metadata),
            "sha256": hashlib.sha256(metadata).hexdigest(),
        }
        for entry in [*manifest["leaves"], *([manifest["rng"]] if "rng" in manifest else [])]:
            for chunk in entry.get("chunks", []):
                if digests and chunk["key"] in digests:
                    chunk["sha256"] = digests[chunk["key"]]

    edit(directory, fix)


def saved_blob(value: Any) -> bytes:
    """What ``torch.save`` writes for ``value``."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def rewrite_chunks(directory: Path, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    """Replaces the given chunks of rank ``rank`` by ``tensors``, every digest recomputed."""
    from funcshard._src.shard.digest import tensor_digest

    replace_blobs(
        directory,
        rank,
        {k: (saved_blob(t), t.dtype, tuple(t.shape)) for k, t in tensors.items()},
        digests={k: tensor_digest(t) for k, t in tensors.items()},
    )


def declared(directory: Path, rank: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """What rank ``rank``'s metadata declares of each chunk: its dtype and shape."""
    from funcshard._src.checkpoint.dcp_io import metadata_unpickler

    with open(directory / f"rank{rank}/.metadata", "rb") as f:
        entries = metadata_unpickler(f).load().state_dict_metadata
    return {k: (e.properties.dtype, tuple(e.size)) for k, e in entries.items()}


def replace_blobs(
    directory: Path,
    rank: int,
    new: dict[str, tuple[bytes, torch.dtype, tuple[int, ...]] | None],
    *,
    digests: dict[str, str] | None = None,
) -> None:
    """Rank ``rank``'s chunks with the blobs of ``new`` added or replaced (``None``: removed),
    every other chunk as it was; digests recomputed as :func:`write_blobs` does."""
    kept = declared(directory, rank)
    blobs: dict[str, tuple[bytes, torch.dtype, tuple[int, ...]]] = {
        k: (b, *kept[k]) for k, b in read_blobs(directory, rank).items() if k not in new
    }
    blobs |= {k: v for k, v in new.items() if v is not None}
    write_blobs(directory, rank, blobs, digests=digests)


def hash_bomb(fanout: int = 64, depth: int = 6) -> bytes:
    """A pickle of ``{t: 1}``, ``t`` a tuple of ``fanout`` tuples ... ``depth`` deep, each level
    one object reused through the memo: a few hundred bytes whose unpickling hashes
    ``fanout**depth`` tuples (hours at depth 6)."""
    t: Any = (0,) * fanout
    for _ in range(depth - 1):
        t = (t,) * fanout
    inner = pickle.dumps(t, protocol=2)[2:-1]  # the memo makes each level one object
    return b"\x80\x02}" + inner + b"K\x01s."  # EMPTY_DICT, t, 1, SETITEM, STOP


def with_records(blob: bytes, change: Callable[[str, bytes], tuple[bytes, int]]) -> bytes:
    """The ``torch.save`` archive ``blob`` with each record's bytes and compression from
    ``change(name, data)`` (``zipfile.ZIP_STORED`` keeps it as torch writes it)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(blob)) as source, zipfile.ZipFile(out, "w") as target:
        for name in source.namelist():
            data, compression = change(name, source.read(name))
            target.writestr(name, data, compress_type=compression)
    return out.getvalue()


def point_dcp_entry(directory: Path, fqn: str, blob: bytes) -> None:
    """Appends ``blob`` to the data file of DCP entry ``fqn``'s chunk at offsets 0 and points the
    chunk's storage there, in the DCP checkpoint at ``directory`` (DCP's files carry no digest)."""
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn and not any(k.offset))
    path = directory / info.relative_path
    info.offset, info.length = path.stat().st_size, len(blob)
    with open(path, "ab") as f:
        f.write(blob)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
