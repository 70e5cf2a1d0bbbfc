"""``python -m bench.gpu``: the one-GPU check, in one process, in under 5 minutes, without a network.

On a machine with a CUDA GPU it starts a one-rank NCCL process group on
``cuda:0`` and reports:

1. ``equality``: ``fs.verify`` of a small GPT, sharded (``full_shard``, shards
   and batches on the GPU) against the unsharded reference;
2. ``sync``: a step, ``clip_by_global_norm`` and AdamW under
   ``torch.cuda.set_sync_debug_mode("error")`` (a host read of a device value
   raises); without CUDA it counts the host reads of tensor scalars
   (``aten._local_scalar_dense``) instead;
3. ``checkpoint``: a blocking and an asynchronous save of the GPU shards and
   AdamW state, each loaded back and compared bit for bit, on the GPU;
4. ``throughput``: bf16 tokens/s and peak CUDA memory of funcshard
   ``full_shard`` against FSDP2 ``fully_shard`` (each block, then the root) on
   a GPT of about 350M parameters, the two alternated twice (A B A B), each
   with its own AdamW;
5. ``streams``: a W=2 ``full_shard`` step under torch's ``fake`` process group,
   shards on the GPU, under ``set_sync_debug_mode("error")``: the collectives go
   through funcshard's side streams (``execute/streams.py``), which a one-rank
   step never reaches (no unit takes a collective at W=1).

Without CUDA the same module falls back to gloo on the CPU at a tiny size, so
that it runs anywhere (``tests/test_bench.py`` runs it). Every report line
starts with ``gpu ``; ``--out DIR`` also writes ``gpu.txt`` and ``gpu.json``.

Running it on a GPU machine with no network: funcshard needs ``optree`` and
``numpy`` besides torch (>= 2.11). Where the image lacks optree, carry its wheel
for that machine's Python (``pip download optree --only-binary=:all: --no-deps
--python-version 3.X -d wheels/`` on a machine with a network), then
``pip install --no-index wheels/optree-*.whl`` there and run
``PYTHONPATH=. python -m bench.gpu`` from this repository's root
(docs/performance.md, "The one-GPU check").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import funcshard as fs
from bench import model as gpt

# about 350M parameters: 24 blocks of width 1024 and a 50304-token vocabulary (GPT-2 medium)
LARGE = gpt.Config(vocab=50304, width=1024, heads=16, layers=24, seq=1024, batch=8)
TINY = gpt.Config(vocab=64, width=32, heads=2, layers=2, seq=16, batch=2)
SMALL = gpt.Config(vocab=128, width=64, heads=2, layers=4, seq=32, batch=2)  # equality, sync
OUT = Path(__file__).parent / "results" / "gpu"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--out", type=Path, default=None, help="write gpu.txt and gpu.json here")
    p.add_argument("--steps", type=int, default=None, help="timed steps a run (GPU 10, CPU 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (GPU 3, CPU 1)")
    p.add_argument("--large", action="store_true", help="the ~350M GPT even without CUDA (slow)")
    return p.parse_args(argv)


class Report:
    """The lines of the report, each starting with ``gpu ``, printed as they come."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.data: dict[str, Any] = {}

    def say(self, text: str) -> None:
        line = f"gpu {text}"
        self.lines.append(line)
        print(line, flush=True)


@contextlib.contextmanager
def process_group(backend: str, device: torch.device) -> Iterator[None]:
    """A one-rank process group on ``backend`` (a file store: no network), destroyed after."""
    with tempfile.TemporaryDirectory(prefix="funcshard-bench-gpu-") as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)  # pyright: ignore[reportPrivateImportUsage]
        extra: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(
            backend,
            store=store,
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=120),
            **extra,
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def _plan(params: Any) -> fs.Plan:
    return fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=["blocks/*"])


def _loss(cfg: gpt.Config) -> Callable[..., torch.Tensor]:
    def loss_fn(params: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return gpt.loss_fn(params, batch[0], batch[1], cfg.heads)

    return loss_fn


def _batch(cfg: gpt.Config, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = gpt.batch(cfg, step, fs.rank())
    return tokens.to(device), targets.to(device)


def check_equality(report: Report, device: torch.device) -> bool:
    """``fs.verify``: the sharded steps on ``device`` equal the unsharded reference."""
    cfg = SMALL
    params = gpt.init_params(cfg)
    result = fs.verify(_loss(cfg), params, _plan(params), _batch(cfg, 0, device), steps=2)
    where = {str(leaf.local.device) for leaf in fs.tree.leaves(fs.shard(params, _plan(params)))}
    ok = bool(result.ok)
    detail = "" if ok else f": {'; '.join(result.problems[:3])}"
    report.say(
        f"equality: {'PASS' if ok else 'FAIL'} fs.verify, full_shard, W={fs.world_size()} "
        f"{dist.get_backend()}, shards on {', '.join(sorted(where))}, 2 SGD steps "
        f"against the unsharded reference{detail}"
    )
    report.data["equality"] = {"ok": ok, "problems": list(result.problems)}
    return ok


def _train_objects(cfg: gpt.Config, device: torch.device) -> tuple[Any, Any, Any, Any]:
    params = gpt.init_params(cfg)
    plan = _plan(params)
    sparams = fs.shard(params, plan, device=device)
    opt = fs.optim.adamw(1e-3, weight_decay=0.1)
    return sparams, opt, opt.init(sparams), fs.value_and_grad(_loss(cfg), plan)


def _one_step(step: Any, opt: Any, sparams: Any, state: Any, batch: Any) -> tuple[Any, Any]:
    _, grads = step(sparams, batch)
    grads, _ = fs.optim.clip_by_global_norm(grads, 1.0)
    return opt.update_(grads, state, sparams)


def check_sync(report: Report, device: torch.device) -> bool:
    """A step, clip and AdamW with no host read of a device value (CUDA: sync debug mode "error")."""
    cfg = SMALL
    sparams, opt, state, step = _train_objects(cfg, device)
    sparams, state = _one_step(step, opt, sparams, state, _batch(cfg, 0, device))  # warm-up
    batch = _batch(cfg, 1, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _one_step(step, opt, sparams, state, batch)
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            ok, detail = True, 'torch.cuda.set_sync_debug_mode("error") raised nothing'
        except RuntimeError as e:
            torch.cuda.set_sync_debug_mode("default")
            ok, detail = False, f"a host sync: {str(e).splitlines()[0]}"
        report.say(f"sync: {'PASS' if ok else 'FAIL'} step + clip + AdamW: {detail}")
        report.data["sync"] = {"ok": ok, "detail": detail}
        return ok
    reads = _count_scalar_reads(lambda: _one_step(step, opt, sparams, state, batch))
    report.say(
        f"sync: {reads} host read(s) of tensor scalars (aten._local_scalar_dense) in step + clip "
        f"+ AdamW on the CPU (no CUDA: set_sync_debug_mode not run)"
    )
    report.data["sync"] = {"ok": None, "scalar_reads": reads}
    return True


def check_streams(report: Report, device: torch.device) -> bool:
    """A W=2 full_shard step under torch's ``fake`` process group, shards on ``device``: on CUDA
    its collectives go through the side streams (``execute/streams.py``), with no host sync.

    At W=1 (the NCCL group of the other checks) every unit is its own shard and no collective
    runs, so the stream path is exercised here, where collectives complete at once and move
    no bytes (the values are not checked; ``equality`` checks values).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from funcshard._src.execute import streams

    cfg = TINY
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        params = gpt.init_params(cfg)
        plan = fs.plan(params, fs.Mesh({"fsdp": 2}), units=["blocks/*"])
        sparams = fs.shard(params, plan, device=device)
        step = fs.value_and_grad(_loss(cfg), plan)
        batch = _batch(cfg, 0, device)
        step(sparams, batch)  # warm-up: learns the call order
        if device.type != "cuda":
            step(sparams, batch)
            detail = "no CUDA: a fake W=2 step ran on the CPU, with no streams (none exist there)"
            report.say(f"streams: SKIP {detail}")
            report.data["streams"] = {"ok": None, "detail": detail}
            return True
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(sparams, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        made = streams._BY_DEVICE.get(device)  # only a collective on the device makes them
        ok = made is not None and made.active
        detail = (
            "side streams made and used, no host sync in the step"
            if ok
            else f"no side streams on {device}"
        )
        report.say(f"streams: {'PASS' if ok else 'FAIL'} fake W=2 full_shard step: {detail}")
        report.data["streams"] = {"ok": ok, "detail": detail}
        return ok
    finally:
        dist.destroy_process_group()


def _count_scalar_reads(fn: Callable[[], Any]) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Count.reads += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.reads


def check_checkpoint(report: Report, device: torch.device) -> bool:
    """A blocking and an async save of the device's shards and AdamW state, loaded back bit for bit."""
    cfg = SMALL
    sparams, opt, state, step = _train_objects(cfg, device)
    sparams, state = _one_step(step, opt, sparams, state, _batch(cfg, 0, device))
    tree = {"params": sparams, "opt": state, "step": 1}
    results = []
    with tempfile.TemporaryDirectory(prefix="funcshard-bench-gpu-ckpt-") as root:
        fs.checkpoint.save(f"{root}/blocking", tree, step=1)
        with fs.checkpoint.AsyncCheckpointer() as saver:
            handle = saver.save(f"{root}/async", tree, step=1)
            staged = saver.staging_bytes
            handle.result()
        for name in ("blocking", "async"):
            loaded = fs.checkpoint.load(f"{root}/{name}", like=tree)
            pairs = list(zip(fs.tree.leaves(loaded), fs.tree.leaves(tree)))
            same = all(
                torch.equal(_local(a), _local(b)) and _local(a).device == _local(b).device
                for a, b in pairs
                if isinstance(b, (torch.Tensor, fs.ShardedTensor))
            )
            results.append((name, same))
    ok = all(same for _, same in results)
    shown = ", ".join(f"{name} {'equal' if same else 'DIFFERENT'}" for name, same in results)
    report.say(
        f"checkpoint: {'PASS' if ok else 'FAIL'} save and load of shards and AdamW state on "
        f"{device}: {shown} (async staged {staged / 2**20:.2f} MiB)"
    )
    report.data["checkpoint"] = {"ok": ok, "staged_bytes": staged}
    return ok


def _local(x: Any) -> torch.Tensor:
    return x.local if isinstance(x, fs.ShardedTensor) else x


def _funcshard_run(cfg: gpt.Config, device: torch.device) -> Callable[[int], Any]:
    params = gpt.init_params(cfg)
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=["blocks/*"])
    sparams = fs.shard(params, plan, device=device)
    del params
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    step = fs.value_and_grad(_loss(cfg), plan, mixed_precision=mp, donate_grads=True)
    opt = fs.optim.adamw(1e-4, weight_decay=0.1)
    box = {"sparams": sparams, "state": opt.init(sparams)}

    def run(i: int) -> Any:
        loss, grads = step(box["sparams"], _batch(cfg, i, device))
        box["sparams"], box["state"] = opt.update_(grads, box["state"], box["sparams"])
        return loss

    return run


def _fsdp2_run(cfg: gpt.Config, device: torch.device) -> Callable[[int], Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (fs.world_size(),))
    model = gpt.GPT(gpt.init_params(cfg), cfg.heads).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def run(i: int) -> Any:
        tokens, targets = _batch(cfg, i, device)
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return run


def _measure(
    name: str,
    make: Callable[..., Callable[[int], Any]],
    cfg: gpt.Config,
    device: torch.device,
    warmup: int,
    steps: int,
) -> dict[str, float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gc.collect()  # the previous run's model and optimizer state
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    run = make(cfg, device)
    for i in range(warmup):
        run(i)
    sync()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        loss = run(i)
    sync()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del run
    return {
        "tokens_per_s": steps * cfg.batch * cfg.seq * fs.world_size() / seconds,
        "step_s": seconds / steps,
        "peak_bytes": float(peak),
        "loss": float(loss),
    }


def check_throughput(
    report: Report, device: torch.device, cfg: gpt.Config, warmup: int, steps: int
) -> None:
    """funcshard full_shard and FSDP2 fully_shard, bf16, alternated twice: tokens/s and peak memory."""
    makers = {"funcshard/full_shard": _funcshard_run, "fsdp2": _fsdp2_run}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in makers}
    for _ in range(2):
        for name, make in makers.items():
            runs[name].append(_measure(name, make, cfg, device, warmup, steps))
    size = gpt.param_count(cfg) / 1e6
    for name, rows in runs.items():
        rate = statistics.median(r["tokens_per_s"] for r in rows)
        peak = max(r["peak_bytes"] for r in rows)
        memory = f"peak CUDA memory {peak / 2**30:.2f} GiB" if peak else "no CUDA memory (CPU)"
        report.say(
            f"throughput {name}: {rate:,.0f} tokens/s (runs: "
            f"{', '.join(format(r['tokens_per_s'], ',.0f') for r in rows)}), {memory}, "
            f"bf16, {size:.3g}M params, batch {cfg.batch}x{cfg.seq}, {steps} steps after {warmup}"
        )
    ours, theirs = (statistics.median(r["tokens_per_s"] for r in runs[n]) for n in makers)
    report.say(f"throughput funcshard/fsdp2: {ours / theirs:.2f}x tokens/s")
    report.data["throughput"] = {"config": cfg.to_json(), "runs": runs}


def main(argv: list[str] | None = None) -> Report:
    args = parse(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(device)
    cfg = LARGE if cuda or args.large else TINY
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    steps = args.steps if args.steps is not None else (10 if cuda else 2)
    report = Report()
    start = time.perf_counter()
    gpu = torch.cuda.get_device_name(device) if cuda else "no CUDA device: the CPU fallback"
    report.say(
        f"on {gpu}; torch {torch.__version__}, {backend}, {platform.python_version()}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )
    ok = True
    with process_group(backend, device):
        assert fs.device() == device, (fs.device(), device)
        for check in (check_equality, check_sync, check_checkpoint):
            try:
                ok &= check(report, device)
            except Exception as e:  # one failed check does not hide the others
                ok = False
                report.say(f"{check.__name__}: ERROR {type(e).__name__}: {e}")
        try:
            check_throughput(report, device, cfg, warmup, steps)
        except Exception as e:
            ok = False
            report.say(f"throughput: ERROR {type(e).__name__}: {e}")
    try:  # its own (fake) process group, after the one above
        ok &= check_streams(report, device)
    except Exception as e:
        ok = False
        report.say(f"check_streams: ERROR {type(e).__name__}: {e}")
    report.say(f"{'PASS' if ok else 'FAIL'} in {time.perf_counter() - start:.0f} s")
    report.data.update(ok=ok, command="python -m bench.gpu " + " ".join(argv or sys.argv[1:]))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu.txt").write_text("\n".join(report.lines) + "\n")
        (args.out / "gpu.json").write_text(json.dumps(report.data, indent=1) + "\n")
    return report


if __name__ == "__main__":
    sys.exit(0 if main().data.get("ok") else 1)
