"""Writing a standard DCP checkpoint from funcshard leaves: what ``dcp.load`` reads; collective, atomic.

The files are those ``dcp.save`` writes: each rank's chunks in its own data file
``__<rank>_0.distcp`` (each chunk a ``torch.save`` of one tensor, as DCP's
``FileSystemWriter`` writes them) and one ``.metadata``, the pickle of DCP's
``Metadata`` that rank 0 writes once every rank has reported where its chunks
lie. A sharded leaf is saved as one chunk per distinct shard (replica 0 writes
it; see ``chunks.py``), a plain tensor once, by rank 0; a leaf saved under
several keys (tied weights) is written once and every key points at the same
bytes. As ``fs.checkpoint.save`` does, the ranks write into a staging directory
that rank 0 renames into place last (``commit.py``): a crash leaves nothing at
the target or a complete checkpoint; DCP's own collectives never run.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    _StorageInfo,  # pyright: ignore[reportPrivateUsage]
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from funcshard._src.checkpoint import commit
from funcshard._src.checkpoint.chunks import Chunk, chunks_of, local_pieces
from funcshard._src.checkpoint.dcp_metadata import METADATA_FILE
from funcshard._src.checkpoint.errors import CheckpointError
from funcshard._src.comm import agree, runtime, settle
from funcshard._src.comm.runtime import DesyncError
from funcshard._src.dtypes import dtype_name
from funcshard._src.shard.sharded import ShardedTensor

STAGING_RUN = "dcp"  # staging directories of these saves: .<name>.tmp-dcp-<token>


@dataclass(frozen=True)
class Entry:
    """One tensor to save, under one or more DCP keys (tied weights: one copy on disk)."""

    keys: tuple[str, ...]
    leaf: ShardedTensor | torch.Tensor  # a plain tensor is the same on every rank; rank 0 writes it
    nest: str | None = None  # the state-dict key it sits under (``optimizer``), for DCP's planner


def write_dcp(path: str | os.PathLike[str], entries: Sequence[Entry], /, *, what: str) -> Path:
    """Writes ``entries`` as a standard DCP checkpoint at ``path``; collective (every rank calls it).

    Returns:
        ``path``.

    Raises:
        FileExistsError: ``path`` exists (on rank 0).
        ValueError: a key given twice, a key outside its ``nest``, or a tensor on the
            ``meta`` device.
        DesyncError: the ranks save different entries or paths.
        CheckpointError: writing failed on some rank (the message names it); nothing
            was committed.
    """
    target = Path(path)
    chunks = [_check(entry) for entry in entries]
    _check_keys(entries)
    layout = [[list(e.keys), list(e.leaf.shape), dtype_name(e.leaf.dtype), e.nest] for e in entries]
    rank = runtime.rank()
    with settle.operation(what):
        mine = {
            "target": str(target),
            "layout": agree.digest_of({"entries": layout}).hex(),
            "exists": target.exists(),
            "token": uuid.uuid4().hex,
        }
        everyone = agree.all_gather_json(mine, f"the start of {what}")
        differ = [
            f"rank {r}: {k} {theirs[k]!r} (rank 0: {everyone[0][k]!r})"
            for r, theirs in enumerate(everyone)
            for k in ("target", "layout")
            if theirs[k] != everyone[0][k]
        ]
        if differ:
            raise DesyncError(
                f"{what}: the ranks save different things: {'; '.join(differ)}. Every rank must "
                f"save the same tree (same plan) to the same path"
            )
        first = everyone[0]
        if first["exists"]:
            raise FileExistsError(
                f"{target} exists; save each checkpoint to a new directory (e.g. one per step)"
            )
        staging = commit.staging_dir(target, STAGING_RUN, first["token"])
        report = _write_mine(staging, entries, chunks, rank)
        reports = agree.all_gather_json(report, f"the writes of {what}")
        failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
        if failed:
            if rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            listing = "; ".join(f"rank {r}: {error}" for r, error in failed)
            raise CheckpointError(f"saving {target} failed, nothing was committed: {listing}")
        error: str | None = None
        if rank == 0:
            try:
                staging.mkdir(parents=True, exist_ok=True)
                _write_metadata(staging, entries, chunks, reports, first["token"])
                commit.commit(staging, target)
            except Exception as e:  # every rank must learn of it
                shutil.rmtree(staging, ignore_errors=True)
                error = f"{type(e).__name__}: {e}"
        error = agree.broadcast_json(error, f"the commit of {what}")
        if error is not None:
            raise CheckpointError(f"saving {target} failed on rank 0: {error}")
    return target


def _check(entry: Entry) -> list[Chunk]:
    if not isinstance(entry.leaf, ShardedTensor | torch.Tensor):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(f"{entry.keys[0]}: a {type(entry.leaf).__name__}, not a tensor")
    if isinstance(entry.leaf, torch.Tensor) and entry.leaf.device.type == "meta":
        raise ValueError(
            f"{entry.keys[0]}: a tensor on the meta device has no values to save; materialize it "
            f"first (apply.materialize_state() for a module's buffers)"
        )
    return chunks_of(entry.leaf, entry.keys[0])


def _check_keys(entries: Sequence[Entry]) -> None:
    seen: set[str] = set()
    for entry in entries:
        for key in entry.keys:
            if key in seen:
                raise ValueError(f"{key!r} is saved twice; every entry needs keys of its own")
            if entry.nest is not None and not key.startswith(entry.nest + "."):
                raise ValueError(f"{key!r} does not start with {entry.nest + '.'!r}")
            seen.add(key)


def _write_mine(
    staging: Path, entries: Sequence[Entry], chunks: list[list[Chunk]], rank: int
) -> dict[str, Any]:
    """Writes this rank's chunks into its data file; reports where each lies, or the error."""
    name = f"__{rank}_0.distcp"
    stored: list[list[Any]] = []
    try:
        staging.mkdir(parents=True, exist_ok=True)
        with open(staging / name, "wb") as f:
            for i, (entry, boxes) in enumerate(zip(entries, chunks)):
                mine = [c for c in boxes if c.writer == rank]
                if not mine:
                    continue
                views = (
                    {tuple(a for a, _ in r): v for r, v in local_pieces(entry.leaf)}
                    if isinstance(entry.leaf, ShardedTensor)
                    else {(0,) * entry.leaf.ndim: entry.leaf}
                )
                for chunk in mine:
                    blob = io.BytesIO()
                    # a copy: torch.save of a view writes all of the storage behind it
                    torch.save(views[chunk.offsets].detach().cpu().clone(), blob)
                    stored.append([i, list(chunk.offsets), f.tell(), blob.tell()])
                    f.write(blob.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        return {"error": None, "file": name, "stored": stored}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "file": name, "stored": []}


def _write_metadata(
    staging: Path,
    entries: Sequence[Entry],
    chunks: list[list[Chunk]],
    reports: list[dict[str, Any]],
    token: str,
) -> None:
    """Rank 0: DCP's ``Metadata`` for every entry and where every chunk lies; mutates the disk."""
    described: dict[str, Any] = {}
    planner: dict[str, tuple[str, ...]] = {}
    for entry, boxes in zip(entries, chunks):
        metadata = TensorStorageMetadata(
            properties=TensorProperties(dtype=entry.leaf.dtype),
            size=torch.Size(entry.leaf.shape),
            chunks=[
                ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in boxes
            ],
        )
        for key in entry.keys:
            described[key] = metadata
            planner[key] = (
                (key,) if entry.nest is None else (entry.nest, key[len(entry.nest) + 1 :])
            )
    position = [{c.offsets: j for j, c in enumerate(boxes)} for boxes in chunks]
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for report in reports:
        for i, offsets, offset, length in report["stored"]:
            offsets = tuple(offsets)
            info = _StorageInfo(relative_path=report["file"], offset=offset, length=length)
            for key in entries[i].keys:
                storage[MetadataIndex(key, offsets, position[i][offsets])] = info
    metadata = Metadata(
        state_dict_metadata=described,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(save_id=token),
        version=CURRENT_DCP_VERSION,
    )
    with open(staging / METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
