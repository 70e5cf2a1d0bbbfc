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


def _lora(argv: list[str]) -> dict[str, Any]:
    from examples import lora

    return lora.main(argv)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_lora_on_a_frozen_sharded_base_trains_like_one_process(pools, precision):
    """W=2 equals W=1 on the same global batches; the base never changes and costs 1/W per rank.

    Tolerances: in fp32, losses and adapters agree to 1e-5. Under bf16 mixed
    precision both runs compute in bf16 from the same values (the init does not
    depend on W), but the per-rank batches are half as large, so bf16 kernels
    round differently and the fp32 gradient sums run in another order; losses
    agree to 1e-3, and the adapters, which AdamW moves by normalized steps (so
    rounding noise in gradients near zero becomes lr-sized), to 10% of their norm.
    """
    pytest.importorskip("transformers", reason="the `hf` extra")
    argv = ["--steps", "8", "--eval-every", "4", "--hidden", "32", "--vocab", "64", "--seq", "8"]
    argv += ["--precision", precision]
    (one,) = pools.run(1, _lora, [*argv, "--batch", "8"])
    two = pools.run(2, _lora, [*argv, "--batch", "4"])
    loss_tol = 1e-3 if precision == "bf16" else 1e-5
    for run in two:
        mean = [(a + b) / 2 for a, b in zip(two[0]["losses"], two[1]["losses"])]
        torch.testing.assert_close(
            torch.tensor(mean), torch.tensor(one["losses"]), rtol=0, atol=loss_tol
        )
        assert len(run["evals"]) == 2
        assert all(math.isfinite(x) for x in run["evals"])
        assert len(run["generated"]) == 4 + 4
        assert one["frozen_bytes"] / 2 <= run["frozen_bytes"] <= one["frozen_bytes"] / 2 + 4096
        assert run["optimizer_bytes"] < one["frozen_bytes"] / 10  # moments of the adapters only
    import funcshard as fs

    ours, theirs = [], []
    for path, a, b in zip(
        fs.tree.leaf_paths(one["params"]),
        fs.tree.leaves(one["params"]),
        fs.tree.leaves(two[0]["params"]),
    ):
        if "lora_" in path:
            ours.append(a.flatten())
            theirs.append(b.flatten())
            if precision == "fp32":
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=path)
        else:  # the frozen base, bit for bit the init of every world size
            assert torch.equal(a, b), path
    a, b = torch.cat(ours), torch.cat(theirs)
    assert float((a - b).norm() / a.norm()) < 0.1
