"""funcshard: fully sharded data parallelism for PyTorch, the JAX way.

A model is a pure function over a parameter pytree; :func:`plan` turns
declarative rules into per-leaf placement specs (JAX ``PartitionSpec``
semantics); :func:`shard` keeps each rank's shards in one flat buffer per unit.
"""

from funcshard import checkpoint as checkpoint
from funcshard import interop as interop
from funcshard import optim as optim
from funcshard import testing as testing
from funcshard._src.comm.lifecycle import init as init
from funcshard._src.comm.runtime import CollectiveError as CollectiveError
from funcshard._src.comm.runtime import DesyncError as DesyncError
from funcshard._src.comm.runtime import rank as rank
from funcshard._src.comm.runtime import set_collective_timeout as set_collective_timeout
from funcshard._src.comm.runtime import world_size as world_size
from funcshard._src.execute.call import call as call
from funcshard._src.execute.value_and_grad import Step as Step
from funcshard._src.execute.value_and_grad import StepStats as StepStats
from funcshard._src.execute.value_and_grad import value_and_grad as value_and_grad
from funcshard._src.plan.activations import Workload as Workload
from funcshard._src.plan.auto import BudgetError as BudgetError
from funcshard._src.plan.cost import estimate as estimate
from funcshard._src.plan.cost_model import CostModel as CostModel
from funcshard._src.plan.estimates import Estimate as Estimate
from funcshard._src.plan.estimates import Memory as Memory
from funcshard._src.plan.hardware import Hardware as Hardware
from funcshard._src.plan.hardware import get_hardware as hardware
from funcshard._src.plan.model_config import ModelConfig as ModelConfig
from funcshard._src.plan.plan import LeafPlan as LeafPlan
from funcshard._src.plan.plan import Plan as Plan
from funcshard._src.plan.planner import plan as plan
from funcshard._src.plan.precision import MixedPrecision as MixedPrecision
from funcshard._src.plan.presets import Preset as Preset
from funcshard._src.plan.presets import get_preset as preset
from funcshard._src.plan.step_time import StepTime as StepTime
from funcshard._src.plan.strategy import Strategy as Strategy
from funcshard._src.plan.units import Unit as Unit
from funcshard._src.shard.shard import shard as shard
from funcshard._src.shard.shard import unshard as unshard
from funcshard._src.shard.sharded import DonatedError as DonatedError
from funcshard._src.shard.sharded import ShardedTensor as ShardedTensor
from funcshard._src.spec.mesh import Mesh as Mesh
from funcshard._src.spec.named_sharding import NamedSharding as NamedSharding
from funcshard._src.spec.partition_spec import P as P
from funcshard._src.spec.partition_spec import SpecError as SpecError
from funcshard._src.tree import flatten as tree_flatten
from funcshard._src.tree import leaf_paths as leaf_paths
from funcshard._src.tree import leaves as tree_leaves
from funcshard._src.tree import register_dataclass as register_dataclass
from funcshard._src.tree import tree_map as tree_map
from funcshard._src.tree import unflatten as tree_unflatten

PartitionSpec = P

__all__ = [
    "BudgetError",
    "CollectiveError",
    "CostModel",
    "DesyncError",
    "DonatedError",
    "Estimate",
    "Hardware",
    "LeafPlan",
    "Memory",
    "Mesh",
    "MixedPrecision",
    "ModelConfig",
    "NamedSharding",
    "P",
    "PartitionSpec",
    "Plan",
    "Preset",
    "ShardedTensor",
    "SpecError",
    "Step",
    "StepStats",
    "StepTime",
    "Strategy",
    "Unit",
    "Workload",
    "call",
    "checkpoint",
    "estimate",
    "hardware",
    "init",
    "interop",
    "leaf_paths",
    "optim",
    "plan",
    "preset",
    "rank",
    "register_dataclass",
    "set_collective_timeout",
    "shard",
    "testing",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "unshard",
    "value_and_grad",
    "world_size",
]
