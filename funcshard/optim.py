"""Functional optimizers over sharded params, shaped like optax: ``init`` and ``update_`` on flat buffers.

Optimizers (``sgd``, ``adamw``, ``lion``, ``adafactor``, ``from_torch``), gradient transforms
(``clip_by_global_norm(max_norm)``; ``clip_by_global_norm_`` in place), guards (``skip_nonfinite()``) and
``ema`` compose with ``chain``; ``masked`` and ``partition`` restrict a part to
some leaves (a weight-decay mask is ``adamw(..., mask=decay_mask_default)``);
learning rates may be schedules.
"""

from funcshard._src.optim.adafactor import AdafactorState as AdafactorState
from funcshard._src.optim.adafactor import adafactor as adafactor
from funcshard._src.optim.adamw import AdamWState as AdamWState
from funcshard._src.optim.adamw import adamw as adamw
from funcshard._src.optim.base import Optimizer as Optimizer
from funcshard._src.optim.base import Transform as Transform
from funcshard._src.optim.chain import chain as chain
from funcshard._src.optim.chain import masked as masked
from funcshard._src.optim.chain import partition as partition
from funcshard._src.optim.clip import ClipState as ClipState
from funcshard._src.optim.clip import clip_by_global_norm as clip_by_global_norm
from funcshard._src.optim.clip import clip_by_global_norm_ as clip_by_global_norm_
from funcshard._src.optim.ema import EmaState as EmaState
from funcshard._src.optim.ema import ema as ema
from funcshard._src.optim.ema import ema_params as ema_params
from funcshard._src.optim.lion import LionState as LionState
from funcshard._src.optim.lion import lion as lion
from funcshard._src.optim.nonfinite import Guard as Guard
from funcshard._src.optim.nonfinite import SkipState as SkipState
from funcshard._src.optim.nonfinite import all_finite as all_finite
from funcshard._src.optim.nonfinite import nonfinite_flag as nonfinite_flag
from funcshard._src.optim.nonfinite import skip_nonfinite as skip_nonfinite
from funcshard._src.optim.schedules import constant_schedule as constant_schedule
from funcshard._src.optim.schedules import cosine_decay_schedule as cosine_decay_schedule
from funcshard._src.optim.schedules import join_schedules as join_schedules
from funcshard._src.optim.schedules import linear_schedule as linear_schedule
from funcshard._src.optim.schedules import (
    warmup_cosine_decay_schedule as warmup_cosine_decay_schedule,
)
from funcshard._src.optim.select import decay_mask_default as decay_mask_default
from funcshard._src.optim.sgd import SGDState as SGDState
from funcshard._src.optim.sgd import sgd as sgd
from funcshard._src.optim.torch_optim import TorchOptimState as TorchOptimState
from funcshard._src.optim.torch_optim import from_torch as from_torch

__all__ = [
    "AdafactorState",
    "AdamWState",
    "ClipState",
    "EmaState",
    "Guard",
    "LionState",
    "Optimizer",
    "SGDState",
    "SkipState",
    "TorchOptimState",
    "Transform",
    "adafactor",
    "adamw",
    "all_finite",
    "chain",
    "clip_by_global_norm",
    "clip_by_global_norm_",
    "constant_schedule",
    "cosine_decay_schedule",
    "decay_mask_default",
    "ema",
    "ema_params",
    "from_torch",
    "join_schedules",
    "linear_schedule",
    "lion",
    "masked",
    "nonfinite_flag",
    "partition",
    "sgd",
    "skip_nonfinite",
    "warmup_cosine_decay_schedule",
]
