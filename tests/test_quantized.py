"""Block-quantized collectives ([Note: quantized collectives] in ``plan/quantize.py``).

The format's per-block bound on one process; the int8 all-gather and all-to-all
reduce-scatter against the exact collectives on 2 and 4 ranks; and a step with
``quantize=`` that sends what the cost model says.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcshard as fs
from funcshard._src.comm import collectives, groups, quantized
from funcshard._src.comm.collectives import Ledger
from funcshard._src.plan.cost import estimate
from funcshard._src.plan.cost_model import CostModel
from funcshard._src.plan.quantize import quantized_bytes
from funcshard.testing import held_bytes
from tests.models import Model

# fp32 rounding of s = max|x| / 127 and of x / s, on top of the bound's s / 2
SLACK = 1e-6
FORMATS = ("int8", "int4", "fp8")
# how close a quantized step's gradients stay to the exact step's, as a fraction of the
# largest: int4 sums up to 4 terms each within max / 14 of its block; fp8's weights are
# within 1/16 of each value, and so are the activations they make
CLOSE = {"int8": 0.05, "fp8": 0.2, "int4": 0.3}


def roundtrip(x: torch.Tensor, block: int, format: Any = "int8") -> torch.Tensor:
    data = torch.empty(quantized_bytes(x.numel(), block, format), dtype=torch.uint8)
    quantized.quantize_into(x, data, block, format)
    out = torch.empty(x.numel())
    quantized.dequantize_into(data, x.numel(), block, out, format)
    return out


@settings(max_examples=200)
@given(
    n=st.integers(1, 1500),
    block=st.sampled_from([4, 8, 64, 256]),
    format=st.sampled_from(FORMATS),
    scale=st.floats(1e-6, 1e6),
    seed=st.integers(0, 2**31),
)
def test_every_value_is_within_its_block_bound(n, block, format, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale * torch.rand(n, generator=g).pow(4)
    y = roundtrip(x, block, format)
    bound = quantized.error_bound(x, block, format)
    assert torch.all((x - y).abs() <= bound * (1 + SLACK) + 1e-30)


def test_the_bounds_are_the_stated_ones():
    """int8: max|block| / 254; int4: / 14; fp8: |x| / 16 + max|block| / (448 * 512)."""
    x = torch.tensor([1.0, -0.5, 0.25, 0.0])
    assert torch.equal(quantized.error_bound(x, 4, "int8"), torch.full((4,), 1 / 254))
    assert torch.equal(quantized.error_bound(x, 4, "int4"), torch.full((4,), 1 / 14))
    assert torch.allclose(quantized.error_bound(x, 4, "fp8"), x.abs() / 16 + 1 / (448 * 512))


@pytest.mark.parametrize("format", FORMATS)
def test_zeros_arrive_exact_and_a_non_finite_value_poisons_its_block_only(format):
    x = torch.tensor(
        [0.0] * 4 + [1.0, float("nan"), 2.0, 3.0] + [1.0, float("inf"), 0, 0] + [0.5] * 4
    )
    y = roundtrip(x, 4, format)
    assert torch.equal(y[:4], torch.zeros(4))
    assert torch.isnan(y[4:12]).all()  # a NaN or an infinity: the whole block is NaN
    assert torch.allclose(y[12:], torch.full((4,), 0.5))


def test_a_format_that_is_not_known_is_refused():
    with pytest.raises(ValueError, match="'int8', 'int4', 'fp8'"):
        fs.Quantized(weights="int2")  # pyright: ignore[reportArgumentType]
    q = fs.Quantized(weights=True, gradients=False)
    assert (q.weights, q.gradients, q.weight_format, q.gradient_format) == ("int8", None) * 2


def test_fp8_where_torch_cannot_cast_is_refused_before_sending(monkeypatch):
    monkeypatch.setattr(quantized, "_fp8_failure", lambda device_type: "no float8 here")
    with pytest.raises(ValueError, match=r"cannot cast to float8 e4m3 on cpu.*use 'int8'"):
        quantized.check_format("fp8", torch.device("cpu"))
    quantized.check_format("int4", torch.device("cpu"))


def test_quantized_bytes_are_a_quarter_of_fp32_and_the_scales():
    n = 4096
    assert quantized_bytes(n, 256) == n + 4 * 16
    assert quantized_bytes(n, 256) / (4 * n) == pytest.approx((1 + 4 / 256) / 4)
    assert quantized_bytes(1, 256) == 260  # one padded block
    assert quantized_bytes(n, 256, "fp8") == quantized_bytes(n, 256)
    assert quantized_bytes(n, 256, "int4") == n // 2 + 4 * 16  # two values a byte


@pytest.mark.parametrize("block", [0, 6, -4, 2.5])
def test_a_block_that_is_not_a_positive_multiple_of_4_is_refused(block):
    with pytest.raises(ValueError, match="positive multiple of 4"):
        fs.Quantized(block=block)


def test_units_must_be_patterns():
    with pytest.raises(TypeError, match="tuple of patterns"):
        fs.Quantized(units="blocks/*")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="glob string"):
        fs.Quantized(units=(3,))  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="Quantized"):
        fs.value_and_grad(
            lambda p: p["w"].sum(),
            fs.plan({"w": torch.ones(2)}, fs.Mesh({"fsdp": 1})),
            quantize="int8",  # pyright: ignore[reportArgumentType]
        )
    with pytest.raises(TypeError, match="Quantized"):
        CostModel(quantize="int8")  # pyright: ignore[reportArgumentType]


def _collectives(mesh: dict[str, int], block: int) -> dict[str, Any]:
    """Worker body: each format's all-gather and reduce-scatter against the exact ones, with their bytes."""
    bound_mesh = groups.bind(fs.Mesh(mesh))
    axes = tuple(mesh)
    size = math.prod(mesh.values())
    g = torch.Generator().manual_seed(fs.rank())
    n = 1024
    shard = torch.randn(n, generator=g) * (1 + fs.rank())
    exact = collectives.all_gather(shard, bound_mesh, axes).wait()
    grads = torch.randn(size, n, generator=g)
    everyone = collectives.all_gather(grads.view(-1), bound_mesh, axes).wait()
    me = fs.rank()  # the group is the whole mesh, in mesh order
    exact_sum = everyone.view(size, size, n)[:, me].sum(0)
    out: dict[str, Any] = {"exact": exact.clone()}
    for format in FORMATS:
        ledger = Ledger()
        rows = quantized.all_gather(
            shard,
            bound_mesh,
            axes,
            block=block,
            format=format,
            out=torch.empty(size * n),
            ledger=ledger,
        ).wait()
        bounds = torch.stack([quantized.error_bound(r, block, format) for r in grads])
        bounds = collectives.all_gather(bounds.view(-1), bound_mesh, axes).wait()
        summed = quantized.reduce_scatter(
            grads.clone(), bound_mesh, axes, block=block, format=format, ledger=ledger
        ).wait()
        out[format] = {
            "rows": rows.clone(),
            "row_bounds": torch.stack([quantized.error_bound(r, block, format) for r in exact]),
            "sum_error": (summed - exact_sum).abs(),
            "sum_bound": bounds.view(size, size, n)[:, me].sum(0),
            "ledger": dict(ledger.bytes_by_key),
        }
    return out


@pytest.mark.parametrize(("world_size", "mesh"), [(2, {"fsdp": 2}), (4, {"dp": 2, "fsdp": 2})])
def test_the_quantized_collectives_stay_within_the_bound_and_send_their_bytes(
    pools, world_size, mesh
):
    """int8 and fp8 send (1 + 4 / block) / 4 of fp32's bytes, int4 (0.5 + 4 / block) / 4."""
    block = 64
    results = pools.run(world_size, _collectives, mesh, block)
    axes = tuple(mesh)
    formats: tuple[tuple[Any, float], ...] = (("int8", 1), ("fp8", 1), ("int4", 0.5))
    for format, values in formats:
        sent = (world_size - 1) * quantized_bytes(1024, block, format)
        assert sent / ((world_size - 1) * 4 * 1024) == (values + 4 / block) / 4
        for r in results:
            q = r[format]
            # every rank computes with the same values
            assert torch.equal(q["rows"], results[0][format]["rows"])
            assert torch.all((q["rows"] - r["exact"]).abs() <= q["row_bounds"] * (1 + SLACK))
            assert torch.all(q["sum_error"] <= q["sum_bound"] * (1 + 1e-5) + 1e-6)
            assert q["ledger"] == {("all_gather", axes): sent, ("reduce_scatter", axes): sent}


def _quantized_step(
    mesh: dict[str, int], strategy: Any, layout: Any, quantize: fs.Quantized, micro: int
) -> dict[str, Any]:
    """Worker body: one step exact and one quantized on the same shards; the ledgers and losses."""
    model = Model(kind="transformer", vocab=64, width=32, hidden=64, layers=2, embed_unit=True)
    params = model.init(0)
    plan = fs.plan(params, fs.Mesh(mesh), units=model.units, strategy=strategy, layout=layout)
    sparams = fs.shard(params, plan)
    batches = [model.batch_for(10 * fs.rank() + m) for m in range(micro)]
    out: dict[str, Any] = {}
    for name, q in (("exact", None), ("quantized", quantize)):
        step = fs.value_and_grad(model.loss_fn, plan, quantize=q)
        step.accumulate(sparams, batches)  # learns the call order
        step.ledger.reset()
        loss, grads = step.accumulate(sparams, batches)
        cost = CostModel(micro_batches=micro, quantize=q, backend="gloo")
        predicted = estimate(plan, cost)
        state = fs.optim.adamw(lr=1e-3).init(sparams)
        out[name] = {
            "loss": float(loss),
            "grads": fs.unshard(grads),
            "ledger": dict(step.ledger.bytes_by_key),
            "model": dict(predicted.comm),
            "peak": step.stats.peak_gathered_bytes,
            "bound": predicted.memory.gathered + predicted.memory.staging,
            "held": (held_bytes(sparams), held_bytes(grads), held_bytes(state)),
            "held_model": (
                predicted.memory.params,
                predicted.memory.grads,
                predicted.memory.optimizer,
            ),
        }
    return out


@pytest.mark.parametrize(
    ("world_size", "mesh", "strategy"),
    [
        (2, {"fsdp": 2}, "full_shard"),
        (4, {"dp": 2, "fsdp": 2}, "hybrid_shard"),
        (4, {"node": 2, "local": 2}, "partial_reshard"),
        # two quantized hops ([Note: two-hop reductions] in execute/param_group.py)
        (4, {"node": 2, "local": 2}, "hybrid_shard_optimizer"),
    ],
)
def test_a_quantized_step_sends_what_the_cost_model_says_and_stays_close(
    pools, world_size, mesh, strategy
):
    """Every layout and format, weights and gradients alone and together, over 2 micro-batches: the ledger
    equals ``CostModel(quantize=...)``, and the params, gradients and AdamW state held equal
    it and the exact step's; the loss and gradients stay close to the exact step."""
    for layout in ("leaf", "flat"):
        for q in (
            fs.Quantized(block=64),
            fs.Quantized(weights="fp8", gradients=False, block=32),
            fs.Quantized(weights=False, gradients="int4", units=("blocks/*",)),
        ):
            for r in pools.run(world_size, _quantized_step, mesh, strategy, layout, q, 2):
                exact, quant = r["exact"], r["quantized"]
                assert quant["ledger"] == quant["model"], (layout, q)
                assert exact["ledger"] == exact["model"], (layout, q)
                assert sum(quant["ledger"].values()) < sum(exact["ledger"].values())
                assert quant["peak"] <= quant["bound"]
                assert quant["held"] == quant["held_model"] == exact["held"], (layout, q)
                assert quant["loss"] == pytest.approx(exact["loss"], rel=2e-2)
                tol = max(CLOSE[f] for f in (q.weight_format, q.gradient_format) if f)
                if q.gradient_format and strategy == "hybrid_shard_optimizer":
                    tol = max(tol, 2 * CLOSE[q.gradient_format])  # each hop rounds again
                for a, b in zip(fs.tree.leaves(exact["grads"]), fs.tree.leaves(quant["grads"])):
                    if a is not None:
                        assert (a - b).abs().max() <= tol * a.abs().max() + 1e-3, (layout, q)
