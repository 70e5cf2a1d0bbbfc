"""``fs.checkpoint.save``: every rank writes its chunks in parallel, rank 0 commits.

The ranks first agree on what they save (the same target, tree, step and
options; see [Note: agreements] in ``comm/channel.py``); each writes the chunks it holds (replica 0
of each) into its own sub-directory of a staging directory; they exchange
what they wrote (or why they could not); rank 0 writes the manifest, renames
the staging directory into place (see ``commit.py``) and, with ``keep``,
rotates, all before any rank returns. A failure on any rank before the rename
fails the save on every rank, and nothing is committed; once the rename is
done the save has committed and returns on every rank (what rotation could not
delete is reported as a :class:`CheckpointWarning`, never as a failure).
``async_save.py`` runs the same steps with the writes in a background thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

from funcshard._src import tree, tree_json
from funcshard._src.checkpoint import commit
from funcshard._src.checkpoint.chunks import local_pieces
from funcshard._src.checkpoint.cleanup import remove_saved
from funcshard._src.checkpoint.dcp_io import write_chunks
from funcshard._src.checkpoint.errors import CheckpointError, CheckpointWarning
from funcshard._src.checkpoint.manifest import RNG_PATH, leaf_entry, rank_dir, write_manifest
from funcshard._src.checkpoint.rng import gather_rng_states
from funcshard._src.comm import channel, runtime, settle
from funcshard._src.comm.runtime import DesyncError
from funcshard._src.shard.digest import tensor_digest
from funcshard._src.shard.sharded import ShardedTensor

_AGREED = ("target", "layout", "step", "keep", "rng")


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A save the ranks agreed on: where it goes, what each leaf is, and what this rank holds."""

    target: Path
    staging: Path
    entries: list[dict[str, Any]]  # the tree's leaves, then the RNG states' entry if saved
    leaves: list[Any]  # the values of ``entries``, in order
    structure: Any
    run: str
    step: int | None
    keep: int | None
    token: str
    rank: int
    has_rng: bool


def save(
    path: str | os.PathLike[str],
    state: Any,
    /,
    *,
    step: int | None = None,
    keep: int | None = None,
    run: str | None = None,
    rng: bool = True,
) -> Path:
    """Saves ``state`` as a sharded checkpoint at ``path``; collective (every rank calls it).

    Args:
        path: the checkpoint directory to create (it must not exist yet).
        state: any pytree of sharded leaves, tensors (saved once, from rank 0) and
            JSON scalars: params, optimizer state, a step counter, RNG states.
        step: the training step (an integer >= 0), recorded for :func:`latest`.
        keep: after committing, delete all but the ``keep`` (>= 1) newest checkpoints
            of this run in ``path``'s parent directory, and this run's interrupted
            saves; other runs' checkpoints, the new one and files no save writes are
            never deleted (see ``docs/checkpoints.md``, "What cleanup deletes").
        run: the run this checkpoint belongs to; default: the run of the checkpoint
            this process loaded or saved last, else ``FUNCSHARD_RUN`` or torchrun's
            run id, else a new id (see ``docs/checkpoints.md``, "Runs").
        rng: also save every rank's random generators (torch CPU and CUDA, Python's
            ``random``, numpy's global one), which :func:`load` restores, so that a
            resumed run draws what the uninterrupted one would have.

    Returns:
        ``path``, committed.

    Raises:
        FileExistsError: ``path`` exists (on rank 0).
        TypeError: a leaf that is neither a tensor nor a JSON scalar, or a bad ``step``.
        ValueError: ``keep`` < 1 or a malformed ``run``.
        DesyncError: the ranks save different trees, paths, steps or options.
        CheckpointError: writing failed on some rank (the message names it); nothing
            was committed.

    Warns:
        CheckpointWarning: the save committed, but ``keep`` could not delete everything
            it should have.

    Example:
        >>> import tempfile, funcshard as fs
        >>> p = {"w": torch.arange(6.0).reshape(2, 3)}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"fsdp": 1})))
        >>> root = tempfile.mkdtemp()
        >>> save(f"{root}/step-7", {"params": sp, "step": 7}, step=7).name
        'step-7'
    """
    with settle.operation("fs.checkpoint.save"):
        prepared = prepare(path, state, step=step, keep=keep, run=run, rng=rng)
        try:
            report = _write_mine(prepared.staging, prepared.entries, prepared.leaves, prepared.rank)
            reports = channel.all_gather_json(report, "the writes of fs.checkpoint.save")
            outcome = finish(prepared, reports) if prepared.rank == 0 else None
            outcome = channel.broadcast_json(outcome, "the commit of fs.checkpoint.save")
        finally:
            commit.writing(prepared.token, done=True)
    return conclude(prepared, outcome)


def prepare(
    path: str | os.PathLike[str],
    state: Any,
    /,
    *,
    step: int | None,
    keep: int | None,
    run: str | None,
    rng: bool,
) -> Prepared:
    """Checks the arguments and agrees with every rank on the save; collective.

    Raises:
        as :func:`save`, before anything is written.
    """
    target = Path(path)
    step = commit.check_step(step)
    keep = commit.check_keep(keep)
    run = commit.check_run(run)
    if not isinstance(rng, bool):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(f"rng must be True or False, got {rng!r}")
    paths, leaves, treedef = tree.flatten_with_paths(state)
    entries = [leaf_entry(p, leaf) for p, leaf in zip(paths, leaves)]
    structure = tree_json.treedef_to_json(treedef)
    mine = {
        "target": str(target),
        "layout": channel.digest_of({"leaves": entries, "tree": structure}).hex(),
        "step": step,
        "keep": keep,
        "rng": rng,
        "exists": os.path.lexists(target),
        "run": commit.proposed_run(run),
        "token": uuid.uuid4().hex,
    }
    everyone = channel.all_gather_json(mine, "the start of fs.checkpoint.save")
    _agree(everyone)
    first = everyone[0]
    if first["exists"]:
        raise FileExistsError(
            f"{target} exists; save each checkpoint to a new directory (e.g. one per step)"
        )
    rng_leaf = gather_rng_states() if rng else None  # collective, after the ranks agreed on rng
    if rng_leaf is not None:
        entries.append(leaf_entry(RNG_PATH, rng_leaf))
        leaves = [*leaves, rng_leaf]
    commit.writing(first["token"])  # until the save ends, rotation spares its staging directory
    return Prepared(
        target,
        commit.staging_dir(target, first["run"], first["token"]),
        entries,
        leaves,
        structure,
        first["run"],
        first["step"],
        keep,
        first["token"],
        runtime.rank(),
        rng_leaf is not None,
    )


def finish(prepared: Prepared, reports: list[dict[str, Any]], /) -> dict[str, Any]:
    """Rank 0, once every rank reported its writes: commits, rotates; what every rank must learn.

    Returns:
        ``{"error": why nothing was committed, or None, "problems": what rotation left}``.
    """
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
    if failed:
        listing = "; ".join(f"rank {r}: {error}" for r, error in failed)
        with contextlib.suppress(OSError):  # else the run's next committed save removes it
            remove_saved(prepared.staging.parent, prepared.staging.name)
        return {
            "error": f"saving {prepared.target} failed, nothing was committed: {listing}",
            "problems": [],
        }
    try:
        _commit(prepared, reports)
    except Exception as e:  # every rank must learn of it; the staging directory stays
        return {
            "error": f"saving {prepared.target} failed on rank 0: {type(e).__name__}: {e}",
            "problems": [],
        }
    problems: list[str] = []  # committed: nothing from here on fails the save
    try:
        commit.fsync_dir(prepared.target.parent)
    except OSError as e:
        problems.append(f"syncing {prepared.target.parent}: {e}")
    try:
        problems += commit.rotate(
            prepared.target.parent,
            prepared.run,
            prepared.keep,
            written=prepared.target,
            token=prepared.token,
        )
    except Exception as e:
        problems.append(f"{type(e).__name__}: {e}")
    return {"error": None, "problems": problems}


def conclude(prepared: Prepared, outcome: dict[str, Any], /) -> Path:
    """What every rank does with rank 0's outcome: raise, or warn and return the committed path."""
    if outcome["error"] is not None:
        raise CheckpointError(outcome["error"])
    commit.adopt_run(prepared.run)
    if outcome["problems"]:
        warnings.warn(
            f"{prepared.target} was saved, but keep={prepared.keep} could not delete everything "
            f"it should have: {'; '.join(outcome['problems'])}",
            CheckpointWarning,
            stacklevel=3,
        )
    return prepared.target


def local_views(prepared: Prepared, /) -> dict[str, torch.Tensor]:
    """Views of the chunks this rank writes (its shards where it is replica 0; plain tensors on rank 0)."""
    return _local_views(prepared.entries, prepared.leaves, prepared.rank)


def write_report(staging: Path, chunks: dict[str, torch.Tensor], rank: int, /) -> dict[str, Any]:
    """Writes ``chunks`` to this rank's sub-directory; reports the files, the digests, or the error."""
    try:
        files = write_chunks(staging / rank_dir(rank), chunks) if chunks else {}
        return {
            "error": None,
            "files": {f"{rank_dir(rank)}/{name}": info for name, info in files.items()},
            "chunks": {key: tensor_digest(t) for key, t in chunks.items()},
        }
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "files": {}, "chunks": {}}


def _agree(everyone: list[dict[str, Any]]) -> None:
    """Every rank saves the same thing; else a :class:`DesyncError` naming the differences."""
    first = everyone[0]
    differences = [
        f"rank {r}: {name} {theirs[name]!r} (rank 0: {first[name]!r})"
        for r, theirs in enumerate(everyone)
        for name in _AGREED
        if theirs[name] != first[name]
    ]
    if differences:
        raise DesyncError(
            "fs.checkpoint.save: the ranks save different things: "
            + "; ".join(differences)
            + ". Every rank must save the same tree (same plan) to the same path with the same step "
            "and keep"
        )


def _write_mine(
    staging: Path, entries: list[dict[str, Any]], leaves: list[Any], rank: int
) -> dict[str, Any]:
    """Writes this rank's chunks; reports the files, the chunk digests, or the error."""
    try:
        chunks = _local_chunks(entries, leaves, rank)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "files": {}, "chunks": {}}
    return write_report(staging, chunks, rank)


def _commit(prepared: Prepared, reports: list[dict[str, Any]]) -> None:
    """Rank 0: writes the manifest and renames the staging directory into place."""
    prepared.staging.mkdir(parents=True, exist_ok=True)  # a tree of values has no rank files
    digests = {key: d for rep in reports for key, d in rep["chunks"].items()}
    entries = [
        dict(e, chunks=[dict(c, sha256=digests[c["key"]]) for c in e["chunks"]])
        if "chunks" in e
        else e
        for e in prepared.entries
    ]
    leaves = entries[:-1] if prepared.has_rng else entries
    manifest: dict[str, Any] = {
        "run": prepared.run,
        "step": prepared.step,
        "world_size": len(reports),
        "tree": prepared.structure,
        "leaves": leaves,
        "files": {name: info for rep in reports for name, info in rep["files"].items()},
    }
    if prepared.has_rng:
        manifest["rng"] = entries[-1]
    write_manifest(prepared.staging, manifest)
    commit.rename_into_place(prepared.staging, prepared.target)  # the parent is synced after


def _local_chunks(
    entries: list[dict[str, Any]], leaves: list[Any], rank: int
) -> dict[str, torch.Tensor]:
    """The chunks this rank writes, on the CPU and contiguous."""
    views = _local_views(entries, leaves, rank)
    return {key: view.detach().cpu().contiguous() for key, view in views.items()}


def _local_views(
    entries: list[dict[str, Any]], leaves: list[Any], rank: int
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for entry, leaf in zip(entries, leaves):
        mine = [c for c in entry.get("chunks", []) if c["writer"] == rank]
        if not mine:
            continue
        if isinstance(leaf, ShardedTensor):  # one box, or the boxes of a flat range
            by_offsets = {tuple(a for a, _ in r): v for r, v in local_pieces(leaf)}
            for chunk in mine:
                out[chunk["key"]] = by_offsets[tuple(chunk["offsets"])]
        else:
            (chunk,) = mine
            out[chunk["key"]] = leaf
    return out
