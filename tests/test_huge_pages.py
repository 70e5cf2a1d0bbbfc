"""Huge pages for large gathered storages: asked for where they can be, never changing a value.

[Note: huge pages for gathered storage] in ``execute/unit_state.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from funcshard._src.execute import unit_state


def test_only_large_cpu_storages_are_advised():
    assert not unit_state.advise(torch.empty(1024))
    assert not unit_state.advise(torch.empty(0))


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
    reason="a kernel without transparent huge pages refuses MADV_HUGEPAGE",
)
def test_a_large_storage_is_advised_and_keeps_what_is_written():
    storage = torch.empty(unit_state.MIN_BYTES // 4 + 12345)
    assert unit_state.advise(storage)
    storage.copy_(torch.arange(storage.numel(), dtype=torch.float32))
    assert torch.equal(storage, torch.arange(storage.numel(), dtype=torch.float32))
