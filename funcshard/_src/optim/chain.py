"""Composing optimizers as optax does: ``chain`` runs transforms in order, ``masked`` restricts one.

Every element of a chain is an :class:`Optimizer`, a gradient :class:`Transform`
(an optimizer whose ``update_`` writes into the gradients it is given and leaves
params alone, such as ``clip_by_global_norm(1.0)``) or a :class:`Guard`
(``skip_nonfinite()``), and sees the gradients as the elements before it left
them. Where optax chains updates and applies them once, funcshard's elements
write in place: a transform scales the gradients (a copy the chain makes once,
never the caller's tree), an optimizer writes the params, and an element after
it (``ema``) reads the new params.
"""

from __future__ import annotations

import contextlib
from typing import Any

from funcshard._src import tree
from funcshard._src.optim.base import (
    Optimizer,
    Transform,
    can_skip_on_device,
    skipping_when,
    skips_on_device,
)
from funcshard._src.optim.nonfinite import Guard
from funcshard._src.optim.select import Mask, restrict, selected_paths, trainable_leaves
from funcshard._src.shard.sharded import FlatShard, map_flats


def chain(*parts: Optimizer | Guard) -> Optimizer:
    """Runs ``parts`` in order on each update, in place; the state is the tuple of their states.

    A :class:`Guard` that says no stops the parts after it for this update
    (their state does not change). Before the first :class:`Transform` the
    chain copies the gradients once, and the transforms write into the copy: the
    tree the caller passed is never written (a transform named with a trailing
    ``_``, as ``clip_by_global_norm_(1.0)``, is not a :class:`Transform` and
    writes the caller's gradients, with no copy).

    Example:
        >>> import torch, funcshard as fs
        >>> p = {"w": torch.tensor([3.0, 4.0])}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))
        >>> opt = chain(fs.optim.clip_by_global_norm(1.0), fs.optim.sgd(lr=1.0))
        >>> grads = fs.shard({"w": torch.tensor([3.0, 4.0])}, fs.plan(p, fs.Mesh({"x": 1})))
        >>> sp, state = opt.update_(grads, opt.init(sp), sp)
        >>> sp["w"].local, state[0].norm
        (tensor([2.4000, 3.2000]), tensor(5.))
    """
    for i, part in enumerate(parts):
        if not isinstance(part, (Optimizer, Guard)):
            raise TypeError(
                f"chain: part {i} is a {type(part).__name__}; chain fs.optim optimizers and "
                f"transforms (fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(...)); a "
                f"torch.optim optimizer goes through fs.optim.from_torch(torch.optim.X, ...)"
            )

    def init(sparams: Any, /) -> tuple[Any, ...]:
        return tuple(part.init(sparams) for part in parts)

    def update_(grads: Any, state: tuple[Any, ...], sparams: Any, /) -> tuple[Any, tuple[Any, ...]]:
        if not isinstance(state, tuple) or len(state) != len(parts):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(
                f"chain of {len(parts)} parts: the state must be the tuple init returned, got "
                f"{type(state).__name__}"
                + (f" of {len(state)}" if isinstance(state, tuple) else "")  # pyright: ignore[reportUnnecessaryIsInstance]
            )
        new = list(state)
        copied = False
        with contextlib.ExitStack() as stack:
            for i, part in enumerate(parts):
                if isinstance(part, Transform) and not copied:
                    grads, copied = copy_grads(grads), True
                if isinstance(part, Guard):
                    if part.flag_ is not None and all(map(skips_on_device, parts[i + 1 :])):
                        # See [Note: skipping on the device] (base.py)
                        flag, new[i] = part.flag_(grads, state[i])
                        stack.enter_context(skipping_when(flag))
                        continue
                    go_on, new[i] = part.check_(grads, state[i])
                    if not go_on:
                        break
                else:
                    sparams, new[i] = part.update_(grads, state[i], sparams)
        return sparams, tuple(new)

    if all(isinstance(p, Guard) or skips_on_device(p) for p in parts):
        can_skip_on_device(update_)  # every part honours an outer flag

    return Optimizer(init, update_)


def copy_grads(grads: Any, /) -> Any:
    """A tree like ``grads`` whose flat buffers are new copies, for transforms to write into.

    Example:
        >>> import torch, funcshard as fs
        >>> g = fs.shard({"w": torch.ones(2)}, fs.plan({"w": torch.ones(2)}, fs.Mesh({"x": 1})))
        >>> copy_grads(g)["w"].local.mul_(3), g["w"].local
        (tensor([3., 3.]), tensor([1., 1.]))
    """

    def copy(flat: FlatShard) -> FlatShard:
        leaves = flat.leaves
        if leaves is not None:  # held as leaves: copied as they are, not concatenated
            return FlatShard.of_leaves(flat.layout, [t.clone() for t in leaves], flat.rank)
        return flat.with_data(flat.data.clone())

    return map_flats(copy, grads)


def masked(inner: Optimizer, mask: Mask, /) -> Optimizer:
    """``inner`` on the leaves ``mask`` selects only; the others it neither updates nor keeps state for.

    In place, as ``inner`` is. ``mask`` is a function ``(path, leaf) -> bool``,
    a list of path patterns, or a tree of bools (see ``fs.optim``'s masks).
    Inside a chain, a masked transform leaves the other leaves' gradients as
    they are (optax's ``masked``). The state is ``inner``'s, over the selected
    leaves: ``None`` elsewhere.

    Example:
        >>> import torch, funcshard as fs
        >>> p = {"w": torch.ones(2), "b": torch.ones(2)}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))
        >>> opt = masked(fs.optim.sgd(lr=0.5), ["w"])
        >>> sp, _ = opt.update_(sp, opt.init(sp), sp)  # grads = params
        >>> sp["w"].local, sp["b"].local
        (tensor([0.5000, 0.5000]), tensor([1., 1.]))
    """
    if not isinstance(inner, Optimizer):
        raise TypeError(
            f"masked: the inner part must be an fs.optim optimizer or transform, got "
            f"{type(inner).__name__}"
        )

    def init(sparams: Any, /) -> Any:
        return inner.init(restrict(sparams, selected_paths(mask, sparams, what="masked")))

    def update_(grads: Any, state: Any, sparams: Any, /) -> tuple[Any, Any]:
        chosen = selected_paths(mask, sparams, what="masked")
        _, state = inner.update_(restrict(grads, chosen), state, restrict(sparams, chosen))
        return sparams, state

    # a masked transform writes into the gradients as its inner one does
    return (Transform if isinstance(inner, Transform) else Optimizer)(init, update_)


def partition(parts: dict[str, Optimizer], labels: Any, /) -> Optimizer:
    """Parameter groups: each leaf is updated by ``parts[label]`` for its label (optax's ``partition``).

    ``labels`` is a function ``(path, leaf) -> label`` or a tree of labels like
    the params. Every trainable leaf needs a label that ``parts`` has. The state
    is a dict of the parts' states, each over its own leaves.

    Example:
        >>> import torch, funcshard as fs
        >>> p = {"w": torch.ones(2), "b": torch.ones(2)}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))
        >>> opt = partition(
        ...     {"fast": fs.optim.sgd(lr=0.5), "slow": fs.optim.sgd(lr=0.1)},
        ...     lambda path, leaf: "fast" if path == "w" else "slow",
        ... )
        >>> sp, _ = opt.update_(sp, opt.init(sp), sp)
        >>> sp["w"].local, sp["b"].local
        (tensor([0.5000, 0.5000]), tensor([0.9000, 0.9000]))
    """
    if not parts:
        raise ValueError("partition: give at least one part, e.g. {'decay': adamw(...)}")
    names = sorted(parts)

    def masks(sparams: Any) -> dict[str, Any]:
        if callable(labels):
            of = {leaf.path: labels(leaf.path, leaf) for leaf in trainable_leaves(sparams)}
        else:
            paths, values, _ = tree.flatten_with_paths(labels)
            given = dict(zip(paths, values))
            of = {leaf.path: given.get(leaf.path) for leaf in trainable_leaves(sparams)}
        unknown = {path: label for path, label in of.items() if label not in parts}
        if unknown:
            path, label = next(iter(unknown.items()))
            raise ValueError(
                f"partition: {path!r} has label {label!r}, which is not one of {names}; give every "
                f"trainable leaf a label of parts ({len(unknown)} leaves without one)"
            )
        return {name: frozenset(p for p, label in of.items() if label == name) for name in names}

    def init(sparams: Any, /) -> dict[str, Any]:
        chosen = masks(sparams)
        return {name: parts[name].init(restrict(sparams, chosen[name])) for name in names}

    def update_(grads: Any, state: dict[str, Any], sparams: Any, /) -> tuple[Any, dict[str, Any]]:
        chosen = masks(sparams)
        new = dict(state)
        for name in names:
            _, new[name] = parts[name].update_(
                restrict(grads, chosen[name]), state[name], restrict(sparams, chosen[name])
            )
        return sparams, new

    # parts that write into the gradients make a partition that does
    kind = Transform if any(isinstance(p, Transform) for p in parts.values()) else Optimizer
    return kind(init, update_)
