"""fs.optim against optax on full tensors: Lion with a decay mask, and chain(clip, adamw, schedule).

optax runs in float32 on JAX's CPU; funcshard on one rank's shards (a mesh of one)
in float32: equal to float32 rounding.
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
