"""Sharded checkpoints that reshard: save on W ranks, load on any W' or in one process.

``save`` blocks until the checkpoint is committed; ``AsyncCheckpointer`` saves the same
checkpoints in the background while training goes on.

torch.distributed.checkpoint takes seconds to import, so this module loads it on
first use: ``import funcshard`` stays fast for planning on a laptop.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from funcshard._src.checkpoint.async_save import AsyncCheckpointer as AsyncCheckpointer
    from funcshard._src.checkpoint.async_save import SaveHandle as SaveHandle
    from funcshard._src.checkpoint.commit import latest as latest
    from funcshard._src.checkpoint.errors import CheckpointError as CheckpointError
    from funcshard._src.checkpoint.errors import (
        CheckpointMismatchError as CheckpointMismatchError,
    )
    from funcshard._src.checkpoint.errors import CheckpointWarning as CheckpointWarning
    from funcshard._src.checkpoint.errors import CorruptCheckpointError as CorruptCheckpointError
    from funcshard._src.checkpoint.errors import NotACheckpointError as NotACheckpointError
    from funcshard._src.checkpoint.errors import UnsafeCheckpointError as UnsafeCheckpointError
    from funcshard._src.checkpoint.export import export_safetensors as export_safetensors
    from funcshard._src.checkpoint.load import SAVED as SAVED
    from funcshard._src.checkpoint.load import load as load
    from funcshard._src.checkpoint.load import load_full as load_full
    from funcshard._src.checkpoint.rng import rng_states as rng_states
    from funcshard._src.checkpoint.rng import set_rng_states as set_rng_states
    from funcshard._src.checkpoint.save import save as save
    from funcshard._src.interop.fsdp_checkpoint import load_dcp as load_dcp
    from funcshard._src.interop.fsdp_checkpoint import save_dcp as save_dcp

_WHERE = {
    "SAVED": "load",
    "AsyncCheckpointer": "async_save",
    "CheckpointError": "errors",
    "CheckpointMismatchError": "errors",
    "CheckpointWarning": "errors",
    "CorruptCheckpointError": "errors",
    "NotACheckpointError": "errors",
    "SaveHandle": "async_save",
    "UnsafeCheckpointError": "errors",
    "export_safetensors": "export",
    "latest": "commit",
    "load": "load",
    "load_dcp": "interop.fsdp_checkpoint",  # names FSDP2's, so above the checkpoint layer
    "load_full": "load",
    "rng_states": "rng",
    "save": "save",
    "save_dcp": "interop.fsdp_checkpoint",
    "set_rng_states": "rng",
}

__all__ = [
    "SAVED",
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointWarning",
    "CorruptCheckpointError",
    "NotACheckpointError",
    "SaveHandle",
    "UnsafeCheckpointError",
    "export_safetensors",
    "latest",
    "load",
    "load_dcp",
    "load_full",
    "rng_states",
    "save",
    "save_dcp",
    "set_rng_states",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'funcshard.checkpoint' has no attribute {name!r}")
    where = module if "." in module else f"checkpoint.{module}"
    value = getattr(importlib.import_module(f"funcshard._src.{where}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
