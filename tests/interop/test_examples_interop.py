"""The interop examples run, at tiny size, on two ranks of the worker pool.

``hf_llama`` trains a Hugging Face Llama sharded and saves it; ``jax_roundtrip``
trains with funcshard and evaluates the same parameters in JAX, whose loss and
gradients must equal funcshard's to fp32 precision.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.interop


def _hf_llama(argv: list[str]) -> list[float]:
    from examples import hf_llama

    return hf_llama.main(argv)


def _jax_roundtrip(argv: list[str]) -> dict[str, Any]:
    from examples import jax_roundtrip

    return jax_roundtrip.main(argv)


def test_hf_llama_learns_and_saves_a_model_that_reloads(pools, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the `hf` extra")
    tiny = ["--layers", "2", "--hidden", "32", "--vocab", "64", "--seq", "16", "--batch", "4"]
    argv = [*tiny, "--steps", "12", "--lr", "1e-2", "--save", str(tmp_path / "llama")]
    results = pools.run(2, _hf_llama, argv)
    for losses in results:
        assert len(losses) == 12
        assert all(math.isfinite(x) for x in losses)
        assert sum(losses[-3:]) < sum(losses[:3])
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    fresh = transformers.LlamaForCausalLM(reloaded.config)
    trained = reloaded.model.layers[1].mlp.up_proj.weight
    assert not torch.equal(trained, fresh.model.layers[1].mlp.up_proj.weight)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


def test_jax_roundtrip_gives_the_same_loss_and_gradients(pools):
    pytest.importorskip("jax", reason="the `jax` extra")
    argv = [
        "--steps",
        "8",
        "--layers",
        "2",
        "--width",
        "32",
        "--vocab",
        "32",
        "--seq",
        "8",
        "--batch",
        "4",
    ]
    for result in pools.run(2, _jax_roundtrip, argv):
        assert sum(result["losses"][-2:]) < sum(result["losses"][:2])
        assert result["jax_loss"] == pytest.approx(result["torch_loss"], rel=1e-5)
        assert result["grad_error"] < 1e-4
