"""A model no rank holds, at small size: from each start through an AdamW step to an export.

The bound that ``python -m bench.large_model`` measures as peak RSS at W=8, checked
here on the tensors themselves: on every rank at W=2, no op ever creates a tensor
larger than one unit gathered (its full leaves, or its gathered flat buffer of
``group_size x numel``), so far less than the model, whether the model starts
from ``fs.materialize``, from a Hugging Face checkpoint through
``apply.load_pretrained`` or from a meta-device module through
``apply.materialize``; and the export loads in Hugging Face equal to ``unshard``.
The benchmark itself, with its FSDP2 reference, is smoke-run at tiny size.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard.interop import functionalize
from tests.interop.hf_configs import tiny_llama_config
from tests.largest import Largest

transformers = pytest.importorskip("transformers", reason="Hugging Face is the `hf` extra")

pytestmark = pytest.mark.interop

UNITS = ["LlamaDecoderLayer", "model/embed_tokens", "lm_head"]


def _config() -> Any:
    return tiny_llama_config(vocab=256, layers=4, positions=16, tied=False)


def _start_step_export(source: str, directory: str) -> dict[str, Any]:
    """Worker body: start the model from ``source``, one AdamW step, export; what it created."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_config())
    params, apply = functionalize(model, units=UNITS)
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=apply.units)
    leaves = fs.tree.leaves(params)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(fs.rank()))
    with Largest() as seen:
        if source == "materialize":
            rules = [
                ("**/*norm/weight", fs.initializers.ones),
                ("**", fs.initializers.normal(0.02)),
            ]
            sparams = fs.materialize(params, plan, rules, seed=0)
            apply.materialize_state()
        elif source == "load_pretrained":
            sparams = apply.load_pretrained(Path(directory, "hf"), plan)
        else:
            sparams = apply.materialize(plan, seed=0)
        opt = fs.optim.adamw(1e-3)
        state = opt.init(sparams)
        # no buckets: a bucket gathers several small units at once, up to bucket_bytes
        step = fs.value_and_grad(
            lambda p, x: apply(p, input_ids=x, labels=x).loss, plan, bucket_bytes=0
        )
        loss, grads = step(sparams, ids)
        sparams, state = opt.update_(grads, state, sparams)
        apply.save_pretrained(sparams, Path(directory, f"out-{source}"), max_shard_size="64KB")
    units = {}
    for leaf in plan.leaves:
        units[leaf.unit] = units.get(leaf.unit, 0) + math.prod(leaf.shape) * 4
    return {
        "largest": seen.largest,
        "op": seen.op,
        "model": sum(t.numel() * t.element_size() for t in leaves),
        "largest_unit": max(units.values()),
        "loss": float(loss),
        "full": fs.unshard(sparams),
    }


@pytest.mark.parametrize("source", ["materialize", "load_pretrained", "meta_module"])
def test_no_rank_creates_more_than_one_unit_and_the_export_loads(pools, tmp_path, source):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_config()).save_pretrained(tmp_path / "hf")
    results = pools.run(2, _start_step_export, source, str(tmp_path))
    for rank, r in enumerate(results):
        # one unit's gradients packed for the reduce-scatter: its bytes, and padding
        assert r["largest"] <= r["largest_unit"] + 2 * 64, (rank, r["op"])
        assert r["largest"] < r["model"] / 4, (rank, r["op"])
        assert math.isfinite(r["loss"])
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / f"out-{source}")
    full = results[0]["full"]
    assert set(fs.tree.leaf_paths(full)) == {
        n.replace(".", "/") for n, _ in loaded.named_parameters()
    }
    for name, p in loaded.named_parameters():
        value = full
        for key in name.split("."):
            value = value[int(key)] if isinstance(value, list) else value[key]
        assert torch.equal(p.detach(), value), name


def test_the_benchmark_runs_at_tiny_size(tmp_path):
    from bench import large_model

    report = large_model.main(
        ["--tiny", "--world-size", "2", "--steps", "2", "--out", str(tmp_path / "r.json")]
    )
    assert set(report["sources"]) == {"materialize", "load_pretrained", "meta_module", "fsdp2"}
    for ranks in report["sources"].values():
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(r["peak_rss_mib"] > r["baseline_rss_mib"] > 0 for r in ranks)
        # the steady-state peak (steps 2..N) is measured apart from the first step's
        assert all(r["peak_rss_mib_by_phase"]["steady"] > r["baseline_rss_mib"] for r in ranks)
