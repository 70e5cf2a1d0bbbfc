"""Timings of one process: matmul rate, a transformer block's rate, and memory and copy bandwidth."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def timed(fn: Callable[[], object], /, *, seconds: float, sync: Callable[[], None]) -> float:
    """The median seconds of one call of ``fn``, over calls for about ``seconds`` (one warm-up)."""
    fn()
    sync()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def matmul_rate(
    dtype: torch.dtype, /, *, device: torch.device, n: int, seconds: float = 0.5
) -> float:
    """FLOP/s of an ``(n, n) @ (n, n)`` matmul in ``dtype``: ``2 n^3`` per call, the median call.

    Example:
        >>> matmul_rate(torch.float32, device=torch.device("cpu"), n=64, seconds=0.01) > 0
        True
    """
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device).to(dtype)
    b = torch.randn(n, n, generator=gen, device=device).to(dtype)
    return 2 * n**3 / timed(lambda: a @ b, seconds=seconds, sync=_sync(device))


def block_rate(
    *, device: torch.device, dtype: torch.dtype, width: int, seq: int, batch: int, seconds: float
) -> float:
    """FLOP/s of forward and backward of one pre-norm transformer block (GELU MLP, causal SDPA).

    FLOPs counted as the planner counts them (``funcshard._src.plan.step_time``):
    ``6 * params + 12 * width * seq`` per token. The ratio to :func:`matmul_rate` is
    what a model achieves of the matmul rate: a hardware description's ``efficiency``.

    Example:
        >>> block_rate(device=torch.device("cpu"), dtype=torch.float32, width=32, seq=8,
        ...            batch=1, seconds=0.01) > 0
        True
    """
    gen = torch.Generator(device=device).manual_seed(0)
    heads = max(1, width // 64)

    def param(*shape: int) -> torch.Tensor:
        scale = shape[0] ** -0.5 if len(shape) > 1 else 1.0
        t = torch.randn(*shape, generator=gen, device=device) * scale
        return t.to(dtype).requires_grad_(True)

    p = {
        "ln1": param(width),
        "wqkv": param(width, 3 * width),
        "wo": param(width, width),
        "ln2": param(width),
        "w1": param(width, 4 * width),
        "w2": param(4 * width, width),
    }
    h0 = torch.randn(batch, seq, width, generator=gen, device=device).to(dtype)

    def step() -> None:
        h = h0
        x = F.layer_norm(h, (width,), p["ln1"])
        q, k, v = (x @ p["wqkv"]).split(width, dim=-1)
        q, k, v = (t.reshape(batch, seq, heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + a.transpose(1, 2).reshape(batch, seq, width) @ p["wo"]
        x = F.layer_norm(h, (width,), p["ln2"])
        h = h + F.gelu(x @ p["w1"]) @ p["w2"]
        h.float().square().mean().backward()

    n_params = sum(t.numel() for t in p.values())
    flops = (6 * n_params + 12 * width * seq) * batch * seq
    return flops / timed(step, seconds=seconds, sync=_sync(device))


def copy_bandwidth(*, device: torch.device, nbytes: int, seconds: float = 0.3) -> float:
    """Bytes/s read and written by copying into a new buffer, as collectives' unpacking does.

    A fresh allocation each time, as the executor's: where the allocator returns new
    pages (``MALLOC_MMAP_THRESHOLD_``), the kernel's page faults are part of the cost.

    Example:
        >>> copy_bandwidth(device=torch.device("cpu"), nbytes=2**20, seconds=0.01) > 0
        True
    """
    src = torch.ones(nbytes // 4, device=device)
    return (
        2
        * nbytes
        / timed(lambda: torch.empty_like(src).copy_(src), seconds=seconds, sync=_sync(device))
    )


def memory_bandwidth(*, device: torch.device, nbytes: int, seconds: float = 0.3) -> float:
    """Bytes/s of an in-place ``a += b`` over existing buffers (read two, write one), as an optimizer.

    Example:
        >>> memory_bandwidth(device=torch.device("cpu"), nbytes=2**20, seconds=0.01) > 0
        True
    """
    a = torch.ones(nbytes // 4, device=device)
    b = torch.ones(nbytes // 4, device=device)
    return 3 * nbytes / timed(lambda: a.add_(b), seconds=seconds, sync=_sync(device))
