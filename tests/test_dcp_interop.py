"""FSDP2 to funcshard and back through DCP checkpoints: ``fs.checkpoint.load_dcp`` and ``save_dcp``.

Reference: PyTorch FSDP2 itself at W=2 on gloo (``tests/fsdp2_runs.py``): what it
trained and saved with ``dcp.save``, what it computes in 3 more steps from that
checkpoint, and what ``dcp.load`` reads from funcshard's save. Two models (an untied
stack; a tied head with a frozen parameter, a buffer, uneven and one-row leaves,
planned in the flat layout) in float64 and float32. A failure names the model, the
dtype and the state-dict key that differs. Single-process tests pin the name and
prefix rules, the optimizer mapping (SGD, ``from_torch``) and every refusal.
"""

from __future__ import annotations

import dataclasses
import io
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard._src.checkpoint.dcp_metadata import read_index
from funcshard._src.interop.fsdp_names import find_prefix, split_prefix
from funcshard.checkpoint import CheckpointError, CheckpointMismatchError, NotACheckpointError
from tests import fsdp2_runs

CASES = [
    ("stack", torch.float64),
    ("stack", torch.float32),
    ("tied", torch.float64),
    ("tied", torch.float32),
]
IDS = [f"{name}-{str(dtype).removeprefix('torch.')}" for name, dtype in CASES]


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory) -> dict[tuple[str, torch.dtype], dict[str, Any]]:
    """Each case's round trip at W=2, run once (rank 0's full tensors; both ranks agree)."""

    class Lazy(dict):  # a case runs the first time a test asks for it
        def __missing__(self, case: tuple[str, torch.dtype]) -> dict[str, Any]:
            directory = tmp_path_factory.mktemp(f"{case[0]}-{case[1]}".replace("torch.", ""))
            ranks = pools.run(2, fsdp2_runs.round_trip, *case, str(directory), timeout_s=300)
            for a, b in zip(ranks[0]["fs_after"].values(), ranks[1]["fs_after"].values()):
                assert torch.equal(a, b), "the ranks disagree on the full tensors"
            self[case] = ranks[0]
            return ranks[0]

    return Lazy()


def _same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: other keys"
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, f"{what}: {key}"
        assert torch.equal(actual[key], value), f"{what}: {key}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_an_fsdp2_checkpoint_loads_at_w2_bit_for_bit(runs, case):
    """Params, buffers and AdamW state (exp_avg, exp_avg_sq, step) as FSDP2 saved them."""
    run = runs[case]
    _same(run["loaded"], run["at_save"], f"{case}: load_dcp at W=2")


@pytest.mark.parametrize("case", CASES[:1] + CASES[2:3], ids=IDS[:1] + IDS[2:3])
def test_an_fsdp2_checkpoint_loads_at_w1_bit_for_bit(runs, case):
    name, dtype = case
    run = runs[case]
    params, apply = fs.interop.functionalize(fsdp2_runs.build(name, dtype, seed=5))
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), frozen=apply.frozen)
    adamw = fs.optim.adamw(lr=fsdp2_runs.LR)
    sparams, state = fs.checkpoint.load_dcp(
        run["saved"], fs.shard(params, plan), apply=apply, optimizer=adamw
    )
    _same(fsdp2_runs.fs_full(apply, sparams, state), run["at_save"], f"{case}: load_dcp at W=1")


def test_an_fsdp2_checkpoint_loads_at_w4_on_another_mesh_and_plan(runs, pools):
    run = runs[CASES[0]]
    for rank, loaded in enumerate(pools.run(4, fsdp2_runs.load_on_another_mesh, run["saved"])):
        _same(loaded, run["at_save"], f"load_dcp at W=4, rank {rank}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_three_more_steps_equal_three_more_fsdp2_steps(runs, case):
    """float64 exactly; float32 to tolerance (here it is exact too: the same ops in the same order)."""
    run = runs[case]
    expected, actual = run["fsdp2_after"], run["fs_after"]
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        if case[1] == torch.float64:
            assert torch.equal(actual[key], value), f"{case}: {key}"
        else:
            torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_save_dcp_loads_into_a_fresh_fsdp2_model_and_optimizer(runs, case):
    run = runs[case]
    _same(run["fsdp2_from_fs"], run["fs_after"], f"{case}: dcp.load of save_dcp")


# -- one process: names, prefixes, optimizers ----------------------------------------


@pytest.fixture(autouse=True)
def _dcp_alone() -> Iterator[None]:
    """DCP warns on every call without a process group; here that is the point."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _torch_run(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """``steps`` plain torch steps on a fixed regression batch; mutates both."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, model.in_features, generator=gen, dtype=torch.float64)  # pyright: ignore[reportArgumentType]
    for _ in range(steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _dcp_save(state: dict[str, Any], path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


def _optimizer_sd(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    return get_optimizer_state_dict(model, opt, options=options)


def _linear(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(3, 5).double()


def _loaded(path: Path, optimizer: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    params, apply = fs.interop.functionalize(_linear(seed=9))
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1})))
    out = fs.checkpoint.load_dcp(path, sp, apply=apply, optimizer=optimizer, **kwargs)
    return (*out, apply) if optimizer is not None else (out, None, apply)


def test_sgd_momentum_loads_and_continues_like_torch(tmp_path):
    model = _linear(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _torch_run(model, opt, steps=2, seed=1)
    path = _dcp_save(
        {"model": model.state_dict(), "optimizer": _optimizer_sd(model, opt)}, tmp_path / "c"
    )
    sgd = fs.optim.sgd(lr=0.1, momentum=0.9)
    sp, state, apply = _loaded(path, sgd)
    assert torch.equal(
        fs.unshard(state.momentum)["weight"], opt.state[model.weight]["momentum_buffer"]
    )
    assert int(state.count) == 0  # torch's SGD keeps no step
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    step = fs.value_and_grad(
        lambda p, x: apply(p, x).square().mean(), fs.plan(fs.unshard(sp), fs.Mesh({"fsdp": 1}))
    )
    _, grads = step(sp, x)
    sp, state = sgd.update_(grads, state, sp)
    _torch_run(model, opt, steps=1, seed=1)
    assert torch.equal(fs.unshard(sp)["weight"], model.weight.detach())


def test_from_torch_state_loads_with_torch_names(tmp_path):
    """``fs.optim.from_torch`` keeps torch's names: AdamW with amsgrad's max_exp_avg_sq loads."""
    model = _linear(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, amsgrad=True)
    _torch_run(model, opt, steps=3, seed=2)
    path = _dcp_save({**model.state_dict(), "optim": _optimizer_sd(model, opt)}, tmp_path / "c")
    mine = fs.optim.from_torch(torch.optim.AdamW, lr=0.01, amsgrad=True)
    _, state, _ = _loaded(path, mine)
    torch_state = opt.state[model.bias]
    for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert torch.equal(fs.unshard(state.tensors[name])["bias"], torch_state[name]), name
    assert float(state.scalars["step"]) == 3.0
    assert int(state.count) == 3
    with pytest.raises(CheckpointMismatchError, match=r"max_exp_avg_sq.*amsgrad=True"):
        _loaded(path, fs.optim.adamw(lr=0.01))  # fs.optim.adamw has no amsgrad


def test_names_come_from_a_mapping_or_the_paths(tmp_path):
    w = torch.arange(6.0).reshape(2, 3)
    path = _dcp_save({"model": {"lm_head.weight": w}, "other": torch.ones(1)}, tmp_path / "c")
    like = fs.shard({"w": torch.zeros(2, 3)}, fs.plan({"w": w}, fs.Mesh({"x": 1})))
    out = fs.checkpoint.load_dcp(path, like, apply={"w": "lm_head.weight"})
    assert torch.equal(out["w"].local, w)
    missing = r"missing from the checkpoint: w \('model.w'\) \| 1 entries of the model that it"
    with pytest.raises(CheckpointMismatchError, match=missing):
        fs.checkpoint.load_dcp(path, like, prefix="model.")
    with pytest.raises(ValueError, match="not leaf paths"):
        fs.checkpoint.load_dcp(path, like, apply={"v": "lm_head.weight"})


def test_prefixes_are_found_or_given(tmp_path):
    net = _linear(seed=0)
    sd = net.state_dict()
    tutorial = _dcp_save({"app": {"model": sd, "ema": {"model": sd}}}, tmp_path / "app")
    with pytest.raises(
        CheckpointError, match=r"several prefixes \('app.ema.model.', 'app.model.'\)"
    ):
        _loaded(tutorial, None)
    back, _, _ = _loaded(tutorial, None, prefix="app.model.")
    assert torch.equal(back["weight"].local, net.weight.detach())
    assert split_prefix({"model": "m.", "optimizer": "o."}) == ("m.", "o.")
    with pytest.raises(ValueError, match="prefix must be"):
        split_prefix({"model": 1})
    keys = {"model.a.w", "model.b", "state.a.w.exp_avg"}
    assert find_prefix(keys, [["a.w"], ["b"]], what="m", directory=tmp_path) == "model."
    assert find_prefix(keys, [["state.a.w.exp_avg"]], what="o", directory=tmp_path) == ""


def test_buffers_load_into_apply_state(tmp_path):
    norm = nn.BatchNorm1d(3)
    norm.running_mean.copy_(torch.tensor([1.0, 2.0, 3.0]))  # pyright: ignore[reportOptionalMemberAccess]
    path = _dcp_save(norm.state_dict(), tmp_path / "c")
    params, apply = fs.interop.functionalize(nn.BatchNorm1d(3))
    fs.checkpoint.load_dcp(path, fs.shard(params, fs.plan(params, fs.Mesh({"x": 1}))), apply=apply)
    assert torch.equal(apply.state["running_mean"], torch.tensor([1.0, 2.0, 3.0]))


def test_a_checkpoint_of_another_model_is_refused_with_every_difference(tmp_path):
    bigger = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2), nn.Linear(2, 2))
    path = _dcp_save(bigger.state_dict(), tmp_path / "c")
    params, apply = fs.interop.functionalize(nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2)))
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    with pytest.raises(
        CheckpointMismatchError,
        match=r"2 entries of the model that it does not have: \['2.bias', '2.weight'\]",
    ):
        fs.checkpoint.load_dcp(path, sp, apply=apply)
    params, apply = fs.interop.functionalize(
        nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    )
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    with pytest.raises(CheckpointMismatchError) as info:
        fs.checkpoint.load_dcp(path, sp, apply=apply, prefix={"model": ""})
    assert "0/weight: '0.weight' holds (5, 3) float32, asked for (4, 3) float64" in str(info.value)


def test_per_parameter_steps_that_differ_are_refused(tmp_path):
    model = _linear(seed=0)
    opt = torch.optim.AdamW(model.parameters())
    _torch_run(model, opt, steps=2, seed=1)
    opt.state[model.bias]["step"] = torch.tensor(5.0)
    path = _dcp_save(
        {"model": model.state_dict(), "optimizer": _optimizer_sd(model, opt)}, tmp_path / "c"
    )
    with pytest.raises(CheckpointMismatchError, match="the parameters' step differ"):
        _loaded(path, fs.optim.adamw(lr=0.1))


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([3.0] * 7 + [2.5], r"step differ: 7 of 8 are 3, but step of 3/bias: 2.5; "),
        ([float("nan")] * 8, r"step of 0/bias is nan, where torch keeps a finite number"),
        ([True] * 8, r"step of 0/bias is a torch.bool, where torch keeps a real number"),
    ],
    ids=["one-differs-after-six", "all-nan", "all-bool"],
)
def test_per_parameter_steps_are_finite_numbers_and_the_odd_one_is_named(tmp_path, steps, message):
    """The odd step is named wherever it is; NaN (never equal to itself) and bool steps are
    refused with messages of their own, not as steps that differ or a count of 1."""
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(4))).double()
    optimizer: dict[str, torch.Tensor] = {}
    for (name, p), step in zip(model.named_parameters(), steps):
        optimizer |= {f"state.{name}.{k}": torch.zeros_like(p) for k in ("exp_avg", "exp_avg_sq")}
        optimizer[f"state.{name}.step"] = torch.tensor(step)
    path = _dcp_save({"model": model.state_dict(), "optimizer": optimizer}, tmp_path / "c")
    params, apply = fs.interop.functionalize(model)
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1})))
    with pytest.raises(CheckpointMismatchError, match=message):
        fs.checkpoint.load_dcp(path, sp, apply=apply, optimizer=fs.optim.adamw(lr=0.1))


def test_the_ranks_save_optimizer_state_in_one_order(pools, tmp_path):
    """State names are sorted before they are saved: a set's order differs per process."""
    assert pools.run(2, fsdp2_runs.save_in_either_key_order, str(tmp_path)) == ["saved"] * 2


def test_optimizers_torch_has_no_names_for_are_refused():
    params = {"w": torch.ones(2)}
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    with pytest.raises(ValueError, match=r"mu/w: a LionState holds per-parameter state"):
        fs.checkpoint.save_dcp("never-written", sp, opt_state=fs.optim.lion(lr=0.1).init(sp))
    assert not Path("never-written").exists()


def test_refusals_of_the_arguments(tmp_path):
    params = {"w": torch.ones(2)}
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    path = fs.checkpoint.save_dcp(tmp_path / "c", sp)
    with pytest.raises(FileExistsError):
        fs.checkpoint.save_dcp(path, sp)
    with pytest.raises(TypeError, match="w: a str; DCP checkpoints hold"):
        fs.checkpoint.load_dcp(path, {"w": "x"})
    with pytest.raises(TypeError, match="optimizer must be a funcshard optimizer"):
        fs.checkpoint.load_dcp(path, sp, optimizer=torch.optim.SGD)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="apply must be"):
        fs.checkpoint.load_dcp(path, sp, apply=3)  # pyright: ignore[reportArgumentType]
    own = fs.checkpoint.save(tmp_path / "own", {"params": sp})
    with pytest.raises(NotACheckpointError, match=r"load it with fs\.checkpoint\.load"):
        fs.checkpoint.load_dcp(own, sp)
    with pytest.raises(NotACheckpointError, match="no such checkpoint directory"):
        fs.checkpoint.load_dcp(tmp_path / "nothing", sp)


def test_save_dcp_writes_tied_weights_once_and_dcp_tools_read_it(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model = fsdp2_runs.build("tied", torch.float32, seed=0)
    params, apply = fs.interop.functionalize(model)
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1}), frozen=apply.frozen))
    opt = fs.optim.adamw(lr=0.1)
    path = fs.checkpoint.save_dcp(tmp_path / "c", sp, apply=apply, opt_state=opt.init(sp))
    index = read_index(path)
    head, embed = (index.storage[(k, (0, 0))] for k in ("head.weight", "embed.weight"))
    assert dataclasses.astuple(head) == dataclasses.astuple(embed)  # one copy on disk
    dcp_to_torch_save(path, tmp_path / "c.pt")
    whole = torch.load(tmp_path / "c.pt", weights_only=True)
    assert torch.equal(whole["head.weight"], params["embed"]["weight"])  # tied: one leaf
    assert sorted(whole["optimizer"])[:2] == [
        "state.embed.weight.exp_avg",
        "state.embed.weight.exp_avg_sq",
    ]
    assert "state.pos.exp_avg" not in whole["optimizer"]  # frozen: no optimizer state


def test_a_save_that_fails_commits_nothing(tmp_path, monkeypatch):
    params = {"w": torch.ones(2)}
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))

    def refuse(*_: Any, **__: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", refuse)
    with pytest.raises(CheckpointError, match="nothing was committed: rank 0: OSError: disk full"):
        fs.checkpoint.save_dcp(tmp_path / "c", sp)
    assert list(tmp_path.iterdir()) == []


def test_a_byte_entry_is_never_read(tmp_path):
    """torchtitan's train_state holds pickles; a load that does not need them never opens them."""
    net = _linear(seed=0)
    blob = io.BytesIO(b"not a pickle at all")
    path = _dcp_save(
        {"model": net.state_dict(), "train_state": {"log_steps": blob}}, tmp_path / "c"
    )
    back, _, _ = _loaded(path, None)
    assert torch.equal(back["bias"].local, net.bias.detach())
    shutil.rmtree(path)


def test_ranks_that_save_different_things_refuse_alike(pools, tmp_path):
    outcomes = pools.run(2, fsdp2_runs.save_outcome, str(tmp_path))
    assert all(
        o.startswith("DesyncError: fs.checkpoint.save_dcp: the ranks save different")
        for o in outcomes
    )
    assert list(tmp_path.iterdir()) == []
