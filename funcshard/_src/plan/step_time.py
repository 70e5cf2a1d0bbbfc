"""The step-time estimate: compute, communication not hidden under it, copies, the optimizer update, and MFU."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from funcshard._src.plan.activations import Workload
from funcshard._src.plan.hardware import Hardware, link_bandwidth
from funcshard._src.plan.model_config import ModelConfig
from funcshard._src.spec.mesh import Mesh


@dataclass(frozen=True)
class StepTime:
    """Estimated seconds per step on one rank (all ranks step together), and what they achieve.

    Attributes:
        compute_s: forward and backward (and recomputation) at the hardware's achieved rate.
        comm_s: every collective of the step, one after another, at its links' bandwidth.
        exposed_comm_s: the part of ``comm_s`` not hidden under compute.
        optimizer_s: the update, streaming the optimizer state through memory.
        tokens_per_s: tokens per second over all ranks.
        copy_s: copies around collectives: gathered leaves out of flat buffers,
            gradients into them.
        flops: FLOPs one rank executes per step (recomputation included).
        model_flops: the model's FLOPs per rank per step (6 per parameter and token plus
            attention, no recomputation): the numerator of MFU.
        peak_flops: the device's peak FLOP/s, the denominator of MFU.
    """

    compute_s: float
    comm_s: float
    exposed_comm_s: float
    optimizer_s: float
    tokens_per_s: float
    copy_s: float = 0.0
    flops: float = 0.0
    model_flops: float = 0.0
    peak_flops: float = 0.0

    @property
    def step_s(self) -> float:
        """Compute, the communication not hidden under it, copies and the optimizer update."""
        return self.compute_s + self.exposed_comm_s + self.copy_s + self.optimizer_s

    @property
    def tflops_per_device(self) -> float:
        """Executed TFLOP/s per device (recomputation counted, as the FSDP paper reports)."""
        return self.flops / self.step_s / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: ``model_flops / (step_s * peak_flops)`` (PaLM's definition)."""
        return self.model_flops / (self.step_s * self.peak_flops) if self.peak_flops else 0.0

    def to_json(self) -> dict[str, float]:
        """Every field, the step, TFLOP/s per device and MFU, as JSON output shows them."""
        out = {f.name: float(getattr(self, f.name)) for f in fields(self)}
        return out | {
            "step_s": self.step_s,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
        }


def flops_per_token(n_params: int, workload: Workload, /, *, executed: bool = True) -> float:
    """FLOPs per token of forward and backward: ``6 * n_params + 12 * L * h * s``.

    For a MoE model ``n_params`` counts the experts a token runs (:func:`active_params`).

    Megatron-LM's count (Narayanan et al. 2021, Sec. 5.1): every weight does a
    multiply-add per token forward and two backward, attention scores ``4 * h * s``
    per layer and token forward. Executed FLOPs with remat add one more forward:
    ``8 * n_params + 16 * L * h * s``; model FLOPs (``executed=False``, for MFU) never do.

    Example:
        >>> from funcshard._src.plan.presets import get_preset
        >>> w = Workload(get_preset("gpt-175b").config, 1, remat=True)
        >>> n = get_preset("gpt-175b").n_params
        >>> flops_per_token(n, w) == 8 * n + 16 * 96 * 12288 * 2048
        True
    """
    cfg = workload.model
    seq = workload.seq_len or cfg.seq_len
    passes = 4 if executed and workload.remat else 3  # forward, backward (2), recompute
    return passes * (2 * active_params(n_params, cfg) + 4 * cfg.n_layers * cfg.hidden * seq)


def active_params(n_params: int, config: ModelConfig, /) -> int:
    """The parameters a token passes through: all of them, less a MoE layer's idle experts.

    Each of a MoE model's ``n_experts`` SwiGLU experts holds ``3 * hidden * ffn_hidden``
    weights per layer; a token runs ``experts_per_token`` of them.

    Example:
        >>> from funcshard._src.plan.presets import get_preset
        >>> mixtral = get_preset("mixtral-8x7b")
        >>> f"{active_params(mixtral.n_params, mixtral.config):,}"  # Mixtral: "12.9B active"
        '12,879,925,248'
    """
    idle = config.n_experts - config.experts_per_token
    return n_params - idle * 3 * config.hidden * config.ffn_hidden * config.n_layers


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
    micro_batches: int = 1,
) -> StepTime:
    """Seconds per step of one rank, tokens/s over all ranks, and MFU.

    - Compute: :func:`flops_per_token` times the tokens of ``micro_batches``
      micro-batches, at ``hardware.efficiency`` of ``hardware.peak_flops``; ``comm``
      is every collective of the optimizer step.
    - Communication: each collective over a group of ``g`` ranks takes its bytes
      over :func:`link_bandwidth` (the topology: NVLink in a node, every NIC of a
      node for a ring across nodes) plus ``g - 1`` ring steps of ``hardware.latency``
      per unit (``2 (g - 1)`` for an all-reduce).
    - Overlap: with prefetch, all but one unit's communication (the first gather, the
      last reduction) may run under compute, and ``hardware.overlap`` of it does; without
      prefetch none does.
    - Copies: gathered leaves out of the all-gather's output and gradients into the
      reduction's input, read and written at ``hardware.copy_rate``, not overlapped.
    - The optimizer streams its state ``optimizer_passes`` times through memory.

    Example:
        >>> from funcshard._src.plan.hardware import get_hardware
        >>> from funcshard._src.plan.presets import get_preset
        >>> t = step_time(n_params=10**9, comm={}, mesh=Mesh({"fsdp": 8}),
        ...     workload=Workload(get_preset("llama-7b").config, 1, 1024),
        ...     hardware=get_hardware("a100-80gb"), prefetch=1, sharded_units=0,
        ...     state_bytes=0, optimizer_passes=1.75)
        >>> round(t.compute_s * 1e3, 1)  # (6e9 + 12 * 32 * 4096 * 1024) * 1024 / 156e12
        50.0
        >>> round(t.mfu, 2)  # nothing but compute: the assumed efficiency
        0.5
    """
    hw = hardware
    tokens = workload.tokens * micro_batches
    flops = flops_per_token(n_params, workload) * tokens
    model_flops = flops_per_token(n_params, workload, executed=False) * tokens
    compute_s = flops / (hw.peak_flops * hw.efficiency)
    calls = max(sharded_units, 1)
    comm_s = copied = 0.0
    for (op, axes), n in comm.items():
        g = _group_size(mesh, axes)
        steps = 2 * (g - 1) if op == "all_reduce" else g - 1
        comm_s += n / link_bandwidth(mesh.axes, axes, hw) + calls * steps * hw.latency
        # the whole buffer: n is (g-1)/g of it for a gather or a reduce-scatter, 2(g-1)/g
        # for an all-reduce
        copied += n * g / (g - 1) / (2 if op == "all_reduce" else 1) if g > 1 else 0
    copy_s = 2 * copied / hw.copy_rate  # read and write
    one_unit = comm_s / sharded_units if sharded_units else 0.0
    # the first gather and the last reduction have nothing to hide under
    hidden = hw.overlap * min(comm_s - one_unit, compute_s) if prefetch else 0.0
    exposed = comm_s - hidden
    optimizer_s = state_bytes * optimizer_passes / hw.memory_bandwidth
    step_s = compute_s + exposed + copy_s + optimizer_s
    return StepTime(
        compute_s,
        comm_s,
        exposed,
        optimizer_s,
        mesh.size * tokens / step_s,
        copy_s,
        flops,
        model_flops,
        hw.peak_flops,
    )


def describe(hardware: Hardware, prefetch: int, /) -> str:
    """The assumptions behind :func:`step_time`, in words, for an estimate's list.

    Example:
        >>> from funcshard._src.plan.hardware import get_hardware
        >>> describe(get_hardware("a100-80gb"), 1)[:44]
        'time on a100-80gb: 50% of 312 TFLOP/s peak; '
    """
    hw = hardware
    hidden = (
        f"{hw.overlap:.0%} of it overlaps compute except one unit"
        if prefetch
        else "none of it overlaps compute (prefetch 0)"
    )
    return (
        f"time on {hw.name}: {hw.efficiency:.0%} of {hw.peak_flops / 1e12:.0f} TFLOP/s peak; "
        f"6 FLOPs per parameter and token (8 with remat) plus attention; links "
        f"{hw.intra_node_bandwidth / 1e9:.0f} GB/s in a node of {hw.devices_per_node}, across "
        f"nodes {hw.node_share / 1e9:.0f} GB/s per rank's NIC times the group's ranks in a node; "
        f"communication {hidden}; copies around collectives at {hw.copy_rate / 1e9:.1f} GB/s"
        + (f" ({hw.source})" if hw.source else "")
    )


def _group_size(mesh: Mesh, axes: tuple[str, ...], /) -> int:
    size = 1
    for a in axes:
        size *= mesh.axis_size(a)
    return size
