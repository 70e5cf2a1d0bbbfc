"""Block-quantized int8 collectives: an all-gather of parameters and an all-to-all reduction of gradients.

The format and its error bound are [Note: quantized collectives] in
``plan/quantize.py``. A buffer of ``n`` elements travels as
``quantized_bytes(n, block)`` bytes: the blocks' fp32 scales, then their int8
values. Both collectives go through :func:`~funcshard._src.comm.pending.issue`
like every other (errors, agreements, the trace), and return a :class:`Dequantized`
whose ``wait()`` turns the bytes received into values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from funcshard._src.comm import collectives
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.comm.ledger import Ledger
from funcshard._src.comm.pending import Pending, issue
from funcshard._src.plan.quantize import quantized_bytes


def quantize_into(x: torch.Tensor, out: torch.Tensor, block: int, /) -> None:
    """Writes ``x`` ``(n,)`` into ``out``, ``quantized_bytes(n, block)`` uint8: scales, then int8 values; mutates ``out``.

    Example:
        >>> x = torch.tensor([0.5, -1.0, 0.25, 0.0, 2.0, 0.0, 0.0, 0.0])
        >>> out = torch.empty(quantized_bytes(8, 4), dtype=torch.uint8)
        >>> quantize_into(x, out, 4)
        >>> y = torch.empty(8)
        >>> dequantize_into(out, 8, 4, y)
        >>> bool(((x - y).abs() <= torch.tensor([1.0] * 4 + [2.0] * 4) / 254).all())
        True
    """
    n = x.numel()
    blocks = -(-n // block)
    scales = out[: 4 * blocks].view(torch.float32)
    values = out[4 * blocks :].view(torch.int8).view(blocks, block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n].copy_(x.reshape(-1))
    grid = padded.view(blocks, block)
    amax = grid.abs().amax(dim=1)
    finite = torch.isfinite(amax)
    scale = amax / 127
    # a block with a NaN or an infinity arrives as NaN: its scale carries it
    scales.copy_(torch.where(finite, scale, torch.full_like(scale, float("nan"))))
    divisor = torch.where(finite & (scale > 0), scale, torch.ones_like(scale))
    q = grid.div_(divisor[:, None]).round_().clamp_(-127, 127).nan_to_num_(0.0)
    values.copy_(q)


def dequantize_into(data: torch.Tensor, n: int, block: int, out: torch.Tensor, /) -> None:
    """Writes the ``n`` values that ``data`` (from :func:`quantize_into`) carries into ``out``; mutates ``out``."""
    blocks = -(-n // block)
    scales = data[: 4 * blocks].view(torch.float32)
    values = data[4 * blocks : 4 * blocks + blocks * block].view(torch.int8).view(blocks, block)
    out.copy_(values.to(torch.float32).mul_(scales[:, None]).view(-1)[:n])


@dataclass
class Dequantized(Pending):
    """A quantized collective in flight: :meth:`wait` waits for its bytes, then fills ``result``."""

    finish: Callable[[], None] | None = None

    def wait(self) -> torch.Tensor:
        """Blocks until the bytes are in, dequantizes them (once) and returns ``result``."""
        super().wait()
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        return self.result


def all_gather(
    flat: torch.Tensor,
    bound: BoundMesh,
    axes: tuple[str, ...],
    /,
    *,
    block: int,
    out: torch.Tensor,
    ledger: Ledger | None = None,
    tag: str = "",
) -> Dequantized:
    """Gathers every group member's ``flat`` quantized into ``out`` viewed ``(group_size, numel)``.

    Every rank gets the same dequantized rows, its own included (within the
    per-block bound of its shard). The ledger counts the bytes sent.

    Raises:
        CollectiveError: the collective could not start.
    """
    size = collectives.group_size(bound, axes)
    n = flat.numel()
    nbytes = quantized_bytes(n, block)
    send = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    quantize_into(flat, send, block)
    received = torch.empty(size * nbytes, dtype=torch.uint8, device=flat.device)
    inner = collectives.all_gather(send, bound, axes, out=received, ledger=ledger, tag=tag)
    rows = out.view(size, n)

    def finish() -> None:
        for j in range(size):
            dequantize_into(received[j * nbytes : (j + 1) * nbytes], n, block, rows[j])

    return Dequantized(rows, inner.work, inner.what, inner.then, inner.holds_copy, finish)


def reduce_scatter(
    rows: torch.Tensor,
    bound: BoundMesh,
    axes: tuple[str, ...],
    /,
    *,
    block: int,
    out: torch.Tensor | None = None,
    ledger: Ledger | None = None,
    tag: str = "",
) -> Dequantized:
    """Sums ``rows`` ``(group_size, numel)`` over the group through an int8 all-to-all: rank ``i`` gets row ``i``'s sum.

    Each rank quantizes its rows, sends row ``j`` to group rank ``j`` and sums the
    rows it receives, dequantized, in fp32 in group-rank order. The ledger counts
    the bytes sent, as a ``reduce_scatter`` over ``axes``.

    Raises:
        CollectiveError: the collective could not start.
    """
    size = collectives.group_size(bound, axes)
    group = bound.group(axes)
    assert group is not None, "a quantized reduce-scatter over one rank"
    n = rows.shape[1]
    nbytes = quantized_bytes(n, block)
    send = torch.empty(size * nbytes, dtype=torch.uint8, device=rows.device)
    for j in range(size):
        quantize_into(rows[j], send[j * nbytes : (j + 1) * nbytes], block)
    received = torch.empty_like(send)

    def call() -> Any:
        return dist.all_to_all_single(received, send, group=group, async_op=True)

    inner = issue("reduce_scatter", tag, axes, bound, group, send, call)
    if ledger is not None:
        ledger.record("reduce_scatter", axes, group_size=size, full_bytes=size * nbytes)
    result = out if out is not None else torch.empty(n, dtype=rows.dtype, device=rows.device)

    def finish() -> None:
        total = torch.zeros(n, dtype=torch.float32, device=rows.device)
        term = torch.empty(n, dtype=torch.float32, device=rows.device)
        for j in range(size):
            dequantize_into(received[j * nbytes : (j + 1) * nbytes], n, block, term)
            total.add_(term)
        result.copy_(total)

    return Dequantized(result, inner.work, inner.what, inner.then, inner.holds_copy, finish)
