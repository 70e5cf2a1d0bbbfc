"""NamedSharding: every rank's slices; tiles each leaf once per replica; ceil-div for uneven dims."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from funcshard import Mesh, NamedSharding, P, SpecError
from tests.strategies import meshes, shapes, specs_for


@st.composite
def shardings_and_shapes(draw):
    mesh = draw(meshes())
    shape = draw(shapes())
    return NamedSharding(mesh, draw(specs_for(len(shape), mesh))), shape


@given(shardings_and_shapes())
def test_slices_tile_each_leaf_once_per_replica(case):
    """Within each replica (ranks with equal replica_id) every element is held exactly once."""
    sharding, shape = case
    indices = sharding.indices(shape)
    n_replicas = math.prod(sharding.mesh.axis_size(a) for a in sharding.replica_axes)
    counts = np.zeros((n_replicas, *shape), dtype=np.int64)
    for rank, index in indices.items():
        counts[(sharding.replica_id(rank), *index)] += 1
    assert (counts == 1).all()


@given(shardings_and_shapes())
def test_local_shapes_are_ceil_div_chunks(case):
    """Each chunk is ceil(size/n) long except trailing ones; padded shard shapes are equal."""
    sharding, shape = case
    chunk = sharding.shard_shape(shape)
    for rank in range(sharding.mesh.size):
        local = sharding.local_shape(shape, rank)
        index = sharding.chunk_index(len(shape), rank)
        for size, c, n, i in zip(shape, chunk, local, index):
            assert n == max(0, min(c, size - i * c))
            assert n <= c


def test_uneven_examples_match_torch_chunk_layout():
    four = Mesh({"fsdp": 4})
    sharding = NamedSharding(four, P("fsdp"))
    assert [sharding.local_shape((10,), r) for r in range(4)] == [(3,), (3,), (3,), (1,)]
    assert [sharding.local_shape((3,), r) for r in range(4)] == [(1,), (1,), (1,), (0,)]
    assert sharding.indices((10,))[3] == (slice(9, 10),)
    assert sharding.indices((3,))[3] == (slice(3, 3),)
    two_axes = NamedSharding(Mesh({"dp": 2, "fsdp": 2}), P(("fsdp", "dp")))
    # fsdp major: rank (dp=1, fsdp=0) = rank 2 holds chunk 1
    assert two_axes.indices((10,))[2] == (slice(3, 6),)


def test_dims_split_once_use_full_slices_like_jax():
    sharding = NamedSharding(Mesh({"a": 1, "b": 2}), P("a", "b"))
    assert sharding.indices((3, 4))[1] == (slice(None), slice(2, 4))


def test_strict_refuses_uneven_dims():
    sharding = NamedSharding(Mesh({"fsdp": 4}), P(None, "fsdp"))
    sharding.indices((3, 8), strict=True)
    with pytest.raises(SpecError, match=r"cuts dim 1 of shape \(3, 10\) into 4 shards") as info:
        sharding.indices((3, 10), strict=True)
    assert info.value.kind == "uneven"


def test_replica_axes():
    sharding = NamedSharding(Mesh({"dp": 2, "fsdp": 2, "tp": 2}), P("tp"))
    assert sharding.replica_axes == ("dp", "fsdp")
    assert [sharding.replica_id(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
