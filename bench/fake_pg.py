"""``python -m bench.fake_pg``: host time per unit at W=8 in one process, funcshard against FSDP2.

Under torch's ``fake`` process group (``dist.init_process_group("fake", ...)``) one
process stands for every rank of a W=8 job: each collective completes at once
and moves no bytes ([Note: the fake process group] in ``funcshard/_src/comm/channel.py``).
What a step then costs is the compute of one rank's unit shapes plus the host
time that the sharding library spends on each unit: gathering, freeing,
reducing, hooks and bookkeeping. On a GPT of many narrow blocks the compute is
small, so the step time is mostly that host time.

In one run it alternates, ``--rounds`` times: funcshard ``full_shard`` (each
block a unit, ``fs.value_and_grad``; its default per-leaf layout, which FSDP2's
per-parameter sharding matches, and ``layout="flat"``, whose gathered unit is one
buffer its leaves view, as FSDP1's), FSDP2 (``fully_shard`` on each block,
then the root), and the same GPT unsharded (``plain``: the ``nn.Module``, no
process group involved), each ``--steps`` forward+backward steps after one
warm-up. It reports the median step of each, per unit (``--layers`` blocks + the
root), and per unit over ``plain`` (the sharding library's own host time), and
funcshard's ratio to FSDP2 of both. Every line starts with ``fake_pg ``; the
JSON goes to ``--out`` (default: ``bench/results/fake_pg/``).

Gathered buffers hold whatever memory held (nothing is moved), so denormals are
flushed to zero to keep float arithmetic at one speed, and the loss is no number
to read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from bench import model as gpt

WORLD = 8
OUT = Path(__file__).parent / "results" / "fake_pg"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.fake_pg", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--layers", type=int, default=64, help="blocks: units besides the root")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=OUT, help="where fake_pg.json goes ('-': nowhere)")
    p.add_argument("--tiny", action="store_true", help="a smoke run: 8 blocks, 2 steps, 1 round")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.steps, args.rounds = 8, 32, 2, 1
    return args


def _timed(step: Callable[[int], Any], steps: int) -> list[float]:
    step(-1)  # warm-up: first-call caches, allocations
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    return times


def _funcshard(
    cfg: gpt.Config, params: Any, layout: Literal["leaf", "flat"] = "leaf"
) -> Callable[[int], Any]:
    import funcshard as fs

    mesh = fs.Mesh({"fsdp": WORLD})
    plan = fs.plan(params, mesh, units=["blocks/*"], strategy="full_shard", layout=layout)
    sparams = fs.shard(params, plan, verify=False)
    step = fs.value_and_grad(gpt.loss_fn, plan)

    def run(i: int) -> Any:
        tokens, targets = gpt.batch(cfg, max(i, 0), 0)
        return step(sparams, tokens, targets, cfg.heads)

    return run


def _fsdp2(cfg: gpt.Config, params: Any) -> Callable[[int], Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = gpt.GPT(params, cfg.heads)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _module_step(cfg, model)


def _plain(cfg: gpt.Config, params: Any) -> Callable[[int], Any]:
    return _module_step(cfg, gpt.GPT(params, cfg.heads))


def _module_step(cfg: gpt.Config, model: torch.nn.Module) -> Callable[[int], Any]:
    def run(i: int) -> Any:
        tokens, targets = gpt.batch(cfg, max(i, 0), 0)
        model.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        loss.backward()
        return loss

    return run


def _funcshard_flat(cfg: gpt.Config, params: Any) -> Callable[[int], Any]:
    return _funcshard(cfg, params, layout="flat")


MODES = {
    "funcshard/full_shard": _funcshard,
    "funcshard/full_shard/flat": _funcshard_flat,
    "fsdp2": _fsdp2,
    "plain": _plain,
}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every mode's step times over the rounds, under a fake W=8 process group; collective-free."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # flushing denormals sets the CPU's FTZ/DAZ flags, which Python's float arithmetic obeys
    # too: set for the measurement only, so a caller in the same process (a test) keeps its
    # arithmetic (1e-308 stays 1e-308)
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    cfg = gpt.Config(vocab=64, width=args.width, heads=2, layers=args.layers, seq=args.seq, batch=2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        params = gpt.init_params(cfg)
        steps = {name: make(cfg, params) for name, make in MODES.items()}
        times: dict[str, list[float]] = {name: [] for name in MODES}
        for _ in range(args.rounds):
            for name, step in steps.items():
                times[name] += _timed(step, args.steps)
    finally:
        dist.destroy_process_group()
        torch.set_flush_denormal(False)
    units = cfg.layers + 1
    median = {name: statistics.median(t) for name, t in times.items()}
    per_unit = {name: median[name] / units for name in MODES}
    over = {name: (median[name] - median["plain"]) / units for name in MODES if name != "plain"}
    return {
        "command": "python -m bench.fake_pg " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, 1 thread",
        "world_size": WORLD,
        "config": cfg.to_json(),
        "units": units,
        "steps": args.steps,
        "rounds": args.rounds,
        "step_times_s": times,
        "median_step_s": median,
        "per_unit_s": per_unit,
        "per_unit_over_plain_s": over,
        "ratio_per_unit": per_unit["funcshard/full_shard"] / per_unit["fsdp2"],
        "ratio_over_plain": over["funcshard/full_shard"] / over["fsdp2"],
        "ratio_per_unit_flat": per_unit["funcshard/full_shard/flat"] / per_unit["fsdp2"],
        "ratio_over_plain_flat": over["funcshard/full_shard/flat"] / over["fsdp2"],
    }


def report(result: dict[str, Any]) -> list[str]:
    """The lines ``python -m bench.fake_pg`` prints, each starting with ``fake_pg ``."""
    lines = [
        f"fake_pg W={result['world_size']} (torch's fake process group, one process), "
        f"{result['units']} units ({result['config']['layers']} blocks of width "
        f"{result['config']['width']} + root), {result['rounds']} rounds x {result['steps']} steps, "
        f"torch {result['torch']}"
    ]
    for name, median in result["median_step_s"].items():
        over = result["per_unit_over_plain_s"].get(name)
        extra = "" if over is None else f", {over * 1e6:.0f} us/unit over plain"
        lines.append(
            f"fake_pg {name}: median step {median * 1e3:.2f} ms, "
            f"{result['per_unit_s'][name] * 1e6:.0f} us/unit{extra}"
        )
    lines.append(
        f"fake_pg funcshard/fsdp2 host time per unit (the step over plain): "
        f"{result['ratio_over_plain']:.2f}x (target <= 0.5x); with layout='flat': "
        f"{result['ratio_over_plain_flat']:.2f}x; whole step per unit (plain's compute "
        f"included): {result['ratio_per_unit']:.2f}x, flat {result['ratio_per_unit_flat']:.2f}x"
    )
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    result = measure(args)
    lines = report(result)
    print("\n".join(lines), flush=True)
    if str(args.out) != "-":
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fake_pg.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "fake_pg.txt").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
