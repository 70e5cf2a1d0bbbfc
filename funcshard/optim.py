"""Functional optimizers over sharded params, like optax: ``init`` and ``update`` on flat buffers."""

from funcshard._src.optim.adamw import AdamWState as AdamWState
from funcshard._src.optim.adamw import adamw as adamw
from funcshard._src.optim.base import Optimizer as Optimizer
from funcshard._src.optim.clip import clip_by_global_norm as clip_by_global_norm
from funcshard._src.optim.nonfinite import SkipState as SkipState
from funcshard._src.optim.nonfinite import all_finite as all_finite
from funcshard._src.optim.nonfinite import skip_nonfinite as skip_nonfinite
from funcshard._src.optim.sgd import SGDState as SGDState
from funcshard._src.optim.sgd import sgd as sgd

__all__ = [
    "AdamWState",
    "Optimizer",
    "SGDState",
    "SkipState",
    "adamw",
    "all_finite",
    "clip_by_global_norm",
    "sgd",
    "skip_nonfinite",
]
