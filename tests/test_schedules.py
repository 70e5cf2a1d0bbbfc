"""Learning-rate schedules: their shapes at the boundaries, and bad arguments named."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import funcshard as fs

opt = fs.optim


@given(
    st.floats(0, 1), st.floats(0, 1), st.integers(1, 50), st.integers(0, 20), st.integers(0, 100)
)
def test_linear_is_init_before_end_after_and_monotone_between(init, end, steps, begin, count):
    s = opt.linear_schedule(init, end, steps, begin)
    assert s(begin) == pytest.approx(init, abs=1e-12)  # (init - end) + end, rounded
    assert s(begin + steps + count) == pytest.approx(end)
    low, high = sorted((init, end))
    assert low - 1e-12 <= s(count) <= high + 1e-12


@given(st.floats(1e-6, 1), st.integers(1, 50), st.floats(0, 1), st.integers(0, 100))
def test_cosine_goes_from_init_to_alpha_init_and_stays(init, steps, alpha, extra):
    s = opt.cosine_decay_schedule(init, steps, alpha)
    assert s(0) == pytest.approx(init)
    assert s(steps + extra) == pytest.approx(alpha * init)
    values = [s(n) for n in range(steps + 1)]
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(values))


def test_warmup_cosine_peaks_after_the_warmup_and_ends_at_end_value():
    s = opt.warmup_cosine_decay_schedule(
        0.0, 1e-3, warmup_steps=10, decay_steps=110, end_value=1e-5
    )
    assert s(0) == 0.0
    assert s(5) == pytest.approx(5e-4)
    assert s(10) == pytest.approx(1e-3)
    assert s(110) == pytest.approx(1e-5)
    assert s(1000) == pytest.approx(1e-5)
    assert max(s(n) for n in range(200)) == pytest.approx(1e-3)


def test_a_schedule_drives_an_optimizer():
    import torch

    params = {"w": torch.zeros(2)}
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    sgd = opt.sgd(
        lr=opt.join_schedules([opt.constant_schedule(1.0), opt.constant_schedule(0.5)], [1])
    )
    state = sgd.init(sparams)
    grads = fs.shard({"w": torch.ones(2)}, fs.plan(params, fs.Mesh({"x": 1})))
    for _ in range(3):
        sparams, state = sgd.update_(grads, state, sparams)
    assert torch.equal(sparams["w"].local, torch.full((2,), -2.0))  # 1.0, then 0.5 twice


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: opt.constant_schedule(-1.0), r"constant_schedule: value must be a number >= 0"),
        (lambda: opt.constant_schedule(math.nan), r"constant_schedule: value must be a number"),
        (lambda: opt.linear_schedule(1, 0, -1), r"transition_steps must be an int >= 0, got -1"),
        (lambda: opt.cosine_decay_schedule(1, 0), r"decay_steps must be an int >= 1, got 0"),
        (
            lambda: opt.warmup_cosine_decay_schedule(0, 1, 10, 10),
            r"decay_steps \(10\) counts the warm-up too and must exceed warmup_steps \(10\)",
        ),
        (
            lambda: opt.join_schedules([opt.constant_schedule(1)], [3]),
            r"1 schedules need 0 boundaries, got 1",
        ),
        (
            lambda: opt.join_schedules([opt.constant_schedule(1)] * 3, [5, 2]),
            r"boundaries must be >= 0 and ascending, got \[5, 2\]",
        ),
        (
            lambda: opt.join_schedules([opt.constant_schedule(1)] * 2, [2.5]),  # pyright: ignore[reportArgumentType]
            r"boundaries are update counts, integers; got \[2.5\] in \[2.5\]: round them",
        ),
        (
            lambda: opt.join_schedules([opt.constant_schedule(1)] * 2, [3.0]),  # pyright: ignore[reportArgumentType]
            r"boundaries are update counts, integers; got \[3.0\]",
        ),
        (
            lambda: opt.join_schedules([opt.constant_schedule(1)] * 2, [True]),
            r"boundaries are update counts, integers; got \[True\]",
        ),
    ],
)
def test_bad_arguments_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()
