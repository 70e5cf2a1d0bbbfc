"""FSDP2's names for a funcshard tree, and where a DCP checkpoint keeps them.

[Note: FSDP2 checkpoint layout]
``get_model_state_dict(model)`` names every parameter and persistent buffer by
its module path (``layers.0.attention.wq.weight``), a tied parameter under each
of its names. ``get_optimizer_state_dict`` names a parameter's optimizer state
``state.<name>.<slot>`` (``exp_avg``, ``exp_avg_sq``, ``step``,
``momentum_buffer``), with the parameter's first name (``named_parameters``'),
and hyperparameters ``param_groups.<name>.<option>`` (flattened) or
``param_groups.<i>.<option>``. A checkpoint nests these under a *prefix*:
none for ``dcp.save(get_model_state_dict(model))`` and torchtitan's model;
``model.`` and ``optimizer.`` for ``dcp.save({"model": ..., "optimizer": ...})``
(torchtitan's optimizer, and its model in earlier releases); ``app.model.`` in
DCP's tutorial. Beside them sit entries funcshard does not read
(``train_state.``, ``lr_scheduler.``, ``dataloader.``, hyperparameters).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.checkpoint.chunks import local_pieces
from funcshard._src.checkpoint.errors import CheckpointError
from funcshard._src.interop.apply import Apply
from funcshard._src.interop.state_hooks import Scope, named_tensors, scope_state
from funcshard._src.shard.shard import unshard
from funcshard._src.shard.sharded import ShardedTensor

Names = Mapping[str, str | Sequence[str]]  # leaf path -> its state-dict name(s)


@dataclass(frozen=True)
class HookedScope:
    """A submodule whose state-dict hook computes keys: what it needs and gives ([Note: state-dict hooks] in ``interop/state_hooks.py``)."""

    scope: Scope
    leaves: Mapping[str, str]  # dotted name under it -> leaf path (gathered to run its hooks)
    buffers: Mapping[str, torch.Tensor]  # dotted name under it -> apply.state's tensor
    like: Mapping[str, torch.Tensor]  # dotted name -> a tensor of its shape and dtype
    keys: Mapping[str, torch.Tensor]  # every key it gives -> a meta tensor of its shape

    @property
    def computed(self) -> tuple[str, ...]:
        """The keys its hooks compute, in the module's order."""
        return tuple(k for k in self.keys if k in self.scope.computed)


@dataclass(frozen=True)
class ModelNames:
    """The state-dict names of a params tree: per leaf path (first: the optimizer's), and buffers.

    A leaf a state-dict hook consumes (torchtitan's fused ``wqkv``) may have no name
    of its own: its scope's computed keys stand for it (``scopes``).
    """

    leaves: Mapping[str, tuple[str, ...]]
    buffers: Mapping[str, torch.Tensor]  # persistent buffer name -> apply.state's tensor
    scopes: tuple[HookedScope, ...] = ()
    parameters: Mapping[str, str] = field(default_factory=dict)  # leaf path -> its dotted name

    def first(self, path: str, /) -> str:
        """The name ``get_optimizer_state_dict`` uses for leaf ``path``."""
        return self.optimizer(path)[0]

    def optimizer(self, path: str, /) -> tuple[str, ...]:
        """The names torch's optimizer state may use for leaf ``path``: its keys, else its name."""
        return self.leaves[path] or (self.parameters[path],)

    @property
    def hooked(self) -> frozenset[str]:
        """Leaf paths under a scope: saved and loaded through its hooks."""
        return frozenset(p for s in self.scopes for p in s.leaves.values())

    def all_keys(self) -> list[str]:
        """Every key of the module's state dict these names cover."""
        keys = [n for group in self.leaves.values() for n in group] + list(self.buffers)
        return keys + [k for s in self.scopes for k in s.keys if k not in keys]


def model_names(like: Any, apply: Apply | Names | None, /) -> ModelNames:
    """Every leaf's state-dict names: through ``apply`` (the module's own), a mapping, or the paths.

    Without ``apply`` a leaf's name is its path with ``.`` for ``/``
    (``blocks/0/w`` is ``blocks.0.w``); a mapping names the leaves it lists.
    Through ``apply`` the names come from the module's ``state_dict`` run on the
    meta device, its hooks included ([Note: state-dict hooks] in ``state_hooks.py``).

    Raises:
        ValueError: ``like`` is not ``apply``'s params tree, the mapping names paths
            ``like`` lacks or gives a name that is not a string, or two leaves share a name.
        TypeError: ``apply`` is neither an ``Apply`` nor a mapping.

    Example:
        >>> import torch, funcshard as fs
        >>> net = torch.nn.Linear(2, 2)
        >>> params, apply = fs.interop.functionalize(net)
        >>> dict(model_names(params, apply).leaves)
        {'bias': ('bias',), 'weight': ('weight',)}
        >>> dict(model_names({"w": torch.ones(1)}, {"w": "lm_head.weight"}).leaves)
        {'w': ('lm_head.weight',)}
    """
    paths, _, treedef = tree.flatten_with_paths(like)
    buffers: dict[str, torch.Tensor] = {}
    scopes: tuple[HookedScope, ...] = ()
    parameters = {p: p.replace("/", ".") for p in paths}
    if isinstance(apply, Apply):
        if treedef != apply._treedef:  # pyright: ignore[reportPrivateUsage]
            raise ValueError(
                f"the params do not have the structure functionalize returned for "
                f"{type(apply.module).__name__} (got {treedef}); pass that tree or its fs.shard"
            )
        names, buffers, scopes, parameters = _apply_names(apply, paths)
    elif isinstance(apply, Mapping):
        names = _mapped(paths, apply)
    elif apply is None:
        names = {p: (p.replace("/", "."),) for p in paths}
    else:
        raise TypeError(
            f"apply must be what fs.interop.functionalize returned, a mapping of leaf paths to "
            f"state-dict names, or None; got a {type(apply).__name__}"
        )
    hooked = {p for s in scopes for p in s.leaves.values()}
    owner: dict[str, str] = {}
    for path, keys in names.items():
        if not keys and path not in hooked:
            raise ValueError(f"{path or '<root>'}: the module's state_dict has no name for it")
        for key in keys:
            if key in owner:
                raise ValueError(
                    f"{path or '<root>'} and {owner[key] or '<root>'} are both named {key!r}; "
                    f"give every leaf its own state-dict name"
                )
            owner[key] = path
    return ModelNames(names, buffers, scopes, parameters)


def _apply_names(
    apply: Apply, paths: list[str]
) -> tuple[
    dict[str, tuple[str, ...]], dict[str, torch.Tensor], tuple[HookedScope, ...], dict[str, str]
]:
    """Names through the module's state dict on the meta device ([Note: state-dict hooks] in ``interop/state_hooks.py``)."""
    layout = apply.state_layout()
    leaves = apply._leaves  # pyright: ignore[reportPrivateUsage]
    state = apply._state.tensors  # pyright: ignore[reportPrivateUsage]
    path_of = {name: leaf.path for leaf in leaves for name in leaf.names}
    like = named_tensors(apply.module)
    in_scope = {n for scope in layout.scopes for n in scope.names}
    found: dict[str, list[str]] = {p: [] for p in paths}
    buffers: dict[str, torch.Tensor] = {}
    for key, name in layout.of_key.items():
        if name in path_of:
            found[path_of[name]].append(key)
        elif name in state and name not in in_scope:
            buffers[key] = state[name]
    scopes = tuple(
        HookedScope(
            scope,
            {n: path_of[n] for n in scope.names if n in path_of},
            {n: state[n] for n in scope.names if n not in path_of and n in state},
            {n: like[n] for n in scope.names},
            {final: layout.metas[final] for _, final in scope.keys},
        )
        for scope in layout.scopes
    )
    parameters = {leaf.path: leaf.names[0] for leaf in leaves}
    return {p: tuple(found[p]) for p in paths}, buffers, scopes, parameters


def computed_values(hooked: HookedScope, by_path: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The keys ``hooked``'s state-dict hooks compute, from its leaves gathered; collective.

    Only the scope's leaves are gathered (one unit's flat buffer, where they are a
    unit's), and freed when the caller drops the result's source.
    """
    mine = {path: by_path[path] for path in sorted(set(hooked.leaves.values()))}
    full = unshard(mine)
    values = {name: full[path] for name, path in hooked.leaves.items()}
    values.update(hooked.buffers)
    return scope_state(hooked.scope, values)


def fill_whole(target: ShardedTensor | torch.Tensor, value: torch.Tensor) -> None:
    """Copies this rank's part of the whole ``value`` into ``target``; mutates the target."""
    with torch.no_grad():
        if isinstance(target, ShardedTensor):
            for region, view in local_pieces(target):
                view.copy_(value[tuple(slice(a, b) for a, b in region)].reshape(view.shape))
        else:
            target.copy_(value)


def find_prefix(
    keys: Collection[str], groups: Sequence[Sequence[str]], /, *, what: str, directory: Path
) -> str:
    """The prefix under which the checkpoint's ``keys`` hold the most ``groups``.

    Each group lists the names one item may have (a leaf's tied names); the prefix
    is ``""`` or ends with ``.``. With none found: ``""`` (the loader then lists what
    is missing).

    Raises:
        CheckpointError: two prefixes hold equally many (the message lists them).

    Example:
        >>> find_prefix({"model.w", "model.b", "step"}, [["w"], ["b"]], what="the model", directory=Path("c"))
        'model.'
    """
    if not groups:
        return ""
    candidates = {
        key[: len(key) - len(name)]
        for name in groups[0]
        for key in keys
        if key.endswith(name) and (len(key) == len(name) or key[-len(name) - 1] == ".")
    }
    counts = {p: sum(any(p + n in keys for n in g) for g in groups) for p in candidates}
    if not counts:
        return ""
    best = max(counts.values())
    winners = sorted(p for p, n in counts.items() if n == best)
    if len(winners) > 1:
        listing = ", ".join(repr(p) for p in winners)
        raise CheckpointError(
            f"{directory}: {what} is under several prefixes ({listing}); say which with "
            f"prefix=..., e.g. prefix={winners[0]!r}"
        )
    return winners[0]


def split_prefix(prefix: object, /) -> tuple[str | None, str | None]:
    """``(model, optimizer)`` prefixes from ``load_dcp``'s ``prefix`` (``None``: find it).

    Raises:
        ValueError: anything but ``None``, a string, or a mapping of ``"model"`` and
            ``"optimizer"`` to strings.

    Example:
        >>> split_prefix("model."), split_prefix({"optimizer": "optim."})
        (('model.', None), (None, 'optim.'))
    """
    if prefix is None or isinstance(prefix, str):
        return prefix, None
    if isinstance(prefix, Mapping):
        extra = sorted(map(str, set(prefix) - {"model", "optimizer"}))  # pyright: ignore[reportUnknownArgumentType]
        values = [prefix.get(k) for k in ("model", "optimizer")]  # pyright: ignore[reportUnknownMemberType]
        if not extra and all(v is None or isinstance(v, str) for v in values):
            return values[0], values[1]  # pyright: ignore[reportReturnType]
    raise ValueError(
        f"prefix must be the model's key prefix (a string such as 'model.' or ''), or "
        f"{{'model': ..., 'optimizer': ...}}; got {prefix!r}"
    )


def unexpected(
    keys: Collection[str], names: ModelNames, model: str, optimizer: str | None, /
) -> list[str]:
    """Keys of the model's entries that name nothing of the model (a larger model's layers).

    Under a non-empty prefix every key is the model's. At the top level, where
    other components' entries sit beside it (``train_state.step``), a key is the
    model's if it starts with one of the model's top-level names, or with an index
    where the model's top level is a sequence (``nn.Sequential``). The optimizer's
    entries never count.
    """
    all_names = names.all_keys()
    known = {model + n for n in all_names}
    tops = {n.split(".")[0] for n in all_names}
    indexed = any(top.isdigit() for top in tops)
    others = () if optimizer is None else (optimizer + "state.", optimizer + "param_groups.")

    def models(key: str) -> bool:
        top = key[len(model) :].split(".")[0]
        return bool(model) or top in tops or (indexed and top.isdigit())

    return sorted(
        k
        for k in keys
        if k.startswith(model) and k not in known and not k.startswith(others) and models(k)
    )


def _mapped(paths: list[str], given: Names) -> dict[str, tuple[str, ...]]:
    unknown = sorted(map(str, set(given) - set(paths)))
    if unknown:
        raise ValueError(
            f"the names map {unknown[:5]}, which are not leaf paths of the params (they have "
            f"{paths[:5]}...); key the mapping by leaf path"
        )
    out: dict[str, tuple[str, ...]] = {}
    for path in paths:
        value = given.get(path, path.replace("/", "."))
        keys = (value,) if isinstance(value, str) else tuple(value)
        if not keys or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"{path}: named {value!r}; give a state-dict name (or names) as str")
        out[path] = keys
    return out
