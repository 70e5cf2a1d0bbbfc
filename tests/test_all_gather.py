"""Every all-gather algorithm equals gloo's own ``all_gather_into_tensor`` bit for bit.

The reference is every member's input, rebuilt in the test process from the
same seeds, and ``"native"``'s result on the same rank: a gather only moves
bytes, so every algorithm must match both exactly, in every dtype. Groups are
the world at W=2 and W=4 and both axes of a 2x2 mesh (``("dp",)`` pairs the
non-adjacent ranks 0-2 and 1-3). A failure names the algorithm, the group, the
dtype and the size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.comm import collectives, groups, transport
from funcshard._src.comm.collectives import Ledger
from tests.ring_timeout import check_a_ring_that_a_peer_never_joins

ag = transport.ALL_GATHER  # the all-gather's algorithms on gloo

ALGORITHMS: list[str] = [a for a in ag.ALGORITHMS if a != "auto"]
SIZES = [1, 7, 1001]  # numel per rank: odd, and a single element
DTYPES = ["float32", "bfloat16", "int64"]
MESHES = {  # (mesh, axes of the group)
    "world2": ({"fsdp": 2}, ("fsdp",)),
    "world4": ({"fsdp": 4}, ("fsdp",)),
    "2x2/fsdp": ({"dp": 2, "fsdp": 2}, ("fsdp",)),
    "2x2/dp": ({"dp": 2, "fsdp": 2}, ("dp",)),
}


def _flat(rank: int, n: int, dtype: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + n)
    if dtype == "int64":  # beyond 2**53: a trip through a float would show
        return torch.randint(-(2**62), 2**62, (n,), generator=gen)
    return torch.randn(n, generator=gen).to(getattr(torch, dtype))


def _gather_everywhere(
    mesh: dict[str, int], axes: tuple[str, ...], n: int, dtype: str
) -> dict[str, Any]:
    """Every algorithm once into a NaN-filled ``out=``; the results, whether in out, ledger counts."""
    bound = groups.bind(fs.Mesh(mesh))
    g = collectives.group_size(bound, axes)
    results: dict[str, Any] = {}
    for algorithm in ALGORITHMS:
        ledger = Ledger()
        out = torch.full((g * n,), -1, dtype=getattr(torch, dtype))
        flat = _flat(bound.rank, n, dtype)
        pending = collectives.all_gather(
            flat, bound, axes, out=out, ledger=ledger, tag="u", algorithm=algorithm
        )
        result = pending.wait()
        written = result.data_ptr() == out.data_ptr() and result.shape == (g, n)
        unchanged = torch.equal(flat, _flat(bound.rank, n, dtype))
        results[algorithm] = (result.clone(), written and unchanged, ledger.total())
    group = bound.group(axes)
    assert group is not None
    me = _members(mesh, axes, bound.rank).index(bound.rank)
    for algorithm in ("ring", "direct"):
        rows = torch.full((g, n), -1, dtype=getattr(torch, dtype))
        rows[me] = _flat(bound.rank, n, dtype)  # the input is this rank's row of the output
        ag.start(algorithm, rows[me], rows, group).wait()
        results[f"{algorithm}/in place"] = (rows, True, None)
    return results


def _members(mesh: dict[str, int], axes: tuple[str, ...], rank: int) -> list[int]:
    """Global ranks of ``rank``'s group, in group-rank order."""
    return next(m for m in fs.Mesh(mesh).groups(list(axes)) if rank in m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", sorted(MESHES))
def test_every_algorithm_equals_native_and_every_members_input(pools, name, n, dtype):
    mesh, axes = MESHES[name]
    world = fs.Mesh(mesh).size
    per_rank = pools.run(world, _gather_everywhere, mesh, axes, n, dtype)
    for rank, results in enumerate(per_rank):
        members = _members(mesh, axes, rank)
        g = len(members)
        exact = torch.stack([_flat(m, n, dtype) for m in members])
        native = results["native"][0]
        for algorithm, (got, in_out, sent) in results.items():
            where = f"{algorithm} on {name}, rank {rank}, {dtype}, n={n}"
            assert in_out, f"{where}: the result is not the out= buffer, or flat changed"
            if sent is not None:
                itemsize = exact.element_size()
                assert sent == g * n * itemsize * (g - 1) // g, f"{where}: ledger {sent}"
            assert torch.equal(got, native), f"{where}: {got} != native {native}"
            assert torch.equal(got, exact), f"{where}: {got} != the inputs {exact}"


def _rings_in_flight_together(world: int) -> list[bool]:
    """Two ring gathers of different sizes, a direct one and a ring reduce-scatter in flight at
    once, waited out of order: point-to-point messages pair by order (see [Note: all-gather
    steps] in ``comm/transport.py``)."""
    bound = groups.bind(fs.Mesh({"fsdp": world}))
    a = collectives.all_gather(_flat(bound.rank, 7, "float32"), bound, ("fsdp",), algorithm="ring")
    rows = torch.ones(world, 5) * (bound.rank + 1)
    summed = collectives.reduce_scatter(rows, bound, ("fsdp",), algorithm="ring")
    c = collectives.all_gather(
        _flat(bound.rank, 33, "float32"), bound, ("fsdp",), algorithm="direct"
    )
    b = collectives.all_gather(
        _flat(bound.rank, 1001, "float32"), bound, ("fsdp",), algorithm="ring_overlapped"
    )
    got_b, got_summed, got_c, got_a = b.wait(), summed.wait(), c.wait(), a.wait()
    return [
        torch.equal(got_a, torch.stack([_flat(m, 7, "float32") for m in range(world)])),
        torch.equal(got_b, torch.stack([_flat(m, 1001, "float32") for m in range(world)])),
        torch.equal(got_c, torch.stack([_flat(m, 33, "float32") for m in range(world)])),
        torch.equal(got_summed, torch.full((5,), world * (world + 1) / 2)),
    ]


@pytest.mark.parametrize("world", [2, 4])
def test_rings_in_flight_together_pair_their_messages(pools, world):
    for rank, ok in enumerate(pools.run(world, _rings_in_flight_together, world)):
        assert ok == [True] * 4, f"rank {rank}: (gather a, gather b, direct c, reduce-scatter) {ok}"


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_a_gather_that_a_peer_never_joins_fails_in_time_and_leaves_the_rank_out_of_step(
    pools, algorithm
):
    check_a_ring_that_a_peer_never_joins(pools, "all_gather", algorithm)


def _overlapping_output(algorithm: str) -> str:
    bound = groups.bind(fs.Mesh({"fsdp": 2}))
    group = bound.group(("fsdp",))
    assert group is not None
    rows = torch.zeros(2, 4)
    try:
        ag.start(algorithm, rows[0, 1:], rows[:, :3], group)  # the input straddles two rows
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_a_point_to_point_gather_refuses_an_output_that_overlaps_its_input(pools, algorithm):
    for error in pools.run(2, _overlapping_output, algorithm):
        assert "overlaps its input other than as this rank's row" in error


def test_auto_picks_shared_memory_on_gloo_and_never_off_it():
    assert ag.resolve("auto", "nccl", 2, 1 << 30) == "native"
    assert ag.resolve("shm", "nccl", 2, 1 << 30) == "native"  # never change CUDA behaviour
    for w, n in [(2, 1), (2, 1 << 30), (4, 1 << 20)]:
        assert ag.resolve("auto", "gloo", w, n) == "shm"
    assert ag.fallback("shm", 2, 64) == "ring_overlapped"


def test_auto_keeps_native_off_gloo_and_picks_point_to_point_for_large_buffers_on_gloo(
    monkeypatch,
):
    monkeypatch.setenv("FUNCSHARD_SHM", "0")  # the socket algorithms, as without shared memory
    assert ag.resolve("auto", "nccl", 2, 1 << 30) == "native"
    assert ag.resolve("ring", "nccl", 2, 1 << 30) == "native"  # never change CUDA behaviour
    assert ag.resolve("auto", "gloo", 2, ag.RING_MIN_BYTES) == "ring_overlapped"
    assert ag.resolve("auto", "gloo", 2, ag.RING_MIN_BYTES - 1) == "native"
    # more ranks: every send at once, with no staging of the whole output (docs/performance.md)
    assert ag.resolve("auto", "gloo", 4, ag.RING_MIN_BYTES) == "direct"
    assert ag.resolve("auto", "gloo", 8, ag.RING_MIN_BYTES - 1) == "native"
    assert ag.resolve("ring", "gloo", 4, 10) == "ring"


def test_unknown_algorithms_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="all-gather algorithm 'tree' is unknown"):
        ag.resolve("tree", "gloo", 2, 10)  # pyright: ignore[reportArgumentType]
    monkeypatch.setenv(ag.ALGORITHM_ENV, "ring")
    assert ag.default_algorithm() == "ring"
    monkeypatch.setenv(ag.ALGORITHM_ENV, "tree")
    with pytest.raises(ValueError, match="FUNCSHARD_ALL_GATHER='tree'"):
        ag.default_algorithm()
