"""Test session set-up: hypothesis profiles and the persistent worker pools."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from tests.pool import Pools

# "ci" (the default) derandomizes so that every run draws the same examples;
# HYPOTHESIS_PROFILE=dev explores new examples each run, "thorough" many more.
_common = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, **_common)
settings.register_profile("dev", **_common)
settings.register_profile("thorough", max_examples=1000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def pools() -> Iterator[Pools]:
    """gloo worker pools for world sizes 1, 2 and 4, started on first use."""
    p = Pools()
    yield p
    p.close()
