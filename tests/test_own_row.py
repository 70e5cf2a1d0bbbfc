"""A rank's own row summed from the leaves: the bits of packing it and adding it.

[Note: the own row from the leaves] in ``shard/flat.py``: a reduce-scatter
through shared memory leaves this rank's row out of its packed input and adds
``scale * leaf`` straight from the gradients when it sums. For every flat layout,
range of columns and power-of-two scale, that must equal packing the row and
adding it, bit for bit, in either order of the first addition.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from funcshard import plan
from funcshard._src import tree
from funcshard._src.shard.flat import OwnRow, exact_scale, layouts, pack_all, pack_flat_columns
from funcshard._src.spec.mesh import Mesh
from tests.strategies import meshes, tensor_trees, units_for


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
