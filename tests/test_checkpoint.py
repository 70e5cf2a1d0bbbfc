"""Checkpoints: save on W ranks, load on any W' or in one process; atomic commits; bad files refused.

References: the unsharded tree (``fs.unshard``) and an uninterrupted training run.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard.checkpoint import CheckpointError, UnsafeCheckpointError
from funcshard.testing import assert_trees_close
from tests import tampering
from tests.models import Model

MODEL = Model(kind="transformer", width=6, hidden=10, layers=2)


def _plan(world: int, variant: int) -> fs.Plan:
    """Different plans of the same params: units and specs differ, so loading must reshard."""
    params = MODEL.init(0)
    mesh = fs.Mesh({"fsdp": world})
    if variant == 0:
        return fs.plan(params, mesh, units=MODEL.units)
    if variant == 2:  # the flat layout: ranges of each unit's concatenation, cut inside leaves
        return fs.plan(params, mesh, units=MODEL.units, layout="flat")
    if variant == 3:  # ZeRO-1
        return fs.plan(params, mesh, units=MODEL.units, strategy="shard_optimizer")
    if variant == 4:  # replicated everywhere
        return fs.plan(params, mesh, units=MODEL.units, strategy="no_shard")
    if variant == 5:  # sharded over fsdp, replicated over dp
        hybrid = fs.Mesh({"dp": 2, "fsdp": world // 2})
        return fs.plan(params, hybrid, units=MODEL.units, strategy="hybrid_shard")
    if variant in (
        6,
        7,
    ):  # partial copies over "local" ([Note: partial copies] in ``plan/strategy.py``), flat for 7
        nodes = fs.Mesh({"node": min(world, 2), "local": max(1, world // 2)})
        strategy = "partial_reshard" if variant == 6 else "hybrid_shard_optimizer"
        layout = "leaf" if variant == 6 else "flat"
        return fs.plan(params, nodes, units=MODEL.units, strategy=strategy, layout=layout)
    return fs.plan(
        params,
        mesh,
        rules=[("**/w*", fs.P(None, "fsdp"))],
        units=["blocks"],
        strategy="shard_grad_op",
    )


def _save(directory: str, variant: int) -> Any:
    plan = _plan(fs.world_size(), variant)
    sparams = fs.shard(MODEL.init(0), plan)
    opt = fs.optim.adamw(lr=0.1)
    state = opt.init(sparams)
    step = fs.value_and_grad(MODEL.loss_fn, plan)
    _, grads = step(sparams, *MODEL.batch_for(fs.rank()))
    sparams, state = opt.update_(grads, state, sparams)
    fs.checkpoint.save(
        directory,
        {"params": sparams, "opt": state, "step": 1, "rng": fs.checkpoint.rng_states()},
        step=1,
    )
    return fs.unshard({"params": sparams, "opt": state})


def _load(directory: str, variant: int) -> Any:
    plan = _plan(fs.world_size(), variant)
    sparams = fs.shard(MODEL.init(1), plan)  # other values: all must come from the checkpoint
    opt = fs.optim.adamw(lr=0.1)
    like = {"params": sparams, "opt": opt.init(sparams), "step": 0, "rng": fs.checkpoint.SAVED}
    loaded = fs.checkpoint.load(directory, like=like)
    before = fs.unshard(like["params"])
    return fs.unshard({"params": loaded["params"], "opt": loaded["opt"]}), loaded["step"], before


@pytest.mark.parametrize(
    ("save_world", "saved_variant", "load_world", "variant"),
    [
        (2, 0, 2, 0),
        (2, 0, 4, 1),
        (2, 0, 1, 1),
        (4, 0, 2, 0),
        (1, 0, 4, 0),
        (2, 2, 4, 1),  # flat layout -> per-leaf specs on more ranks
        (4, 0, 2, 2),  # per-leaf -> flat
        (4, 2, 2, 2),  # flat -> flat on fewer ranks: other cuts
        (2, 3, 4, 4),  # shard_optimizer -> no_shard
        (4, 4, 2, 3),  # no_shard -> shard_optimizer
        (2, 3, 2, 1),  # shard_optimizer -> shard_grad_op with rules
        (4, 3, 4, 5),  # shard_optimizer -> hybrid_shard
        (4, 5, 1, 3),  # hybrid_shard -> shard_optimizer on one rank
        (4, 6, 2, 7),  # partial_reshard -> hybrid_shard_optimizer (flat) on fewer ranks
        (4, 7, 1, 0),  # hybrid_shard_optimizer (flat) -> full_shard on one rank
    ],
)
def test_checkpoints_load_on_any_world_size_and_plan(
    pools, tmp_path, save_world, saved_variant, load_world, variant
):
    directory = str(tmp_path / "ckpt")
    saved = pools.run(save_world, _save, directory, saved_variant)[0]
    for loaded, step, untouched in pools.run(load_world, _load, directory, variant):
        assert step == 1
        assert_trees_close(loaded, saved, rtol=0, atol=0)
        assert_trees_close(
            untouched, fs.unshard(fs.shard(MODEL.init(1), _plan(1, 0))), rtol=0, atol=0
        )
    full = fs.checkpoint.load_full(directory)  # one process, no torch.distributed
    assert_trees_close({"params": full["params"], "opt": full["opt"]}, saved, rtol=0, atol=0)
    assert full["step"] == 1
    assert full["rng"].shape[0] == save_world


def _train(directory: str, steps: range, resume: bool) -> Any:
    """Trains MODEL; with ``resume``, starts from the checkpoint in ``directory``."""
    plan = _plan(fs.world_size(), 0)
    sparams = fs.shard(MODEL.init(0), plan)
    opt = fs.optim.adamw(lr=0.05)
    state = opt.init(sparams)
    if resume:
        found = fs.checkpoint.latest(directory)
        assert found is not None
        loaded = fs.checkpoint.load(found, like={"params": sparams, "opt": state, "step": 0})
        sparams, state = loaded["params"], loaded["opt"]
        assert loaded["step"] == steps.start
    step = fs.value_and_grad(MODEL.loss_fn, plan)
    for t in steps:
        per_rank = (
            4 // fs.world_size()
        )  # global batch: micro-batches 0..3 of step t, split over the ranks
        batches = [MODEL.batch_for(100 * t + fs.rank() * per_rank + m) for m in range(per_rank)]
        _, grads = step.accumulate(sparams, batches)  # the same global batch at every world size
        sparams, state = opt.update_(grads, state, sparams)
        if not resume and t + 1 == 3:
            fs.checkpoint.save(
                os.path.join(directory, f"step{t + 1}"),
                {"params": sparams, "opt": state, "step": t + 1},
                step=t + 1,
            )
    return fs.unshard(sparams)


@pytest.mark.parametrize(("world", "exact"), [(2, True), (4, False), (1, False)])
def test_resume_loses_nothing(pools, tmp_path, world, exact):
    """Train 3 steps on W=2, save, stop; resume on W for 3 more == 6 uninterrupted steps on W=2."""
    directory = str(tmp_path)
    uninterrupted = pools.run(2, _train, directory, range(6), False)[0]
    resumed = pools.run(world, _train, directory, range(3, 6), True)[0]
    if exact:
        assert_trees_close(resumed, uninterrupted, rtol=0, atol=0)
    else:
        assert_trees_close(resumed, uninterrupted, rtol=1e-5, atol=1e-6)


def _small(tmp: Path, name: str = "ckpt", step: int | None = None) -> tuple[Path, Any]:
    params = {"w": torch.arange(12.0).reshape(4, 3), "b": torch.ones(2)}
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    return fs.checkpoint.save(tmp / name, {"params": sparams, "n": 3}, step=step), sparams


def test_an_interrupted_save_leaves_no_checkpoint(tmp_path, monkeypatch):
    _small(tmp_path, "step1", step=1)
    import funcshard._src.checkpoint.save as saving

    def crash(*_: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(saving, "write_manifest", crash)
    with pytest.raises(
        CheckpointError, match=r"saving .*step2 failed on rank 0: OSError: disk full"
    ):
        _small(tmp_path, "step2", step=2)
    assert not (tmp_path / "step2").exists()
    assert fs.checkpoint.latest(tmp_path) == tmp_path / "step1"
    staging = next(p for p in tmp_path.iterdir() if ".tmp-" in p.name)
    with pytest.raises(
        CheckpointError, match=r"no manifest.json; its save was interrupted before it committed"
    ):
        fs.checkpoint.load_full(staging)


def test_latest_and_rotation(tmp_path):
    assert fs.checkpoint.latest(tmp_path) is None
    for step in (1, 2, 3):
        _small(tmp_path, f"step{step}", step=step)
    assert fs.checkpoint.latest(tmp_path) == tmp_path / "step3"
    (tmp_path / "notes").mkdir()
    fs.checkpoint.save(tmp_path / "step4", {"n": 1}, step=4, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step3", "step4"]
    with pytest.raises(FileExistsError, match="step4 exists"):
        fs.checkpoint.save(tmp_path / "step4", {"n": 1})


def test_another_model_is_refused_with_the_differences(tmp_path):
    directory, _ = _small(tmp_path)
    other = {"w": torch.zeros(4, 2), "c": torch.zeros(1)}
    like = {"params": fs.shard(other, fs.plan(other, fs.Mesh({"x": 1}))), "n": 0}
    with pytest.raises(CheckpointError) as info:
        fs.checkpoint.load(directory, like=like)
    message = str(info.value)
    assert "missing from the checkpoint: ['params/c']" in message
    assert "in the checkpoint but not asked for: ['params/b']" in message
    assert "params/w: saved (4, 3) float32, asked for (4, 2) float32" in message


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        fs.checkpoint.load_full(tmp_path / "nothing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(
        CheckpointError, match=r"no manifest\.json; it is not a funcshard checkpoint"
    ):
        fs.checkpoint.load_full(tmp_path / "plain")
    (tmp_path / "plain" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest\.json: not valid JSON"):
        fs.checkpoint.load_full(tmp_path / "plain")


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_data_files_are_refused(tmp_path, damage):
    directory, sparams = _small(tmp_path)
    data = directory / "rank0" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    if damage == "truncate":
        data.write_bytes(raw[: len(raw) // 2])
        expected = "the file is truncated"
    elif damage == "flip":
        raw[raw.index(torch.ones(2).numpy().tobytes())] ^= 0xFF  # the data of params/b
        data.write_bytes(raw)
        expected = "its contents differ from what was saved"
    else:
        data.unlink()
        expected = "missing; the checkpoint is incomplete"
    with pytest.raises(CheckpointError, match=expected):
        fs.checkpoint.load(directory, like={"params": sparams, "n": 0})
    with pytest.raises(CheckpointError, match=expected):
        fs.checkpoint.load_full(directory)


class _Payload:
    def __reduce__(self) -> Any:
        return (os.system, (f"touch {_Payload.marker}",))

    marker = ""


def test_a_malicious_pickle_is_refused_without_running_it(tmp_path):
    """The attacker also fixed the manifest's size, digest and self-digest: only the allowlist is left."""
    directory, sparams = _small(tmp_path)
    marker = tmp_path / "pwned"
    _Payload.marker = str(marker)
    tampering.replace_file(directory, "rank0/.metadata", pickle.dumps(_Payload()))
    for load in (
        lambda: fs.checkpoint.load(directory, like={"params": sparams, "n": 0}),
        lambda: fs.checkpoint.load_full(directory),
    ):
        with pytest.raises(
            UnsafeCheckpointError,
            match=r"refers to posix.system, which checkpoint metadata never contains; refusing",
        ):
            load()
    assert not marker.exists()


def test_export_safetensors(tmp_path):
    safetensors = pytest.importorskip(
        "safetensors.torch", reason="safetensors is an optional extra"
    )
    directory, _ = _small(tmp_path)
    out = fs.checkpoint.export_safetensors(directory, tmp_path / "model.safetensors")
    tensors = safetensors.load_file(str(out))
    assert torch.equal(tensors["w"], torch.arange(12.0).reshape(4, 3))
    assert set(tensors) == {"w", "b"}  # the params, keyed from inside them
    everything = fs.checkpoint.export_safetensors(
        directory, tmp_path / "all.safetensors", subtree=None
    )
    assert set(safetensors.load_file(str(everything))) == {"params.w", "params.b"}


def test_export_safetensors_reads_only_the_subtree(tmp_path, monkeypatch):
    """Exporting params from {params, opt, step} reads the params' chunks, not AdamW's moments."""
    pytest.importorskip("safetensors.torch", reason="safetensors is an optional extra")
    import funcshard._src.checkpoint.load as loading

    params = {"w": torch.arange(12.0).reshape(4, 3), "b": torch.ones(2)}
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    state = fs.optim.adamw(1e-3).init(sparams)
    directory = fs.checkpoint.save(tmp_path / "c", {"params": sparams, "opt": state, "step": 1})
    read: list[Any] = []
    real = loading.read_chunks

    def spy(*args: Any, **kwargs: Any) -> Any:
        read.extend(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "read_chunks", spy)
    fs.checkpoint.export_safetensors(directory, tmp_path / "p.safetensors")
    assert len(read) == 2  # w and b, one chunk each on a mesh of one rank
    read.clear()
    fs.checkpoint.export_safetensors(directory, tmp_path / "all.safetensors", subtree=None)
    assert len(read) > 2


def test_export_safetensors_names_and_its_errors(tmp_path):
    """The name map (a mapping or a function) and the errors naming the fix."""
    safetensors = pytest.importorskip(
        "safetensors.torch", reason="safetensors is an optional extra"
    )
    directory, _ = _small(tmp_path)
    out = fs.checkpoint.export_safetensors(
        directory, tmp_path / "a.safetensors", names={"w": "model.weight"}
    )
    assert set(safetensors.load_file(str(out))) == {"model.weight", "b"}
    out = fs.checkpoint.export_safetensors(
        directory, tmp_path / "b.safetensors", names=lambda p: f"lm.{p}"
    )
    assert set(safetensors.load_file(str(out))) == {"lm.w", "lm.b"}
    with pytest.raises(ValueError, match=r"no top-level 'opt' \(it has \['n', 'params'\]\)"):
        fs.checkpoint.export_safetensors(directory, tmp_path / "c.safetensors", subtree="opt")
    with pytest.raises(ValueError, match=r"names maps \['v'\], which are not tensor leaves"):
        fs.checkpoint.export_safetensors(directory, tmp_path / "d.safetensors", names={"v": "x"})
    with pytest.raises(ValueError, match=r"gets the same key as 'b'"):
        fs.checkpoint.export_safetensors(directory, tmp_path / "e.safetensors", names=lambda p: "x")


def test_leaves_a_checkpoint_cannot_hold(tmp_path):
    with pytest.raises(
        TypeError,
        match=r"opt: a checkpoint holds tensors, sharded leaves and JSON scalars; got a object",
    ):
        fs.checkpoint.save(tmp_path / "x", {"opt": object()})


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        # rank 0's range of a flat unit is elements 0..3, rank 1's 4..5: tiles, accepted
        ([((0, 0), (1, 3)), ((1, 0), (1, 1)), ((1, 1), (1, 2))], None),
        # a gap: element 3 (row 1, col 0) is in no chunk
        ([((0, 0), (1, 3)), ((1, 1), (1, 2))], "the chunks of w do not cover dim"),
        # the same elements twice
        (
            [((0, 0), (1, 3)), ((0, 2), (2, 1)), ((1, 0), (1, 3))],
            "the chunks of w do not cover dim",
        ),
        # a box that is no contiguous range and no grid cell
        (
            [((0, 0), (2, 2)), ((0, 2), (1, 1)), ((1, 2), (1, 1))],
            "the chunks of w do not cover dim",
        ),
    ],
)
def test_chunks_of_flat_ranges_must_tile_the_leaf_exactly(chunks, message):
    """A manifest is untrusted: ranges that leave a gap or overlap are refused like grids."""
    from funcshard._src.checkpoint.chunks import Chunk, check_tiling, chunk_key

    made = [Chunk(chunk_key("w", o), o, s, 0) for o, s in chunks]
    got = check_tiling("w", (2, 3), made)
    if message is None:
        assert got is None
    else:
        assert got is not None
        assert message in got
