"""The numbers a benchmark run yields, per size: step times, memory per allocator, ratios, per-unit cost."""

from __future__ import annotations

import statistics
from typing import Any

from bench.model import Config, param_count
from bench.modes import MODES

PAIRS = [  # (funcshard mode, the mode it is measured against: PyTorch's to match or beat, or the floor)
    ("funcshard/full_shard", "fsdp2"),
    ("funcshard/shard_grad_op", "fsdp2/no_reshard"),
    ("funcshard/no_shard", "ddp"),
    ("funcshard/full_shard", "floor"),
]
FLOOR = "floor"
PER_UNIT = ("funcshard/full_shard", "fsdp2")  # the modes whose per-unit overhead is reported
PLAIN = ("plain", "floor")  # their reference, in order of preference (the same computation)

# The convergence check of a mode that trains with inexact values: its loss at every step
# within this fraction of the loss of its reference mode (the same batches, exact). On the
# 34m GPT at W=2 over 20 steps, blocks of 256 (bench/results/quantized/formats-w2): int8
# gathers and reductions at most 0.050 %, fp8 gathers with int8 reductions 0.096 %, int8
# gathers with int4 reductions 1.97 % (its loss fell faster than the exact run's). Each
# margin is about twice what was measured.
CONVERGENCE_MARGINS = {
    "funcshard/quantized": 1e-3,
    "funcshard/quantized_fp8": 2e-3,
    "funcshard/quantized_int4": 4e-2,
}


def summarize(runs: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """Per size (in ``meta["sizes"]``): see :func:`summarize_size`.

    The top level also keeps the one-size layout of earlier results for the headline
    size (34m where it ran): ``meta["config"]`` and ``modes``, which
    ``tests/test_hardware.py`` reads from ``bench/results/results.json``.
    """
    sizes = {
        size: summarize_size([r for r in runs if r["size"] == size], meta, size)
        for size in meta["sizes"]
        if any(r["size"] == size for r in runs)
    }
    headline = "34m" if "34m" in sizes else next(iter(sizes), None)
    if headline is None:
        return {"meta": meta, "sizes": sizes}
    return {
        "meta": {**meta, "config": sizes[headline]["config"]},
        "headline_size": headline,
        "modes": sizes[headline]["modes"],
        "sizes": sizes,
    }


def summarize_size(runs: list[dict[str, Any]], meta: dict[str, Any], size: str) -> dict[str, Any]:
    """One size's runs: per mode its headline figures (from the default allocator's runs
    when there are any), its peak RSS under each allocator, its multiple of the floor; the
    ratios of :data:`PAIRS`; and each of :data:`PER_UNIT`'s overhead per unit over plain torch."""
    cfg = Config(**meta["sizes"][size])
    world = meta["world_size"]
    modes: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        allocators = list(dict.fromkeys(r["malloc"] for r in mine))
        headline = "default" if "default" in allocators else allocators[0]
        timed = [r for r in mine if r["malloc"] == headline]
        times = [t for r in timed for t in r["ranks"][0]["step_times_s"]]
        cpu = [c for r in timed for c in r["ranks"][0].get("step_cpu_s", [])]
        first = timed[0]["ranks"][0]
        median = statistics.median(times)
        cuda = [
            rank["peak_cuda_mib"]
            for r in mine
            for rank in r["ranks"]
            if rank["peak_cuda_mib"] is not None
        ]
        memory = {}
        for malloc in allocators:
            rss = [
                max(rank["peak_rss_mib"] for rank in r["ranks"])
                for r in mine
                if r["malloc"] == malloc
            ]
            memory[malloc] = {
                "runs": len(rss),
                "peak_rss_mib_per_rank": statistics.median(rss),
                "peak_rss_mib_min": min(rss),
            }
        modes[mode] = {
            "description": MODES[mode].description,
            "allocator": headline,
            "median_step_s": median,
            "min_step_s": min(times),
            # rank 0's CPU time per step, all its threads: system time is mostly the
            # kernel's copies of socket traffic and page faults
            "cpu_user_s": statistics.median(u for u, _ in cpu) if cpu else None,
            "cpu_system_s": statistics.median(k for _, k in cpu) if cpu else None,
            "tokens_per_s": MODES[mode].tokens_per_step(world, cfg) / median,
            "memory": memory,
            "peak_cuda_mib": max(cuda) if cuda else None,
            "state_bytes_per_rank": first["state_bytes"],
            "comm_bytes_per_step": first["comm_bytes_per_step"],
            "expected_comm_bytes_per_step": first["expected_comm_bytes_per_step"],
            "units": first.get("units"),
            "losses": first["losses"],
            "notes": first["notes"],
        }
    references = _loss_references(list(modes), world, cfg)
    for mode, summary in modes.items():
        ref_losses = modes[references[mode]]["losses"]
        summary["loss_reference"] = references[mode]
        summary["largest_loss_difference"] = max(
            abs(a - b) for a, b in zip(summary["losses"], ref_losses)
        )
        summary["largest_relative_loss_difference"] = max(
            abs(a - b) / abs(b) for a, b in zip(summary["losses"], ref_losses)
        )
        if mode in CONVERGENCE_MARGINS:  # a lever that changes the values: see the constant
            summary["converges"] = (
                summary["largest_relative_loss_difference"] <= CONVERGENCE_MARGINS[mode]
            )
        if FLOOR in modes:
            summary["floor_multiple"] = summary["median_step_s"] / modes[FLOOR]["median_step_s"]
    n_params = param_count(cfg)
    ideal = 16 * n_params / world  # fp32 params, grads and two AdamW moments, split W ways
    for mode, summary in modes.items():
        if mode.startswith("funcshard/") and mode != "funcshard/no_shard":
            held = sum(summary["state_bytes_per_rank"].values())
            summary["state_vs_ideal"] = held / ideal
    return {
        "config": cfg.to_json(),
        "parameters": n_params,
        "modes": modes,
        "ratios": _ratios(modes),
        "per_unit_us": _per_unit(modes),
    }


def memory_allocator(summary: dict[str, Any]) -> str:
    """The allocator a mode's peak RSS is compared under: ``mmap`` (reproducible) where it ran."""
    return "mmap" if "mmap" in summary["memory"] else summary["allocator"]


def _ratios(modes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    ratios = {}
    for ours, theirs in PAIRS:
        if ours in modes and theirs in modes:
            a, b = modes[ours], modes[theirs]
            malloc = memory_allocator(a)
            rss = (
                a["memory"][malloc]["peak_rss_mib_per_rank"]
                / b["memory"][malloc]["peak_rss_mib_per_rank"]
                if malloc in b["memory"]
                else None
            )
            ratios[f"{ours} / {theirs}"] = {
                "median_step": a["median_step_s"] / b["median_step_s"],
                "peak_rss": rss,
                "peak_rss_allocator": malloc,
            }
    return ratios


def _per_unit(modes: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """(median step - plain torch's median step) / units, in microseconds, per :data:`PER_UNIT` mode."""
    reference = next((m for m in PLAIN if m in modes), None)
    if reference is None:
        return None
    plain = modes[reference]["median_step_s"]
    overhead = {
        mode: 1e6 * (modes[mode]["median_step_s"] - plain) / modes[mode]["units"]
        for mode in PER_UNIT
        if mode in modes and modes[mode]["units"]
    }
    if not overhead:
        return None
    return {
        "reference": reference,
        "units": {m: modes[m]["units"] for m in overhead},
        "us": overhead,
    }


def _loss_references(modes: list[str], world: int, cfg: Config) -> dict[str, str]:
    """Per mode, the mode its losses are compared with: ``single`` among the modes that
    train every rank's batch, else the first mode that trains the same tokens (``floor``
    and ``plain`` train one rank's batch only)."""
    groups: dict[int, list[str]] = {}
    for mode in modes:
        groups.setdefault(MODES[mode].tokens_per_step(world, cfg), []).append(mode)
    references = {}
    for group in groups.values():
        reference = "single" if "single" in group else group[0]
        references.update(dict.fromkeys(group, reference))
    return references
