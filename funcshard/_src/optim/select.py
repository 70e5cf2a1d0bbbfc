"""Masks: which leaves an optimizer (or a part of a chain) touches, and the trees it then sees.

A mask selects trainable leaves of a sharded tree. It is one of:

- a callable ``mask(path, leaf) -> bool`` over every trainable leaf (``leaf`` is
  the :class:`ShardedTensor`, with ``.shape``, ``.ndim`` and ``.dtype``);
- a sequence of path patterns (``fs.plan``'s globs or ``re.compile`` patterns):
  a leaf is selected when a pattern matches it or a subtree above it;
- a pytree of bools shaped like the params, or a prefix of them (a bool at a
  subtree applies to all its leaves), as optax's masks are.

:func:`restrict` gives an optimizer only the selected leaves: each run of
consecutive selected leaves in a flat buffer becomes a flat buffer of its own
(a view of the original, so updates write through), and unselected leaves are
``None``. Optimizer state built from a restricted tree covers the selected
leaves only.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch

from funcshard._src import tree
from funcshard._src.plan.rules import Pattern, check_pattern, matches_within, subtrees
from funcshard._src.shard.flat import FlatLayout, Slot
from funcshard._src.shard.sharded import FlatShard, ShardedTensor, flats_of
from funcshard._src.spec.flat_sharding import FlatSharding

Mask: TypeAlias = "Callable[[str, ShardedTensor], bool] | Sequence[Pattern] | Any"


def decay_mask_default(path: str, leaf: ShardedTensor, /) -> bool:
    """The usual weight-decay mask: matrices decay; biases, norm scales and embeddings do not.

    A leaf decays when it has two or more dims and no segment of its path names
    an embedding (contains ``embed``, or is ``wte`` / ``wpe``) or a norm
    (contains ``norm``, or starts with ``ln``). Pass it as
    ``fs.optim.adamw(..., mask=fs.optim.decay_mask_default)``.

    Example:
        >>> import torch, funcshard as fs
        >>> p = {"embed": torch.zeros(8, 4), "w": torch.zeros(4, 4), "b": torch.zeros(4)}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))
        >>> [k for k in p if decay_mask_default(k, sp[k])]
        ['w']
    """
    if leaf.ndim < 2:
        return False
    for segment in path.lower().split("/"):
        if "embed" in segment or segment in ("wte", "wpe"):
            return False
        if "norm" in segment or segment.startswith("ln"):
            return False
    return True


def trainable_leaves(sparams: Any, /) -> list[ShardedTensor]:
    """The sharded leaves of ``sparams`` that are not frozen, in leaf order."""
    return [
        leaf for leaf in tree.leaves(sparams) if isinstance(leaf, ShardedTensor) and not leaf.frozen
    ]


def selected_paths(mask: Mask, sparams: Any, /, *, what: str) -> frozenset[str]:
    """The paths of the trainable leaves of ``sparams`` that ``mask`` selects.

    Raises:
        TypeError: a mask of another kind, or a callable that returns a non-bool
            (``what`` names the caller in the message).
        ValueError: a pattern that matches no leaf, or a bool tree that does not
            fit the params.
    """
    leaves = trainable_leaves(sparams)
    if callable(mask):
        out: set[str] = set()
        for leaf in leaves:
            chosen = mask(leaf.path, leaf)
            if not isinstance(chosen, bool):
                raise TypeError(
                    f"{what}: the mask returned {chosen!r} for {leaf.path!r}; a mask function "
                    f"returns True (selected) or False"
                )
            if chosen:
                out.add(leaf.path)
        return frozenset(out)
    if isinstance(mask, (list, tuple)) and all(isinstance(m, (str, re.Pattern)) for m in mask):
        patterns = [check_pattern(m, what=f"{what}: mask[{i}]") for i, m in enumerate(mask)]
        return _by_patterns(patterns, leaves, what)
    return _by_bool_tree(mask, leaves, what)


def _by_patterns(patterns: list[Pattern], leaves: list[ShardedTensor], what: str) -> frozenset[str]:
    out: set[str] = set()
    for i, pattern in enumerate(patterns):
        hits = {leaf.path for leaf in leaves if matches_within(pattern, leaf.path)}
        if not hits:
            examples = ", ".join(repr(leaf.path) for leaf in leaves[:6])
            raise ValueError(
                f"{what}: mask[{i}] {pattern!r} matches no trainable leaf or subtree (paths look "
                f"like {examples}); fix the pattern or drop it"
            )
        out |= hits
    return frozenset(out)


def _by_bool_tree(mask: Any, leaves: list[ShardedTensor], what: str) -> frozenset[str]:
    paths, flags, _ = tree.flatten_with_paths(mask)
    if not flags or any(not isinstance(f, bool) for f in flags if f is not None):
        raise TypeError(
            f"{what}: a mask is a function (path, leaf) -> bool, a list of path patterns, or a "
            f"tree of bools like the params; got {type(mask).__name__}"
        )
    given = {p: f for p, f in zip(paths, flags) if f is not None}
    out: set[str] = set()
    for leaf in leaves:
        flag = next((given[a] for a in reversed(subtrees(leaf.path)) if a in given), None)
        if flag is None:
            raise ValueError(
                f"{what}: the mask tree has no bool for {leaf.path!r}; give one for every "
                f"trainable leaf, or for a subtree above it"
            )
        if flag:
            out.add(leaf.path)
    return frozenset(out)


def restrict(sharded: Any, selected: frozenset[str], /) -> Any:
    """``sharded`` with only the ``selected`` leaves, each viewing a flat buffer of its run.

    The new flat buffers are views of the old ones: writing into them writes
    into ``sharded``. Unselected and non-sharded leaves become ``None``.
    """
    views: dict[tuple[int, int], FlatShard] = {}

    def leaf_fn(leaf: Any) -> Any:
        if not isinstance(leaf, ShardedTensor) or leaf.path not in selected:
            return None
        flat = leaf.flat
        runs = _runs(flat.layout, selected, flat.rank if flat.layout.flat else 0)
        run, slot = runs.by_path[leaf.path]
        key = (id(flat), run)
        sub = views.get(key)
        if sub is None:
            start, stop, layout = runs.runs[run]
            sub = views[key] = FlatShard(layout, flat.data[start:stop], flat.rank)
        return ShardedTensor(sub, slot)

    return tree.tree_map(leaf_fn, sharded)


class _Runs:
    """A layout's runs of selected slots: (start, sub-layout) each, and where every selected leaf went."""

    def __init__(
        self, runs: list[tuple[int, int, FlatLayout]], by_path: dict[str, tuple[int, Slot]]
    ):
        self.runs = runs
        self.by_path = by_path


@functools.lru_cache(maxsize=4096)
def _runs(layout: FlatLayout, selected: frozenset[str], rank: int) -> _Runs:
    """The runs of ``layout``'s selected slots; in the flat layout, of ``rank``'s buffer.

    A flat run is a range ``[A, B)`` of the unit's concatenation: its buffer is the
    part of it in the rank's range, its slots keep their place in the
    concatenation, with ``base = A`` (the sub-layout's ``numel`` stays the unit's
    chunk: what a rank holds of a run differs between ranks).
    """
    groups: list[list[Slot]] = []
    previous_selected = False
    for slot in layout.slots:
        chosen = slot.path in selected
        if chosen:
            if not previous_selected:
                groups.append([])
            groups[-1].append(slot)
        previous_selected = chosen
    runs: list[tuple[int, int, FlatLayout]] = []
    by_path: dict[str, tuple[int, Slot]] = {}
    for i, group in enumerate(groups):
        start = group[0].offset
        stop = group[-1].offset + group[-1].numel
        if layout.flat:
            flats = [s.sharding for s in group if isinstance(s.sharding, FlatSharding)]
            assert len(flats) == len(group), "a flat layout's slots are all flat"
            rebased = tuple(
                dataclasses.replace(s, sharding=dataclasses.replace(x, base=start))
                for s, x in zip(group, flats)
            )
            lo = flats[0].range_start(rank)
            a = min(max(start, lo), lo + layout.numel) - lo
            b = max(min(stop, lo + layout.numel) - lo, a)
            sub = dataclasses.replace(layout, slots=rebased)
            runs.append((a, b, sub))
            by_path.update((s.path, (i, s)) for s in rebased)
            continue
        rebased = tuple(
            Slot(s.index, s.path, s.shape, s.sharding, s.shard_shape, s.offset - start)
            for s in group
        )
        sub = FlatLayout(
            layout.unit, layout.dtype, layout.mesh, rebased, stop - start, layout.frozen
        )
        runs.append((start, stop, sub))
        by_path.update((s.path, (i, s)) for s in rebased)
    return _Runs(runs, by_path)


def decay_(sparams: Any, mask: Mask, factor: float, /, *, what: str) -> None:
    """Multiplies the floating-point leaves ``mask`` selects by ``factor``; mutates ``sparams``' buffers.

    Decoupled weight decay of selected leaves only: ``p *= 1 - lr * weight_decay``
    (one foreach op over the selected runs).
    """
    chosen = restrict(sparams, selected_paths(mask, sparams, what=what))
    data = [f.data for f in flats_of(chosen) if f.layout.dtype.is_floating_point]
    if data:
        with torch.no_grad():
            torch._foreach_mul_(data, factor)
