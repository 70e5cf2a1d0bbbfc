"""Every learning-rate schedule equals optax's of the same name, update count by update count.

optax computes in float32 under JAX's default; funcshard in float64: equal to float32
rounding (relative 1e-5).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import funcshard as fs

optax = pytest.importorskip("optax", reason="optax is the oracle (the interop session installs it)")

pytestmark = pytest.mark.interop
# no values near float32's smallest: optax rounds them to zero and divides by them (NaN)
values = st.one_of(st.just(0.0), st.floats(1e-3, 1))
steps = st.integers(1, 40)


def _equal(ours, theirs, upto: int) -> None:
    for n in range(upto):
        assert ours(n) == pytest.approx(float(theirs(n)), rel=1e-5, abs=1e-7), n


@settings(max_examples=30, deadline=None)
@given(values, values, steps, st.integers(0, 10))
def test_linear(init, end, transition, begin):
    _equal(
        fs.optim.linear_schedule(init, end, transition, begin),
        optax.linear_schedule(init, end, transition, begin),
        transition + begin + 5,
    )


@settings(max_examples=30, deadline=None)
@given(values, steps, values, st.sampled_from([1.0, 2.0]))
def test_cosine_decay(init, decay, alpha, exponent):
    _equal(
        fs.optim.cosine_decay_schedule(init, decay, alpha, exponent),
        optax.cosine_decay_schedule(init, decay, alpha, exponent),
        decay + 5,
    )


@settings(max_examples=30, deadline=None)
@given(values, values, st.integers(0, 10), steps, values)
def test_warmup_cosine_decay(init, peak, warmup, decay, end):
    total = warmup + decay
    _equal(
        fs.optim.warmup_cosine_decay_schedule(init, peak, warmup, total, end),
        optax.warmup_cosine_decay_schedule(init, peak, warmup, total, end),
        total + 5,
    )


def test_join_and_constant():
    ours = fs.optim.join_schedules(
        [fs.optim.constant_schedule(0.1), fs.optim.linear_schedule(0.1, 0.0, 4)], [3]
    )
    theirs = optax.join_schedules(
        [optax.constant_schedule(0.1), optax.linear_schedule(0.1, 0.0, 4)], [3]
    )
    _equal(ours, theirs, 10)
