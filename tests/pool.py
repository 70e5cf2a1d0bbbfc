"""A persistent pool of gloo worker processes per world size, fed many test bodies.

Spawning ranks costs seconds (each imports torch), so each world size's ranks
start once per test session and then run test body after test body. A body is
a picklable module-level function ``body(*args)`` that every rank runs; the
pool returns the per-rank results. A failure on any rank raises
:class:`WorkerError` with that rank's traceback; a body that does not finish in
time (a hang: ranks out of step) raises :class:`PoolTimeoutError` and the pool is
restarted, so one bad test never stalls the session.

Rendezvous is a ``FileStore`` in a fresh temporary directory: no network.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

DEFAULT_TIMEOUT_S = 120.0
GRACE_S = 5.0  # after one rank fails, how long the others get to report


class WorkerError(AssertionError):
    """A test body raised on one or more ranks; the message holds each rank's traceback."""


class PoolTimeoutError(AssertionError):
    """A test body did not finish on every rank in time; the pool was restarted."""


class WorkerPool:
    """``world_size`` gloo ranks in worker processes, started on first use."""

    def __init__(self, world_size: int, *, collective_timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self.collective_timeout_s = collective_timeout_s
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._tmp: str | None = None
        self._first_error_at = 0.0

    def run(
        self, body: Callable[..., Any], /, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> list[Any]:
        """Runs ``body(*args)`` on every rank; returns the results in rank order."""
        if not self._procs:
            self._start()
        message = pickle.dumps((body, args))  # plain pickle: no shared-memory tensor handles
        for conn in self._conns:
            conn.send_bytes(message)
        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < self.world_size:
            pending = {conn: r for r, conn in enumerate(self._conns) if r not in results}
            failed = any(kind == "error" for kind, _ in results.values())
            limit = min(deadline, self._first_error_at + GRACE_S) if failed else deadline
            ready = wait(
                list(pending) + [self._procs[r].sentinel for r in pending.values()],
                max(0.0, limit - time.monotonic()),
            )
            if not ready:
                break
            for conn, r in pending.items():
                if conn in ready:
                    try:
                        results[r] = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        results[r] = (
                            "error",
                            f"rank {r} exited (code {self._procs[r].exitcode}) without a result",
                        )
                elif self._procs[r].sentinel in ready and not conn.poll():
                    results[r] = ("error", f"rank {r} died (exit code {self._procs[r].exitcode})")
                if results.get(r, ("ok",))[0] == "error" and not failed:
                    self._first_error_at = time.monotonic()
                    failed = True
        name = getattr(body, "__qualname__", repr(body))
        missing = [r for r in range(self.world_size) if r not in results]
        errors = {r: v for r, (kind, v) in results.items() if kind == "error"}
        if missing and not errors:
            self.close()
            raise PoolTimeoutError(
                f"{name} did not finish on rank(s) {missing} of world size {self.world_size} within "
                f"{timeout_s:.0f} s (ranks out of step or a collective that never completes); "
                f"the pool was restarted"
            )
        if errors:
            self.close()  # a rank stopped mid-body: its process groups may be out of step
            report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            stuck = (
                f"; rank(s) {missing} were still running and the pool was restarted"
                if missing
                else ""
            )
            raise WorkerError(
                f"{name} failed on rank(s) {sorted(errors)} of {self.world_size}{stuck}\n{report}"
            )
        return [results[r][1] for r in range(self.world_size)]

    def _start(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix=f"funcshard-pool{self.world_size}-")
        store = os.path.join(self._tmp, "store")
        ctx = mp.get_context("spawn")
        for r in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(r, self.world_size, store, self.collective_timeout_s, child),
                daemon=True,
                name=f"funcshard-rank{r}of{self.world_size}",
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def close(self) -> None:
        """Stops every worker (killing those that do not stop) and removes the store."""
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send_bytes(b"")
        for proc in self._procs:
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


class Pools:
    """One :class:`WorkerPool` per world size, each started on first use."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def run(
        self,
        world_size: int,
        body: Callable[..., Any],
        /,
        *args: Any,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> list[Any]:
        """Runs ``body(*args)`` on every rank of a ``world_size`` pool."""
        pool = self._pools.setdefault(world_size, WorkerPool(world_size))
        return pool.run(body, *args, timeout_s=timeout_s)

    def pool(self, world_size: int, /) -> WorkerPool:
        """The pool of ``world_size`` ranks."""
        return self._pools.setdefault(world_size, WorkerPool(world_size))

    def close(self) -> None:
        """Stops every pool."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _worker_main(
    rank: int, world_size: int, store_path: str, timeout_s: float, conn: Connection
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    warnings.simplefilter("error")  # as pytest's filterwarnings = ["error"] in the main process
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)  # pyright: ignore[reportPrivateImportUsage]
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        while True:
            try:
                message = conn.recv_bytes()
            except EOFError:
                return
            if not message:
                return
            try:
                body, args = pickle.loads(message)
                reply = pickle.dumps(("ok", body(*args)))
            except BaseException:
                reply = pickle.dumps(("error", traceback.format_exc()))
            conn.send_bytes(reply)
    finally:
        dist.destroy_process_group()
