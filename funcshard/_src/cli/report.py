"""``funcshard plan``'s numbers: per strategy and for the automatic plan, as a table and as JSON."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from funcshard._src.cli.deepspeed import compare, deepspeed_cost_model, describe
from funcshard._src.cli.host import (
    deepspeed_host,
    describe_deepspeed,
    host_per_node,
    ranks_per_node,
)
from funcshard._src.cli.largest import largest_report
from funcshard._src.cli.mesh_fit import check_nodes, check_strategy_axes
from funcshard._src.cli.model_source import ModelSource, from_hf_config, from_preset
from funcshard._src.cli.tables import fits, memory_table, time_table
from funcshard._src.plan.activations import Workload
from funcshard._src.plan.auto import BudgetError, ladder
from funcshard._src.plan.cost import estimate
from funcshard._src.plan.cost_model import CostModel, Reserve, usable_budget
from funcshard._src.plan.efficiency import parse_efficiency, with_efficiency
from funcshard._src.plan.estimates import Estimate, Memory
from funcshard._src.plan.hardware import HARDWARE, Hardware, get_hardware
from funcshard._src.plan.plan import Plan
from funcshard._src.plan.planner import plan
from funcshard._src.plan.precision import MixedPrecision
from funcshard._src.plan.quantize import Quantized
from funcshard._src.plan.search import LADDER
from funcshard._src.plan.sizes import describe_size, format_bytes, parse_bytes
from funcshard._src.spec.mesh import Mesh

SCHEMA_VERSION = 2  # of the --json output; 2 added schema_version, usable_memory, deepspeed
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STRATEGIES = ("all", *LADDER, "auto")  # --strategy's choices, most memory first


class UsageError(ValueError):
    """A command-line argument that cannot be used; the message says which and how to fix it."""


def parse_mesh(text: str, /) -> Mesh:
    """``"dp=2,fsdp=8"`` -> ``Mesh({"dp": 2, "fsdp": 8})``; a bare ``"8"`` is ``fsdp=8``.

    Raises:
        UsageError: anything else, with the expected form.

    Example:
        >>> parse_mesh("dp=2,fsdp=8")
        Mesh({'dp': 2, 'fsdp': 8})
    """
    if re.fullmatch(r"\s*[0-9]+\s*", text):
        pairs = [("fsdp", text.strip())]
    else:
        pairs = [tuple(p.split("=", 1)) for p in text.split(",")] if text.strip() else []
    axes: dict[str, int] = {}
    for pair in pairs:
        if (
            len(pair) != 2
            or not re.fullmatch(r"[A-Za-z_]\w*", pair[0].strip())
            or not (pair[1].strip().isdigit() and int(pair[1]) > 0)
        ):
            raise UsageError(
                f"--mesh {text!r}: write named axes with positive sizes, major first, like "
                f"'fsdp=8' or 'dp=2,fsdp=8'"
            )
        name = pair[0].strip()
        if name in axes:
            raise UsageError(f"--mesh {text!r}: axis {name!r} appears twice")
        axes[name] = int(pair[1])
    return Mesh(axes)


def hardware_of(name: str | None, /) -> Hardware | None:
    """``--hardware``: a preset's name or a JSON file of :class:`Hardware`'s fields."""
    if name is None:
        return None
    if name.lower() in HARDWARE:
        return get_hardware(name)
    path = Path(name)
    if path.suffix == ".json" or path.exists():
        try:  # strict JSON, every field checked (See [Note: plausible hardware] in ``plan/hardware.py``)
            return Hardware.from_json(path)
        except ValueError as e:
            raise UsageError(f"--hardware {e}") from None
    return get_hardware(name)  # raises, listing the presets


def plan_report(args: argparse.Namespace, /) -> dict[str, Any]:
    """The table (``"text"``) and JSON (``"json"``) of ``funcshard plan`` for parsed ``args``."""
    if (args.model is None) == (args.hf_config is None):
        raise UsageError("give a model: --model PRESET or --hf-config path/config.json (one)")
    mesh = parse_mesh(args.mesh)
    hardware = hardware_of(args.hardware)
    check_strategy_axes(args.strategy, mesh, args.mesh, hardware)
    if hardware is not None:
        check_nodes(mesh, hardware)
    if args.efficiency is not None and hardware is not None:
        try:
            hardware = with_efficiency(hardware, *parse_efficiency(args.efficiency))
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif args.efficiency is not None:
        raise UsageError(f"--efficiency {args.efficiency} needs --hardware: the peak it scales")
    sizes: list[str] = []
    if args.device_memory is not None:
        budget = parse_bytes(args.device_memory)
        if not re.search(r"[iI][bB]\s*$", args.device_memory):  # say how GB and G were read
            sizes.append(f"--device-memory {describe_size(args.device_memory)}")
    else:
        budget = hardware.memory_bytes if hardware is not None else None
    if args.batch_size < 1 or (args.seq_len is not None and args.seq_len < 1):
        raise UsageError("--batch-size and --seq-len must be positive")
    if args.micro_batches < 1:
        raise UsageError(
            f"--micro-batches {args.micro_batches}: give the micro-batches per optimizer step, >= 1"
        )
    param_dtype = "fp16" if args.deepspeed else args.param_dtype
    units = [u.strip() for u in args.units.split(",")] if args.units else None
    dtype = DTYPES[param_dtype]
    source: ModelSource = (
        from_preset(args.model, dtype=dtype, units=units)
        if args.model is not None
        else from_hf_config(args.hf_config, dtype=dtype, units=units)
    )
    if args.deepspeed and units is None:
        source = _with_units(source, source.module_units)
    workload = (
        None
        if source.config is None
        else Workload(
            source.config, args.batch_size, args.seq_len, args.remat, args.flash_attention
        )
    )
    if args.deepspeed:
        model = deepspeed_cost_model(workload=workload, hardware=hardware)
    else:
        mp = (
            None
            if args.mixed_precision == "none"
            else MixedPrecision(
                param_dtype=DTYPES[args.mixed_precision], reduce_dtype=DTYPES[args.reduce_dtype]
            )
        )
        model = CostModel(
            optimizer=args.optimizer,
            mixed_precision=mp,
            master_weights=args.master_weights,
            prefetch=args.prefetch,
            workload=workload,
            hardware=hardware,
        )
    model = dataclasses.replace(
        model,
        micro_batches=args.micro_batches,
        accumulate=args.accumulate,
        quantize=_quantize(args),
    )
    if args.reserve is not None:
        model = dataclasses.replace(model, reserve=parse_reserve(args.reserve))
    usable = None if budget is None else usable_budget(budget, model)
    if args.largest:
        return largest_report(args, mesh, model, usable, dtype, SCHEMA_VERSION)
    seq_len = args.seq_len or (source.config.seq_len if source.config else None)
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "model": source.name,
        "n_params": source.n_params,
        "mesh": mesh.axes,
        "device_memory": budget,
        "usable_memory": usable,
        "units": source.units if isinstance(source.units, str) else [str(u) for u in source.units],
        "cost_model": {
            "optimizer": model.optimizer,
            "mixed_precision": "none"
            if model.mixed_precision is None or args.deepspeed
            else args.mixed_precision,
            "reduce_dtype": "fp32"
            if args.deepspeed
            else (args.reduce_dtype if model.mixed_precision else None),
            "param_dtype": param_dtype,
            "master_weights": model.master_weights,
            "deepspeed": args.deepspeed,
            "batch_size": args.batch_size,
            "seq_len": seq_len,
            "remat": args.remat,
            "flash_attention": args.flash_attention,
            "prefetch": model.prefetch,
            "hardware": None if hardware is None else hardware.__dict__,
        },
        "strategies": {},
    }
    wanted = ladder(mesh) if args.strategy == "all" else ()
    if args.strategy not in ("all", "auto"):
        wanted = (args.strategy,)
    assumptions: tuple[str, ...] = ()
    memory: dict[str, Memory] = {}
    kwargs: dict[str, Any] = {"units": source.units, "frozen": source.frozen}
    per_node = ranks_per_node(mesh.size, hardware)
    lines: list[str] = []
    estimates: list[tuple[str, Estimate]] = []
    for strategy in wanted:
        est = estimate(plan(source.params, mesh, strategy=strategy, **kwargs), model)
        assumptions, memory[strategy] = est.assumptions, est.memory
        host = host_per_node(est.memory, per_node, async_checkpoint=args.async_checkpoint)
        out["strategies"][strategy] = {
            **est.to_json(),
            "fits": fits(est, usable),
            "host_per_node": host,
            "tokens_per_s_per_device": _per_device(est, mesh),
        }
        estimates.append((strategy, est))
        if len(wanted) == 1 and budget is not None and not fits(est, usable):
            try:  # the same advice as auto: what would fit
                plan(
                    source.params,
                    mesh,
                    strategy=strategy,
                    memory_budget=budget,
                    cost=model,
                    **kwargs,
                )
            except BudgetError as e:
                out["strategies"][strategy]["error"] = str(e)
                lines = ["", f"{strategy}: {e}", *_auto_advice(source, mesh, budget, model, kwargs)]
    if args.strategy in ("all", "auto"):
        if budget is None and args.strategy == "auto":
            raise UsageError("--strategy auto needs --device-memory or --hardware")
        if budget is not None:
            try:
                chosen: Plan = plan(
                    source.params, mesh, strategy="auto", memory_budget=budget, cost=model, **kwargs
                )
                est = estimate(chosen, model)
                assumptions = est.assumptions
                counts = Counter(u.strategy for u in chosen.units)
                estimates.append(("auto: " + ", ".join(f"{n} {s}" for s, n in counts.items()), est))
                out["auto"] = {
                    **est.to_json(),
                    "fits": fits(est, usable),
                    "units": {u.name: u.strategy for u in chosen.units},
                    "tokens_per_s_per_device": _per_device(est, mesh),
                    "host_per_node": host_per_node(
                        est.memory, per_node, async_checkpoint=args.async_checkpoint
                    ),
                }
            except BudgetError as e:
                out["auto"] = {"error": str(e)}
                lines = ["", f"auto: {e}"]
    where = f"{source.n_params:,} parameters on {mesh!r} ({mesh.size} ranks)"
    if budget is not None:
        where += f", {format_bytes(budget)} per device"
        if usable is not None and usable < budget:
            where += f" ({format_bytes(usable)} usable: the rest is the runtime's reserve)"
    reserve = None if budget is None or usable is None else budget - usable
    text = [f"{source.name}: {where}", *sizes, ""]
    text += memory_table(estimates, reserve, usable)
    text += ["", *time_table(estimates, mesh.size, per_node, args.async_checkpoint), *lines]
    host_ds = deepspeed_host(source.n_params, source.largest_layer_params, per_node)
    out["deepspeed_host_per_node"] = host_ds
    text += ["", describe_deepspeed(host_ds, per_node)]
    if args.deepspeed:
        comparison = compare(memory, source.n_params, source.largest_layer_params, mesh.size)
        out["deepspeed"] = comparison
        text += ["", *describe(comparison)]
    notes = [*source.notes, *assumptions]
    text += ["", "Assumptions:", *(f"- {a}" for a in notes)]
    out["assumptions"] = notes
    return {"text": "\n".join(text), "json": out}


def _per_device(est: Estimate, mesh: Mesh) -> float | None:
    return None if est.time is None else est.time.tokens_per_s / mesh.size


def _auto_advice(
    source: ModelSource, mesh: Mesh, budget: int, model: CostModel, kwargs: dict[str, Any]
) -> list[str]:
    """What ``--strategy auto`` would do where a fixed strategy does not fit."""
    try:
        chosen = plan(
            source.params, mesh, strategy="auto", memory_budget=budget, cost=model, **kwargs
        )
    except BudgetError as e:
        return [f"auto: {e}"]
    est = estimate(chosen, model)
    counts = ", ".join(f"{n} {s}" for s, n in Counter(u.strategy for u in chosen.units).items())
    step = "" if est.time is None else f", {est.time.step_s:.2f} s/step"
    return [
        f"Would fit: --strategy auto ({counts}: {format_bytes(est.memory.total)} per rank{step})"
    ]


def _with_units(source: ModelSource, units: Any) -> ModelSource:
    import dataclasses

    return dataclasses.replace(source, units=list(units))


def parse_reserve(text: str, /) -> Reserve:
    """``--reserve``: ``'5%+1GiB'``, ``'10%'``, ``'2GiB'`` or ``'0'`` (nothing) as a :class:`Reserve`.

    Raises:
        UsageError: another form, naming the accepted ones.

    Example:
        >>> parse_reserve("5%+1GiB")
        Reserve(fraction=0.05, fixed=1073741824)
    """
    fraction, fixed = 0.0, 0
    try:
        for part in (p.strip() for p in text.split("+")):
            if part == "0":
                continue
            if part.endswith("%"):
                fraction += float(part[:-1]) / 100
            else:
                fixed += parse_bytes(part)
        return Reserve(fraction=fraction, fixed=fixed)
    except ValueError as e:
        raise UsageError(
            f"--reserve {text!r}: write a percentage and/or a size, e.g. '5%+1GiB', '10%', "
            f"'2GiB' or '0' ({e})"
        ) from None


def _quantize(args: argparse.Namespace, /) -> Quantized | None:
    """``--quantize``, ``--quantize-block`` and the two formats as a :class:`Quantized`, or ``None``.

    Raises:
        UsageError: a block that is not a positive multiple of 4, or a format for a
            direction ``--quantize`` leaves exact.
    """
    which, block = args.quantize, args.quantize_block
    for flag, fmt, needs in (
        ("--weight-format", args.weight_format, ("weights", "both")),
        ("--gradient-format", args.gradient_format, ("gradients", "both")),
    ):
        if fmt is not None and which not in needs:
            raise UsageError(
                f"{flag} {fmt} with --quantize {which}: that direction is exact; add "
                f"--quantize {'both' if which != 'none' else needs[0]} to quantize it"
            )
    if which == "none":
        return None
    try:
        return Quantized(
            weights=(args.weight_format or "int8") if which != "gradients" else None,
            gradients=(args.gradient_format or "int8") if which != "weights" else None,
            block=block,
        )
    except ValueError:
        raise UsageError(
            f"--quantize-block {block}: give a positive multiple of 4 elements per scale, e.g. 256"
        ) from None
