"""Orbax checkpoints both ways: written by Orbax and loaded by funcshard, and the reverse.

The checkpoints read come from ``orbax-checkpoint`` in the three on-disk layouts it
writes (OCDBT with zarr v2, the default; a folder per array; OCDBT with zarr v3). The
expected values are the arrays that were saved; sharded loads are compared with
funcshard's own ``shard_for_rank``. Checkpoints funcshard writes (``save_orbax`` at
W=2) are restored by ``StandardCheckpointer`` in a separate JAX process onto
``NamedSharding`` targets over eight host devices, and compared bit for bit. A failure
names the layout and the leaf path.
"""

from __future__ import annotations

import json
import os
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
from funcshard.interop import load_orbax, save_orbax
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


@pytest.mark.parametrize("keys", [[".."], ["a/../../x"], ["."]])
def test_metadata_keys_that_would_leave_the_checkpoint_are_refused(checkpoints, tmp_path, keys):
    """_METADATA is untrusted: a folder-per-array name is a path under the checkpoint."""
    import shutil

    crafted = tmp_path / "crafted"
    shutil.copytree(checkpoints["folders"], crafted)
    meta = json.loads((crafted / "_METADATA").read_text())
    item = next(iter(meta["tree_metadata"].values()))
    item["key_metadata"] = [{"key": k, "key_type": 2} for k in keys]
    meta["tree_metadata"] = {"x": item}
    (crafted / "_METADATA").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"do not name an array inside the checkpoint"):
        load_orbax(crafted)


def _crafted(checkpoints: dict[str, Path], tmp_path: Path) -> Path:
    import shutil

    crafted = tmp_path / "crafted"
    shutil.copytree(checkpoints["folders"], crafted)
    return crafted


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.update(tree_metadata=[1]), r"tree_metadata is not an object"),
        (
            lambda m: next(iter(m["tree_metadata"].values())).pop("key_metadata"),
            r"no key_metadata list and value_metadata object",
        ),
        (
            lambda m: next(iter(m["tree_metadata"].values())).update(
                key_metadata=[{"key": None, "key_type": 2}]
            ),
            r"a key is not a string or an integer",
        ),
        (
            lambda m: next(iter(m["tree_metadata"].values())).update(
                key_metadata=[{"key": "x", "key_type": 1}]
            ),
            r"a sequence key 'x' is not an index",
        ),
    ],
    ids=["tree-a-list", "no-keys", "key-none", "sequence-key-a-name"],
)
def test_metadata_of_the_wrong_shape_is_a_clear_error(checkpoints, tmp_path, change, message):
    """_METADATA is untrusted: a wrong field is named, never a KeyError or TypeError."""
    crafted = _crafted(checkpoints, tmp_path)
    meta = json.loads((crafted / "_METADATA").read_text())
    change(meta)
    (crafted / "_METADATA").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=message + r".*this is not a checkpoint Orbax wrote"):
        load_orbax(crafted)


def test_metadata_is_strict_json_and_no_symlink(checkpoints, tmp_path):
    """Read as every untrusted JSON file is ([Note: reader discipline] in ``untrusted.py``)."""
    crafted = _crafted(checkpoints, tmp_path)
    text = (crafted / "_METADATA").read_text()
    (crafted / "_METADATA").write_text(text.replace("{", '{"x": NaN, ', 1))
    with pytest.raises(ValueError, match=r"_METADATA: x is NaN, not a finite number"):
        load_orbax(crafted)
    (tmp_path / "elsewhere").write_text(text)
    (crafted / "_METADATA").unlink()
    (crafted / "_METADATA").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"_METADATA.*symlink"):
        load_orbax(crafted)


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


def test_loading_and_saving_do_not_import_jax(checkpoints):
    code = (
        "import sys, funcshard as fs\n"
        f"tree = fs.interop.load_orbax({str(checkpoints['ocdbt'])!r})\n"
        "assert tree['step'] == 7\n"
        f"fs.interop.save_orbax({str(checkpoints['ocdbt'].parent / 'again')!r}, tree)\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- funcshard writes, Orbax restores ---------------------------------------------------

# the restoring process's targets: a (2, 4) mesh of the eight host devices; the uneven
# leaf replicated, as JAX refuses uneven shardings (funcshard wrote it in uneven shards)
_RESTORE = """
import json, sys
import jax, numpy as np, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
path, out, specs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
meta = ocp.StandardCheckpointer().metadata(path).item_metadata
def target(keypath, m):
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)
    return jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=NamedSharding(mesh, P(*specs[name])))
arrays = {k: v for k, v in meta.items() if k != "step"}
target_tree = {**jax.tree_util.tree_map_with_path(target, arrays), "step": 0}
with ocp.StandardCheckpointer() as c:
    got = c.restore(path, target_tree)
assert got["step"] == 7, got["step"]
flat = jax.tree_util.tree_flatten_with_path({k: v for k, v in got.items() if k != "step"})[0]
saved = {}
for keypath, x in flat:
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)
    assert x.sharding == NamedSharding(mesh, P(*specs[name])), (name, x.sharding)
    a = np.asarray(x)
    saved[name] = a.view(np.uint16) if a.dtype.name == "bfloat16" else a
np.savez(out, **{k.replace("/", "."): v for k, v in saved.items()})
"""
_TARGET_SPECS = {
    "params/embed": ["a", "b"],
    "params/blocks/0/w": ["b", "a"],
    "params/blocks/1/w": [None, "a"],
    "params/odd": [],
    "params/count": ["a"],
    "opt/mu": ["b"],
}


def _save(directory: str, layout: Any) -> None:
    want = expected()
    plan = fs.plan(
        want["params"],
        fs.Mesh({"fsdp": fs.world_size()}),
        rules=[("blocks/*/w", P(None, "fsdp")), ("count", P())],  # count: replicated
        units=["blocks/*"],
        layout=layout,
    )
    save_orbax(directory, {"params": fs.shard(want["params"], plan), "opt": want["opt"], "step": 7})


@pytest.mark.parametrize("layout", ["leaf", "flat"])
def test_orbax_restores_what_each_rank_wrote_bitwise(pools, tmp_path, layout):
    """save_orbax at W=2 (an uneven dim, 5 over 2; a dim-1 spec; bf16; a whole tensor and
    a scalar), then plain Orbax in a JAX process onto NamedShardings of 8 devices."""
    directory = tmp_path / "ckpt"
    pools.run(2, _save, str(directory), layout)
    import tensorstore as ts

    written = [
        {
            key.decode()
            for key in ts.KvStore.open({"driver": "ocdbt", "base": f"file://{part}/"})
            .result()
            .list()
            .result()
            if not key.endswith(b".zarray")
        }
        for part in (directory / "ocdbt.process_0", directory / "ocdbt.process_1")
    ]
    assert written[1], "rank 1 wrote no chunk"
    assert not written[0] & written[1], "a chunk written by both ranks"
    rank_0_only = ("opt.", "step/") + (("params.count/",) if layout == "leaf" else ())
    assert not any(k.startswith(rank_0_only) for k in written[1])  # whole, scalar, replicated
    out = tmp_path / "restored.npz"
    subprocess.run(
        [sys.executable, "-c", _RESTORE, str(directory), str(out), json.dumps(_TARGET_SPECS)],
        check=True,
        timeout=300,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )
    restored = dict(np.load(out))
    for path, want in zip(fs.tree.leaf_paths(expected()), fs.tree.leaves(expected())):
        got = torch.from_numpy(restored.pop(path.replace("/", ".")))
        got = got.view(torch.bfloat16) if want.dtype == torch.bfloat16 else got
        assert got.dtype == want.dtype, path
        assert torch.equal(got, want), path
    assert not restored
    # and funcshard reads its own checkpoint back
    loaded = load_orbax(directory)
    assert loaded.pop("step") == 7
    assert_trees_close(loaded, expected(), rtol=0, atol=0)


def test_the_docstring_example_runs():
    """save_orbax's example skips where TensorStore is missing (the doctest session); here it runs."""
    import doctest

    examples = doctest.DocTestParser().get_examples(save_orbax.__doc__ or "")
    for example in examples:
        example.options.clear()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(doctest.DocTest(examples, {}, "save_orbax", None, 0, None))
    assert (runner.tries, runner.failures) == (len(examples), 0)


def test_saving_refuses_a_folder_in_use_and_keys_orbax_cannot_name(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(
        ValueError, match=r"used exists and is not an empty folder; save to a new one"
    ):
        save_orbax(tmp_path / "used", {"w": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"a\.b: key 'a\.b' is empty or holds '\.'"):
        save_orbax(tmp_path / "new", {"a.b": torch.zeros(2)})
    with pytest.raises(TypeError, match=r"w: a str leaf; save_orbax writes sharded leaves"):
        save_orbax(tmp_path / "new", {"w": "text"})
