"""How a collective in flight is waited for: a timeout on gloo alone, never on NCCL.

See [Note: waits that never block the host] in ``comm/collectives.py``. A fake work
object records the arguments of each wait, so the rule is checked on the CPU.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch

from funcshard._src.comm import runtime
from funcshard._src.comm.collectives import Pending, wait_for
from funcshard._src.comm.runtime import CollectiveError
from funcshard._src.comm.transport import Each


class Work:
    """A torch.distributed work handle that records how it was waited for."""

    def __init__(self, error: Exception | None = None) -> None:
        self.waits: list[dict[str, Any]] = []
        self.error = error

    def wait(self, **kwargs: Any) -> bool:
        self.waits.append(kwargs)
        if self.error is not None:
            raise self.error
        return True


@pytest.fixture
def timeout_5s(monkeypatch):
    monkeypatch.setattr(runtime, "_explicit_timeout_s", 5.0)  # fs.set_collective_timeout(5)


@pytest.mark.usefixtures("timeout_5s")
@pytest.mark.parametrize(
    ("backend", "expected"),
    [("gloo", {"timeout": datetime.timedelta(seconds=5)}), ("nccl", {}), ("fake", {})],
)
def test_only_gloo_waits_get_a_timeout(backend, expected):
    work = Work()
    wait_for(work, backend)
    assert work.waits == [expected]
    # through a Pending, and through several collectives waited for as one (Each)
    parts = [Work(), Work()]
    result = torch.ones(2)
    assert Pending(result, Each(parts), "an all-gather", backend=backend).wait() is result
    assert [p.waits for p in parts] == [[expected], [expected]]


def test_an_nccl_wait_passes_no_timeout_even_when_init_set_one(monkeypatch):
    monkeypatch.setattr(runtime, "_explicit_timeout_s", runtime._UNSET)
    monkeypatch.delenv(runtime.TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(runtime, "_init_timeout_s", 600.0)  # what fs.init records
    assert runtime.collective_timeout() == 600.0
    work = Work()
    Pending(torch.ones(1), work, "a reduce-scatter", backend="nccl").wait()
    assert work.waits == [{}]


@pytest.mark.usefixtures("timeout_5s")
def test_a_gloo_wait_that_times_out_names_the_collective_and_the_timeout():
    work = Work(RuntimeError("Timed out waiting 5000ms for recv operation to complete"))
    pending = Pending(
        torch.ones(1), work, "all_gather of unit 'blocks/0' on rank 0", backend="gloo"
    )
    with pytest.raises(
        CollectiveError,
        match=r"all_gather of unit 'blocks/0' on rank 0 failed: the other ranks did not join within 5 s",
    ):
        pending.wait()


def test_a_failed_nccl_wait_raises_the_backends_error():
    work = Work(RuntimeError("NCCL communicator was aborted"))
    with pytest.raises(
        CollectiveError, match=r"a reduce-scatter failed: NCCL communicator was aborted"
    ):
        Pending(torch.ones(1), work, "a reduce-scatter", backend="nccl").wait()
