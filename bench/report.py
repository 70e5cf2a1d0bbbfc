"""A benchmark run's report: results.json, results.md (a section per size) and results.png.

The header of results.md states the command, the machine, the date and the
allocators; each size's section has the headline table (step time, tokens/s,
multiples of the floor: from glibc's default allocator when it ran), the
memory table (peak RSS under each allocator), the ratios to PyTorch and to
the floor, and where ``plain`` ran, the per-unit overhead over plain torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.summary import CONVERGENCE_MARGINS, memory_allocator, summarize

MIB = 2**20
FLOOR_MEANS = (
    "`floor` is one rank's work alone: its batch (the global batch / W), one process with "
    "the per-rank thread count, no process group and no communication, the plain "
    "`nn.Module` GPT and `torch.optim.AdamW(fused=True)`; `Nx floor` is a mode's median "
    "step over the floor's"
)


def provenance(prog: str, argv: list[str] | None, started: float) -> dict[str, Any]:
    """The command, date, duration and machine of a run that started at ``started`` (``time.time()``)."""
    import os
    import platform
    import sys
    import time

    import torch

    return {
        "command": f"{prog} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "duration_s": round(time.time() - started),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }


def write_report(runs: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> dict[str, Any]:
    """Writes results.json, results.md and (with matplotlib) results.png under ``out``; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(runs, meta)
    (out / "results.json").write_text(json.dumps({**summary, "runs": runs}, indent=1) + "\n")
    text = markdown(summary)
    (out / "results.md").write_text(text)
    chart = _chart(summary, out / "results.png")
    print(text)
    if chart is not None:
        print(chart)
    return summary


def markdown(summary: dict[str, Any]) -> str:
    """The summary as a Markdown report."""
    meta = summary["meta"]
    preload = meta["spec"].get("preload")  # None or absent: spawned
    spec = meta["spec"]
    lines = [
        "# Benchmark: funcshard against PyTorch FSDP2, FSDP1 and DDP",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']} ({meta['duration_s']} s)",
        f"- machine: {meta['machine']['cpus']} CPUs, {meta['machine']['platform']}, Python {meta['machine']['python']}, torch {meta['machine']['torch']}",
        f"- world size {meta['world_size']}, backend {spec['backend']}, {spec['threads']} thread(s) per rank, "
        f"{spec['warmup']} warm-up + {spec['steps']} timed steps per run, interleaved rounds; "
        f"env {', '.join(f'{k}={v}' for k, v in meta['env'].items())}",
        f"- allocator: {' and '.join(_allocator_words(m) for m in meta['malloc'])}; "
        "step times and tokens/s are from the default allocator's runs where they ran, "
        "peak RSS is shown for each",
        "- each run spawns fresh processes"
        if not preload
        else f"- each run forks its ranks from a server that imported {', '.join(f'`{m}`' for m in preload)} "
        "(--tiny): peak RSS counts them in every mode and is not comparable with a full run's",
        f"- {FLOOR_MEANS}",
        "- AdamW, its fused kernel in every mode",
    ]
    for size, s in summary["sizes"].items():
        lines += ["", *_section(size, s, meta)]
    return "\n".join(lines) + "\n"


def _allocator_words(malloc: str) -> str:
    if malloc == "default":
        return "glibc's default (`MALLOC_MMAP_THRESHOLD_` unset)"
    return "`MALLOC_MMAP_THRESHOLD_=65536` (mmap: reproducible peak RSS)"


def _section(size: str, s: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    cfg = s["config"]
    modes = s["modes"]
    headline = sorted({m["allocator"] for m in modes.values()})
    lines = [
        f"## {size}: GPT, {s['parameters']:,} parameters ({s['parameters'] / 1e6:.1f}M)",
        "",
        f"- {', '.join(f'{k} {v}' for k, v in cfg.items())} (batch per rank)",
        "",
        f"Step time and throughput (allocator: {', '.join(headline)}):",
        "",
        "| mode | median step (s) | x floor | min step (s) | CPU user / system per step (s) | tokens/s | params / grads / AdamW per rank (MiB) | sent / step / rank (MiB) | cost model (MiB) | largest loss diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, m in modes.items():
        state = m["state_bytes_per_rank"]
        expected = m["expected_comm_bytes_per_step"]
        floor = f"{m['floor_multiple']:.2f}x floor" if "floor_multiple" in m else ""
        user, system = m.get("cpu_user_s"), m.get("cpu_system_s")
        cpu = "" if user is None or system is None else f"{user:.3f} / {system:.3f}"
        lines.append(
            f"| {mode} | {m['median_step_s']:.3f} | {floor} | {m['min_step_s']:.3f} | {cpu} | {m['tokens_per_s']:,.0f} | "
            f"{state['params'] / MIB:.1f} / {state['grads'] / MIB:.1f} / {state['optimizer'] / MIB:.1f} | "
            f"{m['comm_bytes_per_step'] / MIB:.2f} | {'' if expected is None else f'{expected / MIB:.2f}'} | {m['largest_loss_difference']:.2e} |"
        )
    lines += [
        "",
        "Peak memory:",
        "",
        "| mode | allocator | runs | peak RSS / rank, median (MiB) | min (MiB) |",
        "|---|---|---|---|---|",
    ]
    for mode, m in modes.items():
        for malloc, mem in m["memory"].items():
            lines.append(
                f"| {mode} | {malloc} | {mem['runs']} | {mem['peak_rss_mib_per_rank']:.0f} | {mem['peak_rss_mib_min']:.0f} |"
            )
    lines += ["", "Ratios (below 1: funcshard is faster or leaner):", ""]
    for pair, r in s["ratios"].items():
        rss = (
            ""
            if r["peak_rss"] is None
            else f", peak RSS {r['peak_rss']:.3f} ({r['peak_rss_allocator']})"
        )
        lines.append(f"- {pair}: step time {r['median_step']:.3f}{rss}")
    per_unit = s["per_unit_us"]
    if per_unit is not None:
        world = meta["world_size"]
        lines.append(
            f"- per-unit overhead over plain torch at W={world}, (median step - `{per_unit['reference']}` median step) / units: "
            + "; ".join(
                f"{mode} {us:,.0f} µs/unit ({per_unit['units'][mode]} units)"
                for mode, us in per_unit["us"].items()
            )
            + (
                ""
                if world == 1
                else " (includes the communication not hidden; --world-size 1 for the overhead alone)"
            )
        )
    lines += [""]
    for mode, m in modes.items():
        if "state_vs_ideal" in m:
            lines.append(
                f"- {mode}: model state per rank = {m['state_vs_ideal']:.4f} x (params + grads + AdamW) / W"
            )
        if m["expected_comm_bytes_per_step"] is not None:
            same = m["comm_bytes_per_step"] == m["expected_comm_bytes_per_step"]
            lines.append(
                f"- {mode}: bytes sent per step {'equal' if same else 'DIFFER from'} the cost model"
            )
        lines += [f"- {mode}: {note}" for note in m["notes"]]
        if "converges" in m:
            lines.append(
                f"- {mode}: convergence check: loss within "
                f"{m['largest_relative_loss_difference'] * 100:.3f} % of `{m['loss_reference']}`'s "
                f"at every step, {'within' if m['converges'] else 'OUTSIDE'} the margin of "
                f"{CONVERGENCE_MARGINS[mode] * 100:g} %"
            )
    references = sorted({m["loss_reference"] for m in modes.values()})
    steps = len(next(iter(modes.values()))["losses"])
    lines.append(
        f"- losses compared with {' and '.join(f'`{r}`' for r in references)} (the mode that trains the same batches) over {steps} steps"
    )
    return lines


def _chart(summary: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib  # pyright: ignore[reportMissingImports]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports]
    except ImportError:
        return "matplotlib is not installed: no chart (pip install matplotlib)"
    sizes = summary["sizes"]
    fig, axes = plt.subplots(len(sizes), 2, figsize=(12, 1.2 + 3.3 * len(sizes)), squeeze=False)
    for (left, right), (size, s) in zip(axes, sizes.items()):
        modes = list(s["modes"])
        colors = ["tab:blue" if m.startswith("funcshard/") else "tab:gray" for m in modes]
        left.barh(modes, [s["modes"][m]["median_step_s"] for m in modes], color=colors)
        left.set_xlabel(
            f"{size}: median step time (s), {s['modes'][modes[0]]['allocator']} allocator"
        )
        left.invert_yaxis()
        rss = []
        for m in modes:
            mem = s["modes"][m]["memory"]
            rss.append(mem[memory_allocator(s["modes"][m])]["peak_rss_mib_per_rank"])
        right.barh(modes, rss, color=colors)
        right.set_xlabel(f"{size}: peak RSS per rank (MiB), mmap allocator where it ran")
        right.invert_yaxis()
        right.set_yticklabels([])
    meta = summary["meta"]
    fig.suptitle(
        f"funcshard bench, W={meta['world_size']}, {meta['spec']['backend']}, {meta['date']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
