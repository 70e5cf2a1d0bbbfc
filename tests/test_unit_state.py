"""A unit's state changes only through its transitions; one from the wrong state is an internal error.

Reference: the state diagram in docs/executor.md.
"""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard._src.execute.unit_state import UnitState, UnitStateError


def _unit():
    params = {"blocks": [{"w": torch.ones(4, 2)}]}
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=["blocks/*"])
    step = fs.value_and_grad(
        lambda p, x: fs.call(lambda b, x: (x @ b["w"]).sum(), p["blocks"][0], x), plan
    )
    step(fs.shard(params, plan), torch.ones(3, 4))  # one step binds every unit
    return next(u for u in step._runtimes() if u.name == "blocks/0")


def test_the_transitions_of_the_diagram():
    unit = _unit()
    assert unit.state is UnitState.SHARDED
    unit.prefetch()
    assert unit.state is UnitState.GATHERING
    unit.acquire()
    unit.acquire()  # a second holder (a unit called twice)
    assert (unit.state, unit.holders) == (UnitState.GATHERED, 2)
    unit.release()
    assert unit.state is UnitState.GATHERED
    unit.release()
    assert (unit.state, unit.holders) == (UnitState.SHARDED, 0)
    unit.prefetch()
    unit.drop_unused()  # prefetched, never used
    assert unit.state is UnitState.SHARDED


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (
            lambda u: u.release(),
            r"unit 'blocks/0' asked to release in state sharded, which needs gathered",
        ),
        (
            lambda u: (u.prefetch(), u.prefetch()),
            r"asked to prefetch in state gathering, which needs sharded",
        ),
        (lambda u: u.full_leaves(), r"asked to full_leaves in state sharded"),
        (lambda u: (u.acquire(), u.bind(u.flats)), r"asked to bind in state gathered"),
        (
            lambda u: (u.acquire(), u.release(), u.acquire(), u.release(), u.release()),
            r"in state sharded",
        ),
    ],
    ids=[
        "release-sharded",
        "prefetch-twice",
        "leaves-sharded",
        "bind-gathered",
        "release-too-often",
    ],
)
def test_a_transition_from_the_wrong_state_is_an_internal_error(wrong, message):
    with pytest.raises(UnitStateError, match=message):
        wrong(_unit())
