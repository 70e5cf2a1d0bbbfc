"""``fs.data.shard_indices`` is ``DistributedSampler``'s split, replica by replica, over a mesh's axes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler, TensorDataset

import funcshard as fs
from tests.strategies import meshes


@st.composite
def cases(draw: st.DrawFn) -> dict:
    mesh = draw(meshes(max_axes=3))
    names = list(mesh.axis_names)
    axes = draw(
        st.one_of(
            st.none(),
            st.permutations(names).flatmap(lambda p: st.integers(0, len(p)).map(lambda k: p[:k])),
        )
    )
    return {
        "n": draw(st.integers(0, 40)),
        "mesh": mesh,
        "axes": axes,
        "seed": draw(st.integers(0, 2**31)),
        "epoch": draw(st.integers(0, 5)),
        "shuffle": draw(st.booleans()),
        "drop_last": draw(st.booleans()),
    }


@given(cases())
def test_every_rank_gets_distributed_samplers_indices_for_its_replica(case):
    """Over ``axes`` the ranks are the sampler's replicas (row-major in the order given); ranks that
    differ only on the other axes read the same examples."""
    mesh, axes = case["mesh"], case["axes"]
    names = list(mesh.axis_names if axes is None else axes)
    replicas = 1
    for a in names:
        replicas *= mesh.axis_size(a)
    seen: dict[int, list[int]] = {}
    for rank in range(mesh.size):
        coords = dict(zip(mesh.axis_names, mesh.coords(rank)))
        replica = 0
        for a in names:
            replica = replica * mesh.axis_size(a) + coords[a]
        sampler = DistributedSampler(
            TensorDataset(torch.arange(case["n"])),
            num_replicas=replicas,
            rank=replica,
            shuffle=case["shuffle"],
            seed=case["seed"],
            drop_last=case["drop_last"],
        )
        sampler.set_epoch(case["epoch"])
        got = fs.data.shard_indices(
            case["n"],
            mesh,
            rank=rank,
            axes=axes,
            seed=case["seed"],
            epoch=case["epoch"],
            shuffle=case["shuffle"],
            drop_last=case["drop_last"],
        )
        assert got == list(sampler), (rank, replica)
        assert seen.setdefault(replica, got) == got
    if case["drop_last"]:  # the replicas split what is kept, each example once
        everything = sorted(i for part in seen.values() for i in part)
        assert len(everything) == len(set(everything)) == (case["n"] // replicas) * replicas


def _mine() -> list[int]:
    return fs.data.shard_indices(9, shuffle=False)


def test_defaults_are_this_rank_of_every_rank(pools):
    assert pools.run(2, _mine) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 0]]
    assert _mine() == list(range(9))  # one process: everything


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((-1,), {}, r"n must be an int >= 0 \(the dataset size\), got -1"),
        ((3, fs.Mesh({"fsdp": 2})), {}, r"the mesh has 2 ranks but the world 1; pass the mesh"),
        ((3, fs.Mesh({"fsdp": 2})), {"rank": 2}, r"rank 2|outside"),
        (
            (3, fs.Mesh({"fsdp": 2})),
            {"rank": 0, "axes": ["dp"]},
            r"mesh axis 'dp' is not in the mesh",
        ),
        (
            (8,),
            {"epoch": 2.5},
            r"epoch must be an int >= 0 \(below 2\*\*62\), got 2.5; count epochs",
        ),
        ((8,), {"epoch": -1}, r"epoch must be an int >= 0"),
        ((8,), {"epoch": True}, r"epoch must be an int >= 0"),
        ((8,), {"seed": "0"}, r"seed must be an int >= 0"),
        ((8,), {"seed": 2**64}, r"seed must be an int >= 0 \(below 2\*\*62\)"),
        ((8,), {"shuffle": 1}, r"shuffle must be True or False, got 1"),
        (
            (8, fs.Mesh({"dp": 2, "fsdp": 2})),
            {"rank": 0, "axes": ["fsdp", "fsdp"]},
            r"axes \['fsdp', 'fsdp'\] name \['fsdp'\] more than once",
        ),
        ((8, fs.Mesh({"fsdp": 2})), {"rank": 0, "axes": "fsdp"}, r"pass axes=\['fsdp'\]"),
    ],
)
def test_bad_input_names_what_is_wrong(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fs.data.shard_indices(*args, **kwargs)
