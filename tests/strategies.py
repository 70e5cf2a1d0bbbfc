"""Hypothesis strategies, in one place: meshes, shapes, specs, pytrees, rules and units."""

from __future__ import annotations

import math
from collections import OrderedDict, namedtuple
from typing import Any

import torch
from hypothesis import strategies as st

from funcshard import Mesh, P
from funcshard._src import tree
from funcshard._src.plan.rules import matches

AXIS_NAMES = ("dp", "fsdp", "tp", "a", "b")
Pair = namedtuple("Pair", ["left", "right"])


@st.composite
def meshes(draw: st.DrawFn, *, max_size: int = 8, max_axes: int = 3) -> Mesh:
    """Meshes of 1..max_axes named axes, sizes 1..4, at most ``max_size`` ranks."""
    n_axes = draw(st.integers(1, max_axes))
    names = draw(st.permutations(AXIS_NAMES))[:n_axes]
    sizes: list[int] = []
    for _ in names:
        room = max_size // max(1, math.prod(sizes))
        sizes.append(draw(st.integers(1, max(1, min(4, room)))))
    return Mesh(dict(zip(names, sizes)))


@st.composite
def meshes_of_size(draw: st.DrawFn, size: int, *, max_axes: int = 3) -> Mesh:
    """Meshes whose axis sizes multiply to exactly ``size`` (axes of size 1 included)."""
    n_axes = draw(st.integers(1, max_axes))
    names = draw(st.permutations(AXIS_NAMES))[:n_axes]
    sizes = [1] * n_axes
    rest = size
    for factor in _prime_factors(size):
        sizes[draw(st.integers(0, n_axes - 1))] *= factor
        rest //= factor
    assert rest == 1
    return Mesh(dict(zip(names, sizes)))


def shapes(
    *, max_ndim: int = 3, max_side: int = 10, min_ndim: int = 0
) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes with size-0 and size-1 dims and uneven sizes among them."""
    side = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8]), st.integers(0, max_side))
    return st.lists(side, min_size=min_ndim, max_size=max_ndim).map(tuple)


@st.composite
def specs_for(draw: st.DrawFn, ndim: int, mesh: Mesh, *, axes: tuple[str, ...] | None = None) -> P:
    """Valid specs for a rank-``ndim`` leaf: a subset of ``axes`` (default all), each used once."""
    pool = list(mesh.axis_names if axes is None else axes)
    if ndim == 0 or not pool:
        return P(*([None] * draw(st.integers(0, ndim))))
    used = draw(st.lists(st.sampled_from(pool), unique=True, max_size=len(pool)))
    per_dim: list[list[str]] = [[] for _ in range(ndim)]
    for axis in used:
        per_dim[draw(st.integers(0, ndim - 1))].append(axis)
    entries: list[Any] = []
    for names in per_dim:
        if not names:
            entries.append(None)
        elif len(names) == 1 and draw(st.booleans()):
            entries.append(names[0])
        else:
            entries.append(tuple(names))
    length = draw(
        st.integers(max((i + 1 for i, e in enumerate(entries) if e is not None), default=0), ndim)
    )
    return P(*entries[:length])


@st.composite
def even_shapes_for(draw: st.DrawFn, spec: P, mesh: Mesh, ndim: int) -> tuple[int, ...]:
    """Shapes every dim of which divides by its shard count (what JAX accepts)."""
    dims = spec.dims(ndim)
    return tuple(
        math.prod(mesh.axis_size(a) for a in axes) * draw(st.integers(0, 3)) for axes in dims
    )


_KEYS = st.sampled_from(["w", "b", "wq", "embed", "mlp", "attn", "x", "y", "0a", "Z"])


def pytrees(leaves: st.SearchStrategy[Any], *, max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Nested dict, OrderedDict, list, tuple, namedtuple and None nodes over ``leaves``."""

    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.dictionaries(_KEYS, children, max_size=3),
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.lists(st.tuples(_KEYS, children), max_size=3, unique_by=lambda kv: kv[0]).map(
                OrderedDict
            ),
            st.tuples(children, children).map(lambda t: Pair(*t)),
        )

    return st.recursive(st.one_of(leaves, st.none()), extend, max_leaves=max_leaves)


DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)


@st.composite
def tensors(
    draw: st.DrawFn,
    *,
    max_ndim: int = 3,
    max_side: int = 9,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
) -> torch.Tensor:
    """Tensors of drawn shape and dtype with distinct, seeded values."""
    shape = draw(shapes(max_ndim=max_ndim, max_side=max_side))
    dtype = draw(st.sampled_from(dtypes))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    values = torch.randn(shape, generator=gen) * 100
    return values.to(dtype)


def tensor_trees(*, max_leaves: int = 10, **kwargs: Any) -> st.SearchStrategy[Any]:
    """Pytrees of tensors with at least one leaf."""
    return pytrees(tensors(**kwargs), max_leaves=max_leaves).filter(
        lambda t: len(tree.flatten(t)[0]) > 0
    )


@st.composite
def rules_for(
    draw: st.DrawFn, params: Any, mesh: Mesh, *, axes: tuple[str, ...] | None = None
) -> list[tuple[Any, P]]:
    """Rules for ``params``: exact-path rules with fitting specs, and catch-alls that replicate."""
    paths, leaves, _ = tree.flatten_with_paths(params)
    rules: list[tuple[Any, P]] = []
    for path, leaf in zip(paths, leaves):
        if draw(st.booleans()):
            rules.append((path, draw(specs_for(leaf.ndim, mesh, axes=axes))))
    if draw(st.booleans()):
        rules.append(("**/b", P()))
    if draw(st.booleans()):
        rules = draw(st.permutations(rules))
    # fs.plan refuses a rule that places no leaf: keep the rules that are some leaf's first match
    firsts = {
        next((i for i, (pattern, _) in enumerate(rules) if matches(pattern, p)), None)
        for p in paths
    }
    return [rule for i, rule in enumerate(rules) if i in firsts]


@st.composite
def units_for(draw: st.DrawFn, params: Any) -> list[str]:
    """Disjoint subtree paths of ``params`` to use as unit patterns."""
    paths = tree.leaf_paths(params)
    nodes: list[str] = []
    for path in paths:
        parts = path.split("/") if path else []
        for k in range(1, len(parts) + 1):
            node = "/".join(parts[:k])
            if node not in nodes:
                nodes.append(node)
    chosen: list[str] = []
    for node in draw(st.lists(st.sampled_from(nodes), unique=True, max_size=4)) if nodes else []:
        if not any(
            node == c or node.startswith(c + "/") or c.startswith(node + "/") for c in chosen
        ):
            chosen.append(node)
    return chosen  # the drawn keys hold no glob metacharacters: paths are literal patterns


def _prime_factors(n: int) -> list[int]:
    out: list[int] = []
    p = 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out
