"""``funcshard plan --largest``: the largest model of a preset's family that each strategy fits.

A family is a preset's shape scaled in width and depth together: ``k`` heads of the
preset's width, ``hidden = k * head_dim``, the MLP, key/value heads and layers scaled by
``k / n_heads`` (at least one each), the vocabulary and sequence length kept. Memory
grows with ``k`` for every strategy, so a bisection over ``k`` finds the largest that fits.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch

from funcshard._src.plan.cost import estimate
from funcshard._src.plan.cost_model import CostModel
from funcshard._src.plan.model_config import ModelConfig
from funcshard._src.plan.planner import plan
from funcshard._src.plan.presets import Preset, get_preset
from funcshard._src.plan.search import ladder
from funcshard._src.plan.sizes import format_bytes, table
from funcshard._src.plan.strategy import Strategy
from funcshard._src.spec.mesh import Mesh


def scaled(config: ModelConfig, heads: int, /) -> ModelConfig:
    """``config`` with ``heads`` heads of its width and every other size scaled to match.

    Example:
        >>> from funcshard._src.plan.presets import get_preset
        >>> c = scaled(get_preset("llama-7b").config, 40)
        >>> c.hidden, c.n_layers, c.ffn_hidden, c.n_kv_heads
        (5120, 40, 13760, 40)
    """
    r = heads / config.n_heads

    def grow(n: int, multiple: int = 1) -> int:
        return max(multiple, round(n * r / multiple) * multiple)

    kv = max(1, round(config.n_kv_heads * r))
    while heads % kv:  # grouped-query attention: a whole number of query heads per kv head
        kv -= 1
    layers = grow(config.n_layers)
    square = config.hidden == config.n_heads * config.head_dim
    return dataclasses.replace(
        config,
        n_layers=layers,
        n_encoder_layers=min(grow(config.n_encoder_layers), layers - 1)
        if config.n_encoder_layers
        else 0,
        hidden=heads * config.head_dim if square else grow(config.hidden, 64),
        ffn_hidden=grow(config.ffn_hidden, 64),
        n_heads=heads,
        n_kv_heads=kv,
    )


class Largest(NamedTuple):
    """One strategy's answer: the most heads that fit, that model's size and memory, the next size."""

    heads: int  # 0: not even one head fits
    n_params: int
    total: int | None  # bytes per rank of the largest that fits
    next_n_params: int  # the smallest size tried that does not fit


def largest(
    preset: Preset,
    mesh: Mesh,
    strategies: tuple[Strategy, ...],
    model_of: Callable[[ModelConfig], CostModel],
    usable: int,
    /,
    *,
    dtype: torch.dtype,
) -> dict[str, Largest]:
    """Per strategy, the most heads of ``preset``'s family whose plan fits ``usable`` bytes per rank.

    Memory grows with the heads, so the answer is bisected: doubling from twice the
    preset's heads while that fits (up to 64 times), then halving the interval.
    """
    cache: dict[int, tuple[Preset, CostModel]] = {}
    totals: dict[tuple[int, Strategy], int] = {}

    def member(k: int) -> tuple[Preset, CostModel]:
        if k not in cache:
            cfg = scaled(preset.config, k)
            cache[k] = (Preset(f"{preset.name}-family-{k}h", cfg), model_of(cfg))
        return cache[k]

    def total(k: int, strategy: Strategy) -> int:
        if (k, strategy) not in totals:
            p, m = member(k)
            made = plan(p.params(dtype=dtype), mesh, strategy=strategy, units=[p.unit_pattern])
            totals[k, strategy] = estimate(made, m).memory.total
        return totals[k, strategy]

    cap = 64 * preset.config.n_heads
    out: dict[str, Largest] = {}
    for strategy in strategies:
        low, high = 0, 2 * preset.config.n_heads
        while total(high, strategy) <= usable:
            low, high = high, 2 * high
            if low >= cap:
                break
        while high - low > 1:  # low fits (or is 0), high does not
            mid = (low + high) // 2
            low, high = (mid, high) if total(mid, strategy) <= usable else (low, mid)
        out[strategy] = Largest(
            low,
            member(low)[0].n_params if low else 0,
            total(low, strategy) if low else None,
            member(high)[0].n_params,
        )
    return out


def describe(found: dict[str, Largest], preset: Preset, usable: int, /) -> list[str]:
    """The answer as a table, one row per strategy."""
    rows = [
        [
            strategy,
            f"{f.n_params / 1e9:.2f}B ({f.n_params:,})" if f.n_params else "none",
            "" if f.total is None else format_bytes(f.total),
            f"{f.next_n_params / 1e9:.2f}B",
        ]
        for strategy, f in found.items()
    ]
    c = preset.config
    return [
        f"The largest model of {preset.name}'s family (its {c.arch} shape scaled in width and "
        f"depth, head_dim {c.head_dim}, vocabulary {c.vocab:,}) that fits {format_bytes(usable)} "
        f"usable per rank:",
        table(
            ["strategy", "largest that fits", "total per rank", "next size (does not fit)"], rows
        ),
    ]


def largest_report(
    args: argparse.Namespace,
    mesh: Mesh,
    model: CostModel,
    usable: int | None,
    dtype: torch.dtype,
    schema_version: int,
    /,
) -> dict[str, Any]:
    """``--largest``: per strategy, the largest model of the preset's family that fits."""
    if args.model is None or usable is None:
        raise ValueError(
            "--largest scales a preset: give --model and --device-memory (or --hardware)"
        )
    preset = get_preset(args.model)
    wanted: tuple[Strategy, ...] = (
        ladder(mesh) if args.strategy in ("all", "auto") else (cast(Strategy, args.strategy),)
    )

    def model_of(config: ModelConfig) -> CostModel:
        if model.workload is None:
            return model
        return dataclasses.replace(
            model, workload=dataclasses.replace(model.workload, model=config)
        )

    found = largest(preset, mesh, wanted, model_of, usable, dtype=dtype)
    w = model.workload
    text = [
        *describe(found, preset, usable),
        f"Training: {model.optimizer}, mixed precision {args.mixed_precision}, params "
        f"{args.param_dtype}"
        + (
            ""
            if w is None
            else f", {w.batch_size} x {w.seq_len or preset.config.seq_len} tokens per rank, "
            f"{'with' if w.remat else 'without'} remat"
        ),
    ]
    return {
        "text": "\n".join(text),
        "json": {
            "schema_version": schema_version,
            "model": preset.name,
            "mesh": mesh.axes,
            "usable_memory": usable,
            "largest": {strategy: f._asdict() for strategy, f in found.items()},
        },
    }
