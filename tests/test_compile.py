"""torch.compile of a whole loss_fn: one graph, no break per fs.call, no recompile per unit or step.

See [Note: compiled calls] in funcshard/_src/execute/compiled.py. ``aot_eager``
runs Dynamo, AOTAutograd and its partitioner (where the gather is recomputed or
saved) but no code generation, so its results equal eager bit for bit; one
Inductor run checks the generated code within float tolerance.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import funcshard as fs
from bench import model as gpt
from funcshard._src.shard.sharded import flats_of, map_flats
from tests.pool import WorkerError

CFG = gpt.Config(vocab=64, width=32, heads=2, layers=4, seq=16, batch=2)
STEPS = 3


def loss_fn(params: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return gpt.loss_fn(params, tokens, targets, CFG.heads)


def reuse_loss(params: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """blocks/0 called twice: two gathers and two reductions of one unit in one graph."""
    h = params["embed"]["tokens"][tokens] + params["embed"]["pos"][: tokens.shape[1]]
    for i in (0, 1, 0):
        h = fs.call(gpt.block_fn, params["blocks"][i], h, CFG.heads)
    return gpt.head_loss(params["head"], h, targets)


def remat_loss(params: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The bench GPT with every block recomputed in backward (fs.call(..., remat=True))."""
    h = params["embed"]["tokens"][tokens] + params["embed"]["pos"][: tokens.shape[1]]
    for blk in params["blocks"]:
        h = fs.call(gpt.block_fn, blk, h, CFG.heads, remat=True)
    return gpt.head_loss(params["head"], h, targets)


def _train(fn: Any, strategy: Any) -> tuple[list[Any], Any]:
    params = gpt.init_params(CFG)
    strategy, _, layout = strategy.partition("/")  # "full_shard/flat": the flat layout
    plan = fs.plan(
        params,
        fs.Mesh({"fsdp": fs.world_size()}),
        units=["blocks/*"],
        strategy=strategy,
        layout=layout or "leaf",
    )
    sparams = fs.shard(params, plan)
    step = fs.value_and_grad(fn, plan)
    step.memory.events = []
    out = []
    for i in range(STEPS):
        tokens, targets = gpt.batch(CFG, i, fs.rank())
        loss, grads = step(sparams, tokens, targets)
        out.append((loss, fs.unshard(grads)))
        sparams = _sgd(sparams, grads)
    return out, step


def _sgd(sparams: Any, grads: Any) -> Any:
    by_layout = {id(f.layout): f.data for f in flats_of(grads)}
    return map_flats(lambda f: f.with_data(f.data - 0.1 * by_layout[id(f.layout)]), sparams)


def _compare(strategy: str, backend: str, which: str) -> Any:
    with warnings.catch_warnings():
        # Dynamo reads .grad of its non-leaf inputs (the root unit's full leaves) as it wraps them
        warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf")
        # Inductor's import of torch.utils.mkldnn defines torch.jit script methods (torch 2.13)
        warnings.filterwarnings(
            "ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning
        )
        return _compare_inner(strategy, backend, which)


def _compare_inner(strategy: str, backend: str, which: str) -> Any:
    from torch._dynamo.utils import counters

    fn = {"plain": loss_fn, "reuse": reuse_loss, "remat": remat_loss}[which]
    torch._dynamo.reset()
    eager, eager_step = _train(fn, strategy)
    counters.clear()
    compiled, compiled_step = _train(torch.compile(fn, backend=backend), strategy)
    return (
        eager,
        compiled,
        {
            "frames": counters["frames"]["total"],
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "recompiles": sum(counters["recompiles"].values()),
        },
        eager_step.memory.events == compiled_step.memory.events,
        eager_step.ledger.bytes_by_key == compiled_step.ledger.bytes_by_key,
    )


@pytest.mark.parametrize(
    ("strategy", "which"),
    [
        ("full_shard", "plain"),
        ("shard_grad_op", "plain"),
        ("full_shard", "remat"),
        ("full_shard/flat", "plain"),
    ],
)
def test_compiled_loss_fn_equals_eager_with_one_graph(pools, strategy, which):
    for eager, compiled, count, same_events, same_ledger in pools.run(
        2, _compare, strategy, "aot_eager", which, timeout_s=300
    ):
        for (loss_e, grads_e), (loss_c, grads_c) in zip(eager, compiled):
            torch.testing.assert_close(loss_c, loss_e, rtol=0, atol=0)
            for a, b in zip(fs.tree.leaves(grads_e), fs.tree.leaves(grads_c)):
                torch.testing.assert_close(b, a, rtol=0, atol=0)
        # three steps on new params each: one frame, one graph, no break at any fs.call
        assert count == {"frames": 1, "graphs": 1, "graph_breaks": 0, "recompiles": 0}
        if which == "plain" and strategy == "full_shard":  # the same gathers, frees, re-gathers
            assert same_events
        assert same_ledger


def test_a_unit_called_twice_under_compile_names_the_limit(pools):
    with pytest.raises(WorkerError, match="called twice in one compiled loss_fn"):
        pools.run(2, _compare, "full_shard", "aot_eager", "reuse", timeout_s=300)


@pytest.mark.slow
def test_inductor_loss_fn_matches_eager(pools):
    """Inductor's generated code: within float tolerance (about 1e-6 here), one graph."""
    for eager, compiled, count, _, same_ledger in pools.run(
        2, _compare, "full_shard", "inductor", "plain", timeout_s=900
    ):
        for (loss_e, grads_e), (loss_c, grads_c) in zip(eager, compiled):
            torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
            for a, b in zip(fs.tree.leaves(grads_e), fs.tree.leaves(grads_c)):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        assert count == {"frames": 1, "graphs": 1, "graph_breaks": 0, "recompiles": 0}
        assert same_ledger
