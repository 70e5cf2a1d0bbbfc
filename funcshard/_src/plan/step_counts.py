"""How often a unit's collectives run in one optimizer step: gathers (from its shards or not) and reductions.

The counts the cost model multiplies bytes by (``unit_cost.py``), from the unit's
strategy and the :class:`CostModel`'s micro-batches and accumulation mode, as the
executor runs them.
"""

from __future__ import annotations

from funcshard._src.plan.cost_model import CostModel
from funcshard._src.plan.strategy import keeps_for_step, keeps_partial_copy, reshards_after_forward
from funcshard._src.plan.units import Unit


def gathers_from_shards(unit: Unit, model: CostModel, /, *, trained: bool = True) -> int:
    """How many of a step's gathers of ``unit`` start from its shards, over every shard axis.

    The others re-gather its partial copy over the last mesh axis (see [Note:
    partial copies] in ``strategy.py``): a ``partial_reshard`` unit gathers from its
    shards once per micro-batch (forward) and a ``hybrid_shard_optimizer`` unit
    once per step; a unit of any other strategy always does (``trained``: as
    :func:`collectives_per_step` takes it).

    Example:
        >>> from funcshard._src.plan.units import Unit
        >>> def unit(s):
        ...     return Unit("blocks/0", ("blocks/0/w",), s)
        >>> model = CostModel(micro_batches=4)
        >>> [gathers_from_shards(unit(s), model) for s in ("partial_reshard", "hybrid_shard_optimizer")]
        [4, 1]
        >>> gathers_from_shards(unit("full_shard"), model)
        8
    """
    lifetime = keeps_partial_copy(unit.strategy)
    if lifetime == "step":
        return 1
    if lifetime == "call":
        return model.micro_batches
    return collectives_per_step(unit, model, trained=trained)[0]


def collectives_per_step(
    unit: Unit, model: CostModel, /, *, trained: bool = True
) -> tuple[int, int]:
    """How often ``unit`` is gathered and its gradients reduced in one optimizer step.

    Per micro-batch, a unit that reshards after forward (``full_shard``,
    ``hybrid_shard``, ``partial_reshard``, ``hybrid_shard_optimizer``; not the root)
    is gathered twice (forward, and again for backward) and any other once; its
    gradients are reduced once per micro-batch, or once per step with
    ``accumulate="unsharded"``. A ``shard_optimizer`` unit is gathered and reduced
    once per step (see [Note: shard_optimizer] in ``strategy.py``). A unit with no
    ``trained`` leaf is taken to be called where no backward reaches it, and is
    gathered once per micro-batch ([Note: calls without a backward] in
    ``execute/run.py``).

    Example:
        >>> from funcshard._src.plan.units import Unit
        >>> unit = Unit("blocks/0", ("blocks/0/w",), "full_shard")
        >>> collectives_per_step(unit, CostModel(micro_batches=4))
        (8, 4)
        >>> collectives_per_step(unit, CostModel(micro_batches=4, accumulate="unsharded"))
        (8, 1)
        >>> collectives_per_step(unit, CostModel(micro_batches=4), trained=False)
        (4, 4)
        >>> collectives_per_step(Unit("blocks/0", ("blocks/0/w",), "shard_optimizer"), CostModel(micro_batches=4))
        (1, 1)
    """
    k = model.micro_batches
    if keeps_for_step(unit.strategy):
        return 1, 1
    twice = reshards_after_forward(unit.strategy) and not unit.is_root and trained
    gathers = 2 * k if twice else k
    return gathers, 1 if model.accumulate == "unsharded" else k
