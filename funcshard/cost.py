"""What a plan costs each rank: memory by category, bytes sent, step time, under a training setup.

Example:
    >>> import torch, funcshard as fs
    >>> plan = fs.plan({"w": torch.zeros(1024, 1024)}, fs.Mesh({"fsdp": 4}))
    >>> fs.cost.estimate(plan, fs.cost.CostModel(optimizer="adamw")).memory.optimizer
    2097160
"""

from funcshard._src.plan.activations import Workload as Workload
from funcshard._src.plan.cost import estimate as estimate
from funcshard._src.plan.cost_model import CostModel as CostModel
from funcshard._src.plan.cost_model import Reserve as Reserve
from funcshard._src.plan.estimates import Estimate as Estimate
from funcshard._src.plan.estimates import Memory as Memory
from funcshard._src.plan.hardware import HARDWARE as HARDWARE
from funcshard._src.plan.hardware import Hardware as Hardware
from funcshard._src.plan.hardware import get_hardware as hardware
from funcshard._src.plan.step_time import StepTime as StepTime

__all__ = [
    "HARDWARE",
    "CostModel",
    "Estimate",
    "Hardware",
    "Memory",
    "Reserve",
    "StepTime",
    "Workload",
    "estimate",
    "hardware",
]
