"""The transport interface ([Note: transports] in ``comm/transport.py``).

The shared-memory transport is a plug-in: with ``FUNCSHARD_SHM=0`` none of its
modules is imported, and with its package blocked (as if deleted) a W=2 step
runs on gloo's sockets with the same gradients, bit for bit, as through shared
memory, and equal to a one-process reference.
"""

from __future__ import annotations

import importlib.abc
import os
import subprocess
import sys
from typing import Any

import torch

import funcshard as fs
from funcshard._src.comm import transport
from funcshard._src.comm.transport import TORCH
from funcshard._src.plan.strategy import transport_capabilities
from funcshard.testing import assert_trees_close, reference_value_and_grad
from tests.models import Model

MODEL = Model(kind="transformer", vocab=64, width=16, hidden=32, layers=2, embed_unit=True)


class _Blocked(importlib.abc.MetaPathFinder):
    """Raises ``ImportError`` for the shared-memory package, as if its folder were deleted."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == transport.SHM_PACKAGE or name.startswith(transport.SHM_PACKAGE + "."):
            raise ImportError(f"{name} is blocked")
        return None


def _step() -> dict[str, Any]:
    params = MODEL.init(0)
    plan = fs.plan(params, fs.Mesh({"fsdp": 2}), units=MODEL.units, strategy="full_shard")
    sparams = fs.shard(params, plan)
    step = fs.value_and_grad(MODEL.loss_fn, plan)
    batch = MODEL.batch_for(fs.rank())
    step(sparams, *batch)  # learns the call order
    loss, grads = step(sparams, *batch)
    return {"loss": float(loss), "grads": fs.unshard(grads)}


def _step_with_shm_blocked() -> dict[str, Any]:
    """The step with the package unimportable; the worker's own modules put back after."""
    package = transport.SHM_PACKAGE
    saved = {
        k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[:4] == package.split(".")
    }
    transport._plugin.cache_clear()
    blocker = _Blocked()
    sys.meta_path.insert(0, blocker)
    try:
        got = _step()
        got["plugin"] = transport.shared_memory()
        got["imported"] = sorted(k for k in sys.modules if k.startswith(package))
    finally:
        sys.meta_path.remove(blocker)
        sys.modules.update(saved)
        transport._plugin.cache_clear()
    return got


def test_a_step_with_the_shared_memory_package_blocked_equals_the_reference(pools):
    shared = pools.run(2, _step)
    blocked = pools.run(2, _step_with_shm_blocked)
    batches = [MODEL.batch_for(r) for r in range(2)]
    _, reference = reference_value_and_grad(MODEL.loss_fn, MODEL.init(0), batches)
    for rank, (s, b) in enumerate(zip(shared, blocked)):
        assert b["plugin"] is None, f"rank {rank}"
        assert b["imported"] == [], f"rank {rank}: {b['imported']}"
        assert b["loss"] == s["loss"]
        for x, y in zip(fs.tree.leaves(s["grads"]), fs.tree.leaves(b["grads"])):
            assert torch.equal(x, y), f"rank {rank}: gradients differ from shared memory's"
        assert_trees_close(b["grads"], reference, rtol=1e-5, atol=1e-6)


def test_with_the_transport_off_none_of_its_modules_is_imported():
    code = (
        "import sys, torch, funcshard as fs\n"
        "from funcshard._src.comm import collectives, transport\n"
        "assert transport.shared_memory() is None\n"
        "assert transport.capabilities('gloo', 2).sends_inputs_in_place is False\n"
        "collectives.settle()\n"
        "print(sorted(m for m in sys.modules if m.startswith(transport.SHM_PACKAGE)))\n"
    )
    env = dict(os.environ, FUNCSHARD_SHM="0")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_torch_s_collectives_gather_leaf_by_leaf_on_gloo_over_two_ranks_only():
    caps = TORCH.capabilities
    assert caps("gloo", 2).gathers_leaf_by_leaf
    assert not caps("gloo", 4).gathers_leaf_by_leaf
    assert not caps("nccl", 2).gathers_leaf_by_leaf
    assert not caps("gloo", 2).sends_inputs_in_place
    # the cost model asks through plan/, which names no transport
    assert transport_capabilities("gloo", 2) == caps("gloo", 2)
    assert transport_capabilities("nccl", 8) == caps("nccl", 8)
