"""Calls of a local-only unit: autograd leaves over its shards instead of a gather node.

[Note: local-only calls]
A unit with nothing to gather, cast or agree on (one rank, no mixed precision:
``UnitRuntime.local_only``) needs no autograd node of its own: its function gets
new autograd leaves viewing its shards (the trained ones requiring grad),
autograd accumulates their gradients into ``.grad`` as it does for
``nn.Parameter`` s, and ``Run.finish`` hands them to the reducer. No Python runs
in its backward. An evaluation gets the plain views.
"""

from __future__ import annotations

import torch

from funcshard._src.execute.call_record import CallRecord


def local_leaves(record: CallRecord, /, *, evaluation: bool) -> list[torch.Tensor]:
    """A local-only unit's full leaves for one call, as autograd leaves; sets ``record.leaves`` (mutates).

    In an evaluation, the plain views, and ``record`` is left as it is.
    """
    views = record.unit.full_leaves()
    if evaluation:
        return views
    leaves = [v.requires_grad_() if t else v for v, t in zip(views, record.unit.trained)]
    record.leaves = leaves
    return leaves
