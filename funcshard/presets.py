"""Published models as parameter trees of meta tensors: their real shapes, no weights, no memory.

Example:
    >>> import funcshard as fs
    >>> fs.presets.get("llama-7b").n_params
    6738415616
"""

from funcshard._src.plan.model_config import ModelConfig as ModelConfig
from funcshard._src.plan.presets import PRESETS as PRESETS
from funcshard._src.plan.presets import Preset as Preset
from funcshard._src.plan.presets import get_preset as get

__all__ = ["PRESETS", "ModelConfig", "Preset", "get"]
