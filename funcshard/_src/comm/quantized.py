"""Block-quantized collectives: an all-gather of parameters and an all-to-all reduction of gradients.

The format and its error bound are [Note: quantized collectives] in
``plan/quantize.py``. A buffer of ``n`` elements travels as
``quantized_bytes(n, block, format)`` bytes: the blocks' fp32 scales, then their
values (int8, two int4 a byte, or float8 e4m3). Both collectives go through
:func:`~funcshard._src.comm.collectives.issue` like every other (errors, agreements,
the trace), and return a :class:`Dequantized` whose ``wait()`` turns the bytes
received into values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from funcshard._src.comm import collectives
from funcshard._src.comm.collectives import Ledger, Pending, issue
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.plan.quantize import Format, quantized_bytes, value_bytes

FP8 = torch.float8_e4m3fn
# the largest magnitude of each format's values: a block's scale maps max|x| onto it
LARGEST: dict[Format, float] = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}


def check_format(format: Format, device: torch.device, /) -> None:
    """Raises where ``device`` cannot run ``format``'s casts (fp8 needs torch's float8 on it).

    Example:
        >>> check_format("fp8", torch.device("cpu"))

    Raises:
        ValueError: torch cannot cast to and from float8 e4m3 on ``device``.
    """
    if format != "fp8":
        return
    failure = _fp8_failure(device.type)
    if failure:
        raise ValueError(
            f"Quantized(..., 'fp8'): torch {torch.__version__} cannot cast to float8 e4m3 on "
            f"{device.type} ({failure}); use 'int8', which sends the same bytes"
        )


@functools.cache
def _fp8_failure(device_type: str, /) -> str:
    """Why float8 e4m3 casts fail on devices of ``device_type``, or ``""`` where they work."""
    try:
        torch.ones(4, device=device_type).to(FP8).to(torch.float32)
    except (RuntimeError, TypeError) as e:
        return str(e).splitlines()[0]
    return ""


def error_bound(x: torch.Tensor, block: int, format: Format = "int8", /) -> torch.Tensor:
    """Per element of ``x`` ``(n,)``: how far its quantized value may be from it ([Note: quantized collectives] in ``plan/quantize.py``).

    Example:
        >>> error_bound(torch.tensor([1.0, -0.5, 0.25, 0.0]), 4, "int4")
        tensor([0.0714, 0.0714, 0.0714, 0.0714])
    """
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n].copy_(x.reshape(-1))
    amax = padded.view(blocks, block).abs().amax(dim=1).repeat_interleave(block)[:n]
    if format == "fp8":
        return x.reshape(-1).abs().float() / 16 + amax / LARGEST["fp8"] / 512
    return amax / (2 * LARGEST[format])


def quantize_into(
    x: torch.Tensor, out: torch.Tensor, block: int, format: Format = "int8", /
) -> None:
    """Writes ``x`` ``(n,)`` into ``out``, ``quantized_bytes(n, block, format)`` uint8: scales, then values; mutates ``out``.

    Example:
        >>> x = torch.tensor([0.5, -1.0, 0.25, 0.0, 2.0, 0.0, 0.0, 0.0])
        >>> out = torch.empty(quantized_bytes(8, 4), dtype=torch.uint8)
        >>> quantize_into(x, out, 4)
        >>> y = torch.empty(8)
        >>> dequantize_into(out, 8, 4, y)
        >>> bool(((x - y).abs() <= error_bound(x, 4)).all())
        True
    """
    n = x.numel()
    blocks = -(-n // block)
    scales = out[: 4 * blocks].view(torch.float32)
    values = out[4 * blocks : 4 * blocks + blocks * value_bytes(block, format)]
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n].copy_(x.reshape(-1))
    grid = padded.view(blocks, block)
    amax = grid.abs().amax(dim=1)
    finite = torch.isfinite(amax)
    largest = LARGEST[format]
    scale = amax / largest
    # a block with a NaN or an infinity arrives as NaN: its scale carries it
    scales.copy_(torch.where(finite, scale, torch.full_like(scale, float("nan"))))
    divisor = torch.where(finite & (scale > 0), scale, torch.ones_like(scale))
    y = grid.div_(divisor[:, None]).clamp_(-largest, largest).nan_to_num_(0.0)
    if format == "fp8":
        values.view(FP8).view(blocks, block).copy_(y)
        return
    q = y.round_().to(torch.int8)
    if format == "int8":
        values.view(torch.int8).view(blocks, block).copy_(q)
        return
    nibbles = q.add_(8).to(torch.uint8).view(-1, 2)  # two values a byte, the first low
    torch.bitwise_or(nibbles[:, 0], nibbles[:, 1] << 4, out=values)


def dequantize_into(
    data: torch.Tensor, n: int, block: int, out: torch.Tensor, format: Format = "int8", /
) -> None:
    """Writes the ``n`` values that ``data`` (from :func:`quantize_into`) carries into ``out``; mutates ``out``."""
    blocks = -(-n // block)
    scales = data[: 4 * blocks].view(torch.float32)
    values = data[4 * blocks : 4 * blocks + blocks * value_bytes(block, format)]
    if format == "fp8":
        q = values.view(FP8).to(torch.float32)
    elif format == "int8":
        q = values.view(torch.int8).to(torch.float32)
    else:
        q = torch.stack((values & 15, values >> 4), dim=1).to(torch.float32).sub_(8)
    out.copy_(q.view(blocks, block).mul_(scales[:, None]).view(-1)[:n])


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
    format: Format = "int8",
    out: torch.Tensor,
    ledger: Ledger | None = None,
    tag: str = "",
) -> Dequantized:
    """Gathers every group member's ``flat`` quantized into ``out`` viewed ``(group_size, numel)``.

    Every rank gets the same dequantized rows, its own included (within the
    per-block bound of its shard). The ledger counts the bytes sent.

    Raises:
        ValueError: ``format`` cannot run on the device (:func:`check_format`), on
            every rank alike, before anything is sent.
        CollectiveError: the collective could not start.
    """
    check_format(format, flat.device)
    size = collectives.group_size(bound, axes)
    n = flat.numel()
    nbytes = quantized_bytes(n, block, format)
    send = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    quantize_into(flat, send, block, format)
    received = torch.empty(size * nbytes, dtype=torch.uint8, device=flat.device)
    inner = collectives.all_gather(send, bound, axes, out=received, ledger=ledger, tag=tag)
    rows = out.view(size, n)

    def finish() -> None:
        for j in range(size):
            dequantize_into(received[j * nbytes : (j + 1) * nbytes], n, block, rows[j], format)

    return Dequantized(
        rows, inner.work, inner.what, inner.then, inner.holds_copy, inner.backend, finish=finish
    )


def reduce_scatter(
    rows: torch.Tensor,
    bound: BoundMesh,
    axes: tuple[str, ...],
    /,
    *,
    block: int,
    format: Format = "int8",
    out: torch.Tensor | None = None,
    ledger: Ledger | None = None,
    tag: str = "",
) -> Dequantized:
    """Sums ``rows`` ``(group_size, numel)`` over the group through a quantized all-to-all: rank ``i`` gets row ``i``'s sum.

    Each rank quantizes its rows, sends row ``j`` to group rank ``j`` and sums the
    rows it receives, dequantized, in fp32 in group-rank order. The ledger counts
    the bytes sent, as a ``reduce_scatter`` over ``axes``.

    Raises:
        ValueError: ``format`` cannot run on the device (:func:`check_format`), on
            every rank alike, before anything is sent.
        CollectiveError: the collective could not start.
    """
    check_format(format, rows.device)
    group, size, _ = collectives.resolve(bound, axes)
    assert group is not None, "a quantized reduce-scatter over one rank"
    n = rows.shape[1]
    nbytes = quantized_bytes(n, block, format)
    send = torch.empty(size * nbytes, dtype=torch.uint8, device=rows.device)
    for j in range(size):
        quantize_into(rows[j], send[j * nbytes : (j + 1) * nbytes], block, format)
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
            dequantize_into(received[j * nbytes : (j + 1) * nbytes], n, block, term, format)
            total.add_(term)
        result.copy_(total)

    return Dequantized(
        result, inner.work, inner.what, inner.then, inner.holds_copy, inner.backend, finish=finish
    )
