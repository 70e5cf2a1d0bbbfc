"""The ``funcshard`` command: plan a run of a published model on a laptop.

``funcshard plan --model llama-13b --mesh dp=2,fsdp=8 --device-memory 80GiB`` prints,
for each strategy, the memory one rank holds by category, the bytes it sends per
step, and (with ``--hardware``) the estimated step time and tokens/s; with
``--device-memory`` it also chooses a plan (``strategy="auto"``). ``--json`` and
``--plot`` write the same numbers as JSON and as a bar chart (matplotlib).

``funcshard verify script.py --nproc 2 [-- args]`` runs ``fs.verify`` on the
configuration that the script's ``verify_config()`` returns, on that many local
ranks under torchrun, and exits 0 if it passes, 1 if not (``docs/verify.md``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from funcshard._src.plan.activations import Workload
from funcshard._src.plan.auto import BudgetError, ladder
from funcshard._src.plan.cost import estimate
from funcshard._src.plan.cost_model import CostModel
from funcshard._src.plan.estimates import Estimate
from funcshard._src.plan.hardware import HARDWARE, Hardware, get_hardware
from funcshard._src.plan.plan import Plan
from funcshard._src.plan.planner import plan
from funcshard._src.plan.precision import MixedPrecision
from funcshard._src.plan.presets import PRESETS, get_preset
from funcshard._src.plan.sizes import format_bytes, parse_bytes, table
from funcshard._src.spec.mesh import Mesh
from funcshard._src.verify.launch import ScriptError, launch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def _version() -> str:
    from funcshard import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``funcshard``."""
    parser = argparse.ArgumentParser(
        prog="funcshard", description="funcshard: plan fully sharded training runs."
    )
    parser.add_argument("--version", action="version", version=f"funcshard {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "plan",
        help="memory, communication and time per rank of a published model, per strategy",
        description="Per-rank memory by category, communication per step and (with --hardware) "
        "estimated tokens/s of a model preset under each strategy; with --device-memory, "
        "the automatic plan too.",
    )
    p.add_argument("--model", required=True, help=f"a preset: {', '.join(PRESETS)}")
    p.add_argument("--mesh", required=True, help="named axes, major first: 'fsdp=8', 'dp=2,fsdp=8'")
    p.add_argument("--device-memory", help="bytes per device, e.g. 80GiB; default: the hardware's")
    p.add_argument("--optimizer", default="adamw", choices=["sgd", "sgd_momentum", "adamw"])
    p.add_argument(
        "--mixed-precision",
        default="none",
        choices=["none", "bf16", "fp16"],
        help="gather and compute in this dtype (gradients reduced in --reduce-dtype)",
    )
    p.add_argument("--reduce-dtype", default="fp32", choices=sorted(_DTYPES))
    p.add_argument("--param-dtype", default="fp32", choices=sorted(_DTYPES), help="stored params")
    p.add_argument(
        "--master-weights",
        action="store_true",
        help="model DeepSpeed/Megatron's layout: low-precision params, fp32 master and state",
    )
    p.add_argument("--hardware", help=f"a preset ({', '.join(HARDWARE)}) or a JSON file")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    p.add_argument("--remat", action="store_true", help="recompute activations in backward")
    p.add_argument(
        "--flash-attention",
        action="store_true",
        help="attention keeps no (seq x seq) scores (FlashAttention, fused SDPA)",
    )
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--json", type=Path, help="also write the numbers to this JSON file")
    p.add_argument("--plot", type=Path, help="also draw memory per strategy to this image")
    v = sub.add_parser(
        "verify",
        usage="funcshard verify script.py [--nproc N] [-- args for the script...]",
        help="check a configuration sharded against unsharded, on local ranks (fs.verify)",
        description="Runs fs.verify on what the script's verify_config() returns, on --nproc "
        "local ranks under torchrun; rank 0 prints the report. Exit status 0: pass, 1: fail.",
    )
    v.add_argument("script", help="a Python script that defines verify_config()")
    v.add_argument("--nproc", type=int, default=1, help="ranks to run (default 1)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``funcshard``; returns the exit status (2 for bad arguments, with the reason).

    Example:
        >>> main(["plan", "--model", "llama-7b", "--mesh", "fsdp=8"])  # doctest: +ELLIPSIS
        llama-7b: 6,738,415,616 parameters on Mesh({'fsdp': 8}) (8 ranks)...
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if argv[:1] == ["verify"] and "--" in argv:  # the script's own arguments follow "--"
        argv, rest = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    args = build_parser().parse_args(argv)
    if args.command == "verify":
        try:
            return launch(args.script, rest, nproc=args.nproc)
        except ScriptError as e:
            print(f"funcshard verify: error: {e}", file=sys.stderr)
            return 2
    try:
        report = plan_report(args)
    except (UsageError, ValueError, OSError) as e:
        print(f"funcshard plan: error: {e}", file=sys.stderr)
        return 2
    print(report["text"])
    if args.json is not None:
        args.json.write_text(json.dumps(report["json"], indent=2) + "\n")
    if args.plot is not None:
        plot(report["json"], args.plot)
    return 0


def plan_report(args: argparse.Namespace, /) -> dict[str, Any]:
    """The table and JSON of ``funcshard plan``."""
    preset = get_preset(args.model)
    mesh = parse_mesh(args.mesh)
    hardware = _hardware(args.hardware)
    if args.device_memory is not None:
        budget = parse_bytes(args.device_memory)
    else:
        budget = hardware.memory_bytes if hardware is not None else None
    if args.batch_size < 1 or (args.seq_len is not None and args.seq_len < 1):
        raise UsageError("--batch-size and --seq-len must be positive")
    mp = (
        None
        if args.mixed_precision == "none"
        else MixedPrecision(
            param_dtype=_DTYPES[args.mixed_precision], reduce_dtype=_DTYPES[args.reduce_dtype]
        )
    )
    model = CostModel(
        optimizer=args.optimizer,
        mixed_precision=mp,
        master_weights=args.master_weights,
        prefetch=args.prefetch,
        workload=Workload(
            preset.config, args.batch_size, args.seq_len, args.remat, args.flash_attention
        ),
        hardware=hardware,
    )
    params = preset.params(dtype=_DTYPES[args.param_dtype])
    units = [preset.unit_pattern]
    rows: list[list[str]] = []
    out: dict[str, Any] = {
        "model": preset.name,
        "n_params": preset.n_params,
        "mesh": mesh.axes,
        "device_memory": budget,
        "cost_model": {
            "optimizer": args.optimizer,
            "mixed_precision": args.mixed_precision,
            "reduce_dtype": args.reduce_dtype if mp is not None else None,
            "param_dtype": args.param_dtype,
            "master_weights": args.master_weights,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len or preset.config.seq_len,
            "remat": args.remat,
            "flash_attention": args.flash_attention,
            "prefetch": args.prefetch,
            "hardware": None if hardware is None else hardware.__dict__,
        },
        "strategies": {},
    }
    assumptions: tuple[str, ...] = ()
    for strategy in ladder(mesh):
        p = plan(params, mesh, units=units, strategy=strategy)
        est = estimate(p, model)
        assumptions = est.assumptions
        out["strategies"][strategy] = {
            **est.to_json(),
            "fits": None if budget is None else est.memory.total <= budget,
        }
        rows.append(_row(strategy, est, budget))
    chosen: Plan | None = None
    auto_error = None
    if budget is not None:
        try:
            chosen = plan(
                params, mesh, units=units, strategy="auto", memory_budget=budget, cost=model
            )
        except BudgetError as e:
            auto_error = str(e)
    if chosen is not None:
        est = estimate(chosen, model)
        counts: dict[str, int] = {}
        for u in chosen.units:
            counts[u.strategy] = counts.get(u.strategy, 0) + 1
        label = "auto: " + ", ".join(f"{n} {s}" for s, n in counts.items())
        rows.append(_row(label, est, budget))
        out["auto"] = {
            **est.to_json(),
            "fits": None if budget is None else est.memory.total <= budget,
            "units": {u.name: u.strategy for u in chosen.units},
        }
    elif auto_error is not None:
        out["auto"] = {"error": auto_error}
    heads = ["strategy", "params", "grads", "optimizer", "mixed prec", "gathered", "activations"]
    heads += ["total", "fits", "sent/step", "step", "tokens/s"]
    lines = [
        f"{preset.name}: {preset.n_params:,} parameters on {mesh!r} ({mesh.size} ranks)"
        + (f", {format_bytes(budget)} per device" if budget is not None else ""),
        "",
        table(heads, rows),
    ]
    if auto_error is not None:
        lines += ["", f"auto: {auto_error}"]
    lines += ["", "Assumptions:"] + [f"- {a}" for a in assumptions]
    out["assumptions"] = list(assumptions)
    return {"text": "\n".join(lines), "json": out}


def plot(data: dict[str, Any], path: Path, /) -> None:
    """Draws per-rank memory by category for each strategy as stacked bars; writes ``path``.

    Raises:
        UsageError: matplotlib is not installed (``pip install 'funcshard[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'funcshard[plot]'") from None
    entries = dict(data["strategies"])
    if "auto" in data and "memory" in data["auto"]:
        entries["auto"] = data["auto"]
    names = list(entries)
    categories = list(next(iter(entries.values()))["memory"])
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 4.5))
    bottom = [0.0] * len(names)
    for cat in categories:
        values = [entries[n]["memory"][cat] / 2**30 for n in names]
        ax.bar(names, values, bottom=bottom, label=cat.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    if data.get("device_memory"):
        ax.axhline(data["device_memory"] / 2**30, color="black", linestyle="--", label="device")
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"{data['model']} on {data['mesh']}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _hardware(name: str | None) -> Hardware | None:
    if name is None:
        return None
    if name.lower() in HARDWARE:
        return get_hardware(name)
    path = Path(name)
    if path.suffix == ".json" or path.exists():
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"--hardware {name}: cannot read a JSON description ({e})") from None
        if not isinstance(data, dict):
            raise UsageError(f"--hardware {name}: the JSON must be an object of fields")
        return Hardware.from_dict(data)  # pyright: ignore[reportUnknownArgumentType]
    return get_hardware(name)  # raises, listing the presets


def _row(label: str, est: Estimate, budget: int | None) -> list[str]:
    m = est.memory
    sent = sum(est.comm.values())
    t = est.time
    return [
        label,
        format_bytes(m.params),
        format_bytes(m.grads),
        format_bytes(m.optimizer),
        format_bytes(m.mixed_precision),
        format_bytes(m.gathered),
        format_bytes(m.activations),
        format_bytes(m.total),
        "" if budget is None else ("yes" if m.total <= budget else "no"),
        format_bytes(sent),
        "" if t is None else f"{t.step_s:.2f} s",
        "" if t is None else f"{t.tokens_per_s:,.0f}",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
