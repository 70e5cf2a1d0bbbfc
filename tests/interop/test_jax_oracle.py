"""funcshard against JAX itself: index maps, spec errors, pytree order and paths, device_put.

Runs in ``nox -s interop`` (JAX for the CPU with eight forced host devices);
device id = rank throughout. A failure names the drawn mesh, spec and shape.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import funcshard as fs
from funcshard import Mesh, NamedSharding, P, SpecError
from funcshard._src import tree
from funcshard._src.shard.shard import shard_for_rank
from tests.strategies import even_shapes_for, meshes, pytrees, specs_for

jax = pytest.importorskip("jax", reason="JAX is the oracle here: run `nox -s interop`")
from jax.sharding import Mesh as JaxMesh  # noqa: E402
from jax.sharding import NamedSharding as JaxNamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as JaxP  # noqa: E402

pytestmark = pytest.mark.interop


def jax_mesh(mesh: Mesh) -> JaxMesh:
    devices = np.array(jax.devices()[: mesh.size]).reshape(mesh.shape)
    return JaxMesh(devices, mesh.axis_names)


def jax_sharding(mesh: Mesh, spec: P) -> JaxNamedSharding:
    return JaxNamedSharding(jax_mesh(mesh), JaxP(*spec))


def test_eight_host_devices():
    assert len(jax.devices()) == 8


@st.composite
def even_cases(draw):
    mesh = draw(meshes(max_size=8))
    ndim = draw(st.integers(0, 3))
    spec = draw(specs_for(ndim, mesh))
    return mesh, spec, draw(even_shapes_for(spec, mesh, ndim))


@given(even_cases())
def test_indices_equal_devices_indices_map(case):
    """Tuple entries, partial replication and either axis order: rank -> slices as in JAX."""
    mesh, spec, shape = case
    expected = {d.id: idx for d, idx in jax_sharding(mesh, spec).devices_indices_map(shape).items()}
    assert NamedSharding(mesh, spec).indices(shape, strict=True) == expected


def _jax_error(mesh, spec, shape):
    try:
        jax.device_put(np.zeros(shape, np.float32), jax_sharding(mesh, spec))
    except Exception as e:
        return type(e).__name__, str(e)
    return None


JAX_CATEGORY = {
    "duplicate_axis": ("DuplicateSpecError", "duplicate entries"),
    "unknown_axis": ("ValueError", "not found in mesh"),
    "too_many_entries": ("ValueError", "only valid for values of rank at least"),
    "uneven": ("IndivisibleError", "should evenly divide"),
}


@st.composite
def invalid_cases(draw):
    mesh = draw(meshes(max_size=8))
    kind = draw(st.sampled_from(sorted(JAX_CATEGORY)))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    names = list(mesh.axis_names)
    if kind == "duplicate_axis":
        axis = draw(st.sampled_from(names))
        spec = (
            P(axis, *([None] * draw(st.integers(0, ndim - 1))), axis)
            if ndim > 1
            else P((axis, axis))
        )
    elif kind == "unknown_axis":
        spec = P(*([None] * draw(st.integers(0, ndim - 1))), "zz")
    elif kind == "too_many_entries":
        spec = P(*([None] * (ndim + draw(st.integers(1, 2)))))
    else:
        big = [a for a in names if mesh.axis_size(a) > 1]
        if not big:
            mesh, big = Mesh({"x": 2}), ["x"]
        axis = draw(st.sampled_from(big))
        n = mesh.axis_size(axis)
        shape = (n * draw(st.integers(0, 2)) + draw(st.integers(1, n - 1)), *shape[1:])
        spec = P(axis)
    return mesh, spec, shape, kind


@given(invalid_cases())
def test_invalid_specs_fail_in_the_same_category_as_jax(case):
    mesh, spec, shape, kind = case
    with pytest.raises(SpecError) as info:
        NamedSharding(mesh, spec).validate(shape, path="leaf", strict=True)
    assert info.value.kind == kind
    name, fragment = JAX_CATEGORY[kind]
    jax_error = _jax_error(mesh, spec, shape)
    assert jax_error is not None, f"JAX accepted {spec} on {shape}"
    assert jax_error[0] == name, jax_error
    assert fragment in jax_error[1], jax_error


NT = namedtuple("NT", ["y", "x"])


@dataclasses.dataclass
class Block:
    w: object
    b: object
    name: str = "blk"


fs.tree.register_dataclass(Block, data_fields=["w", "b"], meta_fields=["name"])
jax.tree_util.register_dataclass(Block, data_fields=["w", "b"], meta_fields=["name"])

CORPUS = [
    {"b": 1, "a": 2},
    {"blocks": [{"wq": 1, "wo": 2}, {"wq": 3, "wo": 4}], "embed": 5},
    OrderedDict([("z", 1), ("a", (2, 3))]),
    defaultdict(list, {"q": 1, "p": [2, None]}),
    NT(y=1, x={"k": 2}),
    [None, (), [], {}, (1,)],
    {"blk": Block(w=1, b=2), "n": None},
    {3: 1, 1: 2},
    7,
]


def _jax_path(keys) -> str:
    parts = []
    for k in keys:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return "/".join(parts)


def _compare_with_jax(t):
    flat, _ = jax.tree_util.tree_flatten_with_path(t)
    paths, leaves, treedef = tree.flatten_with_paths(t)
    assert leaves == [leaf for _, leaf in flat]
    assert paths == [_jax_path(keys) for keys, _ in flat]
    assert tree.unflatten(treedef, leaves) == jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(t), leaves
    )


@pytest.mark.parametrize("t", CORPUS, ids=range(len(CORPUS)))
def test_pytree_order_and_paths_on_a_corpus(t):
    _compare_with_jax(t)


@given(pytrees(st.integers()))
def test_pytree_order_and_paths_on_drawn_trees(t):
    _compare_with_jax(t)


@st.composite
def planned_even(draw):
    mesh = draw(meshes(max_size=8))
    n = draw(st.integers(1, 4))
    params, rules = {}, []
    for i in range(n):
        ndim = draw(st.integers(0, 3))
        spec = draw(specs_for(ndim, mesh))
        shape = draw(even_shapes_for(spec, mesh, ndim))
        params[f"leaf{i}"] = torch.randn(shape, generator=torch.Generator().manual_seed(i))
        rules.append((f"leaf{i}", spec))
    return params, fs.plan(params, mesh, rules=rules, strict=True)


@given(planned_even())
def test_plan_specs_work_with_device_put(case):
    """Each device's shard of jax.device_put(x, plan spec) equals that rank's local shard."""
    params, p = case
    jmesh = jax_mesh(p.mesh)
    shardings = jax.tree.map(
        lambda s: JaxNamedSharding(jmesh, JaxP(*s)), p.specs, is_leaf=lambda x: isinstance(x, P)
    )
    arrays = jax.device_put(jax.tree.map(lambda t: t.numpy(), params), shardings)
    per_rank = [shard_for_rank(params, p, r) for r in range(p.mesh.size)]
    for path, array in zip(tree.leaf_paths(params), jax.tree.leaves(arrays)):
        for shard in array.addressable_shards:
            local = per_rank[shard.device.id][path].local
            np.testing.assert_array_equal(np.asarray(shard.data), local.numpy())
