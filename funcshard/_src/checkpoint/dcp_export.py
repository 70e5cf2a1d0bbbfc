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
from funcshard._src.checkpoint.chunks import Chunk, chunk_key, chunks_of, local_pieces
from funcshard._src.checkpoint.dcp_metadata import METADATA_FILE
from funcshard._src.checkpoint.errors import CheckpointError
from funcshard._src.comm import channel, runtime, settle
from funcshard._src.comm.runtime import DesyncError
from funcshard._src.dtypes import dtype_name
from funcshard._src.shard.sharded import ShardedTensor

STAGING_RUN = "dcp"  # staging directories of these saves: .<name>.tmp-dcp-<token>


@dataclass(frozen=True)
class Rows:
    """A tensor every rank computed whole, of which each keeps and writes its share of dim 0.

    Rank ``r`` of ``world`` holds rows ``rows_of(shape[0], world, r)`` (a 0-d tensor:
    rank 0 holds it). For values a module's state-dict hook computes
    ([Note: state-dict hooks] in ``interop/state_hooks.py``): no rank keeps them whole.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    local: torch.Tensor  # this rank's rows
    rank: int
    world: int

    @staticmethod
    def of(value: torch.Tensor, rank: int, world: int) -> Rows:
        """This rank's share of ``value`` (a copy: the whole value can be freed).

        Example:
            >>> Rows.of(torch.arange(5.0), 1, 2).local
            tensor([3., 4.])
        """
        if value.ndim == 0:
            local = value.detach().clone() if rank == 0 else value.detach().new_empty((0,))
        else:
            start, stop = rows_of(value.shape[0], world, rank)
            local = value.detach()[start:stop].clone()
        return Rows(tuple(value.shape), value.dtype, local, rank, world)

    @property
    def ndim(self) -> int:
        """Dims of the whole tensor."""
        return len(self.shape)

    def chunks(self, key: str) -> list[Chunk]:
        """One chunk per rank with rows, written by that rank."""
        if not self.shape:
            return [Chunk(chunk_key(key, ()), (), (), 0)]
        out = []
        for r in range(self.world):
            start, stop = rows_of(self.shape[0], self.world, r)
            if stop > start and all(self.shape[1:]):
                offsets = (start,) + (0,) * (self.ndim - 1)
                sizes = (stop - start, *self.shape[1:])
                out.append(Chunk(chunk_key(key, offsets), offsets, sizes, r))
        return out


def rows_of(n: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s rows of ``n``: the first ``n % world`` ranks one more.

    Example:
        >>> [rows_of(5, 2, r) for r in range(2)]
        [(0, 3), (3, 5)]
    """
    size, extra = divmod(n, world)
    start = rank * size + min(rank, extra)
    return start, start + size + (rank < extra)


@dataclass(frozen=True)
class Entry:
    """One tensor to save, under one or more DCP keys (tied weights: one copy on disk)."""

    keys: tuple[str, ...]
    # a plain tensor is the same on every rank; rank 0 writes it
    leaf: ShardedTensor | torch.Tensor | Rows
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
            "layout": channel.digest_of({"entries": layout}).hex(),
            "exists": target.exists(),
            "token": uuid.uuid4().hex,
        }
        everyone = channel.all_gather_json(mine, f"the start of {what}")
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
        reports = channel.all_gather_json(report, f"the writes of {what}")
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
        error = channel.broadcast_json(error, f"the commit of {what}")
        if error is not None:
            raise CheckpointError(f"saving {target} failed on rank 0: {error}")
    return target


def _check(entry: Entry) -> list[Chunk]:
    if isinstance(entry.leaf, Rows):
        return entry.leaf.chunks(entry.keys[0])
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
                views = _views(entry.leaf)
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


def _views(leaf: ShardedTensor | torch.Tensor | Rows) -> dict[tuple[int, ...], torch.Tensor]:
    """This rank's pieces of ``leaf`` by their offsets."""
    if isinstance(leaf, ShardedTensor):
        return {tuple(a for a, _ in r): v for r, v in local_pieces(leaf)}
    if isinstance(leaf, Rows):
        start = rows_of(leaf.shape[0], leaf.world, leaf.rank)[0] if leaf.shape else 0
        return {((start,) + (0,) * (leaf.ndim - 1)) if leaf.shape else (): leaf.local}
    return {(0,) * leaf.ndim: leaf}


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
