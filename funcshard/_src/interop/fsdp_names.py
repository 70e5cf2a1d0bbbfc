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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.checkpoint.errors import CheckpointError
from funcshard._src.interop.apply import Apply

Names = Mapping[str, str | Sequence[str]]  # leaf path -> its state-dict name(s)


@dataclass(frozen=True)
class ModelNames:
    """The state-dict names of a params tree: per leaf path (first: the optimizer's), and buffers."""

    leaves: Mapping[str, tuple[str, ...]]
    buffers: Mapping[str, torch.Tensor]  # persistent buffer name -> apply.state's tensor

    def first(self, path: str, /) -> str:
        """The name ``get_optimizer_state_dict`` uses for leaf ``path``."""
        return self.leaves[path][0]


def model_names(like: Any, apply: Apply | Names | None, /) -> ModelNames:
    """Every leaf's state-dict names: through ``apply`` (the module's own), a mapping, or the paths.

    Without ``apply`` a leaf's name is its path with ``.`` for ``/``
    (``blocks/0/w`` is ``blocks.0.w``); a mapping names the leaves it lists.

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
    paths, leaves, treedef = tree.flatten_with_paths(like)
    buffers: dict[str, torch.Tensor] = {}
    if isinstance(apply, Apply):
        markers = [torch.empty(0) for _ in leaves]  # identity tells which key is which leaf
        of_marker = {id(m): p for p, m in zip(paths, markers)}
        found: dict[str, list[str]] = {p: [] for p in paths}
        for key, value in apply.state_dict(tree.unflatten(treedef, markers)).items():
            path = of_marker.get(id(value))
            if path is not None:
                found[path].append(key)
            elif isinstance(value, torch.Tensor):
                buffers[key] = value
        names = {p: tuple(found[p]) for p in paths}
    elif isinstance(apply, Mapping):
        names = _mapped(paths, apply)
    elif apply is None:
        names = {p: (p.replace("/", "."),) for p in paths}
    else:
        raise TypeError(
            f"apply must be what fs.interop.functionalize returned, a mapping of leaf paths to "
            f"state-dict names, or None; got a {type(apply).__name__}"
        )
    owner: dict[str, str] = {}
    for path, keys in names.items():
        if not keys:
            raise ValueError(f"{path or '<root>'}: the module's state_dict has no name for it")
        for key in keys:
            if key in owner:
                raise ValueError(
                    f"{path or '<root>'} and {owner[key] or '<root>'} are both named {key!r}; "
                    f"give every leaf its own state-dict name"
                )
            owner[key] = path
    return ModelNames(names, buffers)


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
    all_names = [n for group in names.leaves.values() for n in group] + list(names.buffers)
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
