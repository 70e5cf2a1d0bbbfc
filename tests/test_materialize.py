"""materialize: every rank's shards are shard(full) of one full tree, the same for every mesh.

Reference: the single-rank materialize (and each initializer called on its whole
leaf); per-rank results are checked against ``shard_for_rank`` of the
reassembled tree, so a failure names either the values (mesh dependence) or the
packing (padding, offsets).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcshard as fs
from funcshard import Mesh, plan
from funcshard._src import tree
from funcshard._src.plan.strategy import STRATEGIES, Strategy, shard_axes
from funcshard._src.shard import counter_rng, fill
from funcshard._src.shard.flat import unpack_gathered
from funcshard._src.shard.materialize import materialize_for_rank, resolve_init
from funcshard._src.shard.shard import shard_for_rank
from funcshard._src.shard.sharded import flats_of
from tests.strategies import pytrees, rules_for, shapes, units_for

inits = fs.initializers
Key = inits.Key
MESHES = [Mesh({"fsdp": 1}), Mesh({"fsdp": 2}), Mesh({"fsdp": 4}), Mesh({"dp": 2, "fsdp": 2})]

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
ONE = Mesh({"fsdp": 1})


def _index_times(u, index, shape):
    return index.double() * 0.5 - u


@st.composite
def abstract_leaves(draw):
    shape = draw(shapes(max_ndim=3, max_side=6))
    dtype = draw(st.sampled_from((*FLOATS, torch.int64)))
    return torch.empty(shape, dtype=dtype, device="meta")


@st.composite
def initializers_for(draw, leaf):
    choices = [inits.zeros, inits.ones, inits.constant(3), inits.elementwise(_index_times)]
    if leaf.dtype.is_floating_point:
        choices += [
            inits.constant(-0.25),
            inits.normal(
                std=draw(st.sampled_from([0.02, 1.0])), mean=draw(st.sampled_from([0.0, 1.5]))
            ),
            inits.uniform(-2.0, 0.5),
            inits.truncated_normal(std=0.1, lower=draw(st.sampled_from([-2.0, -0.5])), upper=1.0),
        ]
        if leaf.ndim >= 2:
            choices += [
                inits.xavier_uniform(),
                inits.xavier_normal(gain=2.0),
                inits.kaiming_uniform(a=0.1),
                inits.kaiming_normal(mode="fan_out", nonlinearity="relu"),
                inits.lecun_normal(),
                inits.orthogonal(),
            ]
    return draw(st.sampled_from(choices))


@st.composite
def cases(draw):
    abstract = draw(
        pytrees(abstract_leaves(), max_leaves=4).filter(lambda t: 1 <= len(tree.leaves(t)) <= 4)
    )
    paths, leaves, treedef = tree.flatten_with_paths(abstract)
    chosen = [draw(initializers_for(leaf)) for leaf in leaves]
    if draw(st.booleans()):
        init = tree.unflatten(treedef, chosen)
    else:  # rules: exact paths in any order, the rest to a catch-all that fits any dtype
        ruled = [draw(st.booleans()) for _ in paths]
        init = [(p, i) for p, i, r in zip(paths, chosen, ruled) if r]
        init = draw(st.permutations(init))
        if not all(ruled):
            init.append(("**", inits.elementwise(_index_times)))
    mesh = draw(st.sampled_from(MESHES[::-1]))  # hypothesis favours the first: the largest
    strategy = draw(st.sampled_from(STRATEGIES))
    p = plan(
        abstract,
        mesh,
        strategy=strategy,
        rules=draw(rules_for(abstract, mesh, axes=shard_axes(strategy, mesh))),
        units=draw(units_for(abstract)),
        layout=draw(st.sampled_from(["leaf", "flat"])),
    )
    return abstract, p, init, draw(st.integers(0, 2**64 - 1))


def _reassemble(per_rank):
    """Every full leaf, in leaf order, from every rank's flat buffers (one process)."""
    flats = [flats_of(s) for s in per_rank]
    leaves = {}
    for i, flat in enumerate(flats[0]):
        stacked = torch.stack([f[i].data for f in flats])  # (world_size, numel)
        for slot, leaf in zip(flat.layout.slots, unpack_gathered(flat.layout, stacked)):
            leaves[slot.index] = leaf
    return [leaves[i] for i in sorted(leaves)]


@settings(max_examples=80)
@given(cases())
def test_every_mesh_gives_the_values_of_one_rank(case):
    """Reassembled shards == the one-rank result == each initializer on its whole leaf, bit for bit."""
    abstract, p, init, seed = case
    reference = tree.leaves(
        fs.unshard(materialize_for_rank(abstract, plan(abstract, ONE), init, 0, seed=seed))
    )
    per_leaf = resolve_init(init, p)
    for leaf, full, initializer in zip(p.leaves, reference, per_leaf):
        assert torch.equal(full, initializer(Key(seed, leaf.path), leaf.shape, leaf.dtype)), (
            leaf.path
        )
    per_rank = [materialize_for_rank(abstract, p, init, r, seed=seed) for r in range(p.mesh.size)]
    full = _reassemble(per_rank)
    for leaf, got, want in zip(p.leaves, full, reference):
        assert got.dtype == want.dtype == leaf.dtype, leaf.path
        assert torch.equal(got, want), leaf.path
    full_tree = tree.unflatten(p.treedef, full)
    for rank, sharded in enumerate(per_rank):
        expected = flats_of(shard_for_rank(full_tree, p, rank))
        for got, want in zip(flats_of(sharded), expected, strict=True):
            assert got.layout == want.layout
            assert got.rank == want.rank == rank
            assert torch.equal(got.data, want.data), (rank, got.layout.unit)  # padding zero too


def test_a_rank_generates_in_blocks_never_a_whole_leaf(monkeypatch):
    """Every generated index tensor (elementwise's and the counter RNG's) has at most BLOCK_NUMEL elements."""
    monkeypatch.setattr(fill, "BLOCK_NUMEL", 7)
    sizes = []
    uniform = counter_rng.uniform

    def counting(key, index):
        sizes.append(index.numel())
        return uniform(key, index)

    monkeypatch.setattr(counter_rng, "uniform", counting)
    abstract = {"a": torch.empty(10, 13, device="meta"), "b": torch.empty(3, 5, 4, device="meta")}
    p = plan(abstract, Mesh({"fsdp": 2}), rules=[("b", fs.P(None, "fsdp"))])
    init = [("a", inits.normal(0.02)), ("b", inits.elementwise(lambda u, i, s: u))]
    out = materialize_for_rank(abstract, p, init, 1, seed=0)
    assert max(sizes) <= 7
    assert sum(sizes) == out["a"].local.numel() + out["b"].local.numel()  # each element once
    monkeypatch.setattr(fill, "BLOCK_NUMEL", 1 << 20)
    again = materialize_for_rank(abstract, p, init, 1, seed=0)
    assert all(torch.equal(x.local, y.local) for x, y in zip(tree.leaves(out), tree.leaves(again)))


def test_materialize_outside_a_run_is_the_one_rank_materialize():
    abstract = {"w": torch.empty(4, 3, device="meta"), "i": torch.empty(2, dtype=torch.int64)}
    p = plan(abstract, ONE)
    init = {"w": inits.kaiming_uniform(), "i": inits.constant(7)}
    got = fs.materialize(abstract, p, init, seed=5)
    want = materialize_for_rank(abstract, p, init, 0, seed=5)
    assert all(torch.equal(a.local, b.local) for a, b in zip(tree.leaves(got), tree.leaves(want)))
    assert got["w"].device == torch.device("cpu")
    assert torch.equal(got["i"].local, torch.tensor([7, 7]))
    with pytest.raises(
        ValueError, match=r"Mesh\(\{'fsdp': 2\}\) has 2 ranks but the world size is 1"
    ):
        fs.materialize(abstract, plan(abstract, Mesh({"fsdp": 2})), init)


def test_real_tensors_are_read_for_their_shape_and_dtype_only():
    abstract = {"w": torch.full((4, 2), 9.0)}
    p = plan(abstract, ONE)
    got = fs.unshard(materialize_for_rank(abstract, p, [("**", inits.normal())], 0, seed=1))
    assert torch.equal(got["w"], inits.normal()(Key(1, "w"), (4, 2)))
    assert torch.equal(abstract["w"], torch.full((4, 2), 9.0))


def _materialize_and_unshard(abstract, p, init, seed):
    sharded = fs.materialize(abstract, p, init, seed=seed)
    mine = materialize_for_rank(abstract, p, init, fs.rank(), seed=seed)
    same = all(torch.equal(a.data, b.data) for a, b in zip(flats_of(sharded), flats_of(mine)))
    return same, fs.unshard(sharded)


def test_unshard_of_materialize_at_two_ranks_equals_one_rank(pools):
    abstract = {
        "embed": torch.empty(7, 5, device="meta"),
        "blocks": [{"w": torch.empty(5, 3, device="meta"), "b": torch.empty(3, device="meta")}] * 2,
        "scale": torch.empty((), dtype=torch.bfloat16, device="meta"),
    }
    init = [
        ("**/b", inits.zeros),
        ("blocks/*/w", inits.xavier_normal()),
        ("scale", inits.ones),
        ("**", inits.truncated_normal(0.02)),
    ]
    reference = fs.unshard(fs.materialize(abstract, plan(abstract, ONE), init, seed=11))
    runs: list[tuple[Mesh, Strategy]] = [
        (Mesh({"fsdp": 2}), "full_shard"),
        (Mesh({"dp": 2}), "no_shard"),
    ]
    for mesh, strategy in runs:
        p = plan(abstract, mesh, units=["blocks/*"], strategy=strategy)
        for same, full in pools.run(2, _materialize_and_unshard, abstract, p, init, 11):
            assert same
            for a, b in zip(tree.leaves(full), tree.leaves(reference), strict=True):
                assert a.dtype == b.dtype
                assert torch.equal(a, b)


ABSTRACT = {"w": torch.empty(4, 2, device="meta"), "b": torch.empty(2, device="meta")}
PLAN = plan(ABSTRACT, ONE)


@pytest.mark.parametrize(
    ("abstract", "init", "error", "message"),
    [
        (
            {"w": torch.empty(4, 2, device="meta")},
            [("**", inits.zeros)],
            ValueError,
            r"abstract does not have the plan's tree structure: missing \['b'\], unexpected \[\]",
        ),
        (
            {"w": torch.empty(4, 3, device="meta"), "b": torch.empty(2, device="meta")},
            [("**", inits.zeros)],
            ValueError,
            r"^w: leaf is \(4, 3\) torch.float32 but the plan has \(4, 2\) torch.float32",
        ),
        (
            {"w": torch.empty(4, 2, device="meta"), "b": 0.0},
            [("**", inits.zeros)],
            TypeError,
            r"^b: leaf is a float, not a torch.Tensor",
        ),
        (
            ABSTRACT,
            {"w": inits.zeros},
            ValueError,
            r"init is not a pytree of initializers with the params' structure: missing \['b'\].*\('\*\*', ",
        ),
        (
            ABSTRACT,
            {"w": inits.zeros, "b": 0.5},
            TypeError,
            r"^b: float 0.5 is not an initializer; use fs.initializers.constant\(0.5\)",
        ),
        (
            ABSTRACT,
            {"w": inits.zeros, "b": torch.zeros(2)},
            TypeError,
            r"^b: a tensor \(2,\) torch.float32 is not an initializer; init takes initializers, not values",
        ),
        (
            ABSTRACT,
            [("w", inits.zeros)],
            ValueError,
            r"^b: no init rule matches this leaf; .* or end the rules with a catch-all \('\*\*', ",
        ),
        (
            ABSTRACT,
            [("**", inits.zeros), ("head/*", inits.ones)],
            ValueError,
            r"init rules\[1\] \('head/\*', ones\) initializes no leaf: it matches no leaf \(leaf paths look like 'b', 'w'\)",
        ),
        (
            ABSTRACT,
            [("**", inits.zeros), ("w", inits.ones)],
            ValueError,
            r"init rules\[1\] \('w', ones\) initializes no leaf: every leaf it matches is initialized by an earlier rule \(rules\[0\]\)",
        ),
        (
            ABSTRACT,
            [("**", 0.02)],
            TypeError,
            r"init rules\[0\] \('\*\*', 0.02\): float 0.02 is not an initializer",
        ),
        (
            ABSTRACT,
            [("b", inits.xavier_uniform()), ("**", inits.zeros)],
            ValueError,
            r"^b: xavier_uniform\(\) scales by fan_in/fan_out, which a leaf of shape \(2,\) does not have",
        ),
    ],
)
def test_bad_input_names_the_leaf_and_the_fix(abstract, init, error, message):
    with pytest.raises(error, match=message):
        materialize_for_rank(abstract, PLAN, init, 0)


def test_a_random_initializer_on_an_integer_leaf_is_a_type_error_on_every_rank():
    abstract = {"step": torch.empty(3, dtype=torch.int64, device="meta")}
    p = plan(abstract, Mesh({"fsdp": 4}))
    for rank in range(4):  # rank 3 holds none of it, and refuses it all the same
        with pytest.raises(
            TypeError, match=r"^step: normal\(\) draws random values but the leaf is torch.int64"
        ):
            materialize_for_rank(abstract, p, [("**", inits.normal())], rank)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"seed": -1}, ValueError, r"seed must be in \[0, 2\*\*64\)"),
        ({"seed": 1.5}, TypeError, r"seed must be an int"),
        ({"rank": 1}, ValueError, r"rank must be an int in \[0, 1\)"),
        ({"device": "nowhere"}, ValueError, r"device='nowhere' is not a device"),
    ],
)
def test_bad_options_are_refused(kwargs, error, message):
    rank = kwargs.pop("rank", 0)
    with pytest.raises(error, match=message):
        materialize_for_rank(ABSTRACT, PLAN, [("**", inits.zeros)], rank, **kwargs)
