"""The checkpoint manifest: what a checkpoint holds, where each chunk lives, and whether it is complete.

A checkpoint is a directory: one sub-directory per writing rank (``rank<r>/``,
DCP's ``.metadata`` and data file) plus ``manifest.json``, written last, which
names every leaf, its global shape and dtype, the chunks it was saved in (one
DCP key each, with the chunk's offsets, its writer and the SHA-256 of its
contents), the tree structure, every rank's RNG states (``rng``, optional), the run and step, the size of every file and
the SHA-256 of each rank's ``.metadata``; and, last, the SHA-256 of the
manifest itself. A directory without a complete manifest is not a checkpoint.

The manifest is untrusted input: :func:`read_manifest` reads it as strict JSON
(see [Note: reader discipline] in ``funcshard/_src/untrusted.py``), refuses a
symlinked one, and checks every field's type and range, the digest, that file
names stay inside the checkpoint and that the run is a name from the allowlist
(:data:`RUN_NAME`) before anything else reads it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

import torch

from funcshard._src.checkpoint.chunks import Chunk, check_tiling, chunks_of
from funcshard._src.checkpoint.errors import (
    CorruptCheckpointError,
    NotACheckpointError,
    UnsafeCheckpointError,
)
from funcshard._src.dtypes import MAX_ELEMENTS, dtype_name, dtype_of, plain_dtype
from funcshard._src.shard.sharded import ShardedTensor
from funcshard._src.untrusted import read_json

MANIFEST = "manifest.json"
FORMAT = "funcshard-checkpoint"
VERSION = 2
VALUE_TYPES = (bool, int, float, str, type(None))
KINDS = ("sharded", "tensor", "value")
MAX_MANIFEST_BYTES = 1 << 30
MAX_MANIFEST_DEPTH = 256  # a tree node is three JSON levels: 80-odd levels of pytree
# A run's name: what may reach a staging directory's name (see [Note: runs] in commit.py)
RUN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
RNG_PATH = "<rng>"  # the manifest's "rng" entry: every rank's generator states
_FILE = re.compile(r"rank(0|[1-9][0-9]{0,5})/(\.metadata|__0_0\.distcp)")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def rank_dir(rank: int, /) -> str:
    """The sub-directory that rank ``rank``'s files are written to."""
    return f"rank{rank}"


def leaf_entry(path: str, leaf: Any, /) -> dict[str, Any]:
    """The manifest entry of one leaf (chunk digests are filled in by the writers).

    Raises:
        TypeError: a leaf that is neither a tensor nor a JSON scalar.
    """
    if isinstance(leaf, (ShardedTensor, torch.Tensor)):
        return {
            "path": path,
            "kind": "sharded" if isinstance(leaf, ShardedTensor) else "tensor",
            "shape": list(leaf.shape),
            "dtype": dtype_name(leaf.dtype),
            "chunks": [
                {
                    "key": c.key,
                    "offsets": list(c.offsets),
                    "sizes": list(c.sizes),
                    "writer": c.writer,
                }
                for c in chunks_of(leaf, path)
            ],
        }
    if isinstance(leaf, VALUE_TYPES):
        if isinstance(leaf, float) and not math.isfinite(leaf):
            raise TypeError(
                f"{path or '<root>'}: {leaf} cannot be saved as a JSON scalar; save it as a tensor"
            )
        return {"path": path, "kind": "value", "value": leaf}
    raise TypeError(
        f"{path or '<root>'}: a checkpoint holds tensors, sharded leaves and JSON scalars; "
        f"got a {type(leaf).__name__}"
    )


def chunks(entry: dict[str, Any], /) -> list[Chunk]:
    """The chunks of a checked tensor entry."""
    return [
        Chunk(c["key"], tuple(c["offsets"]), tuple(c["sizes"]), c["writer"])
        for c in entry.get("chunks", [])
    ]


def write_manifest(directory: Path, manifest: dict[str, Any], /) -> None:
    """Writes and fsyncs ``manifest.json`` (with its own digest) in ``directory``; mutates the directory."""
    body = {"format": FORMAT, "version": VERSION, "complete": True, **manifest}
    body["digest"] = _digest(body)
    with open(directory / MANIFEST, "w") as f:
        json.dump(body, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path, /) -> dict[str, Any]:
    """The checked manifest of the checkpoint at ``directory``.

    Raises:
        NotACheckpointError: no such directory, no manifest, or an interrupted save.
        CorruptCheckpointError: the manifest is damaged, inconsistent or of another format.
        UnsafeCheckpointError: it names a file outside the checkpoint.
    """
    if not directory.is_dir():
        raise NotACheckpointError(f"{directory}: no such checkpoint directory")
    target = directory / MANIFEST
    if target.is_symlink():
        raise UnsafeCheckpointError(
            f"{target}: a symlink (to {os.path.realpath(target)}); a checkpoint holds no "
            f"symlink, so it is not read"
        )
    try:  # opened once (O_NOFOLLOW, O_NONBLOCK) and checked by fstat: nothing swapped in between
        manifest = read_json(
            target,
            max_bytes=MAX_MANIFEST_BYTES,
            max_depth=MAX_MANIFEST_DEPTH,
            error=CorruptCheckpointError,
            symlinks=False,
            missing=_NoManifestError,
        )
    except _NoManifestError:
        hint = (
            "its save was interrupted before it committed"
            if any(directory.glob("rank*")) or ".tmp-" in directory.name
            else "it is not a funcshard checkpoint"
        )
        raise NotACheckpointError(
            f"{directory}: no {MANIFEST}; {hint}. Use fs.checkpoint.latest(dir) to find a complete one"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{target}: not a funcshard checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CorruptCheckpointError(
            f"{target}: checkpoint format version {manifest.get('version')!r}; this funcshard "
            f"reads version {VERSION} (checkpoints of version 1 were written before funcshard "
            f"0.1.0; load them with that release and save again)"
        )
    if manifest.get("complete") is not True:
        raise NotACheckpointError(f"{directory}: the save did not complete")
    if manifest.get("digest") != _digest({k: v for k, v in manifest.items() if k != "digest"}):
        raise CorruptCheckpointError(
            f"{target}: its contents differ from what was saved (the manifest's SHA-256 does not "
            f"match); the checkpoint is corrupted"
        )
    problem = _check(manifest)
    if problem is not None:
        error = UnsafeCheckpointError if problem.startswith("unsafe: ") else CorruptCheckpointError
        raise error(f"{target}: {problem.removeprefix('unsafe: ')}; the checkpoint is corrupted")
    return manifest


class _NoManifestError(Exception):
    pass


def is_checkpoint(directory: Path, /) -> bool:
    """Whether ``directory`` holds a manifest at all (complete or not, sound or not; a symlink too)."""
    try:
        mode = os.lstat(directory / MANIFEST).st_mode
    except OSError:
        return False
    return stat.S_ISREG(mode) or stat.S_ISLNK(mode)


def file_digest(path: Path, /) -> str:
    """The SHA-256 (hex) of one file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# -- checks --------------------------------------------------------------------------


def _digest(body: dict[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _is_int(x: object, *, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _check(m: dict[str, Any]) -> str | None:
    """Why manifest ``m`` is unsound (``"unsafe: ..."`` for a hostile one), or ``None``."""
    if not (m.get("step") is None or _is_int(m["step"])):
        return f"step {m.get('step')!r} is not an integer >= 0"
    if not isinstance(m.get("run"), str) or RUN_NAME.fullmatch(m["run"]) is None:
        return (
            f"unsafe: run {str(m.get('run'))[:80]!r} is not a run name (letters, digits, '-', '_' "
            f"and '.', not first, at most 128)"
        )
    if "tree" not in m:
        return "it has no tree structure"
    world = m.get("world_size")
    if not isinstance(world, int) or not _is_int(world, low=1):
        return f"world_size {world!r} is not an integer >= 1"
    files = m.get("files")
    if not isinstance(files, dict):
        return "files is not a mapping"
    for name, info in files.items():
        if not isinstance(name, str) or _FILE.fullmatch(name) is None:
            return f"unsafe: file {name!r} is not a file a checkpoint holds (rank<r>/.metadata or rank<r>/__0_0.distcp)"
        if not isinstance(info, dict) or not _is_int(info.get("size")):
            return f"file {name!r} has no size"
        if name.endswith(".metadata") and not (
            isinstance(info.get("sha256"), str) and _HEX64.fullmatch(info["sha256"])
        ):
            return f"file {name!r} has no SHA-256"
    leaves = m.get("leaves")
    if not isinstance(leaves, list):
        return "leaves is not a list"
    seen: set[str] = set()
    keys: set[str] = set()
    for i, entry in enumerate(leaves):
        problem = _check_entry(i, entry, world, files)
        if problem is not None:
            return problem
        if entry["path"] in seen:
            return f"leaf {entry['path']!r} is listed twice"
        seen.add(entry["path"])
        for c in entry.get("chunks", []):
            if c["key"] in keys:
                return f"chunk key {c['key']!r} is listed twice"
            keys.add(c["key"])
    rng = m.get("rng")
    if rng is not None:
        problem = _check_entry(len(leaves), rng, world, files)
        if problem is not None:
            return problem
        if (
            rng["path"] != RNG_PATH
            or rng["kind"] != "tensor"
            or rng["dtype"] != "uint8"
            or len(rng["shape"]) != 2
        ):
            return "rng is not a (ranks, n) uint8 tensor of RNG states"
        if any(c["key"] in keys for c in rng["chunks"]):
            return "the rng entry reuses a leaf's chunk key"
    return None


def _check_entry(i: int, entry: object, world: int, files: dict[str, Any]) -> str | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        return f"leaves[{i}] is not a leaf entry"
    path, kind = entry["path"], entry.get("kind")
    if kind not in KINDS:
        return f"leaf {path!r} has kind {kind!r}, not one of {list(KINDS)}"
    if kind == "value":
        value = entry.get("value")
        if set(entry) != {"path", "kind", "value"} or not isinstance(value, VALUE_TYPES):
            return f"leaf {path!r}: a value entry holds one JSON scalar"
        return None
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(n) for n in shape) or len(shape) > 64:
        return f"leaf {path!r} has shape {shape!r}"
    if math.prod(shape) >= MAX_ELEMENTS:
        return f"leaf {path!r} has {math.prod(shape)} elements"
    dtype = dtype_of(entry.get("dtype"))
    if dtype is None or not plain_dtype(dtype):
        return (
            f"leaf {path!r} has dtype {str(entry.get('dtype'))[:40]!r}, which is not a dtype of "
            f"plain dense data (floating, complex, integer or bool)"
        )
    raw = entry.get("chunks")
    if not isinstance(raw, list):
        return f"leaf {path!r} has no chunk list"
    for c in raw:
        if not (
            isinstance(c, dict)
            and isinstance(c.get("key"), str)
            and isinstance(c.get("offsets"), list)
            and isinstance(c.get("sizes"), list)
            and all(_is_int(x) for x in c["offsets"] + c["sizes"])
            and _is_int(c.get("writer"))
            and c["writer"] < world
            and isinstance(c.get("sha256"), str)
            and _HEX64.fullmatch(c["sha256"])
        ):
            return f"leaf {path!r} has a malformed chunk {str(c)[:120]}"
        if any(
            f"{rank_dir(c['writer'])}/{name}" not in files for name in (".metadata", "__0_0.distcp")
        ):
            return f"chunk {c['key']!r} of {path!r} names rank {c['writer']}, whose files are not listed"
    if kind == "tensor" and any(c["writer"] != 0 for c in raw):
        return f"leaf {path!r}: a plain tensor is written by rank 0"
    return check_tiling(path, tuple(shape), chunks(entry))
