"""``fs.checkpoint.load`` and ``load_full``: read only the chunks a rank needs, into any plan.

Loading reads, on every rank, only the saved chunks that overlap the shards it
needs (see ``chunks.py``), so a checkpoint saved on W ranks loads on any W' and
any plan, and into a single process without torch.distributed. Everything a
checkpoint's files say is checked before it is used (``manifest.py``,
``dcp_io.py``); the ranks then agree that every one of them loaded the same
checkpoint without error.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from funcshard._src import tree, tree_json
from funcshard._src.checkpoint import commit
from funcshard._src.checkpoint import errors as errors_module
from funcshard._src.checkpoint.chunks import Region, local_pieces, overlap, regions_of, whole
from funcshard._src.checkpoint.dcp_io import read_chunks
from funcshard._src.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
)
from funcshard._src.checkpoint.manifest import (
    VALUE_TYPES,
    chunks,
    read_manifest,
)
from funcshard._src.checkpoint.rng import rng_setter
from funcshard._src.comm import channel, settle
from funcshard._src.dtypes import dtype_name, dtype_of
from funcshard._src.shard.sharded import ShardedTensor, map_flats


class _Saved:
    """The ``like`` leaf that asks for a leaf as it was saved (a full tensor or the value)."""

    def __repr__(self) -> str:
        return "fs.checkpoint.SAVED"


SAVED = _Saved()


def load(
    path: str | os.PathLike[str], /, like: Any, *, verify: bool = True, rng: bool = True
) -> Any:
    """Loads the checkpoint at ``path`` into the structure and shardings of ``like``; collective.

    ``like`` may be sharded with another plan, mesh or world size than the one
    that saved: each rank reads only the saved chunks that overlap its shards.
    Nothing of ``like`` is modified; the result is new. Afterwards this process
    continues the checkpoint's run (see :func:`save`'s ``run``).

    Args:
        path: a checkpoint directory.
        like: a pytree like the saved one (e.g. freshly sharded params and
            ``opt.init`` state): its sharded leaves give the target shardings, its
            other leaves the kind (a tensor, or a value of the same type). A leaf
            :data:`SAVED` takes the saved leaf as it is, whatever its shape
            (per-rank RNG states saved on another world size, say).
        verify: check the SHA-256 of every chunk read (``False`` trusts the data
            files; the manifest and metadata are checked either way).
        rng: restore every rank's random generators saved with the checkpoint
            (``fs.checkpoint.save(..., rng=True)``, the default), once every rank has
            loaded; on more ranks than saved, rank ``r`` takes saved rank ``r % W``'s.
            A checkpoint without them leaves the generators as they are.

    Raises:
        NotACheckpointError: not a checkpoint, or an interrupted save.
        CorruptCheckpointError: damaged, truncated or inconsistent files.
        UnsafeCheckpointError: a file asks to run code or to read outside the checkpoint.
        CheckpointMismatchError: a checkpoint of another tree (the message lists missing
            and unexpected paths, shape, dtype and kind mismatches).
        CheckpointError: another rank failed to load, or the ranks loaded different
            checkpoints.

    Example:
        >>> import tempfile, funcshard as fs
        >>> p = {"w": torch.arange(6.0).reshape(2, 3)}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"fsdp": 1})))
        >>> ckpt = fs.checkpoint.save(f"{tempfile.mkdtemp()}/step-7", {"params": sp, "step": 7}, step=7)
        >>> back = load(ckpt, like={"params": sp, "step": 0})
        >>> back["step"], back["params"]["w"].local
        (7, tensor([[0., 1., 2.],
                [3., 4., 5.]]))
    """
    directory = Path(path)
    with settle.operation("fs.checkpoint.load"):
        failure: Exception | None = None
        result: Any = None
        set_rng: Callable[[], None] | None = None
        digest = None
        try:
            manifest = read_manifest(directory)
            digest = manifest["digest"]
            result = _load_into(directory, manifest, like, verify)
            if rng and manifest.get("rng") is not None:
                try:
                    set_rng = rng_setter(_read_rng(directory, manifest, verify))
                except CorruptCheckpointError as e:
                    raise type(e)(f"{directory}: the rng entry: {e}") from None
        except Exception as e:  # every rank must learn of it
            failure = e
        status = {
            "error": None if failure is None else f"{type(failure).__name__}: {failure}",
            "class": None if failure is None else type(failure).__name__,
            "checkpoint": digest,
            "path": str(directory),
        }
        everyone = channel.all_gather_json(status, "fs.checkpoint.load")
        if failure is not None:
            raise failure
        failed = [(r, s) for r, s in enumerate(everyone) if s["error"]]
        if failed:
            r, s = failed[0]
            named = getattr(errors_module, str(s["class"]), None)
            error = (
                named
                if isinstance(named, type) and issubclass(named, CheckpointError)
                else CheckpointError
            )
            raise error(f"{directory}: loading failed on rank {r}: {s['error']}")
        if any(s["checkpoint"] != digest for s in everyone):
            listing = "; ".join(f"rank {r}: {s['path']}" for r, s in enumerate(everyone))
            raise CheckpointError(
                f"the ranks loaded different checkpoints ({listing}); every rank must load the same "
                f"one (pick it once, e.g. fs.checkpoint.latest(dir) on a directory every rank sees)"
            )
    if set_rng is not None:
        set_rng()
    commit.adopt_run(manifest["run"])
    return result


def _read_rng(directory: Path, manifest: dict[str, Any], verify: bool) -> torch.Tensor:
    """The saved RNG states, ``(ranks, n)`` uint8 (checked when set)."""
    entry = manifest["rng"]
    wanted = [(c, torch.uint8, raw["sha256"]) for c, raw in zip(chunks(entry), entry["chunks"])]
    data = read_chunks(directory, manifest["files"], wanted, verify=verify)
    states = torch.zeros(entry["shape"], dtype=torch.uint8)
    _fill(states, whole(entry["shape"]), entry, data)
    return states


def load_full(
    path: str | os.PathLike[str], /, *, verify: bool = True, subtree: str | None = None
) -> Any:
    """The whole saved tree (or one top-level ``subtree``) as full tensors, in one process.

    No torch.distributed is needed. With ``subtree`` (``"params"`` of a checkpoint
    of ``{"params", "opt", "step"}``) only that subtree's tensors are read.

    Tree nodes that are namedtuples or dataclasses come back only if this process
    knows their types (``fs.register_namedtuple``, ``fs.tree.register_dataclass``);
    funcshard's own optimizer states are known.

    Raises:
        CheckpointError: see :func:`load`; also a tree structure that names an
            unknown type (:class:`CorruptCheckpointError`, saying what to register).
        ValueError: the saved tree has no top-level ``subtree``.

    Example:
        >>> import tempfile, funcshard as fs
        >>> p = {"w": torch.ones(2)}
        >>> ckpt = fs.checkpoint.save(f"{tempfile.mkdtemp()}/c", {"params": fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))})
        >>> load_full(ckpt)
        {'params': {'w': tensor([1., 1.])}}
    """
    directory = Path(path)
    manifest = read_manifest(directory)
    try:
        treedef = tree_json.treedef_from_json(manifest["tree"])
        skeleton = tree.unflatten(treedef, [0] * treedef.num_leaves)
        structure = tree.flatten_with_paths(skeleton)[0]
    except (ValueError, TypeError) as e:
        raise CorruptCheckpointError(
            f"{directory}: cannot rebuild the saved tree structure ({e})"
        ) from None
    entries = manifest["leaves"]
    if structure != [e["path"] for e in entries]:
        raise CorruptCheckpointError(
            f"{directory}: the tree structure's leaves ({treedef.num_leaves}) are not the leaves the "
            f"manifest lists ({len(entries)}), in order; the checkpoint is corrupted"
        )
    if subtree is not None and (not isinstance(skeleton, dict) or subtree not in skeleton):
        have = sorted(map(str, skeleton)) if isinstance(skeleton, dict) else type(skeleton).__name__
        raise ValueError(
            f"{directory}: the checkpoint has no top-level {subtree!r} (it has {have}); pass "
            f"subtree= one of them, or subtree=None for everything"
        )
    read = [subtree is None or e["path"].split("/")[0] == subtree for e in entries]
    wanted = [
        (chunk, _dtype(e), chunk_sha)
        for e, r in zip(entries, read)
        if r and e["kind"] != "value"
        for chunk, chunk_sha in zip(chunks(e), (c["sha256"] for c in e["chunks"]))
    ]
    data = read_chunks(directory, manifest["files"], wanted, verify=verify)
    out: list[Any] = []
    for entry, r in zip(entries, read):
        if not r or entry["kind"] == "value":
            out.append(entry["value"] if r else None)
            continue
        full = torch.zeros(entry["shape"], dtype=_dtype(entry))
        _fill(full, whole(entry["shape"]), entry, data)
        out.append(full)
    loaded = tree.unflatten(treedef, out)
    return loaded if subtree is None else loaded[subtree]


# -- helpers -----------------------------------------------------------------------


def _load_into(directory: Path, manifest: dict[str, Any], like: Any, verify: bool) -> Any:
    paths, leaves, treedef = tree.flatten_with_paths(like)
    saved = _check_compatible(directory, manifest, paths, leaves)
    regions = [_regions(leaf, saved[p]) for p, leaf in zip(paths, leaves)]
    wanted = [
        (chunk, _dtype(saved[p]), c["sha256"])
        for p, needed in zip(paths, regions)
        if saved[p]["kind"] != "value"
        for chunk, c in zip(chunks(saved[p]), saved[p]["chunks"])
        if any(overlap(region, chunk) is not None for region in needed)
    ]
    data = read_chunks(directory, manifest["files"], wanted, verify=verify)
    fresh = map_flats(lambda f: f.with_data(torch.zeros_like(f.data)), like)
    out: list[Any] = []
    for p, leaf in zip(paths, tree.leaves(fresh)):
        entry = saved[p]
        if entry["kind"] == "value":
            out.append(entry["value"])
            continue
        if isinstance(leaf, ShardedTensor):
            for region, view in local_pieces(leaf):  # views of the fresh flat buffer
                _fill(view, region, entry, data)
            out.append(leaf)
            continue
        target = torch.zeros(entry["shape"], dtype=_dtype(entry))
        _fill(target, whole(entry["shape"]), entry, data)
        out.append(target if leaf is SAVED else target.to(leaf.device))
    return tree.unflatten(treedef, out)


def _fill(
    target: torch.Tensor, region: Region, entry: dict[str, Any], data: dict[str, torch.Tensor]
) -> None:
    """Copies every chunk's overlap with ``region`` into ``target``; mutates ``target``."""
    for chunk in chunks(entry):
        hit = overlap(region, chunk)
        if hit is not None:
            dst, src = hit
            target[dst].copy_(data[chunk.key][src])


def _check_compatible(
    directory: Path, manifest: dict[str, Any], paths: list[str], leaves: list[Any]
) -> dict[str, Any]:
    saved = {e["path"]: e for e in manifest["leaves"]}
    missing = [p for p in paths if p not in saved]
    unexpected = [p for p in saved if p not in set(paths)]
    mismatched: list[str] = []
    for p, leaf in zip(paths, leaves):
        entry = saved.get(p)
        if entry is None or leaf is SAVED:
            continue
        problem = _mismatch(entry, leaf)
        if problem is not None:
            mismatched.append(f"{p or '<root>'}: {problem}")
    if missing or unexpected or mismatched:
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint: {missing}")
        if unexpected:
            problems.append(f"in the checkpoint but not asked for: {unexpected}")
        if mismatched:
            problems.append("shape, dtype or kind mismatches: " + "; ".join(mismatched))
        raise CheckpointMismatchError(
            f"{directory} holds another tree than `like`: " + " | ".join(problems)
        )
    return saved


def _mismatch(entry: dict[str, Any], leaf: Any) -> str | None:
    """How the saved ``entry`` differs from what ``leaf`` asks for, or ``None``."""
    is_tensor = isinstance(leaf, torch.Tensor | ShardedTensor)
    if entry["kind"] == "value":
        if is_tensor or not isinstance(leaf, VALUE_TYPES):
            return f"saved a value ({type(entry['value']).__name__}), asked for a {type(leaf).__name__}"
        if type(entry["value"]) is not type(leaf):
            return f"saved a {type(entry['value']).__name__}, asked for a {type(leaf).__name__}"
        return None
    if not is_tensor:
        return f"saved a tensor, asked for a {type(leaf).__name__}"
    if list(leaf.shape) != entry["shape"] or dtype_name(leaf.dtype) != entry["dtype"]:
        return (
            f"saved {tuple(entry['shape'])} {entry['dtype']}, asked for {tuple(leaf.shape)} "
            f"{dtype_name(leaf.dtype)}"
        )
    return None


def _regions(leaf: Any, entry: dict[str, Any]) -> list[Region]:
    """The boxes, [start, stop) per dim, of the saved leaf this rank needs."""
    if entry["kind"] == "value":
        return []
    if isinstance(leaf, ShardedTensor):
        return regions_of(leaf, leaf.flat.rank)
    return [whole(entry["shape"])]


def _dtype(entry: dict[str, Any]) -> torch.dtype:
    dtype = dtype_of(entry["dtype"])
    assert dtype is not None, "read_manifest checked every dtype"
    return dtype
