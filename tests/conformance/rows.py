"""One row of the conformance table: a module, how it is called and what funcshard does with it.

A row either trains equal to its reference (``refused is None``) or funcshard
refuses it at the first step with an error matching ``refused``. Rows are looked
up by name, so that a worker rank builds the same module from a name alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

Batch = tuple[tuple[Any, ...], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Row:
    """A module of the conformance table."""

    name: str
    build: Callable[[], nn.Module]  # seeded by the caller
    units: tuple[Any, ...]  # functionalize(units=...)
    batch: Callable[[int], Batch]  # seed -> (args, kwargs) of the module's forward
    loss: Callable[[Any, tuple[Any, ...], dict[str, Any]], torch.Tensor]  # (output, args, kwargs)
    construct: str  # what the row exercises, for the table
    refused: str | None = None  # a regex of funcshard's error, where it refuses the row
    # how the table describes the refusal: when it comes and what the error names
    refusal: str = (
        "refused at the first step: `UnboundParameterError` naming the parameter, its unit, "
        "the reader and the fix"
    )
    # a regex of torch's error where the model fails in bf16 under FSDP2 too (and must alike)
    bf16_error: str | None = None
    variants: tuple[str, ...] = ("full_shard", "shard_grad_op", "remat", "bf16")
    quiet: tuple[str, ...] = ()  # torch's own warnings the row triggers (messages to ignore)
    around: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext  # each step in it
    # checkpoint paths that refuse the row at save time: (path, regex of the error, what
    # the table says); see tests/conformance/checkpoints.py
    checkpoint_refused: tuple[tuple[str, str, str], ...] = ()


ROWS: dict[str, Row] = {}


def register(*rows: Row) -> None:
    for row in rows:
        assert row.name not in ROWS, row.name
        ROWS[row.name] = row


def tokens(vocab: int, shape: tuple[int, ...]) -> Callable[[int], Batch]:
    """Batches of random token ids of ``shape``."""

    def batch(seed: int) -> Batch:
        gen = torch.Generator().manual_seed(seed)
        return (torch.randint(0, vocab, shape, generator=gen),), {}

    return batch


def features(*shape: int) -> Callable[[int], Batch]:
    """Batches of standard normal features of ``shape`` (the default dtype)."""

    def batch(seed: int) -> Batch:
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(*shape, generator=gen),), {}

    return batch


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least float32 (a bf16 output), float64 kept."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def mean_square(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The mean square of every output."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return torch.stack([wide(o).square().mean() for o in outs]).sum()


def sum_of(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The sum of every output (FSDP's ``get_loss`` for most of its test models)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return torch.stack([wide(o).sum() for o in outs]).sum()


# torch's CPU kernels refuse float32 buffers beside bfloat16 parameters
BATCH_NORM_IN_BF16 = "expected scalar type BFloat16 but found Float"
