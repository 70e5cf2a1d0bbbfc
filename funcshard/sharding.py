"""Placement, as ``jax.sharding``: meshes, partition specs, shardings, and the parts of a plan.

``Mesh``, ``P`` and ``NamedSharding`` are at the root too (``fs.Mesh``); this namespace
adds the types a plan is made of.

Example:
    >>> import funcshard as fs
    >>> fs.sharding.NamedSharding(fs.Mesh({"fsdp": 2}), fs.P("fsdp")).indices((4,))
    {0: (slice(0, 2, None),), 1: (slice(2, 4, None),)}
"""

from funcshard._src.plan.leaf import LeafPlan as LeafPlan
from funcshard._src.plan.plan import Plan as Plan
from funcshard._src.plan.strategy import Strategy as Strategy
from funcshard._src.plan.units import Layout as Layout
from funcshard._src.plan.units import Unit as Unit
from funcshard._src.spec.flat_sharding import FlatSharding as FlatSharding
from funcshard._src.spec.mesh import Mesh as Mesh
from funcshard._src.spec.named_sharding import NamedSharding as NamedSharding
from funcshard._src.spec.partition_spec import P as P
from funcshard._src.spec.partition_spec import P as PartitionSpec

__all__ = [
    "FlatSharding",
    "Layout",
    "LeafPlan",
    "Mesh",
    "NamedSharding",
    "P",
    "PartitionSpec",
    "Plan",
    "Strategy",
    "Unit",
]
