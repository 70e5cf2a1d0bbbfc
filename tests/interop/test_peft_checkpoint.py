"""peft LoRA adapters trained sharded and saved by ``apply.save_pretrained``, loaded by peft.

Reference: ``PeftModel.from_pretrained`` on the same base model (seed 0), which must
hold every trained value (the adapters, and the untouched base) bit for bit; and
``save_dcp``/``load_dcp`` of the same params. At W=2 and W=1; a failure names the
world size, the path and the tensors.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("peft", reason="peft is installed by `nox -s interop`")

from tests.interop import peft_runs

pytestmark = pytest.mark.interop


@pytest.mark.parametrize("world", [2, 1])
def test_lora_adapters_round_trip_through_peft_and_dcp(pools: Any, tmp_path: Any, world: int):
    for rank, result in enumerate(pools.run(world, peft_runs.round_trips, str(tmp_path))):
        assert len(result["adapters"]) == 8, result["adapters"]  # q and v, A and B, two layers
        assert "adapter_config.json" in result["files"], result["files"]
        assert "adapter_model.safetensors" in result["files"], result["files"]
        for path in ("save_pretrained", "dcp"):
            assert result[path] == [], (
                f"W={world} rank {rank} {path}: not bit for bit: {result[path]}"
            )
