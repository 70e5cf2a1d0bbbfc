"""``fs.checkpoint.save``: every rank writes its chunks in parallel, rank 0 commits.

The ranks first agree on what they save (the same target, tree, step and
options; see [Note: agreements]); each writes the chunks it holds (replica 0
of each) into its own sub-directory of a staging directory; they exchange
what they wrote (or why they could not); rank 0 writes the manifest and
renames the staging directory into place (see ``commit.py``). A failure on
any rank fails the save on every rank, and nothing is committed.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.checkpoint import commit
from funcshard._src.checkpoint.chunks import local_pieces
from funcshard._src.checkpoint.dcp_io import write_chunks
from funcshard._src.checkpoint.errors import CheckpointError
from funcshard._src.checkpoint.manifest import RNG_PATH, leaf_entry, rank_dir, write_manifest
from funcshard._src.checkpoint.rng import gather_rng_states
from funcshard._src.comm import agree, runtime, settle
from funcshard._src.comm.runtime import DesyncError
from funcshard._src.shard.digest import tensor_digest
from funcshard._src.shard.sharded import ShardedTensor

_AGREED = ("target", "layout", "step", "keep", "rng")


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
            saves; other runs' checkpoints and the new one are never deleted.
        run: the run this checkpoint belongs to; default: the run of the checkpoint
            this process loaded or saved last, else ``FUNCSHARD_RUN`` or torchrun's
            run id, else a new id (see ``docs/checkpoints.md``, "Runs").
        rng: also save every rank's random generators (torch CPU and CUDA, Python's
            ``random``, numpy's global one), which :func:`load` restores, so that a
            resumed run draws what the uninterrupted one would have.

    Returns:
        ``path``.

    Raises:
        FileExistsError: ``path`` exists (on rank 0).
        TypeError: a leaf that is neither a tensor nor a JSON scalar, or a bad ``step``.
        ValueError: ``keep`` < 1 or a malformed ``run``.
        DesyncError: the ranks save different trees, paths, steps or options.
        CheckpointError: writing failed on some rank (the message names it); nothing
            was committed.

    Example:
        >>> import tempfile, funcshard as fs
        >>> p = {"w": torch.arange(6.0).reshape(2, 3)}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"fsdp": 1})))
        >>> root = tempfile.mkdtemp()
        >>> save(f"{root}/step-7", {"params": sp, "step": 7}, step=7).name
        'step-7'
    """
    target = Path(path)
    step = commit.check_step(step)
    keep = commit.check_keep(keep)
    run = commit.check_run(run)
    if not isinstance(rng, bool):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(f"rng must be True or False, got {rng!r}")
    paths, leaves, treedef = tree.flatten_with_paths(state)
    entries = [leaf_entry(p, leaf) for p, leaf in zip(paths, leaves)]
    structure = tree.treedef_to_json(treedef)
    rank = runtime.rank()
    with settle.operation("fs.checkpoint.save"):
        mine = {
            "target": str(target),
            "layout": agree.digest_of({"leaves": entries, "tree": structure}).hex(),
            "step": step,
            "keep": keep,
            "rng": rng,
            "exists": target.exists(),
            "run": commit.proposed_run(run),
            "token": uuid.uuid4().hex,
        }
        everyone = agree.all_gather_json(mine, "the start of fs.checkpoint.save")
        _agree(everyone)
        first = everyone[0]
        if first["exists"]:
            raise FileExistsError(
                f"{target} exists; save each checkpoint to a new directory (e.g. one per step)"
            )
        staging = commit.staging_dir(target, first["run"], first["token"])
        rng_leaf = gather_rng_states() if rng else None  # collective, after the ranks agreed on rng
        rng_entry = None if rng_leaf is None else leaf_entry(RNG_PATH, rng_leaf)
        written = entries + ([] if rng_entry is None else [rng_entry])
        report = _write_mine(
            staging, written, leaves + ([] if rng_leaf is None else [rng_leaf]), rank
        )
        reports = agree.all_gather_json(report, "the writes of fs.checkpoint.save")
        failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
        if failed:
            if rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            listing = "; ".join(f"rank {r}: {error}" for r, error in failed)
            raise CheckpointError(f"saving {target} failed, nothing was committed: {listing}")
        error: str | None = None
        if rank == 0:
            try:
                _commit(target, staging, entries, rng_entry, structure, reports, first, keep)
            except Exception as e:  # every rank must learn of it
                error = f"{type(e).__name__}: {e}"
        error = agree.broadcast_json(error, "the commit of fs.checkpoint.save")
        if error is not None:
            raise CheckpointError(f"saving {target} failed on rank 0: {error}")
    commit.adopt_run(first["run"])
    return target


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
        files = write_chunks(staging / rank_dir(rank), chunks) if chunks else {}
        return {
            "error": None,
            "files": {f"{rank_dir(rank)}/{name}": info for name, info in files.items()},
            "chunks": {key: tensor_digest(t) for key, t in chunks.items()},
        }
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "files": {}, "chunks": {}}


def _commit(
    target: Path,
    staging: Path,
    entries: list[dict[str, Any]],
    rng_entry: dict[str, Any] | None,
    structure: Any,
    reports: list[dict[str, Any]],
    first: dict[str, Any],
    keep: int | None,
) -> None:
    """Rank 0: writes the manifest, renames the staging directory into place, rotates."""
    staging.mkdir(parents=True, exist_ok=True)  # a tree of values only has no rank files
    digests = {key: d for rep in reports for key, d in rep["chunks"].items()}
    for entry in entries + ([] if rng_entry is None else [rng_entry]):
        for chunk in entry.get("chunks", []):
            chunk["sha256"] = digests[chunk["key"]]
    manifest = {
        "run": first["run"],
        "step": first["step"],
        "world_size": len(reports),
        "tree": structure,
        "leaves": entries,
        "files": {name: info for rep in reports for name, info in rep["files"].items()},
    }
    if rng_entry is not None:
        manifest["rng"] = rng_entry
    write_manifest(staging, manifest)
    commit.commit(staging, target)
    if keep is not None:
        commit.rotate(target.parent, first["run"], keep, written=target, token=first["token"])


def _local_chunks(
    entries: list[dict[str, Any]], leaves: list[Any], rank: int
) -> dict[str, torch.Tensor]:
    """The chunks this rank writes: its own shard where it is replica 0; plain tensors on rank 0."""
    out: dict[str, torch.Tensor] = {}
    for entry, leaf in zip(entries, leaves):
        mine = [c for c in entry.get("chunks", []) if c["writer"] == rank]
        if not mine:
            continue
        if isinstance(leaf, ShardedTensor):  # one box, or the boxes of a flat range
            by_offsets = {tuple(a for a, _ in r): v for r, v in local_pieces(leaf)}
            for chunk in mine:
                out[chunk["key"]] = by_offsets[tuple(chunk["offsets"])].detach().cpu().contiguous()
        else:
            (chunk,) = mine
            out[chunk["key"]] = leaf.detach().cpu().contiguous()
    return out
