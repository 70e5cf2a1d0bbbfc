"""``python -m bench.large_model``: a model no rank holds, from its start to a Hugging Face export.

A Llama of about 0.5B parameters (2 GB in fp32) on W CPU ranks (default 8),
started three ways, each in fresh processes: ``materialize`` (``fs.materialize``
of the abstract params with initializer rules), ``load_pretrained`` (each rank
reads its slices of a safetensors checkpoint that Hugging Face's
``save_pretrained`` wrote) and ``meta_module`` (``apply.materialize`` of a
meta-device ``LlamaForCausalLM``: its own ``_init_weights``, one submodule at a
time). Each then takes one AdamW step and writes ``apply.save_pretrained``.
Every rank reports its peak RSS (``VmHWM``), which must stay below the whole
model's fp32 bytes, next to the RSS the process had before the model (torch and
transformers imported, the model built on the meta device) and to what
``fs.cost.estimate`` predicts for the model state. ``--tiny`` runs a small
model in seconds (the CI smoke run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

SOURCES = ("materialize", "load_pretrained", "meta_module")
FULL = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "vocab_size": 32000,
}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256}


def config(size: dict[str, int]) -> Any:
    import transformers

    return transformers.LlamaConfig(
        hidden_size=size["hidden_size"],
        intermediate_size=size["intermediate_size"],
        num_hidden_layers=size["num_hidden_layers"],
        vocab_size=size["vocab_size"],
        num_attention_heads=size["hidden_size"] // 64,
        num_key_value_heads=size["hidden_size"] // 64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    """This process's peak RSS since it started its program (``VmHWM``).

    Not ``getrusage``'s ``ru_maxrss``: Linux carries that over ``exec`` from the
    forked parent, so a spawned worker would report the launcher's RSS.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def worker(source: str, size: dict[str, int], rank: int, world: int, port: int, tmp: str) -> None:
    """One rank: start the model from ``source``, one AdamW step, export; writes its figures."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch
    import transformers

    import funcshard as fs

    torch.set_num_threads(1)
    fs.init(backend="gloo", timeout_s=1800)
    cfg = config(size)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    # the embedding and the head are units too: in the root they would be gathered,
    # with their gradients, for the whole step (as FSDP users wrap them)
    units = ["LlamaDecoderLayer", "model/embed_tokens", "lm_head"]
    params, apply = fs.interop.functionalize(model, units=units)
    plan = fs.plan(params, fs.Mesh({"fsdp": world}), units=apply.units, frozen=apply.frozen)
    baseline = _rss_mib()  # torch and transformers imported, the model on the meta device
    t0 = time.perf_counter()
    if source == "materialize":
        rules = [("**/*norm/weight", fs.initializers.ones), ("**", fs.initializers.normal(0.02))]
        sparams = fs.materialize(params, plan, rules, seed=0)
        apply.materialize_state()
    elif source == "load_pretrained":
        sparams = apply.load_pretrained(os.path.join(tmp, "hf"), plan)
    else:
        sparams = apply.materialize(plan, seed=0)
    started = time.perf_counter() - t0
    peaks = {"start": _peak_rss_mib()}
    opt = fs.optim.adamw(1e-4)
    state = opt.init(sparams)
    step = fs.value_and_grad(lambda p, ids: apply(p, input_ids=ids, labels=ids).loss, plan)
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(rank))
    t0 = time.perf_counter()
    loss, grads = step(sparams, ids)
    sparams, state = opt.update_(grads, state, sparams)
    del grads
    stepped = time.perf_counter() - t0
    peaks["step"] = _peak_rss_mib()
    t0 = time.perf_counter()
    apply.save_pretrained(sparams, os.path.join(tmp, f"out-{source}"), max_shard_size="200MB")
    saved = time.perf_counter() - t0
    peaks["save"] = _peak_rss_mib()
    memory = fs.cost.estimate(plan, state=apply.state).memory
    result = {
        "rank": rank,
        "peak_rss_mib": peaks["save"],
        "peak_rss_mib_by_phase": peaks,  # the peak so far, after the start, the step, the save
        "baseline_rss_mib": baseline,
        "estimate_mib": (memory.model_state - memory.activations) / 2**20,
        "estimate": memory.to_json(),
        "seconds": {"start": started, "step": stepped, "save": saved},
        "loss": float(loss),
    }
    Path(tmp, f"{source}-rank{rank}.json").write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_hf_checkpoint(size: dict[str, int], path: str) -> None:
    """The model built and initialized by Hugging Face, saved (in a process of its own)."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config(size))
    model.save_pretrained(path, max_shard_size="200MB")
    n = sum(p.numel() for p in model.parameters())
    Path(path, "parameters").write_text(str(n))


def _checkpoint(size: dict[str, int], path: str) -> int:
    """Writes the Hugging Face checkpoint in a child process; the model's parameter count.

    Not here: this process would then hold the whole model's pages when it
    starts the workers.
    """
    writer = mp.get_context("spawn").Process(target=_write_hf_checkpoint, args=(size, path))
    writer.start()
    writer.join()
    if writer.exitcode != 0:
        raise SystemExit(
            f"writing the Hugging Face checkpoint failed (exit code {writer.exitcode})"
        )
    return int(Path(path, "parameters").read_text())


def run(
    source: str, size: dict[str, int], world: int, tmp: str, timeout: float
) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=worker, args=(source, size, r, world, port, tmp)) for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    if failed:
        raise SystemExit(f"{source}: ranks failed (rank, exit code): {failed}")
    return [json.loads(Path(tmp, f"{source}-rank{r}.json").read_text()) for r in range(world)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        prog="python -m bench.large_model", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--tiny", action="store_true", help="a small model: a smoke run in seconds")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args(argv)
    size = TINY if args.tiny else FULL
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed memory goes back at once
    os.environ["OMP_NUM_THREADS"] = "1"
    report: dict[str, Any] = {"world_size": args.world_size, "config": size, "sources": {}}
    with tempfile.TemporaryDirectory(prefix="funcshard-large-") as tmp:
        n = _checkpoint(size, os.path.join(tmp, "hf"))
        bound = n * 4 / 2**20
        report.update(parameters=n, bound_mib=bound)
        print(
            f"Llama of {n / 1e6:.0f}M parameters: {bound:.0f} MiB in fp32, on {args.world_size} ranks"
        )
        for source in [s.strip() for s in args.sources.split(",") if s.strip()]:
            t0 = time.perf_counter()
            ranks = run(source, size, args.world_size, tmp, args.timeout)
            report["sources"][source] = ranks
            print(
                f"\n{source} ({time.perf_counter() - t0:.0f} s): peak RSS per rank vs whole model"
            )
            print(
                f"  {'rank':>4} {'peak':>7} {'start':>7} {'step':>7} {'save':>7} {'before':>7} "
                f"{'estimate':>9} {'bound':>7}   (MiB; start/step/save: the peak by then)"
            )
            for r in ranks:
                by = r["peak_rss_mib_by_phase"]
                print(
                    f"  {r['rank']:>4} {r['peak_rss_mib']:>7.0f} {by['start']:>7.0f} "
                    f"{by['step']:>7.0f} {by['save']:>7.0f} {r['baseline_rss_mib']:>7.0f} "
                    f"{r['estimate_mib']:>9.0f} {bound:>7.0f}"
                )
            worst = max(r["peak_rss_mib"] for r in ranks)
            verdict = "below" if worst < bound else "NOT below"
            print(
                f"  every rank's peak {verdict} the model's fp32 bytes ({worst:.0f} vs {bound:.0f} MiB)"
            )
            if worst >= bound and not args.tiny:  # a tiny model is smaller than the runtime
                report.setdefault("failures", []).append(source)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    if report.get("failures"):
        raise SystemExit(f"peak RSS not below the model's bytes for {report['failures']}")
    return report


if __name__ == "__main__":
    main()
