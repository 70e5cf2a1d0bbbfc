"""Orbax checkpoints, written by Orbax itself, read into funcshard trees through TensorStore.

The checkpoints come from ``orbax-checkpoint`` in the three on-disk layouts it writes
(OCDBT with zarr v2, the default; a folder per array; OCDBT with zarr v3). The
expected values are the arrays that were saved; sharded loads are compared with
funcshard's own ``shard_for_rank``. A failure names the layout and the leaf path.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard._src.shard.shard import shard_for_rank
from funcshard.interop import load_orbax
from funcshard.testing import assert_trees_close

pytest.importorskip("tensorstore", reason="TensorStore is the `orbax` extra: run `nox -s interop`")

pytestmark = pytest.mark.interop

LAYOUTS = {"ocdbt": {}, "folders": {"use_ocdbt": False}, "zarr3": {"use_zarr3": True}}


def arrays() -> dict[str, Any]:
    """The saved values as float32 NumPy arrays (bf16 leaves are rounded on both sides alike)."""
    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return {
        "params": {
            "embed": f32(16, 8),
            "blocks": [{"w": f32(8, 12)}, {"w": f32(8, 12)}],
            "odd": f32(5, 3),
            "count": np.arange(6, dtype=np.int32),
        },
        "opt": {"mu": f32(4)},
    }


BF16 = {"params/blocks/0/w", "params/blocks/1/w"}


def expected() -> dict[str, Any]:
    leaves, treedef = fs.tree.flatten(arrays())
    paths = fs.tree.leaf_paths(arrays())
    return fs.tree.unflatten(
        treedef,
        [
            torch.from_numpy(x).to(torch.bfloat16) if p in BF16 else torch.from_numpy(x)
            for p, x in zip(paths, leaves)
        ],
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    ocp = pytest.importorskip("orbax.checkpoint", reason="Orbax writes the test checkpoints")
    import jax.numpy as jnp

    leaves, treedef = fs.tree.flatten(arrays())
    paths = fs.tree.leaf_paths(arrays())
    state = fs.tree.unflatten(
        treedef,
        [jnp.asarray(x, jnp.bfloat16 if p in BF16 else x.dtype) for p, x in zip(paths, leaves)],
    )
    state["step"] = 7
    out = {}
    for name, options in LAYOUTS.items():
        directory = tmp_path_factory.mktemp("orbax") / name
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**options)) as checkpointer:
            checkpointer.save(directory, args=ocp.args.PyTreeSave(state))
        out[name] = directory
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_whole_checkpoint_loads_as_torch_tensors(checkpoints, layout):
    loaded = load_orbax(checkpoints[layout])
    assert loaded.pop("step") == 7
    assert_trees_close(loaded, expected(), rtol=0, atol=0)
    assert isinstance(loaded["params"]["blocks"], list)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_subtree_loads_into_like(checkpoints, layout):
    want = expected()["params"]
    like = fs.tree.map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), want)
    loaded = load_orbax(checkpoints[layout], like, prefix="params")
    assert_trees_close(loaded, want, rtol=0, atol=0)
    assert all(t.device.type == "cpu" for t in fs.tree.leaves(loaded))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_prefix_without_like_loads_that_subtree(checkpoints, layout):
    """prefix= alone is the subtree, keyed from it (it was once ignored without like)."""
    assert_trees_close(
        load_orbax(checkpoints[layout], prefix="params"), expected()["params"], rtol=0, atol=0
    )
    blocks = load_orbax(checkpoints[layout], prefix="params/blocks")
    assert isinstance(blocks, list)
    assert_trees_close(blocks, expected()["params"]["blocks"], rtol=0, atol=0)
    with pytest.raises(
        ValueError,
        match=r"no checkpoint leaf is under prefix 'opt_state' \(its top-level keys: \['opt', 'params', 'step'\]\)",
    ):
        load_orbax(checkpoints[layout], prefix="opt_state")
    with pytest.raises(ValueError, match=r"prefix 'step' is a leaf"):
        load_orbax(checkpoints[layout], prefix="step")


def test_like_that_does_not_fit_is_an_error_listing_every_problem(checkpoints):
    like = expected()["params"]
    like["extra"] = torch.zeros(2)
    like["odd"] = torch.zeros(3, 5)
    like["embed"] = like["embed"].double()
    del like["count"]
    with pytest.raises(ValueError, match=r"like does not fit the Orbax checkpoint") as e:
        load_orbax(checkpoints["ocdbt"], like, prefix="params")
    message = str(e.value)
    assert "under 'params': missing ['extra']; unexpected ['count']" in message
    assert "embed: saved torch.float32 (16, 8), like has torch.float64 (16, 8)" in message
    assert "odd: saved torch.float32 (5, 3), like has torch.float32 (3, 5)" in message


def test_a_folder_that_is_not_a_checkpoint_is_an_error_pointing_at_items(checkpoints):
    parent = checkpoints["ocdbt"].parent
    with pytest.raises(
        ValueError,
        match=r"is not an Orbax PyTree checkpoint: it has no _METADATA file; the checkpoint items here are \['ocdbt'\]",
    ):
        load_orbax(parent)


def _plan(want: Any, world: int, layout: Any) -> fs.Plan:
    return fs.plan(
        want,
        fs.Mesh({"fsdp": world}),
        rules=[("blocks/*/w", P(None, "fsdp"))],
        units=["blocks/*"],
        layout=layout,
    )


def _load_sharded(directory: str, layout: Any) -> list[torch.Tensor]:
    want = expected()["params"]
    plan = _plan(want, fs.world_size(), layout)
    like = fs.shard(fs.tree.map(torch.zeros_like, want), plan)
    loaded = load_orbax(directory, like, prefix="params")
    assert all(torch.count_nonzero(s.local) == 0 for s in fs.tree.leaves(like))  # like unchanged
    return [s.local.clone() for s in fs.tree.leaves(loaded)]


@pytest.mark.parametrize("layout", ["leaf", "flat"])
def test_each_rank_reads_its_own_shards(pools, checkpoints, layout):
    """W=2 with an uneven dim (5 over 2) and a dim-1 spec, or flat ranges cut inside leaves:
    every rank's shards equal shard_for_rank."""
    results = pools.run(2, _load_sharded, str(checkpoints["ocdbt"]), layout)
    want = expected()["params"]
    plan = _plan(want, 2, layout)
    for rank, shards in enumerate(results):
        for got, ref in zip(shards, fs.tree.leaves(shard_for_rank(want, plan, rank))):
            assert torch.equal(got, ref.local), ref.path


def test_loading_does_not_import_jax(checkpoints):
    code = (
        "import sys, funcshard as fs\n"
        f"tree = fs.interop.load_orbax({str(checkpoints['ocdbt'])!r})\n"
        "assert tree['step'] == 7\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
