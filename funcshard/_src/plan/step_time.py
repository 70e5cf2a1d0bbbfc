"""The step-time estimate: compute, communication not hidden under it, and the optimizer update."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from funcshard._src.plan.activations import Workload
from funcshard._src.plan.hardware import Hardware, axes_bandwidth
from funcshard._src.spec.mesh import Mesh


@dataclass(frozen=True)
class StepTime:
    """Estimated seconds per step on one rank (all ranks step together)."""

    compute_s: float
    comm_s: float
    exposed_comm_s: float
    optimizer_s: float
    tokens_per_s: float

    @property
    def step_s(self) -> float:
        """Compute, the communication not hidden under it, and the optimizer update."""
        return self.compute_s + self.exposed_comm_s + self.optimizer_s


def step_time(
    *,
    n_params: int,
    comm: Mapping[tuple[str, tuple[str, ...]], int],
    mesh: Mesh,
    workload: Workload,
    hardware: Hardware,
    prefetch: int,
    sharded_units: int,
    state_bytes: int,
    optimizer_passes: float,
) -> StepTime:
    """Seconds per step of one rank, and tokens/s over all ranks.

    Compute: 6 FLOPs per parameter and token (8 with remat) plus ``12 * L * h * s``
    per token for attention scores, at ``hardware.efficiency`` of peak. Each
    collective runs at the bandwidth of the links its group spans
    (:func:`axes_bandwidth`). With prefetch, communication hides under compute
    except one unit's worth (the first gather, the last reduction); without,
    none of it does. The optimizer streams its state ``optimizer_passes`` times
    through memory.

    Example:
        >>> from funcshard._src.plan.hardware import get_hardware
        >>> from funcshard._src.plan.presets import get_preset
        >>> t = step_time(n_params=10**9, comm={}, mesh=Mesh({"fsdp": 8}),
        ...     workload=Workload(get_preset("llama-7b").config, 1, 1024),
        ...     hardware=get_hardware("a100-80gb"), prefetch=1, sharded_units=0,
        ...     state_bytes=0, optimizer_passes=1.75)
        >>> round(t.compute_s * 1e3, 1)  # (6e9 + 12 * 32 * 4096 * 1024) * 1024 / 156e12
        50.0
    """
    cfg = workload.model
    seq = workload.seq_len or cfg.seq_len
    per_token = (8 if workload.remat else 6) * n_params + 12 * cfg.n_layers * cfg.hidden * seq
    compute_s = per_token * workload.tokens / (hardware.peak_flops * hardware.efficiency)
    comm_s = sum(n / axes_bandwidth(mesh.axes, axes, hardware) for (_, axes), n in comm.items())
    if prefetch == 0:
        exposed = comm_s
    else:  # the first gather and the last reduction have nothing to hide under
        one_unit = comm_s / sharded_units if sharded_units else 0.0
        exposed = max(comm_s - compute_s, 0.0) + min(one_unit, comm_s)
    optimizer_s = state_bytes * optimizer_passes / hardware.memory_bandwidth
    step_s = compute_s + exposed + optimizer_s
    return StepTime(compute_s, comm_s, exposed, optimizer_s, mesh.size * workload.tokens / step_s)
