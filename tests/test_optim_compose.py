"""fs.optim composed: chain, guards, masks, partition, ema, from_torch; checkpoints of their state."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard.testing import assert_trees_close


def _tree(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": {"tokens": torch.randn(10, 6, generator=gen)},
        "blocks": [
            {
                "ln": {"scale": torch.ones(6), "bias": torch.zeros(6)},
                "w": torch.randn(6, 5, generator=gen),
                "b": torch.randn(5, generator=gen),
            }
            for _ in range(2)
        ],
        "head": {"w": torch.randn(5, 7, generator=gen)},
    }


def _grads(params: Any, step: int) -> Any:
    return fs.tree.map(lambda t: torch.sin(t * (step + 1)) + 0.1 * (step - 1), params)


def _chain_vs_torch(mesh: dict[str, int], strategy: Any, layout: Any) -> list[tuple[Any, Any]]:
    """chain(skip_nonfinite(), clip_by_global_norm(0.5), adamw(mask)) for 4 updates, one of them NaN."""
    params = _tree()
    plan = fs.plan(params, fs.Mesh(mesh), units=["blocks/*"], strategy=strategy, layout=layout)
    sparams = fs.shard(params, plan)
    opt = fs.optim.chain(
        fs.optim.skip_nonfinite(),
        fs.optim.clip_by_global_norm(0.5),
        fs.optim.adamw(lr=0.05, weight_decay=0.1, mask=fs.optim.decay_mask_default),
    )
    state = opt.init(sparams)
    norms = []
    for step in range(4):
        g = _grads(params, step)
        if step == 2:
            g["blocks"][1]["b"][0] = float("nan")  # one rank's shard or another: all skip
        sparams, state = opt.update_(fs.shard(g, plan), state, sparams)
        norms.append(float(state[1].norm))
    return [(fs.unshard(sparams), (int(state[0].skipped), norms))]


@pytest.mark.parametrize(
    ("world_size", "mesh", "strategy", "layout"),
    [
        (1, {"fsdp": 1}, "full_shard", "leaf"),
        (2, {"fsdp": 2}, "full_shard", "leaf"),
        (4, {"dp": 2, "fsdp": 2}, "hybrid_shard", "leaf"),
        # masks select runs of leaves whose ranges are cut inside leaves
        (2, {"fsdp": 2}, "full_shard", "flat"),
        (4, {"dp": 2, "fsdp": 2}, "hybrid_shard", "flat"),
    ],
)
def test_a_chain_equals_torch_clip_and_adamw_groups(pools, world_size, mesh, strategy, layout):
    params = _tree()
    leaves = {
        p: t.clone().requires_grad_()
        for p, t in zip(fs.tree.leaf_paths(params), fs.tree.leaves(params))
    }
    decay = [t for p, t in leaves.items() if p.endswith("/w")]
    rest = [t for p, t in leaves.items() if not p.endswith("/w")]
    reference = torch.optim.AdamW(
        [{"params": decay}, {"params": rest, "weight_decay": 0.0}],
        lr=0.05,
        weight_decay=0.1,
        fused=True,
    )
    norms = []
    for step in range(4):
        if step == 2:
            continue  # skipped
        for t, g in zip(leaves.values(), fs.tree.leaves(_grads(params, step))):
            t.grad = g.clone()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(leaves.values()), 0.5)))
        reference.step()
    for result in pools.run(world_size, _chain_vs_torch, mesh, strategy, layout):
        full, (skipped, seen) = result[0]
        assert skipped == 1
        assert seen[2] == seen[1]  # the skipped update leaves the clip's state as it was
        assert seen[:2] + seen[3:] == pytest.approx(norms, rel=1e-5)
        for path, ours in zip(fs.tree.leaf_paths(full), fs.tree.leaves(full)):
            torch.testing.assert_close(ours, leaves[path].detach(), rtol=1e-5, atol=1e-6)


def test_the_default_decay_mask_skips_norms_biases_and_embeddings():
    params = {
        **_tree(),
        "model": {
            "embed_tokens": {"weight": torch.zeros(4, 2)},
            "layers": [
                {
                    "input_layernorm": {"weight": torch.zeros(2)},
                    "q_proj": {"weight": torch.zeros(2, 2)},
                }
            ],
        },
        "transformer": {"wte": torch.zeros(4, 2), "ln_f": {"weight": torch.zeros(2, 2)}},
    }
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    decayed = [
        leaf.path for leaf in fs.tree.leaves(sp) if fs.optim.decay_mask_default(leaf.path, leaf)
    ]
    assert decayed == ["blocks/0/w", "blocks/1/w", "head/w", "model/layers/0/q_proj/weight"]


@pytest.mark.parametrize(
    "mask",
    [
        ["blocks/*/w", "head"],  # patterns: a leaf or a subtree above it
        [re.compile(r"(^|/)w$")],
        {"embed": False, "blocks": [{"ln": False, "w": True, "b": False}] * 2, "head": True},
        lambda path, leaf: path.endswith("w"),
    ],
    ids=["globs", "regex", "bool-tree-prefixes", "callable"],
)
def test_masks_select_the_same_leaves_in_every_form(mask):
    params = _tree()
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1}), units=["blocks/*"]))
    opt = fs.optim.masked(fs.optim.sgd(lr=1.0), mask)
    sp, state = opt.update_(sp, opt.init(sp), sp)  # grads = params: selected leaves become 0
    full = fs.unshard(sp)
    for path, leaf in zip(fs.tree.leaf_paths(full), fs.tree.leaves(full)):
        original = fs.tree.leaves(params)[fs.tree.leaf_paths(params).index(path)]
        expected = torch.zeros_like(original) if path.endswith("w") else original
        torch.testing.assert_close(leaf, expected)
    assert int(state.count) == 1


@pytest.mark.parametrize(
    ("mask", "error", "message"),
    [
        (["blocks/*/nope"], ValueError, r"mask\[0\] 'blocks/\*/nope' matches no trainable leaf"),
        (lambda path, leaf: 1, TypeError, r"the mask returned 1 for 'blocks/0/b'"),
        ({"embed": True}, ValueError, r"the mask tree has no bool for 'blocks/0/b'"),
        (3, TypeError, r"a mask is a function \(path, leaf\) -> bool, a list of path patterns"),
    ],
)
def test_bad_masks_are_named(mask, error, message):
    params = _tree()
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    with pytest.raises(error, match=message):
        fs.optim.adamw(lr=0.1, mask=mask).init(sp)


def test_ema_averages_the_params_after_each_update_and_serves_forward():
    params = _tree()
    plan = fs.plan(params, fs.Mesh({"x": 1}), units=["blocks/*"], frozen=["embed"])
    sp = fs.shard(params, plan)
    opt = fs.optim.chain(fs.optim.adamw(lr=0.1), fs.optim.ema(0.8))
    state = opt.init(sp)
    trained = [p for p in fs.tree.leaf_paths(params) if not p.startswith("embed")]
    ref = {p: fs.tree.leaves(params)[fs.tree.leaf_paths(params).index(p)].clone() for p in trained}
    avg = {p: t.clone() for p, t in ref.items()}
    torch_opt = torch.optim.AdamW(
        [t.requires_grad_() for t in ref.values()], lr=0.1, weight_decay=0.01, fused=True
    )
    for step in range(3):
        g = _grads(params, step)
        sp, state = opt.update_(fs.shard(g, plan), state, sp)  # frozen leaves' grads unread
        for p, t in ref.items():
            t.grad = fs.tree.leaves(g)[fs.tree.leaf_paths(g).index(p)].clone()
        torch_opt.step()
        for p in trained:
            torch._foreach_lerp_([avg[p]], [ref[p].detach()], 0.2)
    averaged = fs.unshard(fs.optim.ema_params(state, sp))
    for path, leaf in zip(fs.tree.leaf_paths(averaged), fs.tree.leaves(averaged)):
        expected = (
            avg[path]
            if path in avg
            else fs.tree.leaves(params)[fs.tree.leaf_paths(params).index(path)]
        )
        torch.testing.assert_close(leaf, expected, rtol=1e-6, atol=1e-7)

    # the average is a params tree of the plan: evaluation runs on it
    def total(p: Any) -> torch.Tensor:
        return p["head"]["w"].sum() + sum(
            fs.call(lambda b: b["w"].sum(), blk) for blk in p["blocks"]
        )

    value = fs.forward(total, plan)(fs.optim.ema_params(state, sp))
    torch.testing.assert_close(value, total(averaged))


def test_a_masked_ema_keeps_the_other_leaves_current():
    params = _tree()
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))  # one flat buffer: a partial average
    opt = fs.optim.chain(fs.optim.sgd(lr=0.5), fs.optim.masked(fs.optim.ema(0.5), ["head"]))
    sp, state = opt.update_(sp, opt.init(sp), sp)
    full = fs.unshard(fs.optim.ema_params(state, sp))
    torch.testing.assert_close(full["head"]["w"], 0.75 * params["head"]["w"])
    torch.testing.assert_close(full["blocks"][0]["w"], 0.5 * params["blocks"][0]["w"])


def test_misuse_is_refused_with_the_fix():
    params = _tree()
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    with pytest.raises(
        TypeError, match=r"skip_nonfinite\(\) without an optimizer is a chain element"
    ):
        fs.optim.skip_nonfinite().update_(sp, None, sp)
    with pytest.raises(TypeError, match=r"chain: part 0 is a SGD; .*fs.optim.from_torch"):
        fs.optim.chain(torch.optim.SGD([torch.zeros(1)], lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"has no moving average; chain fs.optim.ema"):
        fs.optim.ema_params(fs.optim.sgd(0.1).init(sp), sp)
    with pytest.raises(TypeError, match=r"Adafactor reads whole tensors .* use fs.optim.adafactor"):
        fs.optim.from_torch(torch.optim.Adafactor)

    class Factored(torch.optim.Adafactor):  # a subclass updates as its base does
        pass

    with pytest.raises(
        TypeError,
        match=r"Factored \(a subclass of torch.optim.Adafactor\) reads whole tensors",
    ):
        fs.optim.from_torch(Factored)
    with pytest.raises(TypeError, match=r"a subclass of torch.optim.lbfgs.LBFGS"):
        fs.optim.from_torch(type("Quasi", (torch.optim.LBFGS,), {}))
    with pytest.raises(TypeError, match=r"takes a torch.optim optimizer class"):
        fs.optim.from_torch(torch.optim.SGD([torch.zeros(1)], lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"from_torch: torch.optim.Adam: .*learning rate"):
        fs.optim.from_torch(torch.optim.Adam, lr=-1.0)
    with pytest.raises(
        ValueError, match=r"partition: 'blocks/0/b' has label 'x', which is not one of \['w'\]"
    ):
        fs.optim.partition(
            {"w": fs.optim.sgd(0.1)}, lambda path, leaf: "w" if path.endswith("w") else "x"
        ).init(sp)
    with pytest.raises(ValueError, match=r"ema: decay must be a number in \[0.0, 1.0\)"):
        fs.optim.ema(1.0)
    with pytest.raises(ValueError, match=r"lion: betas\[0\]"):
        fs.optim.lion(1e-4, betas=(1.5, 0.99))


def _composite(sp: Any) -> Any:
    return fs.optim.chain(
        fs.optim.clip_by_global_norm(1.0),
        fs.optim.partition(
            {
                "adam": fs.optim.from_torch(torch.optim.Adam, lr=0.01),
                "lion": fs.optim.lion(1e-3, mask=["head"]),
            },
            lambda path, leaf: "adam" if path.startswith("blocks") else "lion",
        ),
        fs.optim.masked(fs.optim.ema(0.9), ["blocks"]),
    )


def test_composite_state_checkpoints_reshard_and_resume_bit_exactly(tmp_path: Path):
    """Save mid-run with one unit grouping, load into another; the run continues bit for bit."""
    params = _tree()
    saving = fs.plan(params, fs.Mesh({"x": 1}), units=["blocks/*"])
    loading = fs.plan(params, fs.Mesh({"x": 1}), units=["blocks", "head"])

    def run(plan: fs.Plan, sp: Any, state: Any, steps: range) -> tuple[Any, Any]:
        opt = _composite(sp)
        for step in steps:
            sp, state = opt.update_(fs.shard(_grads(params, step), plan), state, sp)
        return sp, state

    sp = fs.shard(params, saving)
    sp, state = run(saving, sp, _composite(sp).init(sp), range(2))
    fs.checkpoint.save(tmp_path / "ckpt", {"params": sp, "opt": state})
    straight = fs.unshard(run(saving, sp, state, range(2, 4))[0])

    fresh = fs.shard(params, loading)
    like = {"params": fresh, "opt": _composite(fresh).init(fresh)}
    loaded = fs.checkpoint.load(tmp_path / "ckpt", like=like)
    resumed, state = run(loading, loaded["params"], loaded["opt"], range(2, 4))
    for a, b in zip(fs.tree.leaves(fs.unshard(resumed)), fs.tree.leaves(straight)):
        assert torch.equal(a, b)
    assert int(state[1]["adam"].count) == 4


@pytest.mark.parametrize("save", ["save", "save_dcp"])
def test_from_torch_sgd_state_resumes_bit_exactly(tmp_path: Path, save: str):
    """torch's SGD keeps no step, so a DCP load leaves count 0: the loaded momentum_buffer
    must still reach torch (with dampening a fresh first update differs from a loaded one)."""
    params = _tree()
    plan = fs.plan(params, fs.Mesh({"x": 1}), units=["blocks/*"])
    opt = fs.optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9, dampening=0.5)
    sp = fs.shard(params, plan)
    state = opt.init(sp)
    for step in range(2):
        sp, state = opt.update_(fs.shard(_grads(params, step), plan), state, sp)
    fresh = fs.shard(params, plan)
    if save == "save":
        fs.checkpoint.save(tmp_path / "c", {"params": sp, "opt": state})
        loaded = fs.checkpoint.load(tmp_path / "c", like={"params": fresh, "opt": opt.init(fresh)})
        back, resumed = loaded["params"], loaded["opt"]
    else:
        fs.checkpoint.save_dcp(tmp_path / "c", sp, opt_state=state)
        back, resumed = fs.checkpoint.load_dcp(tmp_path / "c", fresh, optimizer=opt)
    for step in range(2, 4):
        sp, state = opt.update_(fs.shard(_grads(params, step), plan), state, sp)
        back, resumed = opt.update_(fs.shard(_grads(params, step), plan), resumed, back)
    for a, b in zip(fs.tree.leaves(fs.unshard(back)), fs.tree.leaves(fs.unshard(sp))):
        assert torch.equal(a, b)


def test_from_torch_state_names_do_not_depend_on_the_hash_seed():
    """Every process draws its own PYTHONHASHSEED; a frozenset of state names listed Adam's
    moments in one order under seed 0 and the other under seed 1, and the ranks' saves differed."""
    code = (
        "import torch, funcshard as fs; p = {'w': torch.ones(2)}; "
        "sp = fs.shard(p, fs.plan(p, fs.Mesh({'x': 1}))); "
        "s = fs.optim.from_torch(torch.optim.Adam, lr=0.1, amsgrad=True).init(sp); "
        "print(list(s.tensors), list(s.scalars))"
    )
    listed = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in (0, 1)
    }
    assert listed == {"['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq'] ['step']\n"}


def _composite_run(directory: str, layout: Any, resume: bool) -> Any:
    """Worker body: two composite updates then a save (or a load of that save), then two more."""
    params = _tree()
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=["blocks/*"], layout=layout)
    sp = fs.shard(params, plan)
    opt = _composite(sp)
    state = opt.init(sp)
    if resume:
        loaded = fs.checkpoint.load(directory, like={"params": sp, "opt": state})
        sp, state = loaded["params"], loaded["opt"]
    else:
        for step in range(2):
            sp, state = opt.update_(fs.shard(_grads(params, step), plan), state, sp)
        fs.checkpoint.save(directory, {"params": sp, "opt": state})
    for step in range(2, 4):
        sp, state = opt.update_(fs.shard(_grads(params, step), plan), state, sp)
    return fs.unshard({"params": sp, "opt": state})


@pytest.mark.parametrize(
    ("saving", "loading"), [((2, "flat"), (4, "leaf")), ((4, "leaf"), (2, "flat"))]
)
def test_masked_state_of_the_flat_layout_reshards_to_and_from_per_leaf_specs(
    pools, tmp_path, saving, loading
):
    """Masks cut runs of leaves out of flat ranges; their state checkpoints as boxes of leaves."""
    directory = str(tmp_path / "ckpt")
    straight = pools.run(saving[0], _composite_run, directory, saving[1], False)[0]
    resumed = pools.run(loading[0], _composite_run, directory, loading[1], True)[0]
    assert_trees_close(resumed, straight, rtol=1e-6, atol=1e-7)


def _guarded_runs(mesh: dict[str, int]) -> list[Any]:
    """A guarded chain and a guarded adamw, deciding on the device and on the host: 5 updates, 2 NaN.

    The host decides where the rate is a schedule (constant all the same): AdamW then
    needs its count on the host and cannot skip on the device.
    """
    params = _tree()
    plan = fs.plan(params, fs.Mesh(mesh), units=["blocks/*"])
    results = []
    for lr in (0.05, lambda count: 0.05):
        for opt in (
            fs.optim.chain(
                fs.optim.skip_nonfinite(), fs.optim.clip_by_global_norm(0.5), fs.optim.adamw(lr)
            ),
            fs.optim.chain(
                fs.optim.clip_by_global_norm(0.5), fs.optim.skip_nonfinite(fs.optim.adamw(lr))
            ),
        ):
            sparams = fs.shard(params, plan)
            state = opt.init(sparams)
            for step in range(5):
                grads = _grads(params, step)
                if step in (1, 3):
                    grads["blocks"][0]["w"][1, 1] = float("inf") if step == 1 else float("nan")
                sparams, state = opt.update_(fs.shard(grads, plan), state, sparams)
            results.append(fs.unshard({"params": sparams, "state": state}))
    return results


@pytest.mark.parametrize(("world_size", "mesh"), [(1, {"fsdp": 1}), (2, {"fsdp": 2})])
def test_skipping_on_the_device_equals_skipping_on_the_host(pools, world_size, mesh):
    """skip_nonfinite's device flag (fused AdamW's found_inf) gives the host decision's result, bit for bit.

    A failure localises to the gated path: the clip's state, AdamW's count or moments, or
    the skipped count differ from the update the host decided to skip.
    """
    for device_chain, device_wrapped, host_chain, host_wrapped in pools.run(
        world_size, _guarded_runs, mesh
    ):
        for ours, theirs in ((device_chain, host_chain), (device_wrapped, host_wrapped)):
            for a, b in zip(fs.tree.leaves(ours), fs.tree.leaves(theirs)):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert int(device_chain["state"][0].skipped) == 2
        assert int(device_chain["state"][2].count) == 3
