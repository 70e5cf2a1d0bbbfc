"""The checkpoint manifest: what a checkpoint holds, where each chunk lives, and whether it is complete.

A checkpoint is a directory: DCP's files (``.metadata`` and one ``.distcp`` file
per rank) plus ``manifest.json``, written last, which names every leaf, its
global shape and dtype, the chunks it was saved in (one DCP key each, with the
chunk's offsets in the leaf), the tree structure, and the size and SHA-256 of
every data file. A directory without a complete manifest is not a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from funcshard._src.shard.sharded import ShardedTensor

MANIFEST = "manifest.json"
FORMAT = "funcshard-checkpoint"
VERSION = 1
VALUE_TYPES = (bool, int, float, str, type(None))


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: missing, incomplete, corrupted or of another tree."""


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a leaf: its DCP key and where it sits in the leaf."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "offsets": list(self.offsets), "sizes": list(self.sizes)}


def chunk_key(path: str, offsets: tuple[int, ...]) -> str:
    """The DCP key of the chunk of leaf ``path`` that starts at ``offsets``."""
    return f"{path}@{','.join(map(str, offsets))}"


def chunks_of(leaf: Any, path: str, /) -> list[Chunk]:
    """Every chunk a leaf is saved in: one per distinct non-empty shard (replica 0 writes it)."""
    if isinstance(leaf, ShardedTensor):
        out: list[Chunk] = []
        sharding, shape = leaf.sharding, leaf.shape
        for rank in range(sharding.mesh.size):
            if sharding.replica_id(rank) != 0:
                continue
            index = sharding.local_index(shape, rank)
            offsets = tuple(s.indices(n)[0] for s, n in zip(index, shape))
            sizes = sharding.local_shape(shape, rank)
            if all(sizes):
                out.append(Chunk(chunk_key(path, offsets), offsets, sizes))
        return out
    shape = tuple(leaf.shape)
    offsets = (0,) * len(shape)
    return [Chunk(chunk_key(path, offsets), offsets, shape)] if all(shape) else []


def leaf_entry(path: str, leaf: Any, /) -> dict[str, Any]:
    """The manifest entry of one leaf.

    Raises:
        TypeError: a leaf that is neither a tensor nor a JSON scalar.
    """
    if isinstance(leaf, (ShardedTensor, torch.Tensor)):
        return {
            "path": path,
            "kind": "sharded" if isinstance(leaf, ShardedTensor) else "tensor",
            "shape": list(leaf.shape),
            "dtype": str(leaf.dtype).removeprefix("torch."),
            "chunks": [c.to_json() for c in chunks_of(leaf, path)],
        }
    if isinstance(leaf, VALUE_TYPES):
        return {"path": path, "kind": "value", "value": leaf}
    raise TypeError(
        f"{path or '<root>'}: a checkpoint holds tensors, sharded leaves and JSON scalars; "
        f"got a {type(leaf).__name__}"
    )


def file_digest(path: Path, /) -> dict[str, Any]:
    """Size and SHA-256 of one file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def write_manifest(directory: Path, manifest: dict[str, Any], /) -> None:
    """Writes and fsyncs ``manifest.json`` in ``directory``; mutates the directory."""
    target = directory / MANIFEST
    with open(target, "w") as f:
        json.dump({"format": FORMAT, "version": VERSION, "complete": True, **manifest}, f)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path, /) -> dict[str, Any]:
    """The manifest of the checkpoint at ``directory``.

    Raises:
        CheckpointError: no such directory, not a checkpoint, or an interrupted save.
    """
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    target = directory / MANIFEST
    if not target.is_file():
        hint = (
            "its save was interrupted before it committed"
            if (directory / ".metadata").exists() or ".tmp-" in directory.name
            else "it is not a funcshard checkpoint"
        )
        raise CheckpointError(
            f"{directory}: no {MANIFEST}; {hint}. Use fs.checkpoint.latest(dir) to find a complete one"
        )
    try:
        manifest = json.loads(target.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{target}: unreadable manifest ({e}); the checkpoint is corrupted"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{target}: not a funcshard checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{target}: checkpoint format version {manifest.get('version')!r}; this funcshard reads {VERSION}"
        )
    if manifest.get("complete") is not True:
        raise CheckpointError(f"{directory}: the save did not complete")
    return manifest


def is_complete(directory: Path, /) -> bool:
    """Whether ``directory`` holds a complete checkpoint (its manifest reads)."""
    try:
        read_manifest(directory)
    except CheckpointError:
        return False
    return True
