"""Tensors and specs to JAX and back: zero-copy where the memory allows, shards where device id = rank.

Zero-copy is checked by pointer equality (``data_ptr`` against JAX's
``unsafe_buffer_pointer``), copies by their inequality; shards against funcshard's
own ``shard_for_rank``; shardings against JAX's ``devices_indices_map``. Runs with
JAX on eight host devices (``nox -s interop``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard._src.shard.shard import shard_for_rank
from funcshard.interop import from_jax, to_jax

jax = pytest.importorskip("jax", reason="JAX is the `jax` extra: run `nox -s interop`")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh as JaxMesh  # noqa: E402
from jax.sharding import NamedSharding as JaxNamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as JaxP  # noqa: E402

pytestmark = pytest.mark.interop


def aligned(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    t = torch.arange(n).to(dtype)
    assert t.data_ptr() % 64 == 0, "torch's CPU allocator aligns to 64 bytes"
    return t


def pointer(array) -> int:
    return array.unsafe_buffer_pointer()


# -- torch -> JAX ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_to_jax_shares_compact_aligned_memory(dtype):
    t = aligned(64, dtype).reshape(8, 8)
    array = to_jax({"w": t}, copy=False)["w"]
    assert pointer(array) == t.data_ptr()
    assert array.dtype == {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}.get(
        dtype, jnp.int32
    )
    np.testing.assert_array_equal(np.asarray(array, np.float32), t.float().numpy())


@pytest.mark.parametrize(
    ("view", "reason"),
    [
        (lambda t: t[1:17], r"its first byte is 4 bytes past a 64-byte boundary"),
        (lambda t: t[::2], r"it is not contiguous \(strides \(2,\)\)"),
        (lambda t: t.reshape(8, 8).T, r"it is not contiguous \(strides \(1, 8\)\)"),
    ],
    ids=["unaligned", "strided", "transposed"],
)
def test_to_jax_copies_unaligned_or_strided_tensors_and_copy_false_refuses(view, reason):
    t = view(aligned(64))
    array = to_jax(t)
    assert pointer(array) != t.data_ptr()
    np.testing.assert_array_equal(np.asarray(array), t.numpy())
    with pytest.raises(
        ValueError,
        match=r"<root>: cannot hand this torch.float32 tensor to JAX without a copy: " + reason,
    ):
        to_jax(t, copy=False)


def test_to_jax_copy_true_copies_and_detaches_tensors_that_require_grad():
    t = aligned(16).requires_grad_()
    array = to_jax([t], copy=True)[0]
    assert pointer(array) != t.data_ptr()
    shared = to_jax([t])[0]
    assert pointer(shared) == t.data_ptr()
    with torch.no_grad():
        t.add_(1)  # an in-place update (an optimizer step) shows through the shared array
    np.testing.assert_array_equal(np.asarray(shared), t.detach().numpy())
    np.testing.assert_array_equal(np.asarray(array), t.detach().numpy() - 1)


def test_int64_needs_a_copy_without_x64():
    assert not jax.config.jax_enable_x64
    assert to_jax(torch.arange(3)).dtype == jnp.int32
    with pytest.raises(ValueError, match=r"JAX copied this torch.int64 tensor into a int32 array"):
        to_jax(torch.arange(3), copy=False)


def test_to_jax_leaves_other_leaves_alone():
    out = to_jax({"step": 7, "name": "w", "w": aligned(4)})
    assert out["step"] == 7
    assert out["name"] == "w"


# -- JAX -> torch ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_from_jax_shares_memory_and_copy_true_copies(dtype):
    array = jnp.arange(16, dtype=dtype)
    t = from_jax({"w": array})["w"]
    assert t.data_ptr() == pointer(array)
    assert t.dtype == (torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32)
    copied = from_jax(array, copy=True)
    assert copied.data_ptr() != pointer(array)
    assert torch.equal(copied, t)


def test_a_round_trip_is_zero_copy_both_ways():
    t = aligned(32, torch.bfloat16)
    back = from_jax(to_jax(t, copy=False), copy=False)
    assert back.data_ptr() == t.data_ptr()
    assert torch.equal(back, t)


def jax_mesh(mesh: fs.Mesh) -> JaxMesh:
    return JaxMesh(np.array(jax.devices()[: mesh.size]).reshape(mesh.shape), mesh.axis_names)


def test_a_sharded_array_needs_a_rank():
    mesh = JaxMesh(np.array(jax.devices()[:2]), ("fsdp",))
    array = jax.device_put(jnp.arange(8.0), JaxNamedSharding(mesh, JaxP("fsdp")))
    with pytest.raises(
        ValueError,
        match=r"w: a jax.Array of shape \(8,\) sharded over 2 devices .* pass rank=<device id>",
    ):
        from_jax({"w": array})
    with pytest.raises(
        ValueError, match=r"w: no shard of this array is on device 5 .* devices \[0, 1\]"
    ):
        from_jax({"w": array}, rank=5)
    assert torch.equal(from_jax(array, rank=1), torch.arange(4.0, 8.0))
    replicated = jax.device_put(jnp.arange(8.0), JaxNamedSharding(mesh, JaxP()))
    assert torch.equal(from_jax(replicated), torch.arange(8.0))  # every copy is the whole array


# -- shards and shardings ---------------------------------------------------------------


def params() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(16, 8, generator=gen),
        "blocks": [{"w": torch.randn(8, 12, generator=gen), "b": torch.randn(12, generator=gen)}],
        "scale": torch.tensor(1.5),
    }


@pytest.mark.parametrize(
    ("axes", "rules"),
    [
        ({"fsdp": 2}, []),
        ({"fsdp": 4}, [("blocks/*/w", P(None, "fsdp"))]),
        ({"dp": 2, "fsdp": 2}, [("embed", P(("dp", "fsdp"))), ("blocks/*/w", P("dp", "fsdp"))]),
    ],
)
def test_plan_shardings_place_each_rank_shard_on_its_device(axes, rules):
    """plan.to_jax_shardings: JAX's device r holds what funcshard's rank r holds, for jit too."""
    p = params()
    mesh = fs.Mesh(axes)
    plan = fs.plan(p, mesh, rules=rules, units=["blocks/*"], strict=True)
    shardings = plan.to_jax_shardings(jax_mesh(mesh))
    assert fs.tree.flatten(shardings)[1] == fs.tree.flatten(p)[1]
    for leaf, sharding in zip(plan.leaves, fs.tree.leaves(shardings)):
        assert sharding.spec == JaxP(*leaf.spec)
        expected = {d.id: i for d, i in sharding.devices_indices_map(leaf.shape).items()}
        assert leaf.sharding(mesh).indices(leaf.shape) == expected
    arrays = jax.device_put(to_jax(p), shardings)
    for rank in range(mesh.size):
        mine = from_jax(arrays, rank=rank)
        local = fs.tree.map(lambda s: s.local, shard_for_rank(p, plan, rank))
        for a, b in zip(fs.tree.leaves(mine), fs.tree.leaves(local)):
            assert torch.equal(a, b)
        # and back: this rank's shards as JAX arrays
        back = to_jax(shard_for_rank(p, plan, rank))
        for a, b in zip(fs.tree.leaves(back), fs.tree.leaves(local)):
            np.testing.assert_array_equal(np.asarray(a), b.numpy())
    total = jax.jit(
        lambda t: sum(jnp.sum(x) for x in jax.tree.leaves(t)), in_shardings=(shardings,)
    )
    np.testing.assert_allclose(
        float(total(arrays)), sum(float(x.sum()) for x in fs.tree.leaves(p)), rtol=1e-5
    )


@pytest.mark.parametrize(
    ("names", "shape"), [(("data",), (2,)), (("fsdp",), (4,)), (("fsdp", "dp"), (1, 2))]
)
def test_a_jax_mesh_with_other_axes_is_an_error(names, shape):
    plan = fs.plan(params(), fs.Mesh({"fsdp": 2}))
    other = JaxMesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)
    with pytest.raises(
        ValueError,
        match=r"the JAX mesh has axes .*, the plan's mesh \{'fsdp': 2\}; build the JAX mesh with the same axis names",
    ):
        plan.to_jax_shardings(other)


def test_a_leaf_of_the_flat_layout_is_refused_with_the_fix():
    params = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    sp = shard_for_rank(params, fs.plan(params, fs.Mesh({"fsdp": 2}), layout="flat"), 1)
    with pytest.raises(ValueError, match=r"b: unit '<root>' is in the flat layout.*fs.unshard"):
        to_jax(sp)
    leafwise = shard_for_rank(params, fs.plan(params, fs.Mesh({"fsdp": 2})), 1)
    assert set(to_jax(leafwise)) == {"w", "b"}
