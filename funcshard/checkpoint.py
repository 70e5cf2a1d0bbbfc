"""Sharded checkpoints that reshard: save on W ranks, load on any W' or in one process.

torch.distributed.checkpoint takes seconds to import, so this module loads it on
first use: ``import funcshard`` stays fast for planning on a laptop.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from funcshard._src.checkpoint.dcp import SAVED as SAVED
    from funcshard._src.checkpoint.dcp import export_safetensors as export_safetensors
    from funcshard._src.checkpoint.dcp import latest as latest
    from funcshard._src.checkpoint.dcp import load as load
    from funcshard._src.checkpoint.dcp import load_full as load_full
    from funcshard._src.checkpoint.dcp import save as save
    from funcshard._src.checkpoint.manifest import CheckpointError as CheckpointError
    from funcshard._src.checkpoint.rng import rng_states as rng_states
    from funcshard._src.checkpoint.rng import set_rng_states as set_rng_states
    from funcshard._src.checkpoint.safe_reader import (
        UnsafeCheckpointError as UnsafeCheckpointError,
    )

_WHERE = {
    "SAVED": "dcp",
    "export_safetensors": "dcp",
    "latest": "dcp",
    "load": "dcp",
    "load_full": "dcp",
    "save": "dcp",
    "CheckpointError": "manifest",
    "rng_states": "rng",
    "set_rng_states": "rng",
    "UnsafeCheckpointError": "safe_reader",
}

__all__ = [
    "SAVED",
    "CheckpointError",
    "UnsafeCheckpointError",
    "export_safetensors",
    "latest",
    "load",
    "load_full",
    "rng_states",
    "save",
    "set_rng_states",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'funcshard.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"funcshard._src.checkpoint.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
