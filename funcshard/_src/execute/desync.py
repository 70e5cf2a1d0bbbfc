"""Catching ranks that run different things before they hang in a collective.

Before a step's first collective, every rank contributes a digest of a small
signature (its plan's fingerprint and its params' tree structure) to one
all-gather of 32 bytes, under the collective timeout; if any rank differs,
every rank raises :class:`DesyncError` listing the ranks that differ and how,
instead of deadlocking in the first all-gather of a unit.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist

from funcshard._src import tree
from funcshard._src.comm import collectives, groups, runtime
from funcshard._src.comm.runtime import DesyncError
from funcshard._src.plan.plan import Plan


def signature(plan: Plan, sparams: Any, /) -> dict[str, str]:
    """What must be equal on every rank: the plan's fingerprint and the params' tree structure."""
    structure = repr(tree.flatten(sparams)[1])
    return {
        "plan fingerprint": plan.fingerprint(),
        "params tree": hashlib.sha256(structure.encode()).hexdigest()[:16],
        "leaves": str(len(tree.leaves(sparams))),
    }


def check_peers(plan: Plan, sparams: Any, /) -> None:
    """Compares :func:`signature` across all ranks (one all-gather); collective.

    Raises:
        DesyncError: a rank differs from rank 0; the message lists each such rank and field.
    """
    if not runtime.is_distributed() or runtime.world_size() == 1:
        return
    mine = signature(plan, sparams)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).digest()
    bound = groups.bind(plan.mesh)
    local = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    digests = collectives.all_gather(local, bound, plan.mesh.axis_names, tag="peer check").wait()
    if bool((digests == digests[0]).all()):
        return
    everyone: list[Any] = [None] * runtime.world_size()  # only now the details, from every rank
    dist.all_gather_object(everyone, mine)
    reference = everyone[0]
    differences = [
        f"rank {r}: {field} {value} (rank 0: {reference[field]})"
        for r, sig in enumerate(everyone)
        for field, value in sig.items()
        if value != reference[field]
    ]
    if differences:
        raise DesyncError(
            "ranks disagree before the first collective: "
            + "; ".join(differences)
            + ". Every rank must build "
            "the same plan from the same params tree (same rules, units, strategy and mesh)"
        )
