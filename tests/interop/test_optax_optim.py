"""fs.optim against optax on full tensors: Lion with a decay mask, and chain(clip, adamw, schedule).

optax runs on JAX's CPU; funcshard on one rank's shards (a mesh of one). In float32
the two agree to float32 rounding; in float64 (``jax.enable_x64``) clip, AdamW's
defaults and a chain of both agree to a few roundings of float64, which is what
tells a different formula (torch's ``max_norm / (norm + 1e-6)``) from rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import funcshard as fs

optax = pytest.importorskip("optax", reason="optax is the oracle (the interop session installs it)")
jnp = pytest.importorskip("jax.numpy")

pytestmark = pytest.mark.interop


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 4, generator=gen), "b": torch.randn(4, generator=gen)}


def _run(opt: Any, steps: int) -> dict[str, torch.Tensor]:
    params = _params()
    plan = fs.plan(params, fs.Mesh({"x": 1}))
    sp = fs.shard(params, plan)
    state = opt.init(sp)
    for step in range(steps):
        grads = {k: torch.cos(v * (step + 1)) * (step + 1) for k, v in params.items()}
        sp, state = opt.update_(fs.shard(grads, plan), state, sp)
    return fs.unshard(sp)


def _run_optax(tx: Any, steps: int) -> dict[str, np.ndarray]:
    params = {k: jnp.asarray(v.numpy()) for k, v in _params().items()}
    original = dict(params)
    state = tx.init(params)
    for step in range(steps):
        grads = {k: jnp.cos(v * (step + 1)) * (step + 1) for k, v in original.items()}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return {k: np.asarray(v) for k, v in params.items()}


def _close(ours: dict[str, torch.Tensor], theirs: dict[str, np.ndarray]) -> None:
    for k in ours:
        np.testing.assert_allclose(ours[k].numpy(), theirs[k], rtol=1e-5, atol=1e-6)


def test_lion_with_a_decay_mask_equals_optax():
    ours = _run(fs.optim.lion(3e-3, betas=(0.9, 0.99), weight_decay=0.5, mask=["w"]), steps=5)
    theirs = _run_optax(
        optax.lion(3e-3, b1=0.9, b2=0.99, weight_decay=0.5, mask={"w": True, "b": False}), steps=5
    )
    _close(ours, theirs)


def test_chain_of_clip_and_scheduled_adamw_equals_optax():
    schedule = fs.optim.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6, 1e-4)
    ours = _run(
        fs.optim.chain(
            fs.optim.clip_by_global_norm(1.0),
            fs.optim.adamw(schedule, weight_decay=0.1, mask=fs.optim.decay_mask_default),
        ),
        steps=6,
    )
    theirs = _run_optax(
        optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.adamw(
                optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6, 1e-4),
                weight_decay=0.1,
                mask={"w": True, "b": False},
            ),
        ),
        steps=6,
    )
    _close(ours, theirs)


# float64: funcshard and optax on the same numbers, where each rounding is the last bit


def _params64() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(6, 4, generator=gen, dtype=torch.float64),
        "b": torch.randn(4, generator=gen, dtype=torch.float64),
    }


def _grads64(step: int, scale: float) -> dict[str, torch.Tensor]:
    return {k: torch.cos(v * (step + 1)) * scale for k, v in _params64().items()}


def _run64(opt: Any, steps: int, scale: float) -> dict[str, torch.Tensor]:
    params = _params64()
    plan = fs.plan(params, fs.Mesh({"x": 1}))
    sp = fs.shard(params, plan)
    state = opt.init(sp)
    for step in range(steps):
        sp, state = opt.update_(fs.shard(_grads64(step, scale), plan), state, sp)
    return fs.unshard(sp)


def _run_optax64(tx: Any, steps: int, scale: float) -> dict[str, np.ndarray]:
    import jax

    with jax.enable_x64(True):
        params = {k: jnp.asarray(v.numpy()) for k, v in _params64().items()}
        state = tx.init(params)
        for step in range(steps):
            grads = {k: jnp.asarray(v.numpy()) for k, v in _grads64(step, scale).items()}
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return {k: np.asarray(v) for k, v in params.items()}


def _equal64(ours: dict[str, torch.Tensor], theirs: dict[str, np.ndarray], rtol: float) -> None:
    for k in ours:
        assert theirs[k].dtype == np.float64
        np.testing.assert_allclose(ours[k].numpy(), theirs[k], rtol=rtol, atol=0, err_msg=k)


@pytest.mark.parametrize("scale", [1e-3, 0.3, 40.0])  # under max_norm, near it, far above it
def test_clip_by_global_norm_equals_optax_in_float64(scale):
    """clip_by_global_norm scales as optax does (max_norm / norm), not as torch (norm + 1e-6)."""
    import jax

    gen = torch.Generator().manual_seed(2)
    grads = {
        "w": torch.randn(7, 3, generator=gen, dtype=torch.float64) * scale,
        "b": torch.randn(5, generator=gen, dtype=torch.float64) * scale,
    }
    plan = fs.plan(grads, fs.Mesh({"x": 1}))
    sharded = fs.shard(grads, plan)
    clipped, norm = fs.optim.clip_by_global_norm(sharded, 1.0)
    with jax.enable_x64(True):
        tx = optax.clip_by_global_norm(1.0)
        theirs, _ = tx.update({k: jnp.asarray(v.numpy()) for k, v in grads.items()}, tx.init(None))
        their_norm = float(optax.tree.norm({k: jnp.asarray(v.numpy()) for k, v in grads.items()}))
        theirs = {k: np.asarray(v) for k, v in theirs.items()}
    assert float(norm) == pytest.approx(their_norm, rel=1e-15)
    _equal64(fs.unshard(clipped), theirs, rtol=4e-16)  # one rounding of a multiply
    for k, v in fs.unshard(sharded).items():  # the input tree is not written
        torch.testing.assert_close(v, grads[k], rtol=0, atol=0)
    # torch's formula, kept under eps=1e-6, is what optax is not: about eps / norm off
    torch_clipped, _ = fs.optim.clip_by_global_norm(sharded, 1.0, eps=1e-6)
    if float(norm) > 1.0:
        gap = max(
            float(np.max(np.abs(v.numpy() / theirs[k] - 1)))
            for k, v in fs.unshard(torch_clipped).items()
        )
        assert 0.5e-6 / float(norm) < gap < 2e-6 / float(norm)


def test_adamw_defaults_equal_optax_but_the_weight_decay_in_float64():
    """adamw(learning_rate=...) with optax's names: optax.adamw's numbers, given optax's decay 1e-4."""
    steps, scale = 5, 1.0
    ours_default = _run64(fs.optim.adamw(learning_rate=1e-2), steps, scale)
    ported = _run64(fs.optim.adamw(learning_rate=1e-2, weight_decay=1e-4), steps, scale)
    theirs = _run_optax64(optax.adamw(learning_rate=1e-2), steps, scale)
    _equal64(ported, theirs, rtol=1e-14)
    # funcshard's default decay is torch's 0.01, documented: optax's with weight_decay=0.01
    _equal64(ours_default, _run_optax64(optax.adamw(1e-2, weight_decay=0.01), steps, scale), 1e-14)
    with pytest.raises(AssertionError):
        _equal64(ours_default, theirs, rtol=1e-10)
    # and the foreach path, with optax's b1, b2, eps and mask spelled as optax spells them
    foreach = fs.optim.adamw(
        learning_rate=1e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.3, mask=["w"], fused=False
    )
    _equal64(
        _run64(foreach, steps, scale),
        _run_optax64(
            optax.adamw(
                1e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.3, mask={"w": True, "b": False}
            ),
            steps,
            scale,
        ),
        rtol=1e-14,
    )


@pytest.mark.parametrize("scale", [0.05, 30.0])  # the clip idle, and clipping every update
def test_chain_of_clip_and_adamw_equals_optax_in_float64(scale):
    """chain(clip_by_global_norm, adamw) as optax.chain of the same, with a schedule and a mask."""
    schedule = fs.optim.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6, 1e-4)
    theirs_schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6, 1e-4)
    ours = _run64(
        fs.optim.chain(
            fs.optim.clip_by_global_norm(1.0),
            fs.optim.adamw(learning_rate=schedule, weight_decay=1e-4, mask=["w"]),
        ),
        steps=6,
        scale=scale,
    )
    theirs = _run_optax64(
        optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.adamw(
                # optax's count is int32, which makes its schedule float32: cast it first
                lambda count: theirs_schedule(count.astype(jnp.float64)),
                mask={"w": True, "b": False},
            ),
        ),
        steps=6,
        scale=scale,
    )
    _equal64(ours, theirs, rtol=1e-14)
