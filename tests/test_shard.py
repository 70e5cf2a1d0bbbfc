"""shard/unshard: every rank keeps its own slices; unshard(shard(x)) == x bit for bit at W = 1, 2, 4."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcshard as fs
from funcshard import Mesh, P, plan
from funcshard._src import tree
from funcshard._src.shard.shard import shard_for_rank
from funcshard._src.shard.sharded import flats_of, map_flats
from tests.strategies import meshes, meshes_of_size, rules_for, tensor_trees, units_for


@st.composite
def cases(draw, mesh_strategy):
    params = draw(tensor_trees())
    mesh = draw(mesh_strategy)
    return params, plan(
        params, mesh, rules=draw(rules_for(params, mesh)), units=draw(units_for(params))
    )


@given(cases(meshes()))
def test_each_rank_holds_its_slices(case):
    """ShardedTensor.local is the rank's slice of the global leaf (single process, every rank)."""
    params, p = case
    paths, leaves, _ = tree.flatten_with_paths(params)
    for rank in range(p.mesh.size):
        sharded = tree.flatten(shard_for_rank(params, p, rank))[0]
        for path, full, s in zip(paths, leaves, sharded):
            assert s.path == path
            assert s.shape == tuple(full.shape)
            assert torch.equal(s.local, full[s.sharding.local_index(s.shape, rank)])
            assert (
                s.local.data_ptr() == 0
                or s.local.untyped_storage().data_ptr() == s.flat.data.untyped_storage().data_ptr()
            )


def test_leaves_of_a_unit_share_one_flat_buffer_per_dtype():
    params = {
        "a": {"w": torch.ones(4, 2), "b": torch.ones(4), "i": torch.ones(3, dtype=torch.int64)},
        "c": torch.ones(2),
    }
    sharded = shard_for_rank(params, plan(params, Mesh({"x": 2}), units=["a"]), 1)
    assert sharded["a"]["w"].flat is sharded["a"]["b"].flat
    assert sharded["a"]["i"].flat is not sharded["a"]["w"].flat
    assert len(flats_of(sharded)) == 3
    assert sharded["a"]["w"].flat.data.shape == (4 + 2,)
    assert (
        repr(sharded["a"]["w"])
        == "ShardedTensor(path='a/w', shape=(4, 2), dtype=float32, spec=P('x'), local_shape=(2, 2))"
    )


def test_map_flats_runs_once_per_buffer():
    params = {"w": torch.ones(4), "b": torch.ones(2)}
    sharded = fs.shard(params, plan(params, Mesh({"x": 1})))
    calls = []
    out = map_flats(lambda f: calls.append(f) or f.with_data(f.data * 2), sharded)
    assert len(calls) == 1
    assert torch.equal(out["w"].local, torch.full((4,), 2.0))


def _round_trip(params, p, rank0_only):
    sharded = fs.shard(params, p)
    held = sum(f.data.numel() * f.data.element_size() for f in flats_of(sharded))
    full = fs.unshard(sharded, rank0_only=rank0_only)
    ok = full is None or all(
        torch.equal(a, b) and a.dtype == b.dtype
        for a, b in zip(tree.flatten(full)[0], tree.flatten(params)[0])
    )
    same_structure = full is None or tree.flatten(full)[1] == tree.flatten(params)[1]
    return ok and same_structure, full is None, p.fingerprint(), held


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_unshard_of_shard_is_the_identity(pools, world_size):
    @settings(max_examples=25)
    @given(case=cases(meshes_of_size(world_size)), rank0_only=st.booleans())
    def check(case, rank0_only):
        params, p = case
        results = pools.run(world_size, _round_trip, params, p, rank0_only)
        assert all(ok for ok, _, _, _ in results)
        assert [none for _, none, _, _ in results] == [False] + [rank0_only] * (world_size - 1)
        assert len({fp for _, _, fp, _ in results}) == 1
        assert {held for _, _, _, held in results} == {sum(layout.nbytes for layout in _layouts(p))}

    check()


def _layouts(p):
    from funcshard._src.shard.flat import layouts

    return layouts(p)


def _plan_fingerprint(shape):
    params = {"w": torch.zeros(shape), "blocks": [{"a": torch.zeros(3)}, {"a": torch.zeros(3)}]}
    return plan(params, Mesh({"fsdp": 4}), rules=[("**/a", P())], units=["blocks/*"]).fingerprint()


def test_fingerprint_is_the_same_on_every_rank(pools):
    assert len(set(pools.run(4, _plan_fingerprint, (5, 7)))) == 1


def test_shard_outside_a_distributed_run_needs_a_mesh_of_one():
    params = {"w": torch.zeros(4)}
    with pytest.raises(
        ValueError, match=r"Mesh\(\{'fsdp': 2\}\) has 2 ranks but the world size is 1"
    ):
        fs.shard(params, plan(params, Mesh({"fsdp": 2})))


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        (
            {"w": torch.zeros(4), "b": torch.zeros(2, device="meta")},
            ValueError,
            r"leaves are on different devices \('b' on meta, 'w' on cpu\); move every leaf to one device first",
        ),
        (
            {"w": torch.zeros(4, device="meta"), "b": torch.zeros(2, device="meta")},
            ValueError,
            r"'b' is on the meta device: shard needs values",
        ),
        (
            {"w": torch.zeros(4)},
            ValueError,
            r"params do not have the plan's tree structure: missing \['b'\], unexpected \[\]; plan these params",
        ),
        (
            {"w": torch.zeros(4), "b": torch.zeros(3)},
            ValueError,
            r"b: leaf is \(3,\) torch.float32 but the plan has \(2,\) torch.float32; plan these params",
        ),
        (
            {"w": torch.zeros(4), "b": torch.zeros(2, dtype=torch.float64)},
            ValueError,
            r"b: leaf is \(2,\) torch.float64 but the plan has \(2,\) torch.float32",
        ),
        ({"w": torch.zeros(4), "b": 1.0}, TypeError, r"b: leaf is a float, not a torch.Tensor"),
        (
            {"w": torch.zeros(4), "b": [torch.zeros(2)]},
            ValueError,
            r"missing \['b'\], unexpected \['b/0'\]",
        ),
    ],
)
def test_shard_refuses_params_that_do_not_fit(params, error, message):
    p = plan({"w": torch.zeros(4), "b": torch.zeros(2)}, Mesh({"fsdp": 1}))
    with pytest.raises(error, match=message):
        fs.shard(params, p)


def test_shard_moves_to_the_requested_device():
    params = {"w": torch.arange(4.0)}
    sharded = fs.shard(params, plan(params, Mesh({"x": 1})), device="meta")
    assert sharded["w"].device.type == "meta"


def test_unshard_passes_plain_leaves_through():
    params = {"w": torch.arange(4.0)}
    sharded = fs.shard(params, plan(params, Mesh({"x": 1})))
    out = fs.unshard({"params": sharded, "step": torch.tensor(3)})
    assert torch.equal(out["params"]["w"], params["w"])
    assert out["step"] == 3


def test_unshard_keeps_trees_that_share_a_layout_apart():
    """Params and optimizer state share slots; each leaf comes back from its own buffer."""
    params = {"w": torch.arange(4.0)}
    sparams = fs.shard(params, plan(params, Mesh({"x": 1})))
    doubled = map_flats(lambda f: f.with_data(f.data * 2), sparams)
    out = fs.unshard({"a": sparams, "b": doubled})
    assert torch.equal(out["a"]["w"], params["w"])
    assert torch.equal(out["b"]["w"], params["w"] * 2)
