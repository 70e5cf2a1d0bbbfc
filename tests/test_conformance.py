"""The conformance suite: every row of the table trains equal to its reference, or is refused.

Rows (``tests/conformance/``) are PyTorch's own FSDP test models, Hugging Face
families, torchvision-shaped vision models and the constructs module code uses
outside a plain forward (activation checkpoints, hooks, reads across units,
parametrizations, attention, norms, compiled submodules, buffers). Each runs at
W=2 under full_shard, shard_grad_op, remat and bf16 mixed precision, and under
partial_reshard, hybrid_shard_optimizer and shard_optimizer (``LEVERS``; CI: see
``CI_VARIANTS`` and ``LEVERS_IN_CI``; ``nox -s conformance`` runs all) against the
reference of ``tests/conformance/harness.py``: the replicated module with
all-reduced gradients in float64 (every parameter and buffer within 1e-10 after
three steps), FSDP2 itself in bf16. A refused row must raise its funcshard error
at the first step. ``fs.verify`` passes each supported row and fails each refused
one (in the row's full_shard run). A failure names the row, the variant and the
tensor. ``docs/interop.md`` holds the resulting table; the last test keeps it true.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.conformance.catalog import ROWS
from tests.conformance.harness import run_row

EXACT = 1e-10  # float64, after three steps
BF16_RTOL, BF16_ATOL = 2e-2, 1e-3  # against FSDP2: a bf16 ulp of the larger tensors

# What CI runs besides every row under full_shard: the variants that take another path
# through the binding (a recompute under remat, a cast under bf16, no reshard after forward)
# on the rows that exercise it. ``nox -s conformance`` runs the whole matrix (marker ``matrix``).
CI_VARIANTS = {
    "remat": (
        "checkpoint/",
        "hook/full-backward",
        "hook/backward-pre",
        "state/",
        "norm/",
        "share/",
        "write/clamp",
    ),
    "bf16": ("fsdp/MLP", "dtensor/Transformer-checkpointed", "hf/Llama", "norm/", "param/spectral"),
    "shard_grad_op": ("checkpoint/non-reentrant", "checkpoint/reentrant", "dtensor/", "hf/GPT2"),
}


# The levers stored like full_shard, on every row that trains, beside its own variants (the
# docs' table lists those): partial_reshard and hybrid_shard_optimizer
# ([Note: partial copies] in ``plan/strategy.py``,
# [Note: two-hop reductions] in ``execute/param_group.py``)
# on 4 ranks, {node: 2, local: 2}; shard_optimizer on 2.
# In CI, these rows.
LEVERS = ("partial_reshard", "hybrid_shard_optimizer", "shard_optimizer")
LEVERS_IN_CI = ("dtensor/Transformer-checkpointed",)
FOUR_RANKS = ("partial_reshard", "hybrid_shard_optimizer")


def _in_ci(name: str, variant: str) -> bool:
    if variant in LEVERS:
        return name in LEVERS_IN_CI
    return variant == "full_shard" or name.startswith(CI_VARIANTS.get(variant, ()))


CASES = [
    pytest.param(
        name,
        variant,
        id=f"{name}-{variant}",
        marks=() if _in_ci(name, variant) else pytest.mark.matrix,
    )
    for name, row in ROWS.items()
    for variant in (
        *row.variants,
        *(LEVERS if row.refused is None and "shard_grad_op" in row.variants else ()),
    )
]


@pytest.mark.parametrize(("name", "variant"), CASES)
def test_row_trains_equal_to_its_reference_or_is_refused(pools: Any, name: str, variant: str):
    results = pools.run(4 if variant in FOUR_RANKS else 2, run_row, name, variant, timeout_s=300)
    row = ROWS[name]
    for rank, result in enumerate(results):
        if "verify" in result:  # fs.verify of the row (its full_shard run)
            verdict = result["verify"]
            assert verdict["ok"] == (row.refused is None), f"rank {rank}: {verdict['problems']}"
        if row.refused is not None:
            assert result["error"] is not None, f"rank {rank}: {name} trained; expected a refusal"
            assert result["step"] == 0, f"rank {rank}: refused only at step {result['step']}"
            assert re.search(row.refused, result["error"]), result["error"]
            continue
        if variant == "bf16" and row.bf16_error is not None:  # FSDP2 fails in torch too
            assert "fsdp2" in result, f"rank {rank}: FSDP2 trained {name}: update bf16_error"
            assert re.search(row.bf16_error, result["fsdp2"]), result["fsdp2"]
            assert result["error"] == result["fsdp2"], (
                f"rank {rank}: FSDP2 raised {result['fsdp2']!r}, funcshard {result['error']!r}"
            )
            continue
        assert result["error"] is None, f"rank {rank}: {result['error']}"
        for key, diff in result["diffs"].items():
            scale = result["scales"][key]
            bound = BF16_ATOL + BF16_RTOL * scale if variant == "bf16" else EXACT
            assert diff <= bound, f"rank {rank}: {key} differs by {diff:.3g} (bound {bound:.3g})"
        assert result["losses"], "no step ran"


def test_broadcast_state_trains_as_ddp_with_broadcast_buffers(pools: Any):
    """BatchNorm statistics from rank 0 before each step: parameters and buffers equal DDP's."""
    from tests.conformance.harness import run_broadcast_buffers

    for rank, diffs in enumerate(pools.run(2, run_broadcast_buffers, "norm/BatchNorm")):
        for key, diff in diffs.items():
            assert diff <= EXACT, f"rank {rank}: {key} differs from DDP's by {diff:.3g}"


def test_the_table_in_the_docs_is_this_suite():
    """docs/interop.md lists every row with the outcome this suite checks, and no other."""
    from pathlib import Path

    from tests.conformance.catalog import table

    docs = (Path(__file__).parent.parent / "docs" / "interop.md").read_text()
    documented = [line for line in docs.splitlines() if re.match(r"\| `[\w./-]+` \|", line)]
    assert documented == table(), "regenerate the table: tests.conformance.catalog.table()"
