"""The public API: the core at the root, the rest by namespace, old names warning for one release."""

from __future__ import annotations

import pytest

import funcshard as fs

CORE = {
    "init",
    "device",
    "rank",
    "world_size",
    "mean_over_ranks",
    "set_collective_timeout",
    "Mesh",
    "P",
    "NamedSharding",
    "plan",
    "Plan",
    "shard",
    "unshard",
    "materialize",
    "ShardedTensor",
    "call",
    "value_and_grad",
    "forward",
    "Step",
    "StepStats",
    "MixedPrecision",
    "Quantized",
    "BudgetError",
    "CollectiveError",
    "DesyncError",
    "DonatedError",
    "ParameterWriteError",
    "SpecError",
    "verify",
    "VerifyReport",
    "seed",
    "MetricLogger",
}
NAMESPACES = {
    "tree",
    "sharding",
    "cost",
    "presets",
    "initializers",
    "optim",
    "checkpoint",
    "interop",
    "testing",
    "data",
}


def test_the_root_holds_the_core_and_the_namespaces():
    assert set(fs.__all__) == CORE | NAMESPACES
    assert all(hasattr(fs, name) for name in fs.__all__)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("PartitionSpec", lambda: fs.P),
        ("tree_map", lambda: fs.tree.map),
        ("leaf_paths", lambda: fs.tree.leaf_paths),
        ("register_dataclass", lambda: fs.tree.register_dataclass),
        ("estimate", lambda: fs.cost.estimate),
        ("CostModel", lambda: fs.cost.CostModel),
        ("hardware", lambda: fs.cost.hardware),
        ("preset", lambda: fs.presets.get),
        ("ModelConfig", lambda: fs.presets.ModelConfig),
        ("LeafPlan", lambda: fs.sharding.LeafPlan),
    ],
)
def test_old_root_names_warn_and_still_work(old, new):
    with pytest.warns(DeprecationWarning, match=rf"fs\.{old} is now fs\."):
        value = getattr(fs, old)
    assert value is new()


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'funcshard' has no attribute 'shard_all'"):
        fs.shard_all  # noqa: B018
