"""Ranks whose transport settings differ stop at their first collective with the variable named.

See [Note: transport settings] in ``funcshard/_src/comm/collectives.py``. Without the
agreement these runs time out or abort with ``gloo::EnforceNotMet`` (a signal).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest

import funcshard as fs
from funcshard._src.comm import collectives
from tests.models import Model

MODEL = Model(kind="mlp", width=6, layers=3)
TIMEOUT_S = 10.0  # a rank that waited it out would have timed out, not been told why
# (variable, what rank 1 sets, how each rank reports the two values)
CASES = [
    pytest.param(
        "FUNCSHARD_SHM",
        "0",
        r"rank 1: FUNCSHARD_SHM off \(rank 0: on\)",
        marks=pytest.mark.skipif(
            not hasattr(os, "memfd_create"), reason="no memfd: shared memory is off on every rank"
        ),
    ),
    ("FUNCSHARD_ALL_GATHER", "native", r"rank 1: FUNCSHARD_ALL_GATHER native \(rank 0: auto\)"),
    ("FUNCSHARD_REDUCE_SCATTER", "ring", r"rank 1: FUNCSHARD_REDUCE_SCATTER ring \(rank 0: auto\)"),
    ("FUNCSHARD_DEBUG", "1", r"rank 1: FUNCSHARD_DEBUG on \(rank 0: off\)"),
]


@pytest.mark.parametrize("call", ["step", "forward"])
def test_a_step_holds_the_settings_it_started_with(monkeypatch, call):
    # [Note: settings held through a step] in comm/runtime.py: a variable set inside a step
    # (from loss_fn or a hook) takes effect at the next step, never between its collectives
    from funcshard._src.comm import runtime

    monkeypatch.setenv("FUNCSHARD_ALL_GATHER", "auto")
    plan = fs.plan(MODEL.init(0), fs.Mesh({"fsdp": 1}), units=MODEL.units)
    seen = []

    def loss_fn(params, *batch):
        os.environ["FUNCSHARD_ALL_GATHER"] = "native"
        seen.append(
            (
                collectives.settings()["FUNCSHARD_ALL_GATHER"],
                runtime.setting("FUNCSHARD_ALL_GATHER"),
            )
        )
        return MODEL.loss_fn(params, *batch)

    step = fs.value_and_grad(loss_fn, plan)
    run = step if call == "step" else step.forward  # an evaluation holds them too
    run(fs.shard(MODEL.init(0), plan), *MODEL.batch_for(0))
    assert seen == [("auto", "auto")]
    assert collectives.settings()["FUNCSHARD_ALL_GATHER"] == "native"  # read afresh after it


def test_settings_read_the_environment_with_its_defaults(monkeypatch):
    for name in ("FUNCSHARD_SHM", "FUNCSHARD_ALL_GATHER", "FUNCSHARD_REDUCE_SCATTER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FUNCSHARD_DEBUG", "0")
    unset = collectives.settings()
    assert unset["FUNCSHARD_ALL_GATHER"] == unset["FUNCSHARD_REDUCE_SCATTER"] == "auto"
    assert unset["FUNCSHARD_DEBUG"] == "off"
    monkeypatch.setenv("FUNCSHARD_SHM", "1")  # the default, written out: the same setting
    assert collectives.settings() == unset
    monkeypatch.setenv("FUNCSHARD_SHM", "0")
    monkeypatch.setenv("FUNCSHARD_REDUCE_SCATTER", "ring")
    changed = collectives.settings()
    assert (changed["FUNCSHARD_SHM"], changed["FUNCSHARD_REDUCE_SCATTER"]) == ("off", "ring")


def _sharded_step() -> tuple[Any, fs.Step]:
    params = MODEL.init(0)
    plan = fs.plan(params, fs.Mesh({"fsdp": 2}), units=MODEL.units)
    return fs.shard(params, plan), fs.value_and_grad(MODEL.loss_fn, plan)


def _step_with(name: str, value: str) -> tuple[str, str, float]:
    """A step where rank 1 alone has ``name=value`` from the start; what each rank raised."""
    fs.set_collective_timeout(TIMEOUT_S)
    if fs.rank() == 1:
        os.environ[name] = value
    start = time.monotonic()
    try:
        sparams, step = _sharded_step()
        step(sparams, *MODEL.batch_for(fs.rank()))
        return "ok", "", time.monotonic() - start
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - start
    finally:
        os.environ.pop(name, None)
        fs.set_collective_timeout(None)


@pytest.mark.parametrize(("name", "value", "pattern"), CASES)
def test_a_setting_one_rank_has_alone_fails_every_rank_naming_it(pools, name, value, pattern):
    pools.pool(2).close()  # fresh workers: the settings are read before any collective
    results: list[Any] = pools.run(2, _step_with, name, value, timeout_s=60)
    for rank, (error, message, seconds) in enumerate(results):
        assert error == "DesyncError", f"rank {rank} raised {error}: {message}"
        assert "transport settings before all_gather of unit" in message
        assert re.search(pattern, message), f"rank {rank}: {message}"
        assert seconds < TIMEOUT_S, f"rank {rank} waited {seconds:.1f} s"
        assert "the same values" in message  # the fix


def _step_with_both(name: str, value: str) -> tuple[str, float]:
    """Both ranks set ``name=value`` between steps: the next step agrees again and trains."""
    sparams, step = _sharded_step()
    before = float(step(sparams, *MODEL.batch_for(fs.rank()))[0])
    os.environ[name] = value
    try:
        return "ok", float(step(sparams, *MODEL.batch_for(fs.rank()))[0]) - before
    finally:
        del os.environ[name]


@pytest.mark.parametrize(
    ("name", "value"), [("FUNCSHARD_SHM", "0"), ("FUNCSHARD_ALL_GATHER", "native")]
)
def test_a_setting_every_rank_changes_between_steps_is_agreed_again(pools, name, value):
    for rank, (outcome, change) in enumerate(pools.run(2, _step_with_both, name, value)):
        assert outcome == "ok"
        assert change == 0.0, f"rank {rank}: the loss moved by {change}"  # a gather is exact


def test_a_value_one_rank_cannot_read_is_named_there_and_reported_to_the_peer(pools):
    """The rank that reads ``tree`` refuses it before its first collective; its peer hears why."""
    pools.pool(2).close()
    (error0, message0, _), (error1, message1, seconds) = pools.run(
        2, _step_with, "FUNCSHARD_ALL_GATHER", "tree", timeout_s=60
    )
    assert error1 == "ValueError"
    assert "FUNCSHARD_ALL_GATHER='tree' is not an all-gather algorithm; use one of" in message1
    assert error0 == "CollectiveError"
    assert "rank 1: gave up with ValueError" in message0
    assert seconds < TIMEOUT_S
    pools.pool(2).close()  # rank 0 is out of step, as it says
