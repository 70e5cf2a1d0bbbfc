"""Measures this machine with ``world_size`` local ranks and describes it as a :class:`Hardware`.

The ranks use the backend training would (:func:`backend_for`): NCCL on the
GPUs where there is one per rank, as ``fs.init`` picks it, else gloo on the CPU.

Every rank measures at once, as ranks train at once: each rank's matmul rate,
block rate and memory bandwidth are what it gets while the others run too. The
ranks then time all-gathers, reduce-scatters and all-reduces (bytes counted as
the ledger counts them, so the bandwidths plug straight into the step-time
estimate), a one-element all-reduce (latency), and an all-reduce started under
a matmul (how much communication hides under compute).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from funcshard._src.calibrate import measure
from funcshard._src.comm import collectives, groups
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.plan.hardware import Hardware
from funcshard._src.spec.mesh import Mesh


@dataclass(frozen=True)
class Settings:
    """What to measure with.

    Attributes:
        world_size: local ranks (processes).
        threads: torch threads per rank.
        comm_bytes: bytes of one collective's whole buffer.
        seconds: time per measurement.
        width, seq, batch: the transformer block timed for ``efficiency``.
        backend: the process group's backend; ``None``: :func:`backend_for`'s choice.
    """

    world_size: int = 2
    threads: int = 1
    comm_bytes: int = 32 * 2**20
    seconds: float = 1.0
    width: int = 512
    seq: int = 256
    batch: int = 2
    backend: str | None = None


def backend_for(settings: Settings, /) -> str:
    """The backend calibrate measures: ``settings.backend``, else the one ``fs.init`` would pick.

    NCCL where CUDA is available with a GPU per rank, else gloo.

    Example:
        >>> backend_for(Settings(backend="gloo"))
        'gloo'
    """
    if settings.backend is not None:
        return settings.backend
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= settings.world_size
    return "nccl" if enough else "gloo"


_AXES = ("fsdp",)  # the one mesh axis of the ranks that calibrate times


def calibrate(settings: Settings = Settings(), /, *, name: str = "this-machine") -> Hardware:
    """Measures this machine (its CPU, or its first CUDA device) and returns its description.

    Spawns ``settings.world_size`` processes that rendezvous through a file store
    (no network) and time collectives on the backend of :func:`backend_for`
    (NCCL between GPUs, gloo between CPU processes). The description's inter-node
    figures equal the intra-node ones: one machine cannot measure a network.

    Raises:
        RuntimeError: a rank failed; the message holds its error.
    """
    settings = replace(settings, backend=backend_for(settings))
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="funcshard-calibrate-") as tmp:
        store = os.path.join(tmp, "store")
        pipes = [ctx.Pipe(duplex=False) for _ in range(settings.world_size)]
        procs = [
            ctx.Process(target=_worker, args=(rank, settings, store, send), daemon=True)
            for rank, (_, send) in enumerate(pipes)
        ]
        for p in procs:
            p.start()
        results = [_receive(recv, p) for (recv, _), p in zip(pipes, procs)]
        for p in procs:
            p.join(timeout=60)
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"funcshard calibrate: a rank failed:\n{errors[0]}")
    return describe(results, settings, name=name)


def describe(results: list[dict[str, float]], settings: Settings, /, *, name: str) -> Hardware:
    """A :class:`Hardware` from every rank's measurements: the median over ranks of each.

    Example:
        >>> r = {"peak_flops": 5e10, "block_flops": 4e10, "memory_bandwidth": 8e9,
        ...      "copy_bandwidth": 2e9, "bandwidth": 1e9, "latency": 1e-4, "overlap": 0.2,
        ...      "memory_bytes": 2**33, "devices_per_node": 2}
        >>> hw = describe([r, r], Settings(), name="box")
        >>> hw.efficiency, hw.intra_node_bandwidth, hw.devices_per_node
        (0.8, 1000000000.0, 2)
    """
    m = {key: statistics.median(r[key] for r in results) for key in results[0]}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    env = {
        k: os.environ[k] for k in ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_") if k in os.environ
    }
    source = (
        f"measured by funcshard calibrate on {date}: {platform.platform()}, torch "
        f"{torch.__version__}, {settings.world_size} {settings.backend or 'gloo'} ranks x {settings.threads} thread(s), "
        f"{settings.comm_bytes >> 20} MiB collectives, env {env or 'default'}; block "
        f"{settings.width}x{settings.seq}x{settings.batch}; inter-node = intra-node (not measured)"
    )
    return Hardware(
        name=name,
        peak_flops=m["peak_flops"],
        memory_bytes=int(m["memory_bytes"]),
        memory_bandwidth=m["memory_bandwidth"],
        intra_node_bandwidth=m["bandwidth"],
        inter_node_bandwidth=m["bandwidth"],
        devices_per_node=int(m["devices_per_node"]),
        efficiency=min(1.0, m["block_flops"] / m["peak_flops"]),
        latency=m["latency"],
        overlap=min(1.0, max(0.0, m["overlap"])),
        copy_bandwidth=m["copy_bandwidth"],
        source=source,
    )


def write_json(hardware: Hardware, path: str | os.PathLike[str], /) -> None:
    """Writes ``hardware`` as the JSON object that ``Hardware.from_json`` and ``--hardware`` read."""
    Path(path).write_text(json.dumps(hardware.to_json(), indent=2) + "\n")


def _receive(recv: Connection, proc: Any) -> Any:
    """The rank's result, or its exit code in words if it died without one (no hang)."""
    while not recv.poll(0.5):
        if not proc.is_alive():
            return f"the process exited with code {proc.exitcode} before reporting"
    return recv.recv()


def _worker(rank: int, settings: Settings, store_path: str, conn: Connection) -> None:
    try:
        conn.send(_measure(rank, settings, store_path))
    except BaseException as e:  # report, do not hang the parent
        import traceback

        conn.send(f"rank {rank}: {e!r}\n{traceback.format_exc()}")


def _measure(rank: int, s: Settings, store_path: str) -> dict[str, float]:
    warnings.simplefilter("ignore")  # measuring, not testing
    torch.set_num_threads(s.threads)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= s.world_size
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    backend = s.backend or "gloo"
    extra: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(device)
        extra["device_id"] = device
    store = dist.FileStore(store_path, s.world_size)  # pyright: ignore[reportPrivateImportUsage]
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=s.world_size,
        timeout=datetime.timedelta(seconds=600),
        **extra,
    )
    try:
        return _measure_all(s, device)
    finally:
        dist.destroy_process_group()


def _measure_all(s: Settings, device: torch.device) -> dict[str, float]:
    out: dict[str, float] = {}
    n = 8192 if device.type == "cuda" else 1024
    dtypes = [torch.bfloat16, torch.float32] if device.type == "cuda" else [torch.float32]
    dist.barrier()  # every rank computes at once from here
    rates = {d: measure.matmul_rate(d, device=device, n=n, seconds=s.seconds) for d in dtypes}
    best = max(rates, key=lambda d: rates[d])
    out["peak_flops"] = rates[best]
    dist.barrier()
    out["block_flops"] = measure.block_rate(
        device=device, dtype=best, width=s.width, seq=s.seq, batch=s.batch, seconds=2 * s.seconds
    )
    dist.barrier()
    out["memory_bandwidth"] = measure.memory_bandwidth(device=device, nbytes=64 * 2**20)
    dist.barrier()
    out["copy_bandwidth"] = measure.copy_bandwidth(device=device, nbytes=64 * 2**20)
    # gloo runs on CPU tensors even when the device is a GPU; NCCL on the GPU's
    w = s.world_size
    on = _comm_device(device)
    whole = torch.ones(s.comm_bytes // 4, device=on)
    shard = torch.ones(s.comm_bytes // 4 // w, device=on)
    done = _sync_of(on)  # an NCCL wait returns at once: the time is the stream's

    def seconds_of(fn: Any) -> float:
        return _timed_together(lambda: (fn(), done()), seconds=s.seconds)

    # funcshard's own collectives, with the algorithms a step runs (on one host, gloo's
    # ranks go through shared memory: comm/shm/__init__.py)
    bound = groups.bind(Mesh({_AXES[0]: w}))
    axes = _AXES
    sent = (w - 1) / w * s.comm_bytes  # ledger bytes of a gather or a reduce-scatter
    gather = sent / seconds_of(lambda: collectives.all_gather(shard, bound, axes, out=whole).wait())
    scatter = sent / seconds_of(
        lambda: collectives.reduce_scatter(whole.view(w, -1), bound, axes, out=shard).wait()
    )
    reduce = 2 * sent / seconds_of(lambda: collectives.all_reduce(whole, bound, axes).wait())
    # One bandwidth for every collective: FSDP's step is two gathers and a reduce-scatter.
    out["bandwidth"] = 3 / (2 / gather + 1 / scatter)
    out["all_gather_bandwidth"], out["reduce_scatter_bandwidth"] = gather, scatter
    out["all_reduce_bandwidth"] = reduce
    one = torch.ones(1, device=on)
    out["latency"] = seconds_of(lambda: collectives.all_reduce(one, bound, axes).wait()) / (
        2 * (w - 1)
    )
    out["overlap"] = _overlap(whole, bound, device, n, seconds_of)
    out["memory_bytes"] = _memory_bytes(device, w)
    out["devices_per_node"] = (
        torch.cuda.device_count()
        if device.type == "cuda"
        else max(w, (os.cpu_count() or w) // s.threads)
    )
    return out


def _overlap(
    whole: torch.Tensor, bound: BoundMesh, device: torch.device, n: int, seconds_of: Any
) -> float:
    """The fraction of an all-reduce that hides under a matmul as long as it: ``(a + c - both) / min``."""
    axes = _AXES
    comm = seconds_of(lambda: collectives.all_reduce(whole, bound, axes).wait())
    a = torch.ones(n, n, device=device)
    one = measure.timed(lambda: a @ a, seconds=0.1, sync=_sync_of(device))
    reps = _agree(max(1, round(comm / one)), dist.ReduceOp.MAX)  # a matmul as long as the comm
    compute = seconds_of(lambda: [a @ a for _ in range(reps)])

    def both() -> None:
        pending = collectives.all_reduce(whole, bound, axes)
        for _ in range(reps):
            torch.mm(a, a)
        pending.wait()
        if device.type == "cuda":
            torch.cuda.synchronize()

    together = seconds_of(both)
    return (comm + compute - together) / min(comm, compute)


def _agree(value: int, op: Any, /) -> int:
    """``value`` reduced over the ranks: every rank then runs the same number of collectives."""
    t = torch.tensor([value], device=_comm_device(torch.device("cpu")))
    dist.all_reduce(t, op=op)
    return int(t.item())


def _timed_together(fn: Any, /, *, seconds: float) -> float:
    """The median seconds of ``fn`` (which may hold collectives), over a count all ranks agree on."""
    dist.barrier()
    fn()  # warm-up
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    calls = _agree(max(3, int(seconds / max(first, 1e-6))), dist.ReduceOp.MIN)
    times = []
    for _ in range(calls):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _comm_device(device: torch.device) -> torch.device:
    """Where the process group's collectives take tensors: the rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync_of(device: torch.device) -> Any:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _memory_bytes(device: torch.device, world_size: int) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return float(pages // world_size)  # the ranks of one machine share its memory


def add_arguments(parser: argparse.ArgumentParser, /) -> None:
    """The options of ``funcshard calibrate``."""
    parser.add_argument("--out", type=Path, required=True, help="the hardware JSON to write")
    parser.add_argument("--name", default="this-machine", help="the description's name")
    parser.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: nccl where there is a GPU per rank, else gloo (as fs.init picks)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measurement")


def run(args: argparse.Namespace, /) -> int:
    """``funcshard calibrate``: measures, prints the description and writes it to ``--out``."""
    if args.nproc < 2 or args.threads < 1 or not args.seconds > 0:
        print(
            "funcshard calibrate: error: --nproc >= 2, --threads >= 1, --seconds > 0",
            file=sys.stderr,
        )
        return 2
    settings = Settings(
        world_size=args.nproc, threads=args.threads, seconds=args.seconds, backend=args.backend
    )
    try:
        hardware = calibrate(settings, name=args.name)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    write_json(hardware, args.out)
    print(
        f"{hardware.name}: matmul {hardware.peak_flops / 1e9:.1f} GFLOP/s per rank, a transformer "
        f"block {hardware.efficiency:.0%} of it; memory {hardware.memory_bandwidth / 1e9:.1f} GB/s, "
        f"copies {hardware.copy_rate / 1e9:.2f} GB/s; {backend_for(settings)} {hardware.intra_node_bandwidth / 1e6:.0f} "
        f"MB/s per rank, {hardware.latency * 1e6:.0f} us per ring step, {hardware.overlap:.0%} "
        f"hidden under compute\nwrote {args.out}; use it with --hardware {args.out}"
    )
    return 0
