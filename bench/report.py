"""Summaries of a benchmark run: JSON, a Markdown table, a PNG chart, and the ratios to PyTorch."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from bench.modes import MODES

PAIRS = [  # (funcshard mode, the PyTorch mode it must match or beat)
    ("funcshard/full_shard", "fsdp2"),
    ("funcshard/shard_grad_op", "fsdp2/no_reshard"),
    ("funcshard/no_shard", "ddp"),
]
MIB = 2**20


def summarize(runs: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """Per mode: step times, tokens/s, peak memory, state and communicated bytes, losses; and ratios."""
    cfg = meta["config"]
    modes: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        times = [t for r in mine for t in r["ranks"][0]["step_times_s"]]
        rss = [max(rank["peak_rss_mib"] for rank in r["ranks"]) for r in mine]
        first = mine[0]["ranks"][0]
        median = statistics.median(times)
        cuda = [
            rank["peak_cuda_mib"]
            for r in mine
            for rank in r["ranks"]
            if rank["peak_cuda_mib"] is not None
        ]
        modes[mode] = {
            "description": MODES[mode],
            "median_step_s": median,
            "min_step_s": min(times),
            "tokens_per_s": meta["world_size"] * cfg["batch"] * cfg["seq"] / median,
            "peak_rss_mib_per_rank": statistics.median(rss),
            "peak_rss_mib_min": min(rss),
            "peak_cuda_mib": max(cuda) if cuda else None,
            "state_bytes_per_rank": first["state_bytes"],
            "comm_bytes_per_step": first["comm_bytes_per_step"],
            "expected_comm_bytes_per_step": first["expected_comm_bytes_per_step"],
            "losses": first["losses"],
            "notes": first["notes"],
        }
    reference = "single" if "single" in modes else next(iter(modes))
    ref_losses = modes[reference]["losses"]
    for summary in modes.values():
        summary["largest_loss_difference"] = max(
            abs(a - b) for a, b in zip(summary["losses"], ref_losses)
        )
    n_params = _param_count(cfg)
    ideal = (
        16 * n_params / meta["world_size"]
    )  # fp32 params, grads and two AdamW moments, split W ways
    for mode, summary in modes.items():
        if mode.startswith("funcshard/") and mode != "funcshard/no_shard":
            held = sum(summary["state_bytes_per_rank"].values())
            summary["state_vs_ideal"] = held / ideal
    ratios = {}
    for ours, theirs in PAIRS:
        if ours in modes and theirs in modes:
            ratios[f"{ours} / {theirs}"] = {
                "median_step": modes[ours]["median_step_s"] / modes[theirs]["median_step_s"],
                "peak_rss": modes[ours]["peak_rss_mib_per_rank"]
                / modes[theirs]["peak_rss_mib_per_rank"],
            }
    return {
        "meta": meta,
        "parameters": n_params,
        "reference_for_losses": reference,
        "modes": modes,
        "ratios": ratios,
    }


def write_report(runs: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> dict[str, Any]:
    """Writes results.json, results.md and (with matplotlib) results.png under ``out``; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(runs, meta)
    (out / "results.json").write_text(json.dumps({**summary, "runs": runs}, indent=1) + "\n")
    (out / "results.md").write_text(markdown(summary))
    chart = _chart(summary, out / "results.png")
    print(markdown(summary))
    if chart is not None:
        print(chart)
    return summary


def markdown(summary: dict[str, Any]) -> str:
    """The summary as a Markdown report."""
    meta = summary["meta"]
    preload = meta["spec"].get("preload")  # None or absent: spawned
    lines = [
        "# Benchmark: funcshard against PyTorch FSDP2, FSDP1 and DDP",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']} ({meta['duration_s']} s)",
        f"- machine: {meta['machine']['cpus']} CPUs, {meta['machine']['platform']}, Python {meta['machine']['python']}, torch {meta['machine']['torch']}",
        f"- world size {meta['world_size']}, backend {meta['spec']['backend']}, {meta['spec']['threads']} thread(s) per rank, "
        f"{meta['spec']['warmup']} warm-up + {meta['spec']['steps']} timed steps per run, interleaved rounds; "
        f"env {', '.join(f'{k}={v}' for k, v in meta['env'].items())}",
        "- each run spawns fresh processes"
        if not preload
        else f"- each run forks its ranks from a server that imported {', '.join(f'`{m}`' for m in preload)} "
        "(--tiny): peak RSS counts them in every mode and is not comparable with a full run's",
        f"- model: GPT, {summary['parameters'] / 1e6:.1f}M parameters ({', '.join(f'{k} {v}' for k, v in meta['config'].items())}); AdamW, its fused kernel in every mode",
        "",
        "| mode | median step (s) | min step (s) | tokens/s | peak RSS / rank (MiB) | params / grads / AdamW per rank (MiB) | sent / step / rank (MiB) | cost model (MiB) | largest loss diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, s in summary["modes"].items():
        state = s["state_bytes_per_rank"]
        expected = s["expected_comm_bytes_per_step"]
        lines.append(
            f"| {mode} | {s['median_step_s']:.3f} | {s['min_step_s']:.3f} | {s['tokens_per_s']:,.0f} | "
            f"{s['peak_rss_mib_per_rank']:.0f} | {state['params'] / MIB:.1f} / {state['grads'] / MIB:.1f} / {state['optimizer'] / MIB:.1f} | "
            f"{s['comm_bytes_per_step'] / MIB:.2f} | {'' if expected is None else f'{expected / MIB:.2f}'} | {s['largest_loss_difference']:.2e} |"
        )
    lines += ["", "Ratios (below 1: funcshard is faster or leaner):", ""]
    for pair, r in summary["ratios"].items():
        lines.append(f"- {pair}: step time {r['median_step']:.3f}, peak RSS {r['peak_rss']:.3f}")
    lines += [""]
    for mode, s in summary["modes"].items():
        if "state_vs_ideal" in s:
            lines.append(
                f"- {mode}: model state per rank = {s['state_vs_ideal']:.4f} x (params + grads + AdamW) / W"
            )
        if s["expected_comm_bytes_per_step"] is not None:
            same = s["comm_bytes_per_step"] == s["expected_comm_bytes_per_step"]
            lines.append(
                f"- {mode}: bytes sent per step {'equal' if same else 'DIFFER from'} the cost model"
            )
        lines += [f"- {mode}: {note}" for note in s["notes"]]
    lines.append(
        f"- losses compared with `{summary['reference_for_losses']}` over {len(next(iter(summary['modes'].values()))['losses'])} steps"
    )
    return "\n".join(lines) + "\n"


def _chart(summary: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib  # pyright: ignore[reportMissingImports]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports]
    except ImportError:
        return "matplotlib is not installed: no chart (pip install matplotlib)"
    modes = list(summary["modes"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = ["tab:blue" if m.startswith("funcshard/") else "tab:gray" for m in modes]
    left.barh(modes, [summary["modes"][m]["median_step_s"] for m in modes], color=colors)
    left.set_xlabel("median step time (s)")
    left.invert_yaxis()
    right.barh(modes, [summary["modes"][m]["peak_rss_mib_per_rank"] for m in modes], color=colors)
    right.set_xlabel("peak RSS per rank (MiB)")
    right.invert_yaxis()
    right.set_yticklabels([])
    meta = summary["meta"]
    fig.suptitle(
        f"GPT {summary['parameters'] / 1e6:.1f}M, W={meta['world_size']}, {meta['spec']['backend']}, {meta['date']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _param_count(cfg: dict[str, int]) -> int:
    w, v, s, layers = cfg["width"], cfg["vocab"], cfg["seq"], cfg["layers"]
    block = 2 * w + 3 * w * w + w * w + 2 * w + 4 * w * w + 4 * w + 4 * w * w
    return v * w + s * w + layers * block + 2 * w + w * v
