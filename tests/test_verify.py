"""``fs.verify`` passes a right configuration and fails wrong ones, naming the leaf; so does the CLI.

Reference: the unsharded ``torch.func`` run inside ``fs.verify`` itself (its own
parity with the sharded step is tests/test_value_and_grad.py's). A failure here
localises to verify's comparison (a right plan that fails), its detection (a
wrong plan that passes: a unit leaf used outside ``fs.call``, a rank-dependent
loss), its argument checks, or the ``funcshard verify`` launcher.
"""

from __future__ import annotations

import math
import sys
import textwrap
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.verify.worker import ConfigError, arguments
from funcshard._src.verify.worker import main as worker_main
from funcshard.cli import main

VOCAB, WIDTH = 11, 6  # 11 rows over 2 ranks: uneven on purpose


def init_params(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": {"w": torch.randn(VOCAB, WIDTH, generator=gen)},
        "blocks": [
            {
                "w": torch.randn(WIDTH, WIDTH, generator=gen) / math.sqrt(WIDTH),
                "b": 0.1 * torch.randn(WIDTH, generator=gen),
            }
            for _ in range(2)
        ],
        "head": {"w": torch.randn(WIDTH, 1, generator=gen)},
    }


def batch_for(rank: int, examples: int = 4) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(100 + rank)
    return {
        "tokens": torch.randint(0, VOCAB, (examples,), generator=gen),
        "target": torch.randn(examples, generator=gen),
        "weight": 0.5,  # not a tensor: travels to the other ranks as JSON
    }


def embed(p: Any, tokens: torch.Tensor) -> torch.Tensor:
    return p["w"][tokens]


def block(p: Any, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ p["w"] + p["b"]) + h


def loss_fn(params: Any, batch: Any) -> torch.Tensor:
    h = fs.call(embed, params["embed"], batch["tokens"])
    for blk in params["blocks"]:
        h = fs.call(block, blk, h)
    return (
        batch["weight"] * ((h @ params["head"]["w"]).squeeze(-1) - batch["target"]).square().mean()
    )


def outside_call(params: Any, batch: Any) -> torch.Tensor:
    """Wrong: indexes the ``embed`` unit's leaf directly instead of through ``fs.call``."""
    h = embed(params["embed"], batch["tokens"])
    for blk in params["blocks"]:
        h = fs.call(block, blk, h)
    return ((h @ params["head"]["w"]).squeeze(-1) - batch["target"]).square().mean()


def rank_dependent(params: Any, batch: Any) -> torch.Tensor:
    """Wrong: each rank trains a slightly different function."""
    h = fs.call(embed, params["embed"], batch["tokens"])
    for i, blk in enumerate(params["blocks"]):
        shift = fs.rank() * 1e-3 if i == 0 else 0.0
        h = fs.call(lambda p, h, s=shift: block({"w": p["w"] + s, "b": p["b"]}, h), blk, h)
    return ((h @ params["head"]["w"]).squeeze(-1) - batch["target"]).square().mean()


UNITS = ["embed", "blocks/*"]
LOSSES = {"right": loss_fn, "outside": outside_call, "rank": rank_dependent}


def _verify(kind: str, **plan_kwargs: Any) -> dict[str, Any]:
    """Worker body: one ``fs.verify`` of the ``kind`` loss on this world size; the report as data."""
    params = init_params()
    options = {k: plan_kwargs.pop(k) for k in ("mixed_precision", "optimizer") if k in plan_kwargs}
    examples = plan_kwargs.pop("examples", None)  # rank r: examples + r of them
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=UNITS, **plan_kwargs)
    batch = batch_for(fs.rank(), 4 if examples is None else examples + fs.rank())
    report = fs.verify(LOSSES[kind], params, plan, batch, **options)
    return {
        "ok": report.ok,
        "text": str(report),
        "problems": list(report.problems),
        "steps": report.steps,
        "exact": [
            (c.name, c.measured, c.estimated) for c in report.memory + report.sent if c.exact
        ],
        "grad_compared": [r.path for r in report.leaves if r.grad_diff is not None],
    }


def _cases() -> list[dict[str, Any]]:
    """Worker body: right configurations that must pass on every world size."""
    bf16 = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return [
        _verify("right"),
        _verify("right", strategy="shard_grad_op", examples=3),  # batches of 3 and 4 examples
        _verify("right", strategy="no_shard", optimizer=fs.optim.adamw(lr=1e-2)),
        _verify("right", frozen=["embed"]),
        _verify("right", mixed_precision=bf16),
    ]


def _check_passes(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["ok"], r["text"]
        assert r["steps"] == 2
        for name, measured, estimated in r["exact"]:
            assert estimated is None or measured == estimated, (name, r["text"])
    frozen = results[3]
    assert "embed/w" not in frozen["grad_compared"]
    assert "blocks/0/w" in frozen["grad_compared"]


def test_a_right_configuration_passes_in_one_process():
    _check_passes(_cases())
    text = _verify("right")["text"]
    assert text.startswith("fs.verify: PASS: 2 step(s) on 1 rank(s), fp32")
    for part in ("blocks/1/b", "memory per rank", "loss (reference)"):
        assert part in text


def test_a_right_configuration_passes_on_two_ranks(pools):
    per_rank = pools.run(2, _cases)
    for results in per_rank:
        _check_passes(results)
    assert [r["text"] for r in per_rank[0]] == [r["text"] for r in per_rank[1]]  # one report
    assert "all_gather over fsdp" in per_rank[0][0]["text"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_unit_leaf_used_outside_call_fails_naming_the_leaf(pools, world_size):
    for r in pools.run(world_size, _verify, "outside"):
        assert not r["ok"]
        assert r["problems"][0].startswith("embed/w: ")
        assert "fs.call(fn, <the unit's subtree>, ...)" in r["problems"][0]
        assert "FAIL" in r["text"].splitlines()[0]


def test_a_rank_dependent_loss_fails_on_two_ranks(pools):
    assert _verify("rank")["ok"]  # one rank: nothing to disagree with
    for r in pools.run(2, _verify, "rank"):
        assert not r["ok"], r["text"]
        assert any("depends on the rank" in p for p in r["problems"]), r["problems"]


def test_bad_arguments_are_clear_errors():
    params = init_params()
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=UNITS)
    batch = batch_for(0)
    for steps in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"fs\.verify: steps must be a whole number >= 1"):
            fs.verify(loss_fn, params, plan, batch, steps=steps)  # pyright: ignore[reportArgumentType]
    other = {**params, "extra": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"fs\.verify: params do not have the plan's tree"):
        fs.verify(loss_fn, other, plan, batch)
    with pytest.raises(ValueError, match=r"fs\.verify: rtol must be a finite number >= 0"):
        fs.verify(loss_fn, params, plan, batch, rtol=-1.0)
    with pytest.raises(TypeError, match=r"fs\.verify: loss_fn must be callable"):
        fs.verify("loss", params, plan, batch)  # pyright: ignore[reportArgumentType]
    two = fs.plan(params, fs.Mesh({"fsdp": 2}), units=UNITS)
    with pytest.raises(ValueError, match=r"has 2 ranks but the world size is 1"):
        fs.verify(loss_fn, params, two, batch)


def test_an_exception_in_the_step_is_a_problem_not_a_crash():
    params = init_params()
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=UNITS)

    def not_scalar(p: Any, b: Any) -> torch.Tensor:
        return loss_fn(p, b).reshape(1).expand(2)

    report = fs.verify(not_scalar, params, plan, batch_for(0))
    assert not report.ok
    assert report.steps == 0
    assert "loss_fn must return a floating-point scalar" in report.problems[0]
    assert "[the sharded step raised TypeError at step 0]" in report.problems[0]


def test_a_nondeterministic_loss_fails_naming_the_leaves_that_differ():
    params = init_params()
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=UNITS)
    gen = torch.Generator().manual_seed(0)

    def noisy(p: Any, b: Any) -> torch.Tensor:  # dropout-like: another draw in every call
        return loss_fn(p, b) * (1 + 0.1 * torch.rand((), generator=gen))

    report = fs.verify(noisy, params, plan, batch_for(0), steps=1)
    assert isinstance(report, fs.VerifyReport)
    assert not report.ok
    assert not any(row.ok for row in report.leaves)
    differ = [p for p in report.problems if "the sharded gradient differs" in p]
    assert differ, report.problems
    assert differ[0].startswith("blocks/0/b: "), report.problems
    assert "is deterministic (no dropout" in differ[0]
    with pytest.raises(AttributeError):
        report.steps = 3  # pyright: ignore[reportAttributeAccessIssue]


def test_what_verify_config_returns():
    assert set(arguments((loss_fn, 1, 2, 3), "s.py")) == {"loss_fn", "params", "plan", "batch"}
    with pytest.raises(ConfigError, match=r"s\.py: verify_config\(\) returned a list"):
        arguments([1, 2, 3, 4], "s.py")
    with pytest.raises(ConfigError, match=r"lacks \['batch'\] and has unknown keys \['lr'\]"):
        arguments({"loss_fn": 1, "params": 2, "plan": 3, "lr": 4}, "s.py")


SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import funcshard as fs


    def loss_fn(params, x):
        h = fs.call(lambda p, x: torch.tanh(x @ p["w"]), params["layer"], x)
        return (h @ params["head"]).square().mean()


    def wrong(params, x):  # the unit's leaf outside fs.call
        return (torch.tanh(x @ params["layer"]["w"]) @ params["head"]).square().mean()


    def verify_config():
        gen = torch.Generator().manual_seed(0)
        params = {"layer": {"w": torch.randn(4, 6, generator=gen)}, "head": torch.randn(6, 1, generator=gen)}
        plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=["layer"])
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(fs.rank()))
        fn = wrong if sys.argv[1:] == ["--wrong"] else loss_fn
        return {"loss_fn": fn, "params": params, "plan": plan, "batch": x, "steps": 1}


    if __name__ == "__main__":
        raise SystemExit("funcshard verify imports this script; it does not run it as __main__")
    """
)


def test_the_command_passes_and_fails_with_its_exit_status(tmp_path, capfd):
    """Two real torchrun launches: a pass on 2 ranks, a fail (the script's own argument) on 1."""
    script = tmp_path / "config.py"
    script.write_text(SCRIPT)
    assert main(["verify", str(script), "--nproc", "2"]) == 0
    out = capfd.readouterr().out
    assert out.count("fs.verify: PASS: 1 step(s) on 2 rank(s)") == 1  # rank 0 prints
    assert main(["verify", str(script), "--nproc", "1", "--", "--wrong"]) == 1
    out = capfd.readouterr().out
    assert "fs.verify: FAIL" in out
    assert "layer/w: " in out


def test_the_worker_exit_status(tmp_path, monkeypatch, capfd):
    """In this process (one rank): 1 for a fail, 2 for an unusable config; 0 when it writes the status."""
    monkeypatch.setattr("sys.argv", list(sys.argv))
    monkeypatch.setattr("sys.path", list(sys.path))
    script = tmp_path / "config.py"
    script.write_text(SCRIPT)
    assert worker_main([str(script), "--wrong"]) == 1
    assert "fs.verify: FAIL" in capfd.readouterr().out
    bad = tmp_path / "bad.py"
    bad.write_text("def verify_config():\n    return {'loss_fn': print}\n")
    assert worker_main([str(bad)]) == 2
    assert "lacks ['params', 'plan', 'batch']" in capfd.readouterr().err
    status = tmp_path / "status"
    monkeypatch.setenv("FUNCSHARD_VERIFY_STATUS", str(status))
    assert worker_main([str(script)]) == 0
    assert status.read_text() == "0\n"


def test_the_command_refuses_unusable_scripts_with_status_2(tmp_path, capfd):
    assert main(["verify", str(tmp_path / "missing.py")]) == 2
    assert "missing.py: no such file" in capfd.readouterr().err
    bare = tmp_path / "bare.py"
    bare.write_text("x = 1\n")
    assert main(["verify", str(bare)]) == 2
    assert "defines no top-level verify_config() function" in capfd.readouterr().err
    broken = tmp_path / "broken.py"
    broken.write_text("def verify_config(:\n")
    assert main(["verify", str(broken)]) == 2
    assert "cannot read it as Python" in capfd.readouterr().err
    script = tmp_path / "ok.py"
    script.write_text("def verify_config(): pass\n")
    assert main(["verify", str(script), "--nproc", "0"]) == 2
    assert "--nproc 0: give at least 1 process" in capfd.readouterr().err
