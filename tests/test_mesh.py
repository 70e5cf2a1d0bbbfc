"""Mesh: row-major rank layout, groups per axis, validation; bound to torch's DeviceMesh."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from funcshard import Mesh
from tests.strategies import meshes


@given(meshes())
def test_coords_and_rank_are_inverse_and_row_major(mesh):
    expected = np.arange(mesh.size).reshape(mesh.shape)
    assert (mesh.devices == expected).all()
    for rank in range(mesh.size):
        coords = mesh.coords(rank)
        assert expected[coords] == rank
        assert mesh.rank_of(coords) == rank


@given(meshes())
def test_groups_partition_the_ranks(mesh):
    """Each axis's groups cover every rank once; members differ only along that axis."""
    for axis in mesh.axis_names:
        groups = mesh.groups([axis])
        assert sorted(r for g in groups for r in g) == list(range(mesh.size))
        i = mesh.axis_index(axis)
        for group in groups:
            assert [mesh.coords(r)[i] for r in group] == list(range(mesh.axis_size(axis)))
            others = {tuple(c for j, c in enumerate(mesh.coords(r)) if j != i) for r in group}
            assert len(others) == 1


def test_groups_of_two_axes_follow_the_given_order():
    mesh = Mesh({"a": 2, "b": 2, "c": 2})
    assert mesh.groups(["a", "c"]) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert mesh.groups(["c", "a"]) == [[0, 4, 1, 5], [2, 6, 3, 7]]


def test_mesh_accepts_pairs_and_reports_itself():
    mesh = Mesh([("dp", 2), ("fsdp", 3)])
    assert mesh == Mesh({"dp": 2, "fsdp": 3})
    assert mesh != Mesh({"fsdp": 3, "dp": 2})
    assert repr(mesh) == "Mesh({'dp': 2, 'fsdp': 3})"
    assert Mesh.from_json(mesh.to_json()) == mesh
    assert hash(mesh) == hash(Mesh({"dp": 2, "fsdp": 3}))


@pytest.mark.parametrize(
    ("axes", "error", "message"),
    [
        ({}, ValueError, "at least one axis"),
        ([("a", 2), ("a", 2)], ValueError, "'a' appears twice"),
        ({"a": 0}, ValueError, "'a': size must be at least 1"),
        ({"a": 2.0}, TypeError, "'a': size must be an int"),
        ({"": 2}, ValueError, "non-empty"),
        ([(1, 2)], TypeError, "names must be strings"),
    ],
)
def test_bad_meshes(axes, error, message):
    with pytest.raises(error, match=message):
        Mesh(axes)


def test_unknown_axis_and_rank_out_of_range():
    mesh = Mesh({"dp": 2})
    with pytest.raises(ValueError, match="'tp' is not in the mesh; its axes are \\['dp'\\]"):
        mesh.axis_size("tp")
    with pytest.raises(ValueError, match="rank 2 is outside"):
        mesh.coords(2)


def test_bind_outside_a_distributed_run():
    from funcshard._src.comm.groups import bind

    assert bind(Mesh({"fsdp": 1})).rank == 0
    with pytest.raises(
        ValueError, match=r"has 2 ranks but the world size is 1; run under torchrun"
    ):
        bind(Mesh({"fsdp": 2}))


def _bound_layout(shape: dict[str, int]):
    import torch.distributed as dist

    from funcshard._src.comm.groups import bind

    mesh = Mesh(shape)
    bound = bind(mesh)
    groups = {
        a: dist.get_process_group_ranks(bound.group((a,)))
        for a in mesh.axis_names
        if mesh.axis_size(a) > 1
    }
    return bound.layout, groups, bound.coords


@pytest.mark.parametrize("shape", [{"dp": 2, "fsdp": 2}, {"fsdp": 4}, {"a": 1, "b": 4}])
def test_bound_mesh_matches_init_device_mesh(pools, shape):
    """Rank layout and per-axis groups equal torch's init_device_mesh on 4 ranks."""
    mesh = Mesh(shape)
    for rank, (layout, groups, coords) in enumerate(pools.run(4, _bound_layout, shape)):
        assert layout == mesh.devices.tolist()
        assert coords == dict(zip(mesh.axis_names, mesh.coords(rank)))
        for axis, ranks in groups.items():
            assert rank in ranks
            assert ranks in mesh.groups([axis])


def _bind_wrong_size():
    from funcshard._src.comm.groups import bind

    bind(Mesh({"fsdp": 4}))


def test_bind_refuses_a_mesh_that_is_not_the_world(pools):
    with pytest.raises(
        AssertionError, match=r"has 4 ranks but the world size is 2; make the product"
    ):
        pools.run(2, _bind_wrong_size)


def _groups_die_with_the_process_group() -> bool:
    """funcshard holds no process group or DeviceMesh strongly (see [Note: weak process groups] in ``comm/groups.py``)."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from funcshard._src.comm import groups

    bound = groups.bind(Mesh({"dp": 2, "fsdp": 2}))
    assert bound.group(("fsdp",)) is not None
    assert bound.group(("dp", "fsdp")) is not None
    reachable, stack = set(), [groups._BOUND]
    while stack:  # everything funcshard's cache holds strongly
        obj = stack.pop()
        if id(obj) in reachable or isinstance(obj, type):
            continue
        reachable.add(id(obj))
        if isinstance(obj, (dist.ProcessGroup, DeviceMesh)):
            return False
        stack.extend(gc.get_referents(obj))
    # a collective through shared memory keys its arena by the group, weakly too
    from funcshard._src.comm import shm

    group = bound.group(("fsdp",))
    assert shm.arena(group) is not None, "ranks of one host share memory"
    dead = weakref.ref(group)
    del group  # the bound mesh holds it weakly
    store = dist.distributed_c10d._get_default_store()
    rank, size = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    gc.collect()
    if dead() is not None:
        return False
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("again", store), rank=rank, world_size=size
    )
    rebound = groups.bind(Mesh({"dp": 2, "fsdp": 2}))  # a new world binds anew
    return rebound is not bound and rebound.group(("fsdp",)) is not None


def test_process_groups_are_not_kept_alive(pools):
    assert pools.run(4, _groups_die_with_the_process_group) == [True] * 4
