"""Every reduce-scatter algorithm equals gloo's own ``reduce_scatter_tensor`` and the exact sum.

The reference is the sum of every rank's rows, rebuilt in the test process from
the same seeds, computed in float64 (exact for the integer-valued inputs, whose
sums every algorithm must then match bit for bit in any order). At W=2 a sum
has one addition and ``a + b == b + a``, so every algorithm matches
``"native"`` bit for bit on random inputs too; at W=4 the orders differ and
the comparison allows rounding. Groups are the world at W=2 and W=4 and both
axes of a 2x2 mesh (``("dp",)`` pairs the non-adjacent ranks 0-2 and 1-3).
A failure names the algorithm, the group, the dtype and the size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.comm import collectives, groups, transport
from funcshard._src.comm.collectives import Ledger
from tests.ring_timeout import check_a_ring_that_a_peer_never_joins

rs = transport.REDUCE_SCATTER  # the reduce-scatter's algorithms on gloo

ALGORITHMS: list[str] = [a for a in rs.ALGORITHMS if a != "auto"]
SIZES = [1, 7, 1001]  # numel per row: odd, and one row of a single element
DTYPES = ["float32", "bfloat16"]
# each of the W - 1 additions rounds once, by up to half an ulp of a partial sum of randn
# values (|sum| < 16): 2**-8 relative in bfloat16, 2**-23 in float32
TOL = {"float32": (1e-5, 1e-5), "bfloat16": (0.0, 3 * 16 * 2**-9)}  # (rtol, atol)
MESHES = {  # (mesh, axes of the group)
    "world2": ({"fsdp": 2}, ("fsdp",)),
    "world4": ({"fsdp": 4}, ("fsdp",)),
    "2x2/fsdp": ({"dp": 2, "fsdp": 2}, ("fsdp",)),
    "2x2/dp": ({"dp": 2, "fsdp": 2}, ("dp",)),
}


def _rows(rank: int, group_size: int, n: int, dtype: str, integers: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + n)
    if integers:  # exactly representable sums in bfloat16 too (|sum| <= 4 * 16 < 256)
        x = torch.randint(-16, 17, (group_size, n), generator=gen).to(torch.float32)
    else:
        x = torch.randn(group_size, n, generator=gen)
    return x.to(getattr(torch, dtype))


def _reduce_everywhere(
    mesh: dict[str, int], axes: tuple[str, ...], n: int, dtype: str, integers: bool
) -> dict[str, Any]:
    """Every algorithm once, and the ring in 3 pieces; the results and ledger counts."""
    bound = groups.bind(fs.Mesh(mesh))
    g = collectives.group_size(bound, axes)
    results: dict[str, Any] = {}
    for algorithm in ALGORITHMS:
        ledger = Ledger()
        out = torch.full((n,), float("nan"), dtype=getattr(torch, dtype))
        rows = _rows(bound.rank, g, n, dtype, integers)
        pending = collectives.reduce_scatter(
            rows, bound, axes, out=out, ledger=ledger, tag="u", algorithm=algorithm
        )
        result = pending.wait()
        results[algorithm] = (result.clone(), result.data_ptr() == out.data_ptr(), ledger.total())
    group = bound.group(axes)
    assert group is not None
    out = torch.empty(n, dtype=getattr(torch, dtype))
    rs.start(
        "ring_pipelined", _rows(bound.rank, g, n, dtype, integers), out, group, pieces=3
    ).wait()
    results["ring_pipelined/3"] = (out, True, None)
    return results


def _members(mesh: dict[str, int], axes: tuple[str, ...], rank: int) -> list[int]:
    """Global ranks of ``rank``'s group, in group-rank order."""
    return next(m for m in fs.Mesh(mesh).groups(list(axes)) if rank in m)


@pytest.mark.parametrize("integers", [True, False], ids=["integers", "random"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", sorted(MESHES))
def test_every_algorithm_equals_native_and_the_exact_sum(pools, name, n, dtype, integers):
    mesh, axes = MESHES[name]
    world = fs.Mesh(mesh).size
    per_rank = pools.run(world, _reduce_everywhere, mesh, axes, n, dtype, integers)
    for rank, results in enumerate(per_rank):
        members = _members(mesh, axes, rank)
        g, me = len(members), members.index(rank)
        exact = sum(_rows(m, g, n, dtype, integers)[me].double() for m in members)
        native = results["native"][0]
        bitwise = integers or g == 2
        for algorithm, (got, in_out, sent) in results.items():
            where = f"{algorithm} on {name}, rank {rank}, {dtype}, n={n}"
            assert in_out, f"{where}: the result is not the out= buffer"
            if sent is not None:
                itemsize = torch.finfo(getattr(torch, dtype)).bits // 8
                assert sent == g * n * itemsize * (g - 1) // g, f"{where}: ledger {sent}"
            if bitwise:
                assert torch.equal(got, native), f"{where}: {got} != native {native}"
            rtol, atol = TOL[dtype]
            torch.testing.assert_close(got.double(), exact, rtol=rtol, atol=atol, msg=where)


def test_a_ring_that_a_peer_never_joins_fails_in_time_and_leaves_the_rank_out_of_step(pools):
    check_a_ring_that_a_peer_never_joins(pools, "reduce_scatter")


def test_auto_picks_shared_memory_on_gloo_and_never_off_it():
    assert rs.resolve("auto", "nccl", 2, 1 << 30) == "native"
    assert rs.resolve("shm", "nccl", 2, 1 << 30) == "native"  # never change CUDA behaviour
    for w, n in [(2, 1), (2, 1 << 30), (4, 1 << 20)]:
        assert rs.resolve("auto", "gloo", w, n) == "shm"
    assert rs.fallback("shm", 2, 64) == "all_reduce"


def test_auto_keeps_native_off_gloo_and_picks_the_ring_for_large_buffers_on_two_gloo_ranks(
    monkeypatch,
):
    monkeypatch.setenv("FUNCSHARD_SHM", "0")  # the socket algorithms, as without shared memory
    assert rs.resolve("auto", "nccl", 2, 1 << 30) == "native"
    assert rs.resolve("ring", "nccl", 2, 1 << 30) == "native"  # never change CUDA behaviour
    assert rs.resolve("auto", "gloo", 2, rs.RING_MIN_BYTES) == "ring"
    assert rs.resolve("auto", "gloo", 2, rs.RING_MIN_BYTES - 1) == "all_reduce"
    assert rs.resolve("auto", "gloo", 4, 1 << 30) == "all_reduce"  # no clear gain measured
    assert rs.resolve("all_to_all", "gloo", 4, 10) == "all_to_all"


def test_unknown_algorithms_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="reduce-scatter algorithm 'tree' is unknown"):
        rs.resolve("tree", "gloo", 2, 10)  # pyright: ignore[reportArgumentType]
    monkeypatch.setenv(rs.ALGORITHM_ENV, "ring")
    assert rs.default_algorithm() == "ring"
    monkeypatch.setenv(rs.ALGORITHM_ENV, "tree")
    with pytest.raises(ValueError, match="FUNCSHARD_REDUCE_SCATTER='tree'"):
        rs.default_algorithm()
