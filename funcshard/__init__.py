"""funcshard: fully sharded data parallelism for PyTorch, the JAX way.

A model is a pure function over a parameter pytree; :func:`plan` turns
declarative rules into per-leaf placement specs (JAX ``PartitionSpec``
semantics); :func:`shard` keeps each rank's shards in one flat buffer per unit,
and :func:`materialize` generates them, for models no rank can hold whole.
The core is at the root; the rest by namespace, as in JAX: ``fs.tree`` (pytrees),
``fs.sharding`` (the types of a plan), ``fs.cost`` (what a plan costs),
``fs.presets`` (published models), ``fs.initializers`` (for :func:`materialize`),
``fs.optim``, ``fs.data`` (which examples each rank reads), ``fs.checkpoint``,
``fs.interop`` and ``fs.testing``.
"""

import importlib
import importlib.metadata
import warnings
from typing import Any

from funcshard import checkpoint as checkpoint
from funcshard import cost as cost
from funcshard import data as data
from funcshard import initializers as initializers
from funcshard import interop as interop
from funcshard import optim as optim
from funcshard import presets as presets
from funcshard import sharding as sharding
from funcshard import testing as testing
from funcshard import tree as tree
from funcshard._src.comm.lifecycle import init as init
from funcshard._src.comm.metrics import MetricLogger as MetricLogger
from funcshard._src.comm.metrics import mean_over_ranks as mean_over_ranks
from funcshard._src.comm.runtime import CollectiveError as CollectiveError
from funcshard._src.comm.runtime import DesyncError as DesyncError
from funcshard._src.comm.runtime import device as device
from funcshard._src.comm.runtime import rank as rank
from funcshard._src.comm.runtime import set_collective_timeout as set_collective_timeout
from funcshard._src.comm.runtime import world_size as world_size
from funcshard._src.data.seed import seed as seed
from funcshard._src.execute.call import call as call
from funcshard._src.execute.call_record import ParameterWriteError as ParameterWriteError
from funcshard._src.execute.forward import forward as forward
from funcshard._src.execute.value_and_grad import Step as Step
from funcshard._src.execute.value_and_grad import StepStats as StepStats
from funcshard._src.execute.value_and_grad import value_and_grad as value_and_grad
from funcshard._src.plan.auto import BudgetError as BudgetError
from funcshard._src.plan.plan import Plan as Plan
from funcshard._src.plan.planner import plan as plan
from funcshard._src.plan.precision import MixedPrecision as MixedPrecision
from funcshard._src.plan.quantize import Quantized as Quantized
from funcshard._src.shard.materialize import materialize as materialize
from funcshard._src.shard.shard import shard as shard
from funcshard._src.shard.shard import unshard as unshard
from funcshard._src.shard.sharded import DonatedError as DonatedError
from funcshard._src.shard.sharded import ShardedTensor as ShardedTensor
from funcshard._src.spec.mesh import Mesh as Mesh
from funcshard._src.spec.named_sharding import NamedSharding as NamedSharding
from funcshard._src.spec.partition_spec import P as P
from funcshard._src.spec.partition_spec import SpecError as SpecError
from funcshard._src.verify.report import VerifyReport as VerifyReport
from funcshard._src.verify.verify import verify as verify

try:
    __version__ = importlib.metadata.version("funcshard")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "BudgetError",
    "CollectiveError",
    "DesyncError",
    "DonatedError",
    "Mesh",
    "MetricLogger",
    "MixedPrecision",
    "NamedSharding",
    "P",
    "ParameterWriteError",
    "Plan",
    "Quantized",
    "ShardedTensor",
    "SpecError",
    "Step",
    "StepStats",
    "VerifyReport",
    "call",
    "checkpoint",
    "cost",
    "data",
    "device",
    "forward",
    "init",
    "initializers",
    "interop",
    "materialize",
    "mean_over_ranks",
    "optim",
    "plan",
    "presets",
    "rank",
    "seed",
    "set_collective_timeout",
    "shard",
    "sharding",
    "testing",
    "tree",
    "unshard",
    "value_and_grad",
    "verify",
    "world_size",
]

# names that lived at the root before the namespaces: old name -> (namespace, name there)
_MOVED = {
    "PartitionSpec": ("funcshard", "P"),
    "tree_map": ("funcshard.tree", "map"),
    "tree_flatten": ("funcshard.tree", "flatten"),
    "tree_unflatten": ("funcshard.tree", "unflatten"),
    "tree_leaves": ("funcshard.tree", "leaves"),
    "leaf_paths": ("funcshard.tree", "leaf_paths"),
    "register_dataclass": ("funcshard.tree", "register_dataclass"),
    "estimate": ("funcshard.cost", "estimate"),
    "CostModel": ("funcshard.cost", "CostModel"),
    "Estimate": ("funcshard.cost", "Estimate"),
    "Memory": ("funcshard.cost", "Memory"),
    "Hardware": ("funcshard.cost", "Hardware"),
    "hardware": ("funcshard.cost", "hardware"),
    "Workload": ("funcshard.cost", "Workload"),
    "StepTime": ("funcshard.cost", "StepTime"),
    "preset": ("funcshard.presets", "get"),
    "Preset": ("funcshard.presets", "Preset"),
    "ModelConfig": ("funcshard.presets", "ModelConfig"),
    "LeafPlan": ("funcshard.sharding", "LeafPlan"),
    "Unit": ("funcshard.sharding", "Unit"),
    "Strategy": ("funcshard.sharding", "Strategy"),
}


def __getattr__(name: str) -> Any:
    """The names that moved into namespaces, for one release, with a ``DeprecationWarning``."""
    moved = _MOVED.get(name)
    if moved is None:
        raise AttributeError(f"module 'funcshard' has no attribute {name!r}")
    module, new = moved
    where = "fs" if module == "funcshard" else "fs." + module.removeprefix("funcshard.")
    warnings.warn(
        f"fs.{name} is now {where}.{new}; the old name goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), new)
