"""Functional optimizers over sharded params, like optax: ``init`` and ``update`` on flat buffers."""

from funcshard._src.optim.adamw import AdamWState as AdamWState
from funcshard._src.optim.adamw import adamw as adamw
from funcshard._src.optim.base import Optimizer as Optimizer
from funcshard._src.optim.clip import clip_by_global_norm as clip_by_global_norm
from funcshard._src.optim.nonfinite import SkipState as SkipState
from funcshard._src.optim.nonfinite import all_finite as all_finite
from funcshard._src.optim.nonfinite import skip_nonfinite as skip_nonfinite
from funcshard._src.optim.schedules import constant_schedule as constant_schedule
from funcshard._src.optim.schedules import cosine_decay_schedule as cosine_decay_schedule
from funcshard._src.optim.schedules import join_schedules as join_schedules
from funcshard._src.optim.schedules import linear_schedule as linear_schedule
from funcshard._src.optim.schedules import (
    warmup_cosine_decay_schedule as warmup_cosine_decay_schedule,
)
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
    "constant_schedule",
    "cosine_decay_schedule",
    "join_schedules",
    "linear_schedule",
    "sgd",
    "skip_nonfinite",
    "warmup_cosine_decay_schedule",
]
