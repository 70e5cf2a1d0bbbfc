"""Flat layouts: packing every rank's shards and cutting full leaves back out are inverse.

A rank's own row summed from the leaves: the bits of packing it and adding it.

[Note: the own row from the leaves] in ``shard/flat.py``: a reduce-scatter
through shared memory leaves this rank's row out of its packed input and adds
``scale * leaf`` straight from the gradients when it sums. For every flat layout,
range of columns and power-of-two scale, that must equal packing the row and
adding it, bit for bit, in either order of the first addition.
"""

from __future__ import annotations

from typing import cast

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from funcshard import P, plan
from funcshard._src import tree
from funcshard._src.shard.flat import (
    OwnRow,
    exact_scale,
    gathers_in_place,
    layouts,
    leaf_column_ranges,
    pack_all,
    pack_flat_columns,
    pack_into,
    pack_leaf_columns,
    pack_local,
    padded_view,
    row_order,
    unpack_gathered,
)
from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.named_sharding import NamedSharding
from tests.strategies import meshes, rules_for, tensor_trees, units_for


@st.composite
def planned_params(draw):
    params = draw(tensor_trees())
    mesh = draw(meshes())
    p = plan(params, mesh, rules=draw(rules_for(params, mesh)), units=draw(units_for(params)))
    return params, p


@given(planned_params())
def test_slots_tile_the_flat_buffer(case):
    _, p = case
    seen = []
    for layout in layouts(p):
        offset = 0
        for slot in layout.slots:
            assert slot.offset == offset
            assert p.leaves[slot.index].dtype == layout.dtype
            assert p.leaves[slot.index].unit == layout.unit
            offset += slot.numel
            seen.append(slot.index)
        assert layout.numel == offset
    assert sorted(seen) == list(range(len(p.leaves)))


@given(planned_params())
def test_pack_and_unpack_are_inverse(case):
    """Stacked per-rank buffers == pack_all, and unpack_gathered gives every leaf back bit for bit."""
    params, p = case
    leaves = tree.flatten(params)[0]
    for layout in layouts(p):
        members = [leaves[s.index] for s in layout.slots]
        stacked = torch.stack([pack_local(layout, members, r) for r in range(p.mesh.size)])
        assert torch.equal(stacked, pack_all(layout, members))
        for slot, full in zip(layout.slots, unpack_gathered(layout, stacked)):
            assert full.dtype == leaves[slot.index].dtype
            assert torch.equal(full, leaves[slot.index])
            assert full.is_contiguous()


@given(planned_params())
def test_padding_is_zero(case):
    params, p = case
    leaves = tree.flatten(params)[0]
    for layout in layouts(p):
        for rank in range(p.mesh.size):
            flat = pack_local(layout, [leaves[s.index] for s in layout.slots], rank)
            for slot in layout.slots:
                local = slot.sharding.local_shape(slot.shape, rank)
                padded = padded_view(flat, slot).clone()
                padded[tuple(slice(0, n) for n in local)] = 0
                assert not padded.any()


@st.composite
def hybrid_params(draw):
    params = draw(tensor_trees())
    mesh = draw(meshes(max_axes=3).filter(lambda m: len(m.shape) >= 2))
    strategy = draw(st.sampled_from(["hybrid_shard", "no_shard"]))
    p = plan(params, mesh, strategy=strategy, units=draw(units_for(params)))
    return params, p


@given(hybrid_params())
def test_pack_and_unpack_over_a_subset_of_axes(case):
    """Over the shard group of one replica (hybrid) or no axes at all (no_shard), still inverse."""
    params, p = case
    axes = p.mesh.axis_names[-1:] if p.strategy == "hybrid_shard" else ()
    group = p.mesh.groups(list(axes))[0] if axes else [0]
    leaves = tree.flatten(params)[0]
    for layout in layouts(p):
        members = [leaves[s.index] for s in layout.slots]
        stacked = torch.stack([pack_local(layout, members, r) for r in group])
        assert torch.equal(stacked, pack_all(layout, members, axes))
        for slot, full in zip(layout.slots, unpack_gathered(layout, stacked, axes)):
            assert torch.equal(full, leaves[slot.index])


@given(planned_params())
def test_a_layout_gathered_in_place_is_its_leaf_in_memory_order(case):
    """gathers_in_place holds exactly when the gathered buffer is the one leaf's memory; then the
    unpacked leaf is a view of it (no copy)."""
    params, p = case
    leaves = tree.flatten(params)[0]
    for layout in layouts(p):
        members = [leaves[s.index] for s in layout.slots]
        rows = pack_all(layout, members)
        same = len(members) == 1 and rows.numel() == members[0].numel()
        same = same and torch.equal(rows.reshape(-1), members[0].reshape(-1))
        if gathers_in_place(layout):
            assert same
            (full,) = unpack_gathered(layout, rows)
            assert full.data_ptr() == rows.data_ptr()
            assert torch.equal(full, members[0])


@pytest.mark.parametrize(
    ("shape", "spec", "expected"),
    [
        ((8, 3), P("fsdp"), True),
        ((7, 3), P("fsdp"), False),  # padded
        ((8, 4), P(None, "fsdp"), False),  # dim 1: rank-major rows are not the leaf's memory
        ((8,), P(), False),  # replicated: every row is the whole leaf
    ],
)
def test_gathers_in_place_examples(shape, spec, expected):
    params = {"w": torch.zeros(shape)}
    p = plan(params, Mesh({"fsdp": 4}), rules=[("w", spec)])
    assert gathers_in_place(layouts(p)[0]) is expected
    two = plan({**params, "b": torch.zeros(4)}, Mesh({"fsdp": 4}), rules=[("w", spec)])
    assert not gathers_in_place(layouts(two)[0])  # two leaves in one buffer


@st.composite
def reordered_params(draw):
    params = draw(tensor_trees())
    mesh = draw(meshes(max_axes=3).filter(lambda m: len(m.shape) >= 2))
    layout = draw(st.sampled_from(["leaf", "flat"]))
    p = plan(params, mesh, units=draw(units_for(params)), layout=layout)
    names = list(mesh.axis_names)
    return params, p, (names[-1], *names[:-1])


@given(reordered_params(), st.sampled_from([1.0, 0.25]))
def test_packing_with_the_last_axis_major_permutes_the_rows(case, scale):
    """Packed over the axes with the last one first (a two-hop reduction's order), every
    layout's rows are pack_all's rows at ``row_order``'s places, scaled; None packs as zeros."""
    params, p, axes = case
    leaves = tree.flatten(params)[0]
    order = row_order(p.mesh, axes)
    for layout in layouts(p):
        members = [leaves[s.index] for s in layout.slots]
        members[0] = None
        expected = pack_all(layout, [torch.zeros_like(leaves[layout.slots[0].index]), *members[1:]])
        s = scale if layout.dtype.is_floating_point else 1.0  # gradients are floating
        out = torch.full_like(expected, 7)  # every element written over
        pack_into(layout, members, out, axes, scale=s)
        rows = out if order is None else out[list(order)]
        assert torch.equal(rows, expected * s if s != 1.0 else expected)


@st.composite
def flat_columns(draw):
    params = draw(tensor_trees())
    mesh = draw(meshes(max_axes=2))
    p = plan(params, mesh, units=draw(units_for(params)), layout="flat")
    return params, p, draw(st.integers(0, 10**6)), draw(st.integers(1, 10**6))


@given(flat_columns())
def test_packing_a_range_of_columns_is_that_range_of_the_rows(case):
    """A reduction in chunks ([Note: reductions in chunks] in ``execute/param_group.py``): columns [start, stop) of every
    flat layout's packed rows, a None leaf as zeros, padding zeros."""
    params, p, a, b = case
    leaves = tree.flatten(params)[0]
    for layout in layouts(p):
        members = [leaves[s.index] for s in layout.slots]
        members[-1] = None
        rows = pack_all(layout, [*members[:-1], torch.zeros_like(leaves[layout.slots[-1].index])])
        start = a % layout.numel if layout.numel else 0
        width = 1 + b % max(layout.numel - start, 1)
        if layout.numel == 0:
            continue
        out = torch.full((rows.shape[0], width), 7, dtype=rows.dtype)
        pack_flat_columns(layout, members, out, start, 1.0)
        assert torch.equal(out, rows[:, start : start + width])


@given(planned_params(), st.integers(1, 64), st.sampled_from([1.0, 0.5]))
def test_a_leaf_layout_packed_a_range_at_a_time_is_the_whole_packing(case, columns, scale):
    """Reductions in chunks of a leaf layout ([Note: reductions in chunks] in
    ``execute/param_group.py``): the ranges tile the columns, each within ``columns`` unless
    one row of a chunk is wider, and packing each range gives those columns of the whole
    packing, a None leaf as zeros."""
    params, p = case
    leaves = tree.flatten(params)[0]
    axes = p.mesh.axis_names
    for layout in layouts(p):
        ranges = leaf_column_ranges(layout, axes, columns)
        if layout.flat:
            assert ranges is None
            continue
        shardings = [s.sharding for s in layout.slots]
        assert all(isinstance(x, NamedSharding) for x in shardings)
        padded = any(
            n * c != size
            for s, x in zip(layout.slots, shardings)
            for n, c, size in zip(
                cast(NamedSharding, x).num_shards(s.shape), s.shard_shape, s.shape
            )
        )
        if padded:
            assert ranges is None
            continue
        assert ranges is not None
        starts = [lo for lo, _ in ranges]
        assert starts == [0, *(hi for _, hi in ranges[:-1])][: len(ranges)]
        assert (ranges[-1][1] if ranges else 0) == layout.numel
        for lo, hi in ranges:
            assert hi > lo
            if hi - lo > columns:  # one row of one slot's chunk
                (slot,) = [s for s in layout.slots if s.offset <= lo < s.offset + s.numel]
                assert hi - lo == slot.numel // slot.shard_shape[0]
        members: list[torch.Tensor | None] = [leaves[s.index] for s in layout.slots]
        members[0] = None
        factor = scale if layout.dtype.is_floating_point else 1.0  # gradients are floating
        whole = torch.empty(p.mesh.size, layout.numel, dtype=layout.dtype)
        pack_into(layout, members, whole, axes, scale=factor)
        for lo, hi in ranges:
            out = torch.full((p.mesh.size, hi - lo), 7, dtype=layout.dtype)
            pack_leaf_columns(layout, members, out, lo, axes, scale=factor)
            assert torch.equal(out, whole[:, lo:hi])


@st.composite
def cast_params(draw):
    params = draw(tensor_trees())
    mesh = draw(meshes(max_axes=2))
    layout = draw(st.sampled_from(["leaf", "flat"]))
    p = plan(params, mesh, units=draw(units_for(params)), layout=layout)
    return params, p, draw(st.sampled_from([1.0, 1 / 3])), draw(st.booleans())


@given(cast_params())
def test_packing_leaves_of_a_narrower_dtype_casts_them_bit_for_bit(case):
    """[Note: cast while packing] in ``shard/flat.py``: bf16 gradients packed into float32
    rows are the bits of casting each leaf first, scaled or not, in mesh order or the last axis major."""
    params, p, scale, reverse = case
    leaves = tree.flatten(params)[0]
    axes = tuple(reversed(p.mesh.axis_names)) if reverse else None  # a two-hop order
    for layout in layouts(p):
        if layout.dtype != torch.float32:
            continue
        narrow = [leaves[s.index].to(torch.bfloat16) for s in layout.slots]
        wide = [x.to(torch.float32) for x in narrow]
        expected = torch.full((p.mesh.size, layout.numel), 7.0)
        got = torch.full((p.mesh.size, layout.numel), 7.0)
        pack_into(layout, wide, expected, axes, scale=scale)
        pack_into(layout, narrow, got, axes, scale=scale)
        assert torch.equal(got, expected)
        width = max(layout.numel // 2, 1)
        if layout.flat and layout.numel:
            expected = torch.full((p.mesh.size, width), 7.0)
            got = torch.full((p.mesh.size, width), 7.0)
            pack_flat_columns(layout, wide, expected, 1 % layout.numel, scale)
            pack_flat_columns(layout, narrow, got, 1 % layout.numel, scale)
            assert torch.equal(got, expected)


@st.composite
def own_rows(draw):
    params = draw(tensor_trees())
    mesh = draw(meshes(max_axes=2))
    p = plan(params, mesh, units=draw(units_for(params)), layout="flat")
    scale = 2.0 ** -draw(st.integers(0, 4))
    return params, p, draw(st.integers(0, 10**6)), draw(st.integers(1, 10**6)), scale


@given(own_rows())
def test_the_own_row_adds_what_packing_it_would_with_the_same_bits(case):
    params, p, a, b, scale = case
    leaves = tree.flatten(params)[0]
    for layout in layouts(p):
        if layout.numel == 0 or not layout.dtype.is_floating_point:
            continue
        members = [leaves[s.index] for s in layout.slots]
        members[0] = None  # a leaf without a gradient: zeros
        present = [torch.zeros_like(leaves[layout.slots[0].index]), *members[1:]]
        rows = pack_all(layout, present)
        packed = torch.mul(rows, scale)
        me = (a // 7) % rows.shape[0]
        start = a % layout.numel
        width = 1 + b % (layout.numel - start)
        own = OwnRow(layout, members, me * layout.numel + start, width, scale)
        mine = packed[me, start : start + width]
        base = torch.randn(width).to(layout.dtype)
        out = torch.full((width,), 7, dtype=layout.dtype)
        own(out, base)
        assert torch.equal(out, torch.add(base, mine)), "base + own"
        assert torch.equal(out, torch.add(mine, base)), "own + base"
        own(out, None)
        assert torch.equal(out, mine)
        out.copy_(base)
        own(out, out)  # in place
        assert torch.equal(out, base + mine)


@given(own_rows())
def test_packing_without_the_own_row_leaves_it_untouched(case):
    params, p, a, _, _ = case
    leaves = tree.flatten(params)[0]
    for layout in layouts(p):
        if layout.numel == 0:
            continue
        members = [leaves[s.index] for s in layout.slots]
        rows = pack_all(layout, members)
        skip = a % rows.shape[0]
        out = torch.full_like(rows, 7)
        pack_flat_columns(layout, members, out, 0, 1.0, skip=skip)
        for r in range(rows.shape[0]):
            expected = torch.full_like(rows[r], 7) if r == skip else rows[r]
            assert torch.equal(out[r], expected), f"row {r} (skipped: {skip})"


def test_only_a_power_of_two_scale_sums_exactly():
    assert [exact_scale(s) for s in (1.0, 0.5, 0.125, 1 / 3, 0.0, -0.5)] == [
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    (layout,) = layouts(plan({"w": torch.zeros(8)}, Mesh({"fsdp": 2}), layout="flat"))
    with pytest.raises(ValueError, match="power-of-two"):
        OwnRow(layout, [torch.ones(8)], 0, 4, 1 / 3)


def test_a_gradient_written_while_its_reduction_is_in_flight_is_an_error():
    (layout,) = layouts(plan({"w": torch.zeros(8)}, Mesh({"fsdp": 2}), layout="flat"))
    grad = torch.ones(8)
    own = OwnRow(layout, [grad], 4, 4, 0.5)
    grad.mul_(2)
    with pytest.raises(RuntimeError, match="written while its reduction was in flight"):
        own(torch.empty(4), None)
