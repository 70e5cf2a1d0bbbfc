"""torchtitan 0.3's llama3 with fused QKV: funcshard's checkpoints and torchtitan's, both ways, at W=2.

Reference: torchtitan's own model code and checkpointer (``ModelWrapper``: the
module's ``state_dict`` with its hooks, ``dcp.load``, ``load_state_dict``), unsharded
and under FSDP2. ``FusedQKVLinear`` checkpoints its ``wqkv`` as ``wq``/``wk``/``wv``
through a state-dict post-hook and concatenates them back in a load pre-hook, so
each direction runs the hook on live, gathered tensors
([Note: state-dict hooks] in ``funcshard/_src/interop/state_hooks.py``). Every
value must arrive bit for bit; a failure names the direction and the tensors.
Runs in ``nox -s torchtitan`` (torchtitan imports triton).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.torchtitan import runs

CHECKS = ("state_dict", "bound", "to_torchtitan", "to_fsdp2", "from_fsdp2")


@pytest.fixture(scope="module")
def results(pools: Any, tmp_path_factory: Any) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("torchtitan")
    return pools.run(2, runs.round_trips, str(directory), timeout_s=300)


def test_funcshard_state_dict_has_torchtitans_keys(results: list[dict[str, Any]]):
    for rank, result in enumerate(results):
        assert result["keys"] == [], f"rank {rank}: keys differ: {result['keys']}"


@pytest.mark.parametrize("check", CHECKS)
def test_round_trip_is_bit_for_bit(results: list[dict[str, Any]], check: str):
    for rank, result in enumerate(results):
        assert result[check] == [], f"rank {rank}, {check}: not bit for bit: {result[check]}"
