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


# -- states checked by value (See [Note: rng states checked by value] in ``checkpoint/rng.py``) ---------------------


def _row(change: Any = None, *, cuda: list[bytes] | None = None) -> bytes:
    """This process's state row, with ``change(cpu_fields, py, npy)`` applied to its fields."""
    from funcshard._src.checkpoint import rng

    raw = rng._pack()
    at = len(rng._MAGIC) + 4
    cpu = list(rng.TORCH_CPU_STATE.unpack(raw[at : at + rng.TORCH_CPU_STATE.size]))
    at += rng.TORCH_CPU_STATE.size
    py = list(rng._PY.unpack(raw[at : at + rng._PY.size]))
    npy = list(rng._NP.unpack(raw[at + rng._PY.size : at + rng._PY.size + rng._NP.size]))
    if change is not None:
        change(cpu, py, npy)
    packed_cpu = rng.TORCH_CPU_STATE.pack(*cpu)
    states = cuda or []
    return b"".join(
        [rng._MAGIC, len(packed_cpu).to_bytes(4, "little"), packed_cpu, rng._PY.pack(*py)]
        + [rng._NP.pack(*npy), len(states).to_bytes(4, "little")]
        + [len(s).to_bytes(4, "little") + s for s in states]
    )


def _set(fields: list[Any], index: slice | int, value: Any) -> None:
    if isinstance(index, slice):
        fields[index] = [value] * len(fields[index])
    else:
        fields[index] = value


BAD_ROWS: dict[str, tuple[Any, str]] = {
    "python-gauss-nan": (
        lambda c, p, n: (_set(p, 625, 1), _set(p, 626, float("nan"))),
        r"Python's random state: its cached Gaussian is nan",
    ),
    "python-gauss-inf": (
        lambda c, p, n: _set(p, 626, float("inf")),
        r"Python's random state: its cached Gaussian is inf",
    ),
    "python-mt-zero": (
        lambda c, p, n: _set(p, slice(0, 624), 0),
        r"Python's random state: its MT19937 state is all zero",
    ),
    "python-mt-degenerate": (
        lambda c, p, n: (_set(p, slice(1, 624), 0), _set(p, 0, 0x7FFF_FFFF)),
        r"all zero \(degenerate",
    ),
    "python-position": (lambda c, p, n: _set(p, 624, 625), r"position 625 is not in \[0, 624\]"),
    "numpy-gauss-nan": (
        lambda c, p, n: (_set(n, 625, 1), _set(n, 626, float("nan"))),
        r"numpy's global generator state: its cached Gaussian is nan",
    ),
    "numpy-mt-zero": (
        lambda c, p, n: _set(n, slice(0, 624), 0),
        r"numpy's global generator state: its MT19937 state is all zero",
    ),
    "torch-normal-nan": (
        lambda c, p, n: (_set(c, 629, float("nan")), _set(c, 631, 1)),
        r"torch CPU RNG state: a cached normal sample is not finite",
    ),
    "torch-float-normal-nan": (
        lambda c, p, n: _set(c, 632, float("nan")),
        r"torch CPU RNG state: a cached normal sample is not finite",
    ),
    "torch-mt-zero": (
        lambda c, p, n: _set(c, slice(4, 628), 0),
        r"torch CPU RNG state: its MT19937 state is all zero",
    ),
    "torch-mt-word": (
        lambda c, p, n: _set(c, 10, 1 << 40),
        r"torch CPU RNG state: an MT19937 word is not a 32-bit value",
    ),
    "torch-left": (lambda c, p, n: _set(c, 1, 0), r"torch CPU RNG state: seeded=1, left=0"),
    "torch-past-the-end": (  # the audit's row: torch's next draws read past its 624 words
        lambda c, p, n: (_set(c, 1, 624), _set(c, 3, 624)),
        r"left=624, next=624 is no position torch's MT19937 reaches",
    ),
    "torch-left-next": (
        lambda c, p, n: (_set(c, 1, 1), _set(c, 3, 1)),
        r"left=1, next=1 is no position torch's MT19937 reaches",
    ),
    "torch-seeded": (lambda c, p, n: _set(c, 2, 0), r"torch CPU RNG state: seeded=0"),
    "torch-flag": (lambda c, p, n: _set(c, 633, 7), r"a cached-normal flag is neither 0 nor 1"),
    "torch-flag-negative": (  # the double's flag is a signed int
        lambda c, p, n: _set(c, 631, -7),
        r"a cached-normal flag is neither 0 nor 1",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_states_are_checked_by_value_and_no_generator_changes(case):
    change, message = BAD_ROWS[case]
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=True))
    row = torch.frombuffer(bytearray(_row(change)), dtype=torch.uint8).unsqueeze(0)
    with pytest.raises(CorruptCheckpointError, match=message):
        fs.checkpoint.set_rng_states(row)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    after = np.random.get_state(legacy=True)
    assert all(np.array_equal(a, b) for a, b in zip(after, before[2]))


@pytest.mark.parametrize("draws", [0, 1, 623, 624, 625, 10000])
def test_every_position_torch_reaches_is_accepted(draws):
    """Reference: torch's own CPU generator after ``draws`` 32-bit draws (``torch.rand``: one each);
    a failure names a left/next pair torch reaches that the position rule refuses."""
    from funcshard._src.checkpoint.rng import TORCH_CPU_STATE

    generator = torch.Generator().manual_seed(5)
    torch.rand(draws, generator=generator)
    state = generator.get_state()
    fields = TORCH_CPU_STATE.unpack(state.numpy().tobytes())
    assert fields[1] + fields[3] == 625 or (fields[1], fields[3]) == (1, 0)
    expected = torch.rand(3, generator=generator)
    fs.checkpoint.set_rng_states(state.unsqueeze(0))
    assert torch.equal(torch.rand(3), expected)


def _cuda_row(state: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(_row(cuda=[state])), dtype=torch.uint8).unsqueeze(0)


def test_a_cuda_state_must_be_a_philox_seed_and_an_offset_torch_accepts():
    before = torch.get_rng_state()
    with pytest.raises(CorruptCheckpointError, match=r"CUDA device 0 has 8 bytes, not the 16"):
        fs.checkpoint.set_rng_states(_cuda_row(bytes(8)))
    seed = (7).to_bytes(8, "little")
    with pytest.raises(
        CorruptCheckpointError,
        match=r"CUDA device 0: its Philox offset 6 is not a multiple of 4, which "
        r"torch.cuda.set_rng_state refuses",
    ):
        fs.checkpoint.set_rng_states(_cuda_row(seed + (6).to_bytes(8, "little")))
    assert torch.equal(torch.get_rng_state(), before)  # refused before any generator changed
    fs.checkpoint.set_rng_states(_cuda_row(bytes(16)))
    fs.checkpoint.set_rng_states(_cuda_row(seed + (8).to_bytes(8, "little")))


def test_an_untouched_row_restores_every_generator():
    row = torch.frombuffer(bytearray(_row()), dtype=torch.uint8).unsqueeze(0)
    expected = _draws(), random.gauss(0, 1), torch.randn(2)
    fs.checkpoint.set_rng_states(row)
    assert (_draws(), random.gauss(0, 1)) == expected[:2]
    assert torch.equal(torch.randn(2), expected[2])


def test_a_crafted_checkpoint_with_a_nan_gaussian_is_refused_and_changes_nothing(tmp_path):
    """The row rewritten in the file with every digest recomputed: only the value check stands."""
    p = {"w": torch.ones(2)}
    sp = fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))
    directory = fs.checkpoint.save(tmp_path / "c", {"params": sp})
    width = tampering.read(directory)["rng"]["shape"][1]
    bad = bytearray(_row(BAD_ROWS["python-gauss-nan"][0]).ljust(width, b"\0"))
    tampering.rewrite_chunks(
        directory, 0, {"<rng>@0,0": torch.frombuffer(bad, dtype=torch.uint8).unsqueeze(0)}
    )
    before = (torch.get_rng_state(), random.getstate())
    with pytest.raises(
        CorruptCheckpointError, match=r"RNG states, row 0: .*cached Gaussian is nan"
    ):
        fs.checkpoint.load(directory, like={"params": sp})
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    fs.checkpoint.load(directory, like={"params": sp}, rng=False)  # the params themselves are sound


def test_only_the_local_devices_cuda_generator_is_saved_and_set(monkeypatch):
    """[Note: the local CUDA generator] in ``checkpoint/rng.py``, with torch.cuda faked: rank on cuda:2 of 4 GPUs."""
    from funcshard._src.checkpoint import rng

    states = {d: bytes([d]) * 8 + (4 * d).to_bytes(8, "little") for d in range(4)}
    read, written = [], []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("read every GPU"))
    monkeypatch.setattr(
        torch.cuda,
        "get_rng_state",
        lambda d: read.append(d) or torch.frombuffer(bytearray(states[d]), dtype=torch.uint8),
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda s, d: written.append((bytes(s.numpy()), d))
    )
    packed = rng._pack()
    assert read == [2]
    assert packed.endswith((1).to_bytes(4, "little") + (16).to_bytes(4, "little") + states[2])
    fs.checkpoint.set_rng_states(torch.frombuffer(bytearray(packed), dtype=torch.uint8)[None])
    assert written == [(states[2], 2)]  # one state: the current device's
    every = torch.frombuffer(bytearray(_row(cuda=list(states.values()))), dtype=torch.uint8)
    fs.checkpoint.set_rng_states(every[None])  # a row of every visible GPU: its device's alone
    assert written[1:] == [(states[2], 2)]
