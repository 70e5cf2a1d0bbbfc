"""``funcshard plan --plot``: per-rank memory by category for each strategy, as a chart to read.

Horizontal stacked bars, one per strategy and one for the automatic plan (marked), on a
linear axis that is broken past 1.5 times the device memory: a bar that runs off it
(``no_shard`` of a 70B model: a TiB) ends in a break mark and is labelled with its
total, so it no longer flattens the bars that matter. The device memory and the usable
budget (the device memory less the runtime's reserve, ``usable_budget``) are vertical
lines; each bar is labelled with its total and whether it fits.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from funcshard._src.plan.sizes import GiB, format_bytes

_COLORS = {
    "params": "#4c72b0",
    "grads": "#dd8452",
    "optimizer": "#55a868",
    "mixed_precision": "#8172b3",
    "gathered": "#937860",
    "activations": "#da8bc3",
    "frozen": "#8c8c8c",
    "buffers": "#ccb974",
}


class MissingExtraError(RuntimeError):
    """matplotlib is not installed; the message names the extra to install."""


def require_matplotlib() -> None:
    """Raises :class:`MissingExtraError` when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401  # pyright: ignore[reportUnusedImport]
    except ImportError:
        raise MissingExtraError("--plot needs matplotlib: pip install 'funcshard[plot]'") from None


def plot(data: dict[str, Any], path: Path, /) -> None:
    """Draws the plan report ``data`` (``funcshard plan --json``'s object) to the image ``path``.

    Raises:
        MissingExtraError: matplotlib is not installed (``pip install 'funcshard[plot]'``).
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = dict(data["strategies"])
    if "memory" in data.get("auto", {}):
        entries["auto"] = data["auto"]
    names = list(entries)
    labels = [_label(n, entries[n]) for n in names]
    budget, usable = data.get("device_memory"), data.get("usable_memory")
    totals = [entries[n]["total"] for n in names]
    limit = 1.5 * budget if budget else min(max(totals), 4 * min(totals)) * 1.15
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.75 * len(names)))
    rows = list(range(len(names)))[::-1]  # the first strategy on top
    left = [0.0] * len(names)
    every = dict.fromkeys(c for n in names for c in entries[n]["memory"])  # in report order
    categories = [c for c in every if any(entries[n]["memory"][c] for n in names)]
    extra = iter(["#64b5cd", "#c44e52", "#8c613c", "#17becf"])
    colors = {c: _COLORS.get(c) or next(extra, "#999999") for c in categories}
    for cat in categories:
        widths = []
        for i, n in enumerate(names):
            value = float(entries[n]["memory"].get(cat, 0))
            widths.append(max(0.0, min(value, limit - left[i])))
        ax.barh(
            rows,
            [w / GiB for w in widths],
            left=[x / GiB for x in left],
            height=0.6,
            color=colors[cat],
            label=cat.replace("_", " "),
        )
        left = [x + w for x, w in zip(left, widths)]
    for row, n, total in zip(rows, names, totals):
        x = min(total, limit) / GiB
        if total > limit:  # the break: two slashes across the bar's end
            ax.text(
                x,
                row,
                "//",
                ha="center",
                va="center",
                fontsize=14,
                fontweight="bold",
                color="white",
                bbox={"boxstyle": "square,pad=0.05", "fc": "black", "ec": "none"},
            )
        fits = entries[n].get("fits")
        verdict = "" if fits is None else ("  fits" if fits else "  does not fit")
        ax.text(
            limit / GiB * 1.03,
            row,
            f"{format_bytes(total)}{verdict}",
            va="center",
            fontsize=9,
            fontweight="bold" if n == "auto" else "normal",
            color="black" if fits is not False else "#b00000",
        )

    def line(at: int, label: str, /, **style: Any) -> None:
        """A labelled vertical line at ``at`` bytes, above the top bar."""
        ha = style.pop("ha", "left")
        ax.axvline(at / GiB, color="#b00000", **style)
        ax.text(at / GiB, len(names) - 0.45, label, color="#b00000", fontsize=8, va="bottom", ha=ha)

    if budget:
        line(budget, f" device {format_bytes(budget)}", linewidth=1.5)
    if budget and usable is not None and usable < budget:
        line(usable, f"usable {format_bytes(usable)} ", linewidth=1, linestyle="--", ha="right")
    ax.set_yticks(rows, labels)
    for tick, n in zip(ax.get_yticklabels(), names):
        if n == "auto":
            tick.set_fontweight("bold")
    if "auto" in names:
        auto_row = rows[names.index("auto")]
        ax.axhspan(auto_row - 0.42, auto_row + 0.42, color="#fff3b0", zorder=0)
    ax.set_xlim(0, limit / GiB * 1.3)
    ax.set_xticks([t for t in ax.get_xticks() if 0 <= t <= limit / GiB])  # none past the break
    ax.set_ylim(-0.6, len(names) - 0.1)
    ax.set_xlabel(
        "GiB per rank (axis broken at 1.5 x device memory: // marks a longer bar)"
        if budget
        else "GiB per rank (// marks a longer bar)"
    )
    ax.set_title(_title(data), fontsize=11, loc="left")
    ax.legend(
        fontsize=8,
        ncol=len(categories),
        loc="upper center",
        bbox_to_anchor=(0.45, -0.1 - 0.25 / len(names)),
        frameon=False,
    )
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _label(name: str, entry: dict[str, Any]) -> str:
    if name != "auto":
        return name
    counts = Counter(entry.get("units", {}).values())
    return "auto plan\n" + ", ".join(f"{k} {s}" for s, k in counts.most_common())


def _title(data: dict[str, Any]) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in data["mesh"].items())
    ranks = 1
    for v in data["mesh"].values():
        ranks *= v
    cm = data["cost_model"]
    hw = cm.get("hardware") or {}
    device = f", {hw['name']}" if hw else ""
    memory = (
        f", {format_bytes(data['device_memory'])} per device" if data.get("device_memory") else ""
    )
    first = f"{data['model']} ({data['n_params'] / 1e9:.1f}B params) on {mesh} ({ranks} ranks){device}{memory}"
    mp = cm["mixed_precision"]
    second = ", ".join(
        part
        for part in (
            cm["optimizer"],
            f"{cm['param_dtype']} params",
            "master weights" if cm.get("master_weights") else "",
            f"{mp} compute" if mp != "none" else "",
            f"batch {cm['batch_size']} x {cm['seq_len']} tokens",
            "remat" if cm.get("remat") else "",
            "flash attention" if cm.get("flash_attention") else "",
        )
        if part
    )
    return f"Memory per rank: {first}\n{second}"
