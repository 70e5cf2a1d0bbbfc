"""Sharded checkpoints that reshard: save on W ranks, load on any W' or in one process."""

from funcshard._src.checkpoint.dcp import SAVED as SAVED
from funcshard._src.checkpoint.dcp import export_safetensors as export_safetensors
from funcshard._src.checkpoint.dcp import latest as latest
from funcshard._src.checkpoint.dcp import load as load
from funcshard._src.checkpoint.dcp import load_full as load_full
from funcshard._src.checkpoint.dcp import save as save
from funcshard._src.checkpoint.manifest import CheckpointError as CheckpointError
from funcshard._src.checkpoint.rng import rng_states as rng_states
from funcshard._src.checkpoint.rng import set_rng_states as set_rng_states
from funcshard._src.checkpoint.safe_reader import UnsafeCheckpointError as UnsafeCheckpointError

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
