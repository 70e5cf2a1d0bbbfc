"""Every row of the conformance table, by name (importing this module registers them)."""

from __future__ import annotations

from tests.conformance import (
    constructs,
    fsdp_models,
    hf_models,
    module_zoo,
    ownership,
    state_hooks,
    vision,
)
from tests.conformance.rows import ROWS, Row

__all__ = [
    "ROWS",
    "Row",
    "constructs",
    "fsdp_models",
    "hf_models",
    "module_zoo",
    "ownership",
    "state_hooks",
    "table",
    "vision",
]

FP64 = ("full_shard", "shard_grad_op", "remat")


def table() -> list[str]:
    """The rows of the conformance table in ``docs/interop.md``, one markdown line each."""
    lines = []
    for name, row in ROWS.items():
        if row.refused is not None:
            fp64 = bf16 = row.refusal
        else:
            ran = [v for v in FP64 if v in row.variants]
            fp64 = "equal" if ran == list(FP64) else "equal (" + ", ".join(ran) + ")"
            if "bf16" not in row.variants:
                bf16 = "not run"
            elif row.bf16_error is not None:
                bf16 = f'raises as FSDP2 does (torch: "{row.bf16_error}")'
            else:
                bf16 = "equal"
        lines.append(f"| `{name}` | {row.construct} | {fp64} | {bf16} | {_checkpoint(row)} |")
    return lines


def _checkpoint(row: Row) -> str:
    """The checkpoint column: what ``tests/test_conformance_checkpoints.py`` checks of the row."""
    if row.refused is not None:
        return "not trained"
    if not row.checkpoint_refused:
        return "bit for bit, every path"
    return "bit for bit; " + "; ".join(said for _, _, said in row.checkpoint_refused)
