"""Checkpoints keep every rank's generators by default, and loading restores them; fs.seed."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

import funcshard as fs
from funcshard._src.checkpoint.errors import CorruptCheckpointError
from tests import tampering


def _draws() -> tuple[list[float], float, float]:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def _save_then_draw(directory: str) -> Any:
    fs.seed(7, per_rank=True)
    params = {"w": torch.ones(4)}
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": fs.world_size()})))
    fs.checkpoint.save(directory, {"params": sp})
    return _draws()


def _load_then_draw(directory: str, rng: bool) -> Any:
    fs.seed(99)  # anything else
    params = {"w": torch.ones(4)}
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": fs.world_size()})))
    fs.checkpoint.load(directory, like={"params": sp}, rng=rng)
    return _draws()


def test_load_restores_every_ranks_generators(pools, tmp_path):
    directory = str(tmp_path / "ckpt")
    after_save = pools.run(2, _save_then_draw, directory)
    assert after_save[0] != after_save[1]  # per-rank seeds: the ranks draw differently
    assert pools.run(2, _load_then_draw, directory, True) == after_save
    assert pools.run(1, _load_then_draw, directory, True) == after_save[:1]  # rank r % 2
    assert pools.run(2, _load_then_draw, directory, False) != after_save


def test_rng_false_saves_none(tmp_path):
    p = {"w": torch.ones(2)}
    sp = fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))
    fs.checkpoint.save(tmp_path / "c", {"params": sp}, rng=False)
    assert "rng" not in tampering.read(tmp_path / "c")
    with pytest.raises(TypeError, match=r"rng must be True or False, got 'yes'"):
        fs.checkpoint.save(tmp_path / "d", {"params": sp}, rng="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m["rng"].update(dtype="float32"), r"rng is not a \(ranks, n\) uint8 tensor"),
        (lambda m: m["rng"].update(path="params/w"), r"does not carry the key of its offsets"),
        (lambda m: m["rng"].update(shape=[1, 10**9]), r"<rng>"),
    ],
)
def test_a_crafted_rng_entry_is_refused(tmp_path, change, message):
    p = {"w": torch.ones(2)}
    sp = fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))
    directory = fs.checkpoint.save(tmp_path / "c", {"params": sp})
    tampering.edit(directory, change)
    with pytest.raises(fs.checkpoint.CheckpointError, match=message):
        fs.checkpoint.load(directory, like={"params": sp})


@pytest.mark.parametrize(
    "row",
    [
        b"FSRNG1\0\0" + b"\xff\xff\xff\xff",  # a length past the end
        b"FSRNG1\0\0" + (5056).to_bytes(4, "little") + bytes(5056),  # truncated after torch's
        bytes(10),  # neither format: torch refuses its size
    ],
)
def test_malformed_states_are_refused_before_any_generator_changes(row):
    before = torch.get_rng_state()
    states = torch.frombuffer(bytearray(row), dtype=torch.uint8).unsqueeze(0)
    with pytest.raises(CorruptCheckpointError, match=r"RNG state"):
        fs.checkpoint.set_rng_states(states)
    assert torch.equal(torch.get_rng_state(), before)


def test_rows_of_torch_state_alone_still_load():
    saved = torch.get_rng_state().unsqueeze(0)
    expected = torch.rand(2)
    fs.checkpoint.set_rng_states(saved)
    assert torch.equal(torch.rand(2), expected)


def test_seed_seeds_python_numpy_and_torch():
    fs.seed(3)
    first = _draws()
    assert fs.seed(3) == 3
    assert _draws() == first
    assert fs.seed(3, per_rank=True) == 3  # rank 0 of one process


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, True, "1"])
def test_bad_seeds(bad):
    with pytest.raises(
        ValueError, match=r"fs.seed: the seed must be an integer in \[0, 2\*\*32 - 1\)"
    ):
        fs.seed(bad)
