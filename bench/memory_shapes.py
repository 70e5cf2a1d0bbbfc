"""``python -m bench.memory_shapes``: steady-state peak memory beside FSDP2 on model shapes the project was not tuned on.

Each shape is a GPT-2 (``transformers.GPT2LMHeadModel``, a different family from
``bench.large_model``'s Llama) built on the meta device and wrapped the way an
FSDP2 user wraps it: every block is a unit (``fully_shard`` per block) and the
rest (embeddings, final norm, the head) is the root. funcshard runs
``apply.materialize`` and AdamW (``fs.optim.adamw``); FSDP2 runs ``to_empty``,
the model's ``_init_weights`` and fused ``torch.optim.AdamW``; both take the same
``--steps`` steps on the same tokens, each source in fresh processes, one after the
other in one run.

Every rank reports its steady-state peak RSS growth: the highest RSS of steps 2..N
(the peak is reset after the first step) less its RSS before the model. funcshard's
peak is broken down by category: its shards, optimizer state and gradients (exact,
from the plan), the gathered units and staging buffers at their peak (measured by the
step), shared-memory regions (``RssShmem``), and the rest: activations, autograd's
saved tensors and the allocator's slack. Run with ``MALLOC_MMAP_THRESHOLD_=65536``
(the default here) so freed memory goes back to the system at once and RSS measures
what is held.

    python -m bench.memory_shapes --shapes gpt,deep_narrow --world-size 8
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.large_model import (
    _peak_rss_mib,
    _reset_peak,
    _resident_mib,
    _rss_mib,
    spawn_ranks,
)

# name: (n_embd, n_layer, vocab, tie, tokens per rank)
SHAPES: dict[str, tuple[int, int, int, bool, int]] = {
    "gpt": (1280, 24, 50257, True, 16),  # ~0.54B, tied head, the held-out check's size
    "gpt_untied": (1280, 24, 50257, False, 16),
    "deep_narrow": (512, 96, 50257, True, 16),
    "wide_shallow": (3072, 4, 50257, True, 16),
    "large_vocab": (1024, 8, 256000, False, 8),  # a large vocabulary, a small batch
    "tiny": (64, 2, 256, True, 8),
}
REFERENCE = "fsdp2"


def config(shape: str, scale: float = 1.0) -> Any:
    import transformers

    n_embd, n_layer, vocab, tie, _ = SHAPES[shape]
    width = max(64, int(n_embd * scale) // 64 * 64)
    # the last three go to PretrainedConfig through **kwargs, which pyright does not see
    rest: dict[str, Any] = {"attn_implementation": "eager", "bos_token_id": 0, "eos_token_id": 0}
    return transformers.GPT2Config(
        n_embd=width,
        n_layer=n_layer,
        n_head=width // 64,
        vocab_size=vocab,
        n_positions=64,
        tie_word_embeddings=tie,
        **rest,
    )


def _tokens(shape: str, vocab: int, rank: int) -> Any:
    import torch

    n = SHAPES[shape][4]
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(rank))


def _steady(train: Any, steps: int) -> tuple[float, float, float]:
    """Runs one step, resets the peak, runs the rest; (first step's peak, steady peak, s per step)."""
    train()
    first = _peak_rss_mib()
    _reset_peak()
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        train()
    return first, _peak_rss_mib(), (time.perf_counter() - t0) / max(1, steps - 1)


def _funcshard(
    shape: str, scale: float, rank: int, world: int, tmp: str, steps: int
) -> dict[str, Any]:
    import torch
    import transformers

    import funcshard as fs

    fs.init(backend="gloo", timeout_s=1800)
    cfg = config(shape, scale)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    params, apply = fs.interop.functionalize(model, units=["GPT2Block"])
    plan = fs.plan(params, fs.Mesh({"fsdp": world}), units=apply.units, frozen=apply.frozen)
    baseline = _rss_mib()
    sparams = apply.materialize(plan, seed=0)
    opt = fs.optim.adamw(1e-4)
    state = opt.init(sparams)
    step = fs.value_and_grad(lambda p, ids: apply(p, input_ids=ids, labels=ids).loss, plan)
    ids = _tokens(shape, cfg.vocab_size, rank)
    peaks = {"gathered": 0, "staging": 0, "partial": 0}

    def train() -> None:
        nonlocal sparams, state
        _, grads = step(sparams, ids)
        sparams, state = opt.update_(grads, state, sparams)
        peaks["gathered"] = max(peaks["gathered"], step.stats.peak_gathered_bytes)
        peaks["staging"] = max(peaks["staging"], step.stats.staging_bytes)
        peaks["partial"] = max(peaks["partial"], step.stats.peak_partial_grad_bytes)

    first, steady, seconds = _steady(train, steps)
    memory = fs.cost.estimate(plan, state=apply.state).memory
    mib = 2**20
    breakdown = {
        "shards": (memory.params + memory.frozen) / mib,
        "optimizer": memory.optimizer / mib,
        "gradients": memory.grads / mib,
        "gathered": peaks["gathered"] / mib,
        "staging": peaks["staging"] / mib,
        "partial": peaks["partial"] / mib,
        "regions": _resident_mib().get("shmem", 0.0),
    }
    return _result(
        rank,
        baseline,
        first,
        steady,
        seconds,
        breakdown,
        estimate_gathered=memory.gathered / mib,
        parameters=sum(p.numel() for p in model.parameters()),
    )


def _fsdp2(shape: str, scale: float, rank: int, world: int, tmp: str, steps: int) -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    cfg = config(shape, scale)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    baseline = _rss_mib()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.apply(model._init_weights)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = _tokens(shape, cfg.vocab_size, rank)

    def train() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    first, steady, seconds = _steady(train, steps)
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())  # type: ignore[attr-defined]
    mib = 2**20
    breakdown = {"shards": local / mib, "optimizer": 2 * local / mib, "gradients": local / mib}
    dist.destroy_process_group()
    return _result(rank, baseline, first, steady, seconds, breakdown)


def _result(
    rank: int,
    baseline: float,
    first: float,
    steady: float,
    seconds: float,
    breakdown: dict[str, float],
    **extra: Any,
) -> dict[str, Any]:
    """One rank's figures: peaks as growth over ``baseline``, the breakdown completed by its rest."""
    growth = steady - baseline
    rest = growth - sum(breakdown.values())
    return {
        "rank": rank,
        "baseline": baseline,
        "first_step": first - baseline,
        "steady": growth,
        "seconds": seconds,
        "breakdown": {**breakdown, "rest": rest},
        **extra,
    }


def worker(
    source: str, shape: str, scale: float, rank: int, world: int, port: int, tmp: str, steps: int
) -> None:
    """One rank of ``source`` on ``shape``; writes its figures as JSON into ``tmp``."""
    import warnings

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "DTensor random operators", UserWarning)
    run = _fsdp2 if source == REFERENCE else _funcshard
    result = run(shape, scale, rank, world, tmp, steps)
    Path(tmp, f"{source}-{shape}-rank{rank}.json").write_text(json.dumps(result))


def run(
    source: str, shape: str, scale: float, world: int, tmp: str, steps: int, timeout: float
) -> list[dict[str, Any]]:
    spawn_ranks(
        worker,
        lambda r, port: (source, shape, scale, r, world, port, tmp, steps),
        world,
        timeout,
        f"{source} on {shape}",
    )
    return [
        json.loads(Path(tmp, f"{source}-{shape}-rank{r}.json").read_text()) for r in range(world)
    ]


def _worst(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return max(ranks, key=lambda r: r["steady"])


def table(report: dict[str, Any]) -> str:
    """The report as a Markdown table: each shape's worst rank, funcshard beside FSDP2."""
    cats = ("shards", "optimizer", "gradients", "gathered", "staging", "partial", "regions", "rest")
    lines = [
        "| shape | params | funcshard steady | FSDP2 steady | ratio | "
        + " | ".join(cats)
        + " | FSDP2 rest |",
        "|---|---|---|---|---|" + "---|" * len(cats) + "---|",
    ]
    for shape, sources in report["shapes"].items():
        mine, ref = _worst(sources["funcshard"]), _worst(sources[REFERENCE])
        b = mine["breakdown"]
        lines.append(
            f"| {shape} | {mine['parameters'] / 1e6:.0f}M | {mine['steady']:.0f} | {ref['steady']:.0f} | "
            f"{mine['steady'] / ref['steady']:.2f} | "
            + " | ".join(f"{b.get(c, 0.0):.0f}" for c in cats)
            + f" | {ref['breakdown']['rest']:.0f} |"
        )
    lines.append(
        "\n(MiB, the worst rank's steady-state peak RSS growth over its RSS before the model; "
        "the breakdown is funcshard's: shards, optimizer state and gradients exact; gathered, "
        "staging and partial gradients at their peak as the step measured them; regions: shared "
        "memory resident; rest: activations, autograd's saved tensors, allocator slack)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        prog="python -m bench.memory_shapes", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--shapes", default="gpt,deep_narrow,wide_shallow,large_vocab,gpt_untied")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--scale", type=float, default=1.0, help="multiplies every shape's width (a quicker look)"
    )
    p.add_argument("--sources", default=f"funcshard,{REFERENCE}")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ["OMP_NUM_THREADS"] = "1"
    report: dict[str, Any] = {
        "world_size": args.world_size,
        "steps": args.steps,
        "scale": args.scale,
        "shapes": {},
    }
    with tempfile.TemporaryDirectory(prefix="funcshard-shapes-") as tmp:
        for shape in [s for s in args.shapes.split(",") if s]:
            if shape not in SHAPES:
                p.error(f"--shapes: unknown shape {shape!r}; known: {', '.join(SHAPES)}")
            report["shapes"][shape] = {}
            for source in args.sources.split(","):
                t0 = time.perf_counter()
                ranks = run(
                    source, shape, args.scale, args.world_size, tmp, args.steps, args.timeout
                )
                report["shapes"][shape][source] = ranks
                w = _worst(ranks)
                print(
                    f"{shape} {source}: worst rank's steady growth {w['steady']:.0f} MiB "
                    f"({time.perf_counter() - t0:.0f} s) {json.dumps({k: round(v) for k, v in w['breakdown'].items()})}",
                    flush=True,
                )
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=2))
    if all(len(s) == 2 for s in report["shapes"].values()):
        print(table(report))
    return report


if __name__ == "__main__":
    main()
