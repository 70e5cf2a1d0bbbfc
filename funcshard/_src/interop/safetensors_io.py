"""Safetensors checkpoints read sharded: each rank reads only the slices of the leaves it keeps.

See [Note: untrusted safetensors] in ``safetensors_format.py`` for what is checked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from funcshard._src import tree
from funcshard._src.comm import runtime
from funcshard._src.interop.safetensors_format import Entry, Files, checkpoint_tensors
from funcshard._src.interop.safetensors_names import (
    Pattern,
    check_ties,
    choose,
    matches,
    opened,
)
from funcshard._src.interop.state_hooks import named_tensors, probe
from funcshard._src.plan.plan import Plan
from funcshard._src.shard.flat import pieces
from funcshard._src.shard.shard import plan_layouts
from funcshard._src.shard.sharded import FlatShard, ShardedTensor


class LeafNames(Protocol):
    """A params leaf and every dotted name its module uses for it (``Apply``'s leaves)."""

    @property
    def path(self) -> str: ...
    @property
    def names(self) -> tuple[str, ...]: ...


def load_safetensors(
    files: Files,
    plan: Plan,
    /,
    *,
    names: Mapping[str, str | Sequence[str]] | None = None,
    ignore_unexpected: Sequence[Pattern] = (),
    device: torch.device | str | None = None,
) -> Any:
    """This rank's shards of safetensors files: what ``fs.shard(full, plan)`` returns, read in slices.

    Each rank reads only the slices of every leaf that it keeps (``get_slice``), never
    a whole leaf it does not keep whole, and casts them to the plan's dtypes. Needs no
    collective. See [Note: untrusted safetensors] in ``interop/safetensors_format.py`` for what is checked.

    Args:
        files: a ``.safetensors`` file, a list of them, an index
            (``model.safetensors.index.json``), or a directory holding
            ``model.safetensors`` or that index (Hugging Face's layout).
        plan: the plan of the params; its leaves give the shapes and stored dtypes.
        names: leaf path -> its tensor name in the files, or names to try in order
            (tied weights: a file holds one of them); default: the path with ``.``
            for ``/``.
        ignore_unexpected: globs over dotted names (``fnmatch``, ``*`` crosses dots)
            or ``re.Pattern`` s (searched) of tensors in the files to skip.
        device: where the shards go (default: ``fs.device()``, the GPU of this rank under NCCL, else the CPU).

    Returns:
        A pytree of :class:`funcshard.ShardedTensor` with the plan's structure.

    Raises:
        ValueError: a leaf none of whose names is in the files, a tensor that maps to
            no leaf, a shape mismatch or a dtype that does not cast, a malformed or
            unsafe file or index, or a plan whose mesh is not the world size.
        ImportError: the ``safetensors`` package is missing.

    Example:
        >>> import tempfile, torch, funcshard as fs
        >>> from safetensors.torch import save_file
        >>> path = f"{tempfile.mkdtemp()}/w.safetensors"
        >>> save_file({"layer.w": torch.arange(6.0).reshape(3, 2)}, path)
        >>> params = {"layer": {"w": torch.empty(3, 2, device="meta")}}
        >>> sparams = load_safetensors(path, fs.plan(params, fs.Mesh({"fsdp": 1})))
        >>> sparams["layer"]["w"].local
        tensor([[0., 1.],
                [2., 3.],
                [4., 5.]])
    """
    return load_safetensors_for_rank(
        files,
        plan,
        _rank_of(plan),
        names=names,
        ignore_unexpected=ignore_unexpected,
        device=device,
    )


def load_safetensors_for_rank(
    files: Files,
    plan: Plan,
    rank: int,
    /,
    *,
    names: Mapping[str, str | Sequence[str]] | None = None,
    ignore_unexpected: Sequence[Pattern] = (),
    device: torch.device | str | None = None,
) -> Any:
    """:func:`load_safetensors` for an explicit ``rank`` of ``plan.mesh``, with no process group.

    What ``shard_for_rank`` is to :func:`funcshard.shard`: for tests that
    look at every rank from one process, and for tools that write per-rank files.
    """
    by_path = {leaf.path: leaf for leaf in plan.leaves}
    unknown = sorted(set(names or {}) - set(by_path))
    if unknown:
        raise ValueError(
            f"names maps {unknown[:5]}, which are not leaf paths of the plan; name leaves by "
            f"their path (fs.tree.leaf_paths(params))"
        )
    wanted = {
        leaf.path: (_names_of(leaf.path, names), leaf.shape, leaf.dtype) for leaf in plan.leaves
    }
    entries = checkpoint_tensors(files)
    hint = "pass names={path: [its tensor name in the files]} for leaves named otherwise"
    keys = choose(entries, wanted, ignore=ignore_unexpected, hint=hint)
    check_ties(entries, {label: names for label, (names, _, _) in wanted.items()})
    return _read_shards(entries, plan, keys, rank, _target(device))


def load_pretrained(
    path: Files,
    plan: Plan,
    /,
    *,
    module: nn.Module,
    treedef: tree.TreeDef,
    leaves: Sequence[LeafNames],
    state: Mapping[str, torch.Tensor],
    ignore_unexpected: Sequence[Pattern] = (),
    device: torch.device | str | None = None,
) -> Any:
    """``Apply.load_pretrained``: a module's sharded params from its checkpoint; mutates ``state``.

    A leaf may be read under any of its module's names (a tied weight is written
    under one). Persistent buffers in the checkpoint are copied into ``state`` (that
    is, ``apply.state``) in place; a missing one is an error unless it matches the
    module's ``_keys_to_ignore_on_load_missing``; non-persistent buffers in the
    checkpoint (a rotary ``inv_freq`` of old checkpoints) are skipped. Other tensors
    that name nothing of the module are an error unless they match
    ``ignore_unexpected`` or the module's ``_keys_to_ignore_on_load_unexpected``
    (regexes, as Hugging Face searches them). As in ``from_pretrained``, a
    checkpoint of the base model loads into the model with a head, and one of a
    model with a head into its base model, across ``base_model_prefix``
    (``model.`` for a Llama). Everything is checked before anything is read.
    Needs no collective.

    Args:
        path: as ``files`` of :func:`load_safetensors` (a ``save_pretrained`` directory).
        plan: the plan of the params ``functionalize`` returned for ``module``.
        module: the module; its ``state_dict`` tells persistent buffers.
        treedef: the params' tree structure, which ``plan`` must have.
        leaves: every leaf's path and dotted names.
        state: the buffers by dotted name (``apply.state``'s tensors), written in place.
        ignore_unexpected: as for :func:`load_safetensors`.
        device: where the shards go (default: ``fs.device()``, the GPU of this rank under NCCL, else the CPU).

    Returns:
        This rank's sharded params, as :func:`load_safetensors` returns them.

    Raises:
        ValueError: as :func:`load_safetensors`, or a plan of other params.

    Example:
        >>> import tempfile, torch, funcshard as fs
        >>> from safetensors.torch import save_file
        >>> net = torch.nn.BatchNorm1d(2)
        >>> root = tempfile.mkdtemp()
        >>> save_file({k: torch.full_like(v, 3) for k, v in net.state_dict().items()},
        ...           f"{root}/model.safetensors")
        >>> params, apply = fs.interop.functionalize(net)
        >>> sparams = apply.load_pretrained(root, fs.plan(params, fs.Mesh({"fsdp": 1})))
        >>> sparams["weight"].local, apply.state["running_mean"]
        (tensor([3., 3.]), tensor([3., 3.]))
    """
    if plan.treedef != treedef:
        raise ValueError(
            f"load_pretrained: the plan is not of {type(module).__name__}'s params; plan the "
            f"params functionalize returned: fs.plan(params, mesh, units=apply.units, "
            f"frozen=apply.frozen)"
        )
    rank = _rank_of(plan)
    persistent = set(
        probe(module, named_tensors(module)).keys
    )  # See [Note: state-dict hooks] in ``interop/state_hooks.py``
    stored = checkpoint_tensors(path)
    entries, stored_as = _prefixed(stored, module, persistent=persistent)
    by_path = {leaf.path: tuple(leaf.names) for leaf in leaves}
    wanted = {lp.path: (by_path[lp.path], lp.shape, lp.dtype) for lp in plan.leaves}
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    tensors = {id(t): t for t in state.values()}
    skip_missing = _regexes(module, "_keys_to_ignore_on_load_missing")
    buffers: dict[str, int] = {}
    for ident, group in groups.items():
        if not persistent.intersection(group):
            continue
        if not any(n in entries for n in group) and matches(group[0], skip_missing):
            continue  # Hugging Face keeps the module's own value
        label = f"buffer {group[0]}"
        buffers[label] = ident
        t = tensors[ident]
        wanted[label] = (tuple(group), tuple(t.shape), t.dtype)
    transient = {n for g in groups.values() if not persistent.intersection(g) for n in g}
    ignore = [*ignore_unexpected, *_regexes(module, "_keys_to_ignore_on_load_unexpected")]
    hint = f"check that the checkpoint is of {type(module).__name__} and its config"
    keys = choose(entries, wanted, ignore=ignore, known=transient, hint=hint)
    check_ties(
        stored,
        {
            label: tuple(stored_as.get(n, n) for n in names if n in entries)
            for label, (names, _, _) in wanted.items()
        },
    )
    keys = {label: stored_as.get(key, key) for label, key in keys.items()}
    shards = _read_shards(stored, plan, keys, rank, _target(device))
    with torch.no_grad(), opened() as handle:
        for label, ident in buffers.items():
            key = keys[label]
            tensors[ident].copy_(handle(stored[key].file).get_tensor(key))
    return shards


def _prefixed(
    entries: Mapping[str, Entry], module: nn.Module, /, *, persistent: set[str]
) -> tuple[dict[str, Entry], dict[str, str]]:
    """``entries`` renamed as Hugging Face does across ``base_model_prefix``, and the stored names.

    A checkpoint of the base model (``LlamaModel``: ``layers.0....``) loaded into a
    model with a head (``LlamaForCausalLM``: ``model.layers.0....``) gets the prefix;
    one of a model with a head loaded into its base model loses it (the head's
    tensors are then unexpected). Other checkpoints are left as they are.
    """
    prefix = getattr(module, "base_model_prefix", "")
    if not isinstance(prefix, str) or not prefix:
        return dict(entries), {}
    dotted = prefix + "."
    ours = any(n.startswith(dotted) for n in persistent)
    theirs = any(k.startswith(dotted) for k in entries)
    if ours and not theirs and isinstance(getattr(module, prefix, None), nn.Module):
        renamed = {dotted + k: k for k in entries}
    elif theirs and not ours:
        renamed = {k.removeprefix(dotted): k for k in entries}
        if len(renamed) < len(entries):  # a name with and one without the prefix collide
            return dict(entries), {}
    else:
        return dict(entries), {}
    return {new: entries[old] for new, old in renamed.items()}, renamed


def _read_shards(
    entries: Mapping[str, Entry],
    plan: Plan,
    keys: Mapping[str, str],
    rank: int,
    device: torch.device,
) -> Any:
    """This rank's flat buffers, each leaf's slice read into its padded chunk (see ``pack_local``)."""
    out: list[Any] = [None] * len(plan.leaves)
    for layout in plan_layouts(plan):
        # the files are opened for one flat buffer at a time: the pages of a mapped file
        # that a read touched count in this process's memory until it is closed
        with opened() as handle:
            flat = torch.zeros(layout.numel, dtype=layout.dtype, device=device)  # (numel,)
            for slot in layout.slots:
                for index, view in pieces(flat, slot, rank):  # a box, or a flat range's boxes
                    if view.numel() > 0:
                        key = keys[slot.path]
                        view.copy_(handle(entries[key].file).get_slice(key)[index])
        shard = FlatShard(layout, flat, rank)
        for slot in layout.slots:
            out[slot.index] = ShardedTensor(shard, slot)
    return tree.unflatten(plan.treedef, out)


def _regexes(module: nn.Module, attribute: str) -> list[re.Pattern[str]]:
    """A Hugging Face model's key patterns (``_keys_to_ignore_on_load_*``), compiled."""
    found = getattr(module, attribute, None)
    return [re.compile(p) for p in found or () if isinstance(p, str)]


def _names_of(path: str, names: Mapping[str, str | Sequence[str]] | None) -> tuple[str, ...]:
    given = (names or {}).get(path)
    if given is None:
        return (path.replace("/", "."),)
    return (given,) if isinstance(given, str) else tuple(given)


def _rank_of(plan: Plan) -> int:
    world = runtime.world_size()
    if plan.mesh.size != world:
        raise ValueError(
            f"{plan.mesh!r} has {plan.mesh.size} ranks but the world size is {world}; plan for "
            f"a mesh of the world size (or read one rank's shards with load_safetensors_for_rank)"
        )
    return runtime.rank()


def _target(device: torch.device | str | None) -> torch.device:
    try:
        # by default where shards go: [Note: devices and backends] in comm/runtime.py
        return runtime.default_device() if device is None else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device ({e})") from None
