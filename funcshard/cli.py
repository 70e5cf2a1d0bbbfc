"""The ``funcshard`` command: plan a run of a published model on a laptop.

``funcshard plan --model llama-13b --mesh dp=2,fsdp=8 --device-memory 80GiB`` prints,
for each strategy, the memory one rank holds by category (the columns add up to the
total), the bytes it sends per step, host RAM per node, and (with ``--hardware``) the
estimated step time, tokens/s per GPU and MFU; with ``--device-memory`` it also chooses a
plan (``strategy="auto"``). ``--largest`` gives the largest model of the preset's family
each strategy fits. ``--json`` and ``--plot`` write the same numbers as JSON and as a bar
chart (matplotlib).

``funcshard verify script.py --nproc 2 [-- args]`` runs ``fs.verify`` on the
configuration that the script's ``verify_config()`` returns, on that many local
ranks under torchrun, and exits 0 if it passes, 1 if not (``docs/verify.md``).

``funcshard calibrate --out hw.json`` measures this machine on local gloo ranks and
writes a hardware description that ``--hardware hw.json`` reads (``docs/planner.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from funcshard._src.calibrate.calibrate import add_arguments as add_calibrate_arguments
from funcshard._src.calibrate.calibrate import run as run_calibrate
from funcshard._src.cli.plot import MissingExtraError, plot, require_matplotlib
from funcshard._src.cli.report import (
    DTYPES,
    STRATEGIES,
    UsageError,
    hardware_of,
    parse_mesh,
    plan_report,
)
from funcshard._src.plan.efficiency import DEFAULT_PROFILE, PROFILES
from funcshard._src.plan.hardware import HARDWARE
from funcshard._src.plan.presets import PRESETS
from funcshard._src.plan.quantize import FORMATS
from funcshard._src.verify.launch import ScriptError, launch

_DTYPES = DTYPES
_hardware = hardware_of  # --hardware: a preset's name or a JSON file
__all__ = ["UsageError", "build_parser", "main", "parse_mesh", "plan_report", "plot"]


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
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help=f"a preset: {', '.join(PRESETS)}")
    what.add_argument(
        "--hf-config",
        type=Path,
        help="a Hugging Face config.json (or its folder): the model transformers builds from it, "
        "on the meta device, offline; its own code (trust_remote_code) is never run",
    )
    p.add_argument(
        "--units",
        help="comma-separated unit patterns (globs over leaf paths; for --hf-config also module "
        "class names), or 'auto'; default: one unit per transformer block",
    )
    p.add_argument(
        "--strategy",
        default="all",
        choices=STRATEGIES,
        help="plan with this strategy only; 'all' (default): every strategy and the auto plan",
    )
    p.add_argument("--mesh", required=True, help="named axes, major first: 'fsdp=8', 'dp=2,fsdp=8'")
    p.add_argument(
        "--device-memory",
        help="bytes per device: 80GiB or 80G (binary, as nvidia-smi means G), 80GB (decimal); "
        "default: the hardware's",
    )
    p.add_argument(
        "--reserve",
        help="device memory a plan leaves to the runtime: '5%%+1GiB', '10%%', '2GiB' or '0' "
        "(default: 5%% plus 1 GiB, at most half of what is beyond 1 GiB)",
    )
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
    p.add_argument(
        "--deepspeed",
        action="store_true",
        help="DeepSpeed's ZeRO layout (fp16 params, fp32 master weights, Adam and reduction, no "
        "prefetch, a unit per module) beside its ZeRO-1/2/3 estimators, term by term",
    )
    p.add_argument("--hardware", help=f"a preset ({', '.join(HARDWARE)}) or a JSON file")
    p.add_argument(
        "--efficiency",
        help=f"the fraction of peak FLOP/s the model's compute reaches: a profile "
        f"({', '.join(f'{k} {v}' for k, v in PROFILES.items())}; default {DEFAULT_PROFILE}, "
        f"or a calibrated machine's own) or a number in (0, 1]",
    )
    p.add_argument(
        "--async-checkpoint",
        action="store_true",
        help="checkpoints saved with fs.checkpoint.AsyncCheckpointer: its pinned host buffers "
        "count in host RAM while training",
    )
    p.add_argument(
        "--largest",
        action="store_true",
        help="the largest model of --model's family (its shape scaled in width and depth) that "
        "each strategy fits in --device-memory or --hardware's memory",
    )
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    p.add_argument("--remat", action="store_true", help="recompute activations in backward")
    p.add_argument(
        "--flash-attention",
        action="store_true",
        help="attention keeps no (seq x seq) scores (FlashAttention, fused SDPA)",
    )
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="micro-batches per optimizer step (step.accumulate); bytes sent are per step",
    )
    p.add_argument(
        "--accumulate",
        default="sharded",
        choices=["sharded", "unsharded"],
        help="reduce every micro-batch (sharded, default) or once per step (unsharded)",
    )
    p.add_argument(
        "--quantize",
        default="none",
        choices=["none", "weights", "gradients", "both"],
        help="low-bit collectives per block (fs.Quantized, ZeRO++'s qwZ and qgZ): all-gathers "
        "of parameters, reductions of gradients, or both; bytes sent as sent",
    )
    p.add_argument(
        "--quantize-block", type=int, default=256, help="elements per fp32 scale (--quantize)"
    )
    p.add_argument(
        "--weight-format",
        choices=FORMATS,
        help="the format of quantized parameter all-gathers (--quantize weights or both; "
        "default int8)",
    )
    p.add_argument(
        "--gradient-format",
        choices=FORMATS,
        help="the format of quantized gradient reductions (--quantize gradients or both; "
        "default int8; int4 is ZeRO++'s qgZ)",
    )
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
    c = sub.add_parser(
        "calibrate",
        help="measure this machine (matmul, memory, gloo links) into a --hardware JSON",
        description="Times matmuls, a transformer block, copies and gloo collectives on "
        "--nproc local ranks at once, and writes a hardware description for --hardware.",
    )
    add_calibrate_arguments(c)
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
    if args.command == "calibrate":
        return run_calibrate(args)
    if args.command == "verify":
        try:
            return launch(args.script, rest, nproc=args.nproc)
        except ScriptError as e:
            print(f"funcshard verify: error: {e}", file=sys.stderr)
            return 2
    try:
        if args.plot is not None:
            require_matplotlib()  # before planning: a missing extra is a usage error
        report = plan_report(args)
        # strict JSON: a number that is not finite is a bug to report, never a NaN in the file
        text = json.dumps(report["json"], indent=2, allow_nan=False) + "\n"
    except (UsageError, ValueError, OSError, MissingExtraError) as e:
        print(f"funcshard plan: error: {e}", file=sys.stderr)
        return 2
    print(report["text"])
    if args.json is not None:
        args.json.write_text(text)
    if args.plot is not None:
        plot(report["json"], args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
