"""FlatSharding: ranges of a unit's concatenation, and the boxes that cut a range of a leaf."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from funcshard import Mesh
from funcshard._src.spec.flat_sharding import FlatSharding, box_shape, range_boxes
from tests.strategies import shapes


@st.composite
def ranges_of(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int]:
    shape = draw(shapes(max_ndim=4, max_side=6))
    n = math.prod(shape)
    start = draw(st.integers(0, n))
    return shape, start, draw(st.integers(start, n))


@given(ranges_of())
def test_the_boxes_of_a_range_are_its_elements_in_order(case):
    shape, start, stop = case
    whole = torch.arange(math.prod(shape)).view(shape)
    boxes = range_boxes(shape, start, stop)
    got = [whole[box].reshape(-1) for box in boxes]
    assert torch.equal(
        torch.cat(got) if got else torch.zeros(0, dtype=torch.long), torch.arange(start, stop)
    )
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    for box in boxes:  # each box is one contiguous run of the row-major elements
        values = whole[box].reshape(-1)
        assert torch.equal(values, torch.arange(int(values[0]), int(values[0]) + values.numel()))
        assert math.prod(box_shape(box)) == values.numel()


@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=5),
    st.sampled_from([{"fsdp": 1}, {"fsdp": 3}, {"fsdp": 4}, {"dp": 2, "fsdp": 2}]),
    st.booleans(),
)
def test_the_ranks_ranges_tile_every_leaf_once_per_replica(sizes, axes, over_all):
    mesh = Mesh(axes)
    shard = mesh.axis_names if over_all else mesh.axis_names[-1:]
    group = math.prod(mesh.axis_size(a) for a in shard)
    chunk = -(-sum(sizes) // group)
    start = 0
    for size in sizes:
        s = FlatSharding(mesh, shard, start, size, chunk)
        for replica in range(mesh.size // group):
            ranks = [r for r in range(mesh.size) if s.replica_id(r) == replica]
            held = sorted(s.local_range(r) for r in ranks)
            held = [(a, b) for a, b in held if b > a]
            assert sum(b - a for a, b in held) == size
            assert all(x[1] == y[0] for x, y in itertools.pairwise(held))
        for r in range(mesh.size):  # each rank's piece sits inside its buffer of chunk elements
            a, b = s.local_range(r)
            if b > a:
                assert s.local_offset(r) >= 0
                assert s.local_offset(r) + b - a <= chunk
        start += size
