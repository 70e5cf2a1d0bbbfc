"""A module's own initialization, one module at a time, keeping only this rank's shards.

[Note: materializing a module]
A module built on the meta device has shapes and dtypes but no values.
:func:`materialize_module` gives it values the way the module itself would,
without ever holding more than one submodule's tensors: for each unit in plan
order, for each submodule that owns tensors of the unit (``recurse=False``), a
shallow copy of the submodule gets fresh empty tensors on the target device,
filled with NaN; the module's own initialization runs on that copy (a Hugging
Face model's ``_init_weights(submodule)``, else the submodule's
``reset_parameters()``); this rank's slices of every owned leaf are copied into
the unit's flat buffers, and the copy is dropped. The generators it draws from (the
CPU's, and the target GPU's) are seeded from ``(seed, submodule name)`` under
``torch.random.fork_rng``, so the values do not depend on the world size, the mesh,
the strategy or the unit grouping, and the caller's RNG state is untouched (no other
GPU's generator is seeded, nor a seed queued for GPUs not yet started). A tensor still
NaN afterwards was not set by the module's initialization (a parameter filled in
``__init__`` only): an error names it. Buffers are replicated: every rank builds all of them the same way.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from funcshard._src import tree
from funcshard._src.comm import groups
from funcshard._src.interop.placeholders import origin
from funcshard._src.plan.plan import Plan
from funcshard._src.shard.flat import pieces
from funcshard._src.shard.shard import plan_layouts
from funcshard._src.shard.sharded import FlatShard, ShardedTensor

Init = Callable[[nn.Module], None]


def materialize_module(
    module: nn.Module,
    plan: Plan,
    names_by_path: Mapping[str, tuple[str, ...]],
    buffer_names: Sequence[tuple[str, ...]],
    *,
    seed: int,
    device: torch.device,
    rank: int | None = None,
) -> tuple[Any, list[torch.Tensor]]:
    """This rank's sharded params and every buffer, from the module's own initialization.

    See [Note: materializing a module]. ``names_by_path`` gives the dotted names
    of each leaf of the params (the first is the one initialized); ``buffer_names``
    those of each buffer.

    Returns:
        ``(sharded params with the plan's structure, buffers in the order given)``.

    Raises:
        ValueError: the plan is for other params, or the module's initialization
            left a tensor unset; the message names it and how to give it a value.
    """
    leaf_names = _check_plan(module, plan, names_by_path)
    rank = groups.bind(plan.mesh).rank if rank is None else rank
    owners = _owners([names[0] for names in leaf_names], [names[0] for names in buffer_names])
    layouts = plan_layouts(plan)
    slots = {slot.index: (layout, slot) for layout in layouts for slot in layout.slots}
    flats = {
        layout: torch.zeros(layout.numel, dtype=layout.dtype, device=device) for layout in layouts
    }
    leaf_of = {names[0]: i for i, names in enumerate(leaf_names)}
    buffer_of = {names[0]: i for i, names in enumerate(buffer_names)}
    buffers: list[torch.Tensor | None] = [None] * len(buffer_names)
    init = _initializer(module)
    for owner, names in _in_unit_order(owners, plan, leaf_of):
        values = _initialize(module, owner, init, seed=seed, device=device)
        for name in names:
            local = name.rsplit(".", 1)[-1]
            value = _checked(module, owner, name, values[local])
            if name in leaf_of:
                layout, slot = slots[leaf_of[name]]
                for index, view in pieces(flats[layout], slot, rank):
                    view.copy_(value[index])
            else:
                buffers[buffer_of[name]] = value
        del values
    out: list[Any] = [None] * len(plan.leaves)
    for layout in layouts:
        flat = FlatShard(layout, flats[layout], rank)
        for slot in layout.slots:
            out[slot.index] = ShardedTensor(flat, slot)
    assert all(b is not None for b in buffers)
    return tree.unflatten(plan.treedef, out), [b for b in buffers if b is not None]


def materialize_buffers(
    module: nn.Module, buffer_names: Sequence[tuple[str, ...]], *, device: torch.device
) -> list[torch.Tensor]:
    """Every buffer (by its names, first initialized) from the module's own initialization.

    For params made another way (``fs.materialize``, ``load_pretrained``): the
    buffers the module computes (rotary frequencies, position ids) get their
    values as :func:`materialize_module` gives them; those with values keep them.

    Raises:
        ValueError: the module's initialization left a buffer unset.
    """
    wanted = [names[0] for names in buffer_names]
    init = _initializer(module)
    found: dict[str, torch.Tensor] = {}
    for owner, names in _owners([], wanted).items():
        values = _initialize(module, owner, init, seed=0, device=device)
        for name in names:
            found[name] = _checked(module, owner, name, values[name.rsplit(".", 1)[-1]])
    return [found[name] for name in wanted]


def _checked(module: nn.Module, owner: str, name: str, value: torch.Tensor) -> torch.Tensor:
    if unset(value):
        kind = type(module.get_submodule(owner)).__name__ if owner else type(module).__name__
        raise ValueError(
            f"{name}: the module's initialization did not set this tensor ({kind} has no "
            f"reset_parameters, or sets it in __init__ only), so it has no value on the meta "
            f"device. Give the module a reset_parameters() (or Hugging Face _init_weights) "
            f"that sets it, or build the params with fs.materialize"
        )
    return value


def derived_seed(seed: int, name: str, /) -> int:
    """The RNG seed of the submodule ``name`` under ``seed``: 63 bits of SHA-256.

    Example:
        >>> derived_seed(0, "model.layers.0") == derived_seed(0, "model.layers.0")
        True
    """
    digest = hashlib.sha256(f"funcshard-module-init:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _owners(leaves: Sequence[str], buffers: Sequence[str]) -> dict[str, list[str]]:
    """Tensor names grouped by the submodule that owns them directly, in first-seen order."""
    out: dict[str, list[str]] = {}
    for name in [*leaves, *buffers]:
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        out.setdefault(owner, []).append(name)
    return out


def _in_unit_order(
    owners: dict[str, list[str]], plan: Plan, leaf_of: dict[str, int]
) -> Iterator[tuple[str, list[str]]]:
    """Owners sorted by the first unit (plan order) of their leaves; buffer-only owners last."""
    unit_rank = {unit.name: i for i, unit in enumerate(plan.units)}

    def key(item: tuple[str, list[str]]) -> int:
        ranks = [unit_rank[plan.leaves[leaf_of[n]].unit] for n in item[1] if n in leaf_of]
        return min(ranks, default=len(unit_rank))

    yield from sorted(owners.items(), key=key)


def _initializer(module: nn.Module) -> Callable[[str, nn.Module], None]:
    """How ``module`` initializes one of its submodules (by dotted name), without recursing.

    A Hugging Face model initializes with the ``_init_weights`` of the nearest
    enclosing pretrained model; any other module, or one that ``_init_weights``
    leaves unset (an adapter added to the model), with its ``reset_parameters``.
    """

    def init(name: str, sub: nn.Module) -> None:
        parts = name.split(".") if name else []
        for k in range(len(parts), -1, -1):
            holder = module.get_submodule(".".join(parts[:k]))
            hf_init = getattr(holder, "_init_weights", None)
            if callable(hf_init) and hasattr(holder, "config"):
                hf_init(sub)
                break
        else:
            holder = None
        reset = getattr(sub, "reset_parameters", None)
        own = [t for t in [*sub._parameters.values(), *sub._buffers.values()] if t is not None]
        if callable(reset) and (holder is None or any(unset(t) for t in own)):
            reset()  # a module Hugging Face's init does not know (an adapter) initializes itself

    return init


def _initialize(
    module: nn.Module,
    owner: str,
    init: Callable[[str, nn.Module], None],
    *,
    seed: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The direct tensors of submodule ``owner`` after its initialization, on ``device``.

    Runs on a shallow copy whose own parameters and buffers are new NaN-filled
    tensors; ``module`` is not changed.
    """
    original = module.get_submodule(owner)
    kept: dict[str, torch.Tensor] = {}  # tensors with values keep them; meta ones are initialized
    for k, v in [*original._parameters.items(), *original._buffers.items()]:
        if v is None or v.device.type == "meta":
            continue
        value = origin(v)  # a functionalized module's parameter: the params leaf
        if value is None:
            raise ValueError(
                f"{owner + '.' if owner else ''}{k}: this parameter had a value when the module "
                f"was functionalized, and the params functionalize returned no longer hold it; "
                f"keep those params until apply.materialize, or shard them (fs.shard) instead"
            )
        kept[k] = value.detach().to(device, copy=True)
    sub = copy.copy(original)
    sub._parameters = {
        k: None if v is None else nn.Parameter(_nan_like(v, device), requires_grad=v.requires_grad)
        for k, v in original._parameters.items()
    }
    sub._buffers = {
        k: None if v is None else _nan_like(v, device) for k, v in original._buffers.items()
    }
    sub.__dict__["_modules"] = dict(original._modules)  # shared children, never initialized here
    with _seeded(derived_seed(seed, owner), device), torch.no_grad():
        init(owner, sub)
    values = {k: v.detach() for k, v in sub._parameters.items() if v is not None}
    values.update({k: v for k, v in sub._buffers.items() if v is not None})
    values.update(kept)
    return values


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device, /) -> Iterator[None]:
    """The CPU's generator and ``device``'s seeded with ``seed`` inside, as they were after; mutates them.

    Only those two: ``torch.manual_seed`` would seed every GPU's generator too (queued until
    CUDA starts, where it has not), which the caller's state would keep.
    """
    index = None
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
    with torch.random.fork_rng(devices=[] if index is None else [index]):
        torch.random.default_generator.manual_seed(seed)
        if index is not None:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def unset(t: torch.Tensor, /) -> bool:
    """Whether ``t`` still holds the fill of :func:`_nan_like` somewhere (NaN, or the lowest integer)."""
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return False  # no spare value to mark with
    return bool((t == torch.iinfo(t.dtype).min).any())


def _nan_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialized-looking tensor like ``t``: NaN, or the lowest integer of its dtype."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    if out.is_floating_point() or out.is_complex():
        out.fill_(float("nan"))
    elif out.dtype == torch.bool:
        out.zero_()
    else:
        out.fill_(torch.iinfo(out.dtype).min)
    return out


def _check_plan(
    module: nn.Module, plan: Plan, names_by_path: Mapping[str, tuple[str, ...]]
) -> list[tuple[str, ...]]:
    """The names of each leaf in the plan's order, if ``plan`` is for these params (shapes, dtypes)."""
    planned = [leaf.path for leaf in plan.leaves]
    if sorted(planned) != sorted(names_by_path):
        missing = sorted(set(names_by_path) - set(planned))[:5]
        extra = sorted(set(planned) - set(names_by_path))[:5]
        raise ValueError(
            f"apply.materialize: the plan is not for this module's params (missing {missing}, "
            f"unexpected {extra}); plan the params functionalize returned: fs.plan(params, mesh, "
            f"units=apply.units, frozen=apply.frozen)"
        )
    out: list[tuple[str, ...]] = []
    for leaf in plan.leaves:
        names = names_by_path[leaf.path]
        tensor = module.get_parameter(names[0])
        if tuple(tensor.shape) != leaf.shape or tensor.dtype != leaf.dtype:
            raise ValueError(
                f"apply.materialize: {leaf.path} is {tuple(tensor.shape)} {tensor.dtype} in the "
                f"module but {leaf.shape} {leaf.dtype} in the plan; plan the params "
                f"functionalize returned"
            )
        out.append(names)
    return out


__all__ = ["derived_seed", "materialize_buffers", "materialize_module", "unset"]
