"""``python -m bench.async_save``: what a checkpoint costs the training loop, blocking or in the background.

Trains the benchmark's GPT (``--size``, default 8m) with AdamW on ``--world-size`` gloo
ranks and saves its params and optimizer state every ``--every`` steps, in three modes
that take turns within each round (so drift of the machine hits all alike):

- ``none``: no saves: the step time to compare with;
- ``sync``: ``fs.checkpoint.save`` (blocking): its call time is what the loop loses;
- ``async``: ``fs.checkpoint.AsyncCheckpointer.save``: its call time (agreement, RNG
  states, the copy into host buffers) is what the loop loses; the files are written
  while the next steps run, whose time is recorded apart ("steps during a save").

Every step is timed between barriers (the slowest rank's time). Writes
``bench/results/async_save.json`` (every step and save of every rank and round) and
``async_save.md`` (medians), and prints the table. ``--tiny`` is a smoke run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("none", "sync", "async")


def _rank_main(rank: int, world: int, store: str, spec: dict[str, Any], out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
    import torch
    import torch.distributed as dist

    import funcshard as fs
    from bench import model as gpt

    torch.set_num_threads(spec["threads"])
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),  # pyright: ignore[reportPrivateImportUsage]
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    cfg = gpt.TINY if spec["tiny"] else gpt.SIZES[spec["size"]]
    records: list[dict[str, Any]] = []
    for round_ in range(spec["rounds"]):
        for mode in MODES:
            records.append(_run(mode, round_, cfg, spec, fs, gpt, torch, dist))
    with open(out, "w") as f:
        json.dump(records, f)
    dist.barrier()
    dist.destroy_process_group()


def _run(
    mode: str, round_: int, cfg: Any, spec: dict[str, Any], fs: Any, gpt: Any, torch: Any, dist: Any
) -> dict[str, Any]:
    params = gpt.init_params(cfg)
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=["blocks/*"])
    sparams = fs.shard(params, plan)
    opt = fs.optim.adamw(lr=1e-4)
    state = {"params": sparams, "opt": opt.init(sparams), "step": 0}
    step = fs.value_and_grad(
        lambda p, tokens, targets: gpt.loss_fn(p, tokens, targets, cfg.heads), plan
    )
    root = Path(spec["directory"]) / f"{mode}-{round_}"
    saver = fs.checkpoint.AsyncCheckpointer()
    steps: list[tuple[float, bool]] = []  # (seconds, a save in flight when the step began)
    saves: list[float] = []
    handle = None
    for i in range(spec["warmup"] + spec["steps"]):
        tokens, targets = gpt.batch(cfg, i, fs.rank())
        in_flight = handle is not None and not handle.done()
        dist.barrier()
        start = time.perf_counter()
        _, grads = step(state["params"], tokens, targets)
        state["params"], state["opt"] = opt.update_(grads, state["opt"], state["params"])
        dist.barrier()
        if i >= spec["warmup"]:
            steps.append((time.perf_counter() - start, in_flight))
        state["step"] = i + 1
        if mode != "none" and (i + 1) % spec["every"] == 0:
            path, kw = root / f"step-{i + 1}", {"step": i + 1, "keep": 2, "run": f"{mode}{round_}"}
            dist.barrier()
            start = time.perf_counter()
            if mode == "sync":
                fs.checkpoint.save(path, state, **kw)
            else:
                handle = saver.save(path, state, **kw)
            dist.barrier()
            saves.append(time.perf_counter() - start)
    staged = saver.staging_bytes
    saver.close()
    files = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0
    return {
        "mode": mode,
        "round": round_,
        "rank": fs.rank(),
        "step_s": [s for s, _ in steps],
        "during_save": [d for _, d in steps],
        "save_call_s": saves,
        "staging_bytes": staged,
        "checkpoint_bytes": files // 2 if files else 0,  # keep=2: two checkpoints on disk
    }


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    rank0 = [r for r in records if r["rank"] == 0]  # timed between barriers: alike on every rank

    def med(values: list[float] | list[int]) -> float:
        return round(statistics.median(values), 4) if values else float("nan")

    none = [s for r in rank0 if r["mode"] == "none" for s in r["step_s"]]
    pairs = [
        (s, d) for r in rank0 if r["mode"] == "async" for s, d in zip(r["step_s"], r["during_save"])
    ]
    during = [s for s, d in pairs if d]
    between = [s for s, d in pairs if not d]  # the same runs' other steps: a control for drift
    sync_call = [s for r in rank0 if r["mode"] == "sync" for s in r["save_call_s"]]
    async_call = [s for r in rank0 if r["mode"] == "async" for s in r["save_call_s"]]
    loop = {
        m: [sum(r["step_s"]) + sum(r["save_call_s"]) for r in rank0 if r["mode"] == m]
        for m in MODES
    }
    return {
        "step_s_without_saves": med(none),
        "step_s_during_async_save": med(during),
        "step_s_async_run_other_steps": med(between),
        "steps_during_async_save": len(during),
        "step_slowdown_during_async_save": round(med(during) / med(between) - 1, 3)
        if between and during
        else None,
        "blocking_s_sync_save": med(sync_call),
        "blocking_s_async_save": med(async_call),
        "blocking_reduction": round(1 - med(async_call) / med(sync_call), 3)
        if sync_call and async_call
        else None,
        "loop_s": {m: med(v) for m, v in loop.items()},
        "checkpoint_bytes": max(r["checkpoint_bytes"] for r in rank0),
        "staging_bytes_rank0": max(r["staging_bytes"] for r in rank0),
    }


def _markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    s = summary
    return "\n".join(
        [
            "# Saving a checkpoint: blocking or in the background",
            "",
            f"`{meta['command']}` on {meta['date']}: {meta['machine']['platform']}, "
            f"{meta['machine']['cpus']} CPUs, torch {meta['machine']['torch']}; GPT {meta['size']} "
            f"(params and AdamW state, {s['checkpoint_bytes'] / 2**20:.1f} MiB a checkpoint), "
            f"W={meta['world_size']} gloo, a save every {meta['every']} steps, "
            f"{meta['rounds']} rounds x {meta['steps']} steps per mode. Medians.",
            "",
            "| | blocking (s) |",
            "|---|---|",
            f"| `fs.checkpoint.save` | {s['blocking_s_sync_save']} |",
            f"| `AsyncCheckpointer.save` | {s['blocking_s_async_save']} |",
            f"| less blocking time | {s['blocking_reduction'] * 100:.0f} % |"
            if s["blocking_reduction"] is not None
            else "| less blocking time | - |",
            "",
            "| | step (s) |",
            "|---|---|",
            f"| without saves | {s['step_s_without_saves']} |",
            f"| while an async save writes ({s['steps_during_async_save']} steps) | "
            f"{s['step_s_during_async_save']} |",
            f"| the async runs' other steps (a control for the machine's drift) | "
            f"{s['step_s_async_run_other_steps']} |",
            f"| slowdown of the steps during a save, against that control | "
            f"{s['step_slowdown_during_async_save'] * 100:+.0f} % |"
            if s["step_slowdown_during_async_save"] is not None
            else "| slowdown of the steps during a save | - |",
            "",
            "| a whole run: timed steps and save calls (s) | none | sync | async |",
            "|---|---|---|---|",
            f"| median over rounds | {s['loop_s']['none']} | {s['loop_s']['sync']} | {s['loop_s']['async']} |",
            "",
            f"Host staging buffers of rank 0: {s['staging_bytes_rank0'] / 2**20:.1f} MiB "
            f"(`AsyncCheckpointer.staging_bytes`).",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    from bench.report import provenance

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", default="8m", help="a bench GPT size (8m, 34m, 126m)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--every", type=int, default=5, help="steps between saves")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--tiny", action="store_true", help="a smoke run in seconds")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    started = time.time()
    if args.tiny:
        args.rounds, args.steps, args.every = 1, 4, 2
    with tempfile.TemporaryDirectory(prefix="funcshard-async-save-") as tmp:
        spec = {**vars(args), "directory": tmp, "out": str(args.out)}
        ctx = mp.get_context("spawn")
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(args.world_size)]
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, args.world_size, os.path.join(tmp, "store"), spec, outs[r]),
            )
            for r in range(args.world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            print(f"a rank failed: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
            return 1
        records = [rec for out in outs for rec in json.loads(Path(out).read_text())]
    meta = {
        **provenance("python -m bench.async_save", argv, started),
        "size": "tiny" if args.tiny else args.size,
        "world_size": args.world_size,
        "every": args.every,
        "rounds": args.rounds,
        "steps": args.steps,
    }
    summary = _summary(records)
    text = _markdown(summary, meta)
    if not args.tiny:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {**meta, "summary": summary, "records": records}
        (args.out / "async_save.json").write_text(json.dumps(payload, indent=1) + "\n")
        (args.out / "async_save.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
