"""``fs.checkpoint.load_dcp`` and ``save_dcp``: FSDP2's and torchtitan's DCP checkpoints, both ways.

Loading reads a directory ``dcp.save`` wrote from an FSDP2 (or any) model's and
optimizer's state dicts into sharded params of any plan, world size and mesh,
and into a funcshard optimizer's state; saving writes such a directory, which
``dcp.load`` reads into an FSDP2 model and optimizer at any world size. Names
follow [Note: FSDP2 checkpoint layout] in ``fsdp_names.py``; optimizer states
map as ``fsdp_optim.py`` says; the files are read as [Note: reading DCP files]
in ``checkpoint/dcp_metadata.py`` says, written as ``checkpoint/dcp_export.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.checkpoint.dcp_export import Entry, Rows, write_dcp
from funcshard._src.checkpoint.dcp_import import Request, agreed, read_into, resolve
from funcshard._src.checkpoint.dcp_metadata import DcpIndex, read_index
from funcshard._src.checkpoint.errors import CheckpointMismatchError
from funcshard._src.comm import runtime
from funcshard._src.interop.apply import Apply
from funcshard._src.interop.fsdp_names import (
    ModelNames,
    Names,
    computed_values,
    fill_whole,
    find_prefix,
    model_names,
    split_prefix,
    unexpected,
)
from funcshard._src.interop.fsdp_optim import TorchSlots, torch_slots
from funcshard._src.interop.state_hooks import scope_load
from funcshard._src.optim.base import Optimizer
from funcshard._src.shard.sharded import ShardedTensor, map_flats

OPTIMIZER = "optimizer"  # where save_dcp puts the optimizer's entries, as torchtitan does


def load_dcp(
    path: str | os.PathLike[str],
    like: Any,
    *,
    apply: Apply | Names | None = None,
    optimizer: Optimizer | None = None,
    prefix: str | dict[str, str] | None = None,
) -> Any:
    """Loads a DCP checkpoint of an FSDP2 or torchtitan run into params sharded like ``like``; collective.

    Each rank reads only the chunks that overlap its shards, so the checkpoint's
    world size, mesh and sharding need not be ``like``'s. Nothing of ``like`` is
    modified. Entries of other components (``train_state``, ``lr_scheduler``,
    ``dataloader``, the optimizer's hyperparameters) are not read: they are
    pickles, which funcshard never unpickles.

    Args:
        path: the checkpoint directory (its ``.metadata`` and ``__<rank>_<n>.distcp``).
        like: params sharded as they should load (``fs.shard(params, plan)``, or
            ``apply.materialize(plan)``); plain tensor leaves load whole.
        apply: names the leaves: what :func:`funcshard.interop.functionalize` returned
            (the module's ``state_dict`` names, a tied weight under any of its names;
            its persistent buffers load too, into ``apply.state``, in place), a mapping
            of leaf paths to names, or ``None`` (a leaf ``blocks/0/w`` is ``blocks.0.w``).
        optimizer: also load this funcshard optimizer's state, from torch's:
            ``fs.optim.adamw`` from ``torch.optim.AdamW`` or ``Adam`` (``exp_avg``,
            ``exp_avg_sq``, ``step``), ``fs.optim.sgd`` from ``SGD``
            (``momentum_buffer``; torch keeps no step, so ``count`` is 0),
            ``fs.optim.from_torch(...)`` from its optimizer, also inside ``chain`` (what
            loads reaches torch on the next update, with or without a ``step``).
        prefix: where the model's entries are: ``""`` (``dcp.save(get_model_state_dict(m))``,
            torchtitan), ``"model."`` (``dcp.save({"model": ..., "optimizer": ...})``),
            or ``{"model": ..., "optimizer": ...}`` for both; default: found from the keys.

    Returns:
        The sharded params; with ``optimizer``, ``(params, opt_state)``.

    Raises:
        NotACheckpointError: no directory or no ``.metadata`` there.
        CorruptCheckpointError: damaged, truncated or inconsistent files.
        UnsafeCheckpointError: a file asks to run code, to read outside the checkpoint or
            through a symlink, or stores a needed tensor as a pickle.
        CheckpointMismatchError: a checkpoint of another model or optimizer (the message
            lists missing and unexpected keys, shape and dtype mismatches).
        CheckpointError: another rank failed, or the ranks read different checkpoints.
        ValueError, TypeError: ``like``, ``apply``, ``optimizer`` or ``prefix`` malformed.

    Example:
        >>> import tempfile, torch, funcshard as fs
        >>> net = torch.nn.Linear(3, 2)
        >>> params, apply = fs.interop.functionalize(net)
        >>> sp = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1})))
        >>> opt = fs.optim.adamw(lr=0.1)
        >>> ckpt = fs.checkpoint.save_dcp(f"{tempfile.mkdtemp()}/c", sp, apply=apply, opt_state=opt.init(sp))
        >>> back, state = load_dcp(ckpt, sp, apply=apply, optimizer=opt)
        >>> torch.equal(back["weight"].local, params["weight"]), int(state.count)
        (True, 0)
    """
    directory = Path(path)
    model_prefix, optimizer_prefix = split_prefix(prefix)
    if optimizer is not None and not isinstance(optimizer, Optimizer):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(
            f"optimizer must be a funcshard optimizer (fs.optim.adamw(...)), got "
            f"{type(optimizer).__name__}"
        )
    _check_leaves(like)
    names = model_names(like, apply)
    state = None if optimizer is None else optimizer.init(like)
    slots = [] if state is None else torch_slots(state)

    def body() -> tuple[str, tuple[Any, dict[str, torch.Tensor]]]:
        index = read_index(directory)
        found = model_prefix
        if found is None:
            groups = [list(n) for n in names.leaves.values() if n] + [[b] for b in names.buffers]
            groups += [[k] for s in names.scopes for k in s.keys]
            found = find_prefix(index.kinds, groups, what="the model", directory=directory)
        opt_found = optimizer_prefix
        if opt_found is None and slots:
            opt_found = _optimizer_prefix(index, names, slots)
        fresh = map_flats(lambda f: f.with_data(torch.zeros_like(f.data)), like)
        paths, leaves, treedef = tree.flatten_with_paths(fresh)
        targets = [_target(leaf) for leaf in leaves]
        under_hooks = names.hooked
        requests = [
            Request(p, tuple(found + n for n in names.leaves[p]), t)
            for p, t in zip(paths, targets)
            if p not in under_hooks
        ]
        buffers = {b: torch.empty(t.shape, dtype=t.dtype) for b, t in names.buffers.items()}
        requests += [Request(f"buffer {b}", (found + b,), t) for b, t in buffers.items()]
        scalars: list[tuple[TorchSlots, str, int]] = []
        if slots:
            assert opt_found is not None
            _check_slots(index, names, slots, opt_found)
            scalars = _optimizer_requests(names, slots, opt_found, requests)
        # the keys of each hooked scope: checked with the rest (meta targets), read whole one
        # scope at a time; see [Note: state-dict hooks] (state_hooks.py)
        hooked = [
            Request(k, (found + k,), torch.empty(m.shape, dtype=m.dtype, device="meta"))
            for scope in names.scopes
            for k, m in scope.keys.items()
        ]
        extra = unexpected(index.kinds, names, found, opt_found)
        resolved = resolve(index, requests + hooked, unexpected=extra)
        read = read_into(index, requests, resolved[: len(requests)])
        _set_scalars(directory, slots, scalars, read, requests)
        stored = dict(zip((r.label for r in hooked), resolved[len(requests) :]))
        target_of = dict(zip(paths, targets))
        for scope in names.scopes:
            saved = {k: torch.empty(m.shape, dtype=m.dtype) for k, m in scope.keys.items()}
            mine = [Request(k, (found + k,), t) for k, t in saved.items()]
            read_into(index, mine, [stored[k] for k in saved])
            values = scope_load(scope.scope, saved, scope.like)
            for name, path in scope.leaves.items():
                fill_whole(target_of[path], values[name])
            for name in scope.buffers:
                buffers[name] = values[name]
        out = tree.unflatten(treedef, [_placed(leaf, t) for leaf, t in zip(leaves, targets)])
        return index.digest, (out, buffers)

    loaded, buffers = agreed("fs.checkpoint.load_dcp", directory, body)
    for s in slots:  # loaded values reach torch on the next update (from_torch's SGD: count 0)
        for flag in s.started:
            flag.fill_(True)
    if buffers:
        assert isinstance(apply, Apply)
        if any(t.device.type == "meta" for t in names.buffers.values()):
            apply.materialize_state()
            names = model_names(like, apply)
        in_scopes = {n: t for s in names.scopes for n, t in s.buffers.items()}
        with torch.no_grad():
            for name, value in buffers.items():
                (names.buffers[name] if name in names.buffers else in_scopes[name]).copy_(value)
    return loaded if optimizer is None else (loaded, state)


def save_dcp(
    path: str | os.PathLike[str],
    sparams: Any,
    *,
    apply: Apply | Names | None = None,
    opt_state: Any = None,
) -> Path:
    """Writes ``sparams`` (and ``opt_state``) as a DCP checkpoint that FSDP2's ``dcp.load`` reads; collective.

    The model's entries are at the top level under its ``state_dict`` names (every
    name of a tied weight, one copy on disk; persistent buffers from ``apply.state``),
    the optimizer's under ``optimizer.`` as ``get_optimizer_state_dict`` names them
    (``optimizer.state.<name>.exp_avg``, ...), as torchtitan lays them out. The
    optimizer's hyperparameters (``param_groups``) are not funcshard state and are
    not written: load the ``state`` entries into a fresh torch optimizer, which keeps
    its own (docs/checkpoints.md, "Coming from FSDP2"). Every rank writes its shards in
    parallel; rank 0 commits by renaming, as :func:`funcshard.checkpoint.save` does.

    Args:
        path: the directory to create (it must not exist yet).
        sparams: sharded params (plain tensor leaves are saved once, by rank 0).
        apply: names the leaves, as in :func:`load_dcp`.
        opt_state: the state of ``fs.optim.adamw``, ``sgd`` or ``from_torch`` for
            ``sparams`` (also inside ``chain``); ``None`` saves the model only.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        FileExistsError: ``path`` exists.
        ValueError: ``opt_state`` has state torch has no name for, or is not for
            ``sparams``; a buffer on the meta device; two leaves with one name.
        DesyncError: the ranks save different trees or paths.
        CheckpointError: writing failed on some rank; nothing was committed.

    Example:
        >>> import tempfile, torch, funcshard as fs
        >>> net = torch.nn.Linear(3, 2)
        >>> params, apply = fs.interop.functionalize(net)
        >>> sp = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1})))
        >>> opt = fs.optim.sgd(lr=0.1, momentum=0.9)
        >>> ckpt = save_dcp(f"{tempfile.mkdtemp()}/c", sp, apply=apply, opt_state=opt.init(sp))
        >>> sorted(p.name for p in ckpt.iterdir())  # what dcp.load reads
        ['.metadata', '__0_0.distcp']
        >>> back, state = fs.checkpoint.load_dcp(ckpt, sp, apply=apply, optimizer=opt)
        >>> torch.equal(back["weight"].local, params["weight"])
        True
    """
    _check_leaves(sparams)
    names = model_names(sparams, apply)
    paths, leaves, _ = tree.flatten_with_paths(sparams)
    entries = [Entry(names.leaves[p], leaf) for p, leaf in zip(paths, leaves) if names.leaves[p]]
    entries += [Entry((b,), t) for b, t in names.buffers.items()]
    by_path = dict(zip(paths, leaves))
    for hooked in names.scopes:  # See [Note: state-dict hooks] (state_hooks.py)
        computed = computed_values(hooked, by_path)
        entries += [
            Entry((k,), Rows.of(computed[k], runtime.rank(), runtime.world_size()))
            for k in hooked.computed
        ]
        del computed
    for s in [] if opt_state is None else torch_slots(opt_state):
        for leaf_path, per in s.leaves().items():
            if leaf_path not in names.leaves:
                raise ValueError(
                    f"opt_state holds state for {leaf_path!r}, which sparams lacks; pass the "
                    f"optimizer state of these params (opt.init(sparams) and its updates)"
                )
            key = f"{OPTIMIZER}.state.{names.first(leaf_path)}."
            values = {**per, **s.scalars}
            entries += [Entry((key + k,), values[k], nest=OPTIMIZER) for k in sorted(values)]
    return write_dcp(path, entries, what="fs.checkpoint.save_dcp")


# -- helpers -----------------------------------------------------------------------


def _check_leaves(like: Any) -> None:
    paths, leaves, _ = tree.flatten_with_paths(like)
    for p, leaf in zip(paths, leaves):
        if not isinstance(leaf, ShardedTensor | torch.Tensor):
            raise TypeError(
                f"{p or '<root>'}: a {type(leaf).__name__}; DCP checkpoints hold the params' "
                f"tensors: pass sharded params (fs.shard(params, plan)) or tensors"
            )


def _target(leaf: ShardedTensor | torch.Tensor) -> ShardedTensor | torch.Tensor:
    return leaf if isinstance(leaf, ShardedTensor) else torch.empty(leaf.shape, dtype=leaf.dtype)


def _placed(like: Any, loaded: ShardedTensor | torch.Tensor) -> Any:
    """The loaded leaf: the filled sharded leaf, or the whole tensor on ``like``'s device."""
    if isinstance(loaded, ShardedTensor) or like.device.type == "meta":
        return loaded  # a meta leaf asks for the shape: the values come on the CPU
    return loaded.to(like.device)


def _optimizer_prefix(index: DcpIndex, names: ModelNames, slots: list[TorchSlots]) -> str:
    groups = [
        [f"state.{n}.{slot}" for n in names.optimizer(path)]
        for s in slots
        for path, per in s.leaves().items()
        for slot in per
    ]
    return find_prefix(index.kinds, groups, what="the optimizer state", directory=index.directory)


def _optimizer_requests(
    names: ModelNames, slots: list[TorchSlots], prefix: str, requests: list[Request]
) -> list[tuple[TorchSlots, str, int]]:
    """Appends a request per optimizer state tensor to ``requests`` (mutates it); returns, per 0-d
    state and leaf, the index of its request."""
    scalars: list[tuple[TorchSlots, str, int]] = []
    for s in slots:
        for leaf_path, per in s.leaves().items():
            keys = [f"{prefix}state.{n}." for n in names.optimizer(leaf_path)]
            for name, target in per.items():
                label = f"{name} of {leaf_path}"
                requests.append(Request(label, tuple(k + name for k in keys), target))
            for name in s.scalars:  # torch keeps them per parameter; funcshard once
                scalars.append((s, name, len(requests)))
                requests.append(
                    Request(f"{name} of {leaf_path}", tuple(k + name for k in keys), None)
                )
    return scalars


def _check_slots(index: DcpIndex, names: ModelNames, slots: list[TorchSlots], prefix: str) -> None:
    """The checkpoint keeps no per-parameter state the optimizer lacks (amsgrad's, another optimizer's)."""
    head = f"{prefix}state."
    held: dict[str, set[str]] = {}
    for key in index.kinds:
        if key.startswith(head) and "." in key[len(head) :]:
            name, slot = key[len(head) :].rsplit(".", 1)
            held.setdefault(name, set()).add(slot)
    for s in slots:
        known = set(s.tensors) | set(s.scalars)
        for leaf_path in s.leaves():
            extra = set().union(*(held.get(n, set()) for n in names.optimizer(leaf_path))) - known
            if extra:
                raise CheckpointMismatchError(
                    f"{index.directory}: the optimizer state of {leaf_path} holds {sorted(extra)}, "
                    f"which the given optimizer does not keep (it keeps {sorted(known)}); load it "
                    f"with the optimizer that saved it (fs.optim.from_torch(torch.optim.AdamW, "
                    f"amsgrad=True, ...) for max_exp_avg_sq)"
                )


def _set_scalars(
    directory: Path,
    slots: list[TorchSlots],
    scalars: list[tuple[TorchSlots, str, int]],
    read: list[torch.Tensor | None],
    requests: list[Request],
) -> None:
    """Every 0-d state (torch's per-parameter ``step``) into its node; mutates the new state."""
    values: dict[tuple[int, str], list[tuple[str, torch.Tensor]]] = {}
    for s, name, i in scalars:
        value = read[i]
        assert value is not None, "resolve checked the shape: 0-d"
        label = requests[i].label
        if value.dtype == torch.bool or value.is_complex():
            raise CheckpointMismatchError(
                f"{directory}: {label} is a {value.dtype}, where torch keeps a real number (a "
                f"float or an integer); the checkpoint is damaged or not torch's"
            )
        if not bool(torch.isfinite(value)):
            raise CheckpointMismatchError(
                f"{directory}: {label} is {float(value):g}, where torch keeps a finite number; "
                f"the checkpoint is damaged or its run diverged"
            )
        values.setdefault((id(s), name), []).append((label, value))
    for s in slots:
        for name, sinks in s.sinks.items():
            found = values.get((id(s), name), [])
            if not found:
                continue
            _check_one_value(directory, name, found)
            label, value = found[0]
            for sink in sinks:
                converted = value.to(sink.dtype)
                count = not sink.dtype.is_floating_point
                if float(converted) != float(value) or (count and float(value) < 0):
                    raise CheckpointMismatchError(
                        f"{directory}: {label} is {float(value):g}, which funcshard's "
                        f"optimizer cannot keep as a {sink.dtype}"
                        + (" count of updates" if count else "")
                    )
                sink.copy_(converted)


def _check_one_value(directory: Path, name: str, found: list[tuple[str, torch.Tensor]]) -> None:
    """Every parameter's ``name`` is one value; else the message names those that differ from
    the most common one."""
    tally: dict[float, int] = {}
    for _, v in found:
        tally[float(v)] = tally.get(float(v), 0) + 1
    if len(tally) == 1:
        return
    common = max(tally, key=lambda x: (tally[x], -x))  # the smaller of equally common ones
    odd = [(label, float(v)) for label, v in found if float(v) != common]
    listing = ", ".join(f"{label}: {v:g}" for label, v in odd[:6])
    more = f" and {len(odd) - 6} more" if len(odd) > 6 else ""
    raise CheckpointMismatchError(
        f"{directory}: the parameters' {name} differ: {tally[common]} of {len(found)} are "
        f"{common:g}, but {listing}{more}; funcshard's optimizer keeps one for all of them "
        f"(a parameter without a gradient in some updates lags): give them one {name} in torch "
        f"before saving"
    )
