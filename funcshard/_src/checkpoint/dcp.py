"""Sharded checkpoints on torch.distributed.checkpoint: save in parallel, load into any mesh.

Every rank writes the chunks it holds (replica 0 of each) as DCP keys, in
parallel, into a temporary directory; rank 0 then writes the manifest, syncs
and renames the directory into place, so a crash at any point of a save leaves
nothing that loads as a checkpoint. Loading reads, on every rank, only the
chunks that overlap the shards it needs, so a checkpoint saved on W ranks loads
on any W' and any plan, and into a single process without torch.distributed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from funcshard._src import tree
from funcshard._src.checkpoint.manifest import (
    CheckpointError,
    Chunk,
    file_digest,
    is_complete,
    leaf_entry,
    read_manifest,
    write_manifest,
)
from funcshard._src.checkpoint.safe_reader import SafeReader
from funcshard._src.comm import runtime
from funcshard._src.shard.sharded import ShardedTensor, map_flats

TMP = ".tmp-"


class _Saved:
    """The ``like`` leaf that asks for a leaf as it was saved (a full tensor or the value)."""

    def __repr__(self) -> str:
        return "fs.checkpoint.SAVED"


SAVED = _Saved()


def save(
    path: str | os.PathLike[str], state: Any, /, *, step: int | None = None, keep: int | None = None
) -> Path:
    """Saves ``state`` as a sharded checkpoint at ``path``; collective (every rank calls it).

    Args:
        path: the checkpoint directory to create (it must not exist yet).
        state: any pytree of sharded leaves, tensors (saved once, from rank 0) and
            JSON scalars: params, optimizer state, a step counter, RNG states.
        step: the training step, recorded for :func:`latest`.
        keep: after committing, delete all but the ``keep`` newest checkpoints in
            ``path``'s parent directory (and leftovers of interrupted saves).

    Returns:
        ``path``.

    Raises:
        FileExistsError: ``path`` exists.
        TypeError: a leaf that is neither a tensor nor a JSON scalar.

    Example:
        >>> import tempfile, funcshard as fs
        >>> p = {"w": torch.arange(6.0).reshape(2, 3)}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"fsdp": 1})))
        >>> root = tempfile.mkdtemp()
        >>> save(f"{root}/step-7", {"params": sp, "step": 7}, step=7).name
        'step-7'
    """
    target = Path(path)
    rank = runtime.rank()
    paths, leaves, treedef = tree.flatten_with_paths(state)
    entries = [leaf_entry(p, leaf) for p, leaf in zip(paths, leaves)]
    if target.exists():
        raise FileExistsError(
            f"{target} exists; save each checkpoint to a new directory (e.g. one per step)"
        )
    token = _broadcast(uuid.uuid4().hex if rank == 0 else None)
    staging = target.parent / f".{target.name}{TMP}{token}"
    with _single_process_is_intended():
        dcp.save(
            _local_chunks(paths, leaves, rank),
            storage_writer=dcp.FileSystemWriter(staging, sync_files=True),
            no_dist=not runtime.is_distributed(),
        )
    files = {p.name: file_digest(p) for p in sorted(staging.glob(f"__{rank}_*.distcp"))}
    all_files = _gather(files)
    error: str | None = None
    if rank == 0:
        try:
            merged = {name: digest for per_rank in all_files for name, digest in per_rank.items()}
            merged[".metadata"] = file_digest(staging / ".metadata")
            write_manifest(
                staging,
                {
                    "step": step,
                    "world_size": runtime.world_size(),
                    "tree": tree.treedef_to_json(treedef),
                    "leaves": entries,
                    "files": merged,
                },
            )
            _fsync_dir(staging)
            os.replace(staging, target)  # the commit: atomic on one filesystem
            _fsync_dir(target.parent)
            if keep is not None:
                _rotate(target.parent, keep)
        except Exception as e:  # every rank must learn of it, or they would wait forever
            error = f"{type(e).__name__}: {e}"
    error = _broadcast(error)
    if error is not None:
        raise CheckpointError(f"saving {target} failed on rank 0: {error}")
    return target


def load(path: str | os.PathLike[str], /, like: Any, *, verify: bool = True) -> Any:
    """Loads the checkpoint at ``path`` into the structure and shardings of ``like``; collective.

    ``like`` may be sharded with another plan, mesh or world size than the one
    that saved: each rank reads only the saved chunks that overlap its shards.
    Nothing of ``like`` is modified; the result is new.

    Args:
        path: a checkpoint directory.
        like: a pytree like the saved one (e.g. freshly sharded params and
            ``opt.init`` state): its sharded leaves give the target shardings. A
            leaf :data:`SAVED` takes the saved leaf as it is, whatever its shape (per-rank
            RNG states saved on another world size, say).
        verify: check the size and SHA-256 of every file read.

    Raises:
        CheckpointError: not a checkpoint, an interrupted save, corrupted or truncated
            files, or a checkpoint of another tree (the message lists missing and
            unexpected paths and shape or dtype mismatches).

    Example:
        >>> import tempfile, funcshard as fs
        >>> p = {"w": torch.arange(6.0).reshape(2, 3)}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"fsdp": 1})))
        >>> ckpt = save(f"{tempfile.mkdtemp()}/step-7", {"params": sp, "step": 7}, step=7)
        >>> back = load(ckpt, like={"params": sp, "step": 0})
        >>> back["step"], back["params"]["w"].local
        (7, tensor([[0., 1., 2.],
                [3., 4., 5.]]))
    """
    directory = Path(path)
    manifest = read_manifest(directory)
    paths, leaves, treedef = tree.flatten_with_paths(like)
    saved = _check_compatible(directory, manifest, paths, leaves)
    rank = runtime.rank()
    requests: dict[str, torch.Tensor] = {}
    for p, leaf in zip(paths, leaves):
        entry = saved[p]
        if entry["kind"] == "value":
            continue
        region = _region(leaf, entry, rank)
        for chunk in _chunks(entry):
            if _overlap(region, chunk) is not None:
                requests[chunk.key] = torch.empty(chunk.sizes, dtype=_dtype(entry["dtype"]))
    _read(directory, manifest, requests, verify)
    fresh = map_flats(lambda f: f.with_data(torch.zeros_like(f.data)), like)
    out: list[Any] = []
    for p, leaf in zip(paths, tree.leaves(fresh)):
        entry = saved[p]
        if entry["kind"] == "value":
            out.append(entry["value"])
            continue
        if isinstance(leaf, ShardedTensor):
            target = leaf.local  # a view of the fresh flat buffer
        else:
            target = torch.zeros(entry["shape"], dtype=_dtype(entry["dtype"]))
        region = _region(leaf, entry, rank)
        for chunk in _chunks(entry):
            hit = _overlap(region, chunk)
            if hit is not None:
                dst, src = hit
                target[dst].copy_(requests[chunk.key][src])
        if isinstance(leaf, ShardedTensor):
            out.append(leaf)
        else:
            out.append(target if leaf is SAVED else target.to(leaf.device))
    return tree.unflatten(treedef, out)


def load_full(path: str | os.PathLike[str], /, *, verify: bool = True) -> Any:
    """The whole saved tree as full tensors, in one process (no torch.distributed needed).

    Raises:
        CheckpointError: see :func:`load`.

    Example:
        >>> import tempfile, funcshard as fs
        >>> p = {"w": torch.ones(2)}
        >>> ckpt = save(f"{tempfile.mkdtemp()}/c", {"params": fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))})
        >>> load_full(ckpt)
        {'params': {'w': tensor([1., 1.])}}
    """
    directory = Path(path)
    manifest = read_manifest(directory)
    requests: dict[str, torch.Tensor] = {}
    for entry in manifest["leaves"]:
        for chunk in _chunks(entry) if entry["kind"] != "value" else []:
            requests[chunk.key] = torch.empty(chunk.sizes, dtype=_dtype(entry["dtype"]))
    _read(directory, manifest, requests, verify, no_dist=True)
    out: list[Any] = []
    for entry in manifest["leaves"]:
        if entry["kind"] == "value":
            out.append(entry["value"])
            continue
        full = torch.zeros(entry["shape"], dtype=_dtype(entry["dtype"]))
        for chunk in _chunks(entry):
            full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))] = requests[
                chunk.key
            ]
        out.append(full)
    try:
        treedef = tree.treedef_from_json(manifest["tree"])
    except ValueError as e:
        raise CheckpointError(
            f"{directory}: cannot rebuild the saved tree structure ({e})"
        ) from None
    return tree.unflatten(treedef, out)


def latest(directory: str | os.PathLike[str], /) -> Path | None:
    """The newest complete checkpoint in ``directory`` (highest step, then newest), or ``None``.

    Interrupted saves and directories that are not checkpoints are skipped.

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> for step in (1, 2):
        ...     _ = save(f"{root}/step-{step}", {"step": step}, step=step)
        >>> latest(root).name
        'step-2'
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    found = [
        (d, read_manifest(d))
        for d in root.iterdir()
        if d.is_dir() and TMP not in d.name and is_complete(d)
    ]
    if not found:
        return None
    return max(
        found,
        key=lambda dm: (
            dm[1].get("step") if dm[1].get("step") is not None else -1,
            dm[0].stat().st_mtime_ns,
        ),
    )[0]


def export_safetensors(path: str | os.PathLike[str], out: str | os.PathLike[str], /) -> Path:
    """Writes the full tensors of a checkpoint to one safetensors file, keys are leaf paths with dots.

    Raises:
        ImportError: the ``safetensors`` package is missing (``pip install safetensors``).

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> ckpt = save(f"{root}/c", {"blocks": [{"w": torch.ones(2)}]})
        >>> from safetensors.torch import load_file
        >>> load_file(export_safetensors(ckpt, f"{root}/full.safetensors"))
        {'blocks.0.w': tensor([1., 1.])}
    """
    try:
        from safetensors.torch import save_file  # pyright: ignore[reportMissingImports]
    except ImportError:
        raise ImportError(
            "export_safetensors needs the safetensors package: pip install safetensors"
        ) from None
    full = load_full(path)
    paths, leaves, _ = tree.flatten_with_paths(full)
    tensors = {
        p.replace("/", "."): t.contiguous()
        for p, t in zip(paths, leaves)
        if isinstance(t, torch.Tensor)
    }
    save_file(tensors, str(out))
    return Path(out)


# -- helpers -----------------------------------------------------------------------


def _local_chunks(paths: list[str], leaves: list[Any], rank: int) -> dict[str, torch.Tensor]:
    """The chunks this rank writes: its own shard where it is replica 0; plain tensors on rank 0."""
    out: dict[str, torch.Tensor] = {}
    for p, leaf in zip(paths, leaves):
        if isinstance(leaf, ShardedTensor):
            mine = leaf.sharding.local_index(leaf.shape, leaf.flat.rank)
            offsets = tuple(s.indices(n)[0] for s, n in zip(mine, leaf.shape))
            for chunk in leaf_entry(p, leaf)["chunks"]:
                if (
                    tuple(chunk["offsets"]) == offsets
                    and leaf.sharding.replica_id(leaf.flat.rank) == 0
                ):
                    out[chunk["key"]] = leaf.local.detach().cpu().contiguous()
        elif isinstance(leaf, torch.Tensor) and rank == 0:
            for chunk in leaf_entry(p, leaf)["chunks"]:
                out[chunk["key"]] = leaf.detach().cpu().contiguous()
    return out


def _check_compatible(
    directory: Path, manifest: dict[str, Any], paths: list[str], leaves: list[Any]
) -> dict[str, Any]:
    saved = {e["path"]: e for e in manifest["leaves"]}
    missing = [p for p in paths if p not in saved]
    unexpected = [p for p in saved if p not in set(paths)]
    mismatched = []
    for p, leaf in zip(paths, leaves):
        entry = saved.get(p)
        if entry is None or entry["kind"] == "value" or leaf is SAVED:
            continue
        if not isinstance(leaf, torch.Tensor | ShardedTensor):
            mismatched.append(f"{p}: saved a tensor, asked for a {type(leaf).__name__}")
        elif (
            list(leaf.shape) != entry["shape"]
            or str(leaf.dtype).removeprefix("torch.") != entry["dtype"]
        ):
            mismatched.append(
                f"{p}: saved {tuple(entry['shape'])} {entry['dtype']}, asked for {tuple(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')}"
            )
    if missing or unexpected or mismatched:
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint: {missing}")
        if unexpected:
            problems.append(f"in the checkpoint but not asked for: {unexpected}")
        if mismatched:
            problems.append("shape or dtype mismatches: " + "; ".join(mismatched))
        raise CheckpointError(
            f"{directory} holds another tree than `like`: " + " | ".join(problems)
        )
    return saved


def _read(
    directory: Path,
    manifest: dict[str, Any],
    requests: dict[str, torch.Tensor],
    verify: bool,
    *,
    no_dist: bool | None = None,
) -> None:
    """Reads ``requests`` (DCP key -> destination) from the checkpoint; collective unless ``no_dist``."""
    files = manifest.get("files", {})
    reader = SafeReader(directory)
    try:
        metadata = reader.read_metadata()
    except (OSError, EOFError) as e:
        raise CheckpointError(
            f"{directory}: unreadable DCP metadata ({e}); the checkpoint is corrupted"
        ) from None
    if verify:
        needed = {".metadata"} | {
            str(info.relative_path)
            for index, info in metadata.storage_data.items()
            if isinstance(index, MetadataIndex) and index.fqn in requests
        }
        for name in sorted(needed):
            expected = files.get(name)
            actual = directory / name
            if expected is None or not actual.is_file():
                raise CheckpointError(
                    f"{directory}: data file {name} is missing; the checkpoint is incomplete"
                )
            digest = file_digest(actual)
            if digest["size"] != expected["size"]:
                raise CheckpointError(
                    f"{actual}: {digest['size']} bytes, saved {expected['size']}; the file is truncated"
                )
            if digest["sha256"] != expected["sha256"]:
                raise CheckpointError(
                    f"{actual}: contents differ from what was saved (SHA-256); the checkpoint is corrupted"
                )
    try:
        with _single_process_is_intended():
            dcp.load(
                requests,
                storage_reader=reader,
                no_dist=not runtime.is_distributed() if no_dist is None else no_dist,
            )
    except Exception as e:  # DCP wraps every rank's failure; say which checkpoint
        raise CheckpointError(
            f"{directory}: reading failed ({type(e).__name__}: {e}); the checkpoint is corrupted"
        ) from e


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """DCP warns on every call without a process group; for funcshard that is a deliberate mode."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _chunks(entry: dict[str, Any]) -> list[Chunk]:
    return [Chunk(c["key"], tuple(c["offsets"]), tuple(c["sizes"])) for c in entry["chunks"]]


def _region(leaf: Any, entry: dict[str, Any], rank: int) -> tuple[tuple[int, int], ...]:
    """The [start, stop) per dim of the saved leaf this rank needs."""
    if leaf is SAVED:
        return tuple((0, n) for n in entry["shape"])
    if isinstance(leaf, ShardedTensor):
        index = leaf.sharding.local_index(leaf.shape, leaf.flat.rank)
        return tuple(s.indices(n)[:2] for s, n in zip(index, leaf.shape))
    return tuple((0, n) for n in leaf.shape)


def _overlap(
    region: tuple[tuple[int, int], ...], chunk: Chunk
) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Slices of (the region, the chunk) where they overlap, or ``None``."""
    dst: list[slice] = []
    src: list[slice] = []
    for (start, stop), offset, size in zip(region, chunk.offsets, chunk.sizes):
        lo, hi = max(start, offset), min(stop, offset + size)
        if lo >= hi:
            return None
        dst.append(slice(lo - start, hi - start))
        src.append(slice(lo - offset, hi - offset))
    return tuple(dst), tuple(src)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint manifest")
    return dtype


def _broadcast(value: Any) -> Any:
    if not runtime.is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value: Any) -> list[Any]:
    if not runtime.is_distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rotate(parent: Path, keep: int) -> None:
    """Deletes all but the ``keep`` newest complete checkpoints in ``parent``, and interrupted saves."""
    for stale in parent.glob(f".*{TMP}*"):
        shutil.rmtree(stale, ignore_errors=True)
    complete = [
        (d, read_manifest(d))
        for d in parent.iterdir()
        if d.is_dir() and TMP not in d.name and is_complete(d)
    ]
    complete.sort(
        key=lambda dm: (
            dm[1].get("step") if dm[1].get("step") is not None else -1,
            dm[0].stat().st_mtime_ns,
        )
    )
    for old, _ in complete[: max(0, len(complete) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
