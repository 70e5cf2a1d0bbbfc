"""``Apply.save_pretrained`` writes what Hugging Face's ``from_pretrained`` loads, bit for bit.

Reference: ``AutoModelForCausalLM.from_pretrained(dir).state_dict()`` equals
``apply.state_dict(fs.unshard(sparams))`` after a sharded AdamW step at W=2, and the
files are named and indexed as the model's own ``save_pretrained`` names them. A
failure names the model, the key, or the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import funcshard as fs
from funcshard._src.interop import hf_files
from funcshard.interop import functionalize
from tests.interop.test_safetensors_io import MODELS, VOCAB, llama

pytestmark = pytest.mark.interop

CASES = {
    "llama_tied": (lambda: llama(), "LlamaDecoderLayer"),
    "llama_untied": (lambda: llama(tied=False), "LlamaDecoderLayer"),
    "gpt2": MODELS["gpt2"],
}


def _train_and_save(case: str, directory: str, max_shard_size: str) -> dict[str, torch.Tensor]:
    build, unit = CASES[case]
    params, apply = functionalize(build(), units=[unit])
    plan = fs.plan(
        params, fs.Mesh({"fsdp": fs.world_size()}), units=apply.units, frozen=apply.frozen
    )
    sparams = fs.shard(params, plan)
    opt = fs.optim.adamw(lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(fs.rank()))
    step = fs.value_and_grad(lambda p, x: apply(p, input_ids=x, labels=x).loss, plan)
    _, grads = step(sparams, ids)
    sparams, _ = opt.update_(grads, opt.init(sparams), sparams)
    apply.save_pretrained(sparams, directory, max_shard_size=max_shard_size)
    return apply.state_dict(fs.unshard(sparams))


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_pretrained_loads_what_w2_saved(pools, tmp_path, case):
    """Several files and an index; tied weights once, as the model's own save_pretrained writes them."""
    transformers = pytest.importorskip("transformers", reason="Hugging Face is the `hf` extra")
    out = tmp_path / "out"
    results = pools.run(2, _train_and_save, case, str(out), "20KB")
    assert all(r.keys() == results[0].keys() for r in results)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert sorted(loaded) == sorted(results[0])
    for key, value in results[0].items():
        assert torch.equal(loaded[key], value), f"{case}: {key}"
    CASES[case][0]().save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    theirs = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(theirs["weight_map"])  # the same names kept
    assert index["metadata"] == theirs["metadata"]
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    assert set(index["weight_map"].values()) == set(files)
    for name in files:
        with safe_open(str(out / name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            keys = list(f.keys())
            assert all(index["weight_map"][k] == name for k in keys)
            size = sum(f.get_tensor(k).nbytes for k in keys)
            assert size <= 20_000 or len(keys) == 1, f"{name}: {size} bytes"
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (out / "generation_config.json").exists()
    assert not list(tmp_path.glob(".out.*"))  # the staging directory became out


class _Net(torch.nn.Module):
    """No config: a frozen weight, persistent buffers (batch norm) and a non-persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.lin.bias.requires_grad_(False)
        self.register_buffer("scratch", torch.ones(2), persistent=False)


def _net() -> tuple[dict[str, torch.Tensor], Any, Any]:
    """The net's state dict (copied before functionalize), its apply and its sharded params."""
    net = _Net()
    with torch.no_grad():
        net.get_buffer("norm.running_mean").add_(3.0)
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    params, apply = functionalize(net)
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), frozen=apply.frozen)
    return expected, apply, fs.shard(params, plan)


def test_one_file_holds_frozen_parameters_and_persistent_buffers(tmp_path):
    expected, apply, sparams = _net()
    out = apply.save_pretrained(sparams, tmp_path / "net")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # no config, no index
    tensors = load_file(out / "model.safetensors")
    assert sorted(tensors) == sorted(expected)  # not scratch
    for key, value in expected.items():
        assert torch.equal(tensors[key], value), key


def test_each_flat_buffer_is_gathered_once_and_never_the_whole_model(tmp_path, monkeypatch):
    from funcshard._src.comm import collectives

    sizes: list[int] = []
    real = collectives.gather_to_rank0

    def gather(flat: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(flat.numel())
        return real(flat, *args, **kwargs)

    monkeypatch.setattr(collectives, "gather_to_rank0", gather)
    params, apply = functionalize(llama(), units=["LlamaDecoderLayer"])
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units, frozen=apply.frozen)
    sparams = fs.shard(params, plan)
    apply.save_pretrained(sparams, tmp_path / "out", max_shard_size="20KB")
    flats = fs.tree.leaves(sparams)
    assert len(sizes) == len({id(t.flat) for t in flats})
    assert max(sizes) < sum(t.local.numel() for t in flats) / 2


def test_saving_into_a_directory_replaces_the_checkpoint_and_keeps_other_files(tmp_path):
    _, apply, sparams = _net()
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_bytes(b"stale")
    (out / "model.safetensors.index.json").write_text("{}")
    (out / "README.md").write_text("mine")
    apply.save_pretrained(sparams, out, max_shard_size=64)
    names = sorted(p.name for p in out.iterdir())
    assert "model-00001-of-00009.safetensors" not in names
    assert "README.md" in names
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {n for n in names if n.startswith("model-")}
    apply.save_pretrained(sparams, out)  # one file now: no index left behind
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.safetensors"]


def test_a_failed_write_leaves_the_old_checkpoint_and_no_staging(tmp_path, monkeypatch):
    _, apply, sparams = _net()
    out = apply.save_pretrained(sparams, tmp_path / "out")
    before = (out / "model.safetensors").read_bytes()

    def full_disk(*_: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_files.Writer, "write", full_disk)
    with pytest.raises(
        OSError, match=r"save_pretrained to .*out failed on rank 0: OSError: \[Errno 28\] No space"
    ):
        apply.save_pretrained(sparams, out)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_next_save_removes_what_a_killed_save_left(tmp_path):
    _, apply, sparams = _net()
    killed = tmp_path / ".out.0123456789ab.saving"  # a save killed mid-write leaves this
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"partial")
    other = tmp_path / ".outer.0123456789ab.saving"  # another target's: kept
    other.mkdir()
    apply.save_pretrained(sparams, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".outer.0123456789ab.saving", "out"]


def _fail_on_rank0(directory: str) -> str:
    params, apply = functionalize(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 2}), units=["0", "1"]))
    write = hf_files.Writer.write

    def full_disk(*_: Any) -> None:
        raise OSError("disk gone")

    if fs.rank() == 0:
        hf_files.Writer.write = full_disk  # pyright: ignore[reportAttributeAccessIssue]
    try:
        apply.save_pretrained(sparams, directory)
    except OSError as e:
        return str(e)
    finally:
        hf_files.Writer.write = write
    return "saved"


def test_a_failure_on_rank0_raises_on_every_rank_without_a_hang(pools, tmp_path):
    messages = pools.run(2, _fail_on_rank0, str(tmp_path / "out"), timeout_s=60)
    assert all("failed on rank 0: OSError: disk gone" in m for m in messages), messages
    assert not (tmp_path / "out").exists()


def test_refusals_name_the_fix(tmp_path):
    _, apply, sparams = _net()
    with pytest.raises(ValueError, match=r"writes safetensors only; pass safe_serialization=True"):
        apply.save_pretrained(sparams, tmp_path / "a", safe_serialization=False)
    for size in ("5 parsecs", 0, "-1GB", True):
        with pytest.raises(ValueError, match=r"is not a size; pass bytes or a string like '5GB'"):
            apply.save_pretrained(sparams, tmp_path / "a", max_shard_size=size)
    with pytest.raises(ValueError, match=r"sparams do not have the structure of _Net's params"):
        apply.save_pretrained({"w": sparams["lin"]["weight"]}, tmp_path / "a")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match=r"NotADirectoryError: .*file is a file"):
        apply.save_pretrained(sparams, tmp_path / "file")
    meta = _Net()
    meta.norm.running_mean = torch.empty(4, device="meta")
    params, apply = functionalize(meta)
    with pytest.raises(ValueError, match=r"norm\.running_mean: a meta tensor cannot be written"):
        apply.save_pretrained(
            fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1}))), tmp_path / "m"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_the_kept_name_of_a_tied_weight_follows_tied_weights_keys(tmp_path):
    class Tied(torch.nn.Module):
        _tied_weights_keys = {"a.weight": "b.weight"}  # noqa: RUF012 (Hugging Face v5's form)

        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(2, 2, bias=False)
            self.b = torch.nn.Linear(2, 2, bias=False)
            self.a.weight = self.b.weight

    params, apply = functionalize(Tied())
    assert fs.tree.leaf_paths(params) == ["a/weight"]
    out = apply.save_pretrained(
        fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1}))), tmp_path / "t"
    )
    assert sorted(load_file(Path(out) / "model.safetensors")) == ["b.weight"]
