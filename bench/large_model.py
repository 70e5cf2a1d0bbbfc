"""``python -m bench.large_model``: a model no rank holds, from its start to a Hugging Face export.

A Llama of about 0.5B parameters (2 GB in fp32) on W CPU ranks (default 8),
started three ways, each in fresh processes: ``materialize`` (``fs.materialize``
of the abstract params with initializer rules), ``load_pretrained`` (each rank
reads its slices of a safetensors checkpoint that Hugging Face's
``save_pretrained`` wrote) and ``meta_module`` (``apply.materialize`` of a
meta-device ``LlamaForCausalLM``: its own ``_init_weights``, one submodule at a
time), planned with ``layout="auto"``. Each then takes ``--steps`` AdamW steps and writes
``apply.save_pretrained``. Every rank reports its peak RSS (``VmHWM``), which
must stay below the whole model's fp32 bytes, next to the RSS the process had
before the model (torch and transformers imported, the model built on the meta
device) and to what ``fs.cost.estimate`` predicts for the model state.

The reference, ``fsdp2``, is the same model under PyTorch's FSDP2: built on
the meta device, ``fully_shard`` on each decoder layer and on the root,
``to_empty`` and Hugging Face's ``_init_weights``, ``torch.optim.AdamW``
(fused, as ``fs.optim.adamw``), the same steps. For every source the table
compares, per rank and as growth over the RSS before the model, the peak up
to the end of the first step and the steady-state peak: the highest RSS
during steps 2 to N alone (the peak is reset after the first step through
``/proc/self/clear_refs``), which is what a long run holds. ``--tiny`` runs a
small model in seconds (the CI smoke run).
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

SOURCES = ("materialize", "load_pretrained", "meta_module", "fsdp2")
REFERENCE = "fsdp2"  # PyTorch's FSDP2, for comparison: not held to the bound
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


def _reset_peak() -> bool:
    """Sets this process's peak RSS (``VmHWM``) to its RSS now; whether Linux allowed it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _resident_mib() -> dict[str, float]:
    """This process's RSS now, split into anonymous memory and shared memory (``memfd``, ``/dev/shm``)."""
    fields = {"RssAnon:": "anon", "RssShmem:": "shmem", "RssFile:": "file"}
    out: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(maxsplit=1)[0] if line.strip() else ""
            if key in fields:
                out[fields[key]] = int(line.split()[1]) / 1024
    return out


def _steps(step_fn: Any, steps: int) -> tuple[dict[str, float], dict[str, float], float]:
    """Takes ``steps`` training steps; the peaks (first step, steps 2..N), seconds per step, last loss.

    The peak is reset after the first step, so ``"steady"`` is the highest RSS of
    the later steps alone (the first step's peak where there are none, or where
    the reset is not allowed).
    """
    t0 = time.perf_counter()
    loss = step_fn()
    seconds = {"first_step": time.perf_counter() - t0}
    peaks = {"first_step": _peak_rss_mib()}
    reset = _reset_peak()
    peaks["after_first_step"] = _rss_mib()
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        loss = step_fn()
    seconds["later_steps"] = (time.perf_counter() - t0) / max(1, steps - 1)
    peaks["steady"] = _peak_rss_mib() if reset and steps > 1 else peaks["first_step"]
    return peaks, seconds, loss


def worker(
    source: str, size: dict[str, int], rank: int, world: int, port: int, tmp: str, steps: int
) -> None:
    """One rank: start the model from ``source``, ``steps`` AdamW steps, export; writes its figures."""
    if source == REFERENCE:
        _fsdp2_worker(size, rank, world, port, tmp, steps)
        return
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
    # the planner picks each unit's layout: flat decoder layers gather straight into their
    # storage, with no staging buffer and no unpacking copy at any W
    plan = fs.plan(
        params,
        fs.Mesh({"fsdp": world}),
        units=apply.units,
        frozen=apply.frozen,
        layout="auto",
    )
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

    def train() -> float:
        nonlocal sparams, state
        loss, grads = step(sparams, ids)
        sparams, state = opt.update_(grads, state, sparams)
        return float(loss)  # the gradients are dropped, as a training loop does

    stepped, seconds, loss = _steps(train, steps)
    peaks.update(stepped)
    resident = _resident_mib()
    _reset_peak()
    t0 = time.perf_counter()
    apply.save_pretrained(sparams, os.path.join(tmp, f"out-{source}"), max_shard_size="200MB")
    seconds.update(start=started, save=time.perf_counter() - t0)
    peaks["save"] = _peak_rss_mib()
    memory = fs.cost.estimate(plan, state=apply.state).memory
    result = {
        "rank": rank,
        "peak_rss_mib": max(peaks["first_step"], peaks["steady"], peaks["save"]),
        # the peak so far after the start and the first step; then the peak of the later
        # steps alone, and of the export alone (each reset before it), and the RSS between
        "peak_rss_mib_by_phase": peaks,
        "resident_mib_after_steps": resident,
        "baseline_rss_mib": baseline,
        "estimate_mib": (memory.model_state - memory.activations) / 2**20,
        "estimate": memory.to_json(),
        "seconds": seconds,
        "loss": loss,
    }
    Path(tmp, f"{source}-rank{rank}.json").write_text(json.dumps(result))


def _fsdp2_worker(
    size: dict[str, int], rank: int, world: int, port: int, tmp: str, steps: int
) -> None:
    """One rank of the reference: the model under FSDP2, ``steps`` AdamW steps; writes its figures."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import datetime
    import warnings

    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    # _init_weights' normal_ on a sharded DTensor: each rank draws its own shard
    warnings.filterwarnings("ignore", "DTensor random operators", UserWarning)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    cfg = config(size)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    baseline = _rss_mib()  # as funcshard's: torch and transformers imported, the model on meta
    t0 = time.perf_counter()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.apply(model._init_weights)  # the rotary embedding's buffers too
    started = time.perf_counter() - t0
    peaks = {"start": _peak_rss_mib()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(rank))

    def train() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    stepped, seconds, loss = _steps(train, steps)
    peaks.update(stepped)
    seconds["start"] = started
    result = {
        "rank": rank,
        "peak_rss_mib": max(peaks["first_step"], peaks["steady"]),
        "peak_rss_mib_by_phase": peaks,
        "resident_mib_after_steps": _resident_mib(),
        "baseline_rss_mib": baseline,
        "seconds": seconds,
        "loss": loss,
    }
    Path(tmp, f"{REFERENCE}-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


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


def spawn_ranks(target: Any, args_of: Any, world: int, timeout: float, what: str) -> None:
    """Runs ``target(*args_of(rank, port))`` in ``world`` fresh processes, one a rank; waits.

    Ranks still running after ``timeout`` seconds are killed; any rank that did not exit
    cleanly ends the benchmark, naming ``what`` and every such rank's exit code.
    """
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=target, args=args_of(r, port)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise SystemExit(f"{what}: ranks failed (rank, exit code): {failed}")


def run(
    source: str, size: dict[str, int], world: int, tmp: str, timeout: float, steps: int
) -> list[dict[str, Any]]:
    spawn_ranks(
        worker, lambda r, port: (source, size, r, world, port, tmp, steps), world, timeout, source
    )
    return [json.loads(Path(tmp, f"{source}-rank{r}.json").read_text()) for r in range(world)]


def _print_source(source: str, ranks: list[dict[str, Any]], bound: float, seconds: float) -> None:
    print(f"\n{source} ({seconds:.0f} s): peak RSS per rank vs whole model")
    print(
        f"  {'rank':>4} {'peak':>7} {'before':>7} {'start':>7} {'step 1':>7} {'steady':>7} "
        f"{'save':>7} {'anon':>7} {'shmem':>7} {'estimate':>9} {'bound':>7}"
    )
    for r in ranks:
        by = r["peak_rss_mib_by_phase"]
        now = r["resident_mib_after_steps"]
        save = f"{by['save']:>7.0f}" if "save" in by else f"{'-':>7}"
        estimate = f"{r['estimate_mib']:>9.0f}" if "estimate_mib" in r else f"{'-':>9}"
        print(
            f"  {r['rank']:>4} {r['peak_rss_mib']:>7.0f} {r['baseline_rss_mib']:>7.0f} "
            f"{by['start']:>7.0f} {by['first_step']:>7.0f} {by['steady']:>7.0f} {save} "
            f"{now.get('anon', 0):>7.0f} {now.get('shmem', 0):>7.0f} {estimate} {bound:>7.0f}"
        )
    print(
        "  (MiB; before: RSS before the model; start, step 1: the peak by then; steady: the\n"
        "  peak of steps 2..N alone; save: of the export alone; anon, shmem: RSS after the steps)"
    )


def _growth(r: dict[str, Any], phase: str) -> float:
    """A rank's peak in ``phase`` less its RSS before the model, MiB."""
    return r["peak_rss_mib_by_phase"][phase] - r["baseline_rss_mib"]


def _print_comparison(report: dict[str, Any]) -> None:
    """Each funcshard source's peaks against FSDP2's, as growth over the RSS before the model."""
    sources = report["sources"]
    if REFERENCE not in sources:
        return
    ref = sources[REFERENCE]
    for source, ranks in sources.items():
        if source == REFERENCE:
            continue
        print(f"\n{source} vs {REFERENCE}: peak RSS growth over the RSS before the model (MiB)")
        print(
            f"  {'rank':>4} {'step 1':>8} {'fsdp2':>8} {'ratio':>6}   "
            f"{'steady':>8} {'fsdp2':>8} {'ratio':>6}"
        )
        rows = list(zip(ranks, ref, strict=True))
        for mine, theirs in rows:
            a, b = _growth(mine, "first_step"), _growth(theirs, "first_step")
            c, d = _growth(mine, "steady"), _growth(theirs, "steady")
            print(
                f"  {mine['rank']:>4} {a:>8.0f} {b:>8.0f} {a / b:>6.2f}   {c:>8.0f} {d:>8.0f} {c / d:>6.2f}"
            )
        for phase in ("first_step", "steady"):
            a = max(_growth(m, phase) for m, _ in rows)
            b = max(_growth(t, phase) for _, t in rows)
            print(f"  worst rank, {phase.replace('_', ' ')}: {a:.0f} vs {b:.0f} MiB ({a / b:.2f}x)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        prog="python -m bench.large_model", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--steps", type=int, default=3, help="AdamW steps per source (at least 1)")
    p.add_argument("--tiny", action="store_true", help="a small model: a smoke run in seconds")
    p.add_argument(
        "--default-malloc",
        action="store_true",
        help="keep glibc's own thresholds (no MALLOC_MMAP_THRESHOLD_=65536): freed memory may stay",
    )
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    size = TINY if args.tiny else FULL
    if args.default_malloc:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    else:
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed memory goes back at once
    os.environ["OMP_NUM_THREADS"] = "1"
    report: dict[str, Any] = {
        "world_size": args.world_size,
        "config": size,
        "steps": args.steps,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"),
        "sources": {},
    }
    with tempfile.TemporaryDirectory(prefix="funcshard-large-") as tmp:
        n = _checkpoint(size, os.path.join(tmp, "hf"))
        bound = n * 4 / 2**20
        report.update(parameters=n, bound_mib=bound)
        print(
            f"Llama of {n / 1e6:.0f}M parameters: {bound:.0f} MiB in fp32, on {args.world_size} "
            f"ranks, {args.steps} steps, MALLOC_MMAP_THRESHOLD_={report['malloc_mmap_threshold']}"
        )
        for source in [s.strip() for s in args.sources.split(",") if s.strip()]:
            t0 = time.perf_counter()
            ranks = run(source, size, args.world_size, tmp, args.timeout, args.steps)
            report["sources"][source] = ranks
            _print_source(source, ranks, bound, time.perf_counter() - t0)
            worst = max(r["peak_rss_mib"] for r in ranks)
            verdict = "below" if worst < bound else "NOT below"
            print(
                f"  every rank's peak {verdict} the model's fp32 bytes ({worst:.0f} vs {bound:.0f} MiB)"
            )
            # a tiny model is smaller than the runtime; FSDP2 is the reference, not held to it
            if worst >= bound and not args.tiny and source != REFERENCE:
                report.setdefault("failures", []).append(source)
        _print_comparison(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    if report.get("failures"):
        raise SystemExit(f"peak RSS not below the model's bytes for {report['failures']}")
    return report


if __name__ == "__main__":
    main()
