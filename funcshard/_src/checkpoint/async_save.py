"""``fs.checkpoint.AsyncCheckpointer``: a save copies to host buffers, then writes while training runs.

[Note: async saves]
``AsyncCheckpointer.save`` blocks only for what must happen in step with the other
ranks and before the state changes: the agreement at the start of the save and the
RNG states (two small collectives, as in a blocking save), and the copy of this
rank's chunks into host staging buffers (pinned, in batches, waited for on an
event: [Note: staging in batches] in ``staging.py``), which the checkpointer keeps
and reuses from one save to the next while the chunks keep their shapes
(:attr:`AsyncCheckpointer.staging_bytes`; ``fs.cost.CostModel(async_checkpoint=True)``
counts them). A background thread then writes the files and hashes the chunks
(as ``torch.distributed.checkpoint.async_save`` and Orbax's async checkpointing do).
The thread issues no collective: the control channel's sequence belongs to the
thread that trains, so the ranks' threads exchange their reports through the
process group's store instead; rank 0's thread commits and rotates exactly as a
blocking save does (``save.finish``), and every rank's thread reads rank 0's outcome
from the store. So every rank ends a save with the same outcome (but a rank whose
wait for rank 0's outcome times out, which reports that the save may or may not have
committed), and it surfaces on every rank at the next call: :meth:`SaveHandle.result`, the next save,
:meth:`AsyncCheckpointer.wait` or :meth:`AsyncCheckpointer.close`. At most one save
is in flight: the next waits for it (and raises its error, if it failed and no one
asked). A crash or SIGKILL in the middle of writing leaves the previous checkpoints
as they were, and a staging directory that the run's next committed save removes
(with ``keep=`` or not).
"""

from __future__ import annotations

import datetime
import json
import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from funcshard._src.checkpoint import commit
from funcshard._src.checkpoint.save import (
    Prepared,
    conclude,
    finish,
    local_views,
    prepare,
    write_report,
)
from funcshard._src.checkpoint.staging import Staging
from funcshard._src.comm import runtime, settle

_STORE_PREFIX = "funcshard/async-save"
DEFAULT_WAIT_S = 600.0  # for the threads' store waits when no collective timeout is set


class SaveHandle:
    """One asynchronous save: :meth:`result` waits for it and raises its error on every rank."""

    def __init__(self, prepared: Prepared, thread: threading.Thread, box: dict[str, Any]) -> None:
        self._prepared = prepared
        self._thread = thread
        self._box = box
        self._reported = False

    @property
    def path(self) -> Path:
        """The checkpoint directory this save commits."""
        return self._prepared.target

    def done(self) -> bool:
        """Whether the background work has finished (committed or failed)."""
        return not self._thread.is_alive()

    def result(self) -> Path:
        """Waits for the save; returns its committed path.

        Raises:
            CheckpointError: the save failed on some rank (the message names it);
                nothing was committed. Every rank raises it.

        Warns:
            CheckpointWarning: committed, but ``keep`` could not delete everything.
        """
        self._thread.join()
        self._reported = True
        return conclude(self._prepared, self._box["outcome"])

    @property
    def reported(self) -> bool:
        """Whether :meth:`result` was called (its outcome surfaced)."""
        return self._reported


class AsyncCheckpointer:
    """Saves checkpoints in the background, one at a time, reusing its host staging buffers.

    ``save`` returns once this rank's chunks are copied to host memory; the files
    are written while the next steps run (see [Note: async saves]). The checkpoint
    format, the commit and ``keep=`` are those of :func:`funcshard.checkpoint.save`,
    so a run resumes from an asynchronous save exactly as from a blocking one.

    Example:
        >>> import tempfile, torch, funcshard as fs
        >>> p = {"w": torch.arange(4.0)}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"fsdp": 1})))
        >>> root = tempfile.mkdtemp()
        >>> with fs.checkpoint.AsyncCheckpointer() as saver:
        ...     handle = saver.save(f"{root}/step-1", {"params": sp, "step": 1}, step=1)
        ...     _ = sp["w"].local.add_(1)  # training goes on: the save copied what it writes
        ...     handle.result().name
        'step-1'
        >>> fs.checkpoint.load_full(f"{root}/step-1")["params"]["w"]
        tensor([0., 1., 2., 3.])
    """

    def __init__(self) -> None:
        self._staging = Staging()
        self._pending: SaveHandle | None = None

    @property
    def staging_bytes(self) -> int:
        """Bytes of host memory the staging buffers hold (this rank's chunks of the last save).

        The buffers add under 64 bytes a chunk to align them ([Note: staging in batches] in ``checkpoint/staging.py``).
        """
        return self._staging.chunk_bytes

    def save(
        self,
        path: str | os.PathLike[str],
        state: Any,
        /,
        *,
        step: int | None = None,
        keep: int | None = None,
        run: str | None = None,
        rng: bool = True,
    ) -> SaveHandle:
        """Starts saving ``state`` at ``path``; collective (every rank calls it), returns once staged.

        Args and errors as :func:`funcshard.checkpoint.save`; the ones found while
        writing (a full disk on some rank) surface from :meth:`SaveHandle.result`
        or the next call of this checkpointer, on every rank.

        Raises:
            CheckpointError: the previous save failed and its error was not yet
                reported (this save is not started; call ``save`` again).
        """
        self.wait()
        with settle.operation("fs.checkpoint.save"):
            prepared = prepare(path, state, step=step, keep=keep, run=run, rng=rng)
            try:
                chunks = self._stage(local_views(prepared))
            except BaseException:
                commit.writing(prepared.token, done=True)
                raise
        commit.adopt_run(prepared.run)
        box: dict[str, Any] = {}
        thread = threading.Thread(
            target=_write_and_commit,
            args=(prepared, chunks, box, _exchange_timeout()),
            name=f"funcshard-async-save-{prepared.target.name}",
        )
        thread.start()
        self._pending = SaveHandle(prepared, thread, box)
        return self._pending

    def wait(self) -> Path | None:
        """Waits for the save in flight; its path (``None`` if there is none, or it was reported).

        Raises:
            CheckpointError: it failed (on every rank), unless :meth:`SaveHandle.result`
                already raised that.
        """
        pending, self._pending = self._pending, None
        if pending is None or pending.reported:
            if pending is not None:
                pending._thread.join()  # pyright: ignore[reportPrivateUsage]
            return None
        return pending.result()

    def close(self) -> None:
        """Waits for the save in flight (raising its error) and frees the staging buffers."""
        try:
            self.wait()
        finally:
            self._staging.clear()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stage(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies ``views`` into this checkpointer's host buffers (reused when shapes match); mutates them.

        See [Note: staging in batches] in ``staging.py``: pinned batches from a GPU,
        waited for on an event.
        """
        return self._staging.stage(views)


def _exchange_timeout() -> float:
    return runtime.collective_timeout() or DEFAULT_WAIT_S


def _write_and_commit(
    prepared: Prepared, chunks: dict[str, torch.Tensor], box: dict[str, Any], timeout: float
) -> None:
    """The background thread: writes, exchanges reports, rank 0 commits; ``box["outcome"]``."""
    try:
        report = write_report(prepared.staging, chunks, prepared.rank)
        if not runtime.is_distributed() or runtime.world_size() == 1:
            box["outcome"] = finish(prepared, [report])
        else:
            box["outcome"] = _exchange(prepared, report, timeout)
    except BaseException as e:  # the outcome must exist for result() on every path
        box["outcome"] = {
            "error": f"saving {prepared.target} failed: {type(e).__name__}: {e}",
            "problems": [],
        }
    finally:
        commit.writing(prepared.token, done=True)


def _exchange(prepared: Prepared, report: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Every rank posts its report to the store; rank 0 commits and posts the outcome; all read it."""
    store = dist.distributed_c10d._get_default_store()  # pyright: ignore[reportPrivateUsage]
    world = runtime.world_size()
    prefix = f"{_STORE_PREFIX}/{prepared.token}"
    wait = datetime.timedelta(seconds=timeout)
    store.set(f"{prefix}/report/{prepared.rank}", json.dumps(report))
    if prepared.rank == 0:
        keys = [f"{prefix}/report/{r}" for r in range(world)]
        try:
            store.wait(keys, wait)
            reports = [json.loads(store.get(k)) for k in keys]
        except Exception:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            outcome: dict[str, Any] = {
                "error": f"saving {prepared.target} failed, nothing was committed: ranks "
                f"{missing} did not report their writes within {timeout:g} s (a rank died or "
                f"stopped)",
                "problems": [],
            }
        else:
            outcome = finish(prepared, reports)
        for k in keys:
            store.delete_key(k)
        store.set(f"{prefix}/outcome", json.dumps(outcome))
        return outcome
    try:
        store.wait([f"{prefix}/outcome"], wait)
        outcome = json.loads(store.get(f"{prefix}/outcome"))
    except Exception:
        return {
            "error": f"saving {prepared.target} failed on rank {prepared.rank}: rank 0 did not "
            f"report the commit within {timeout:g} s (it died or stopped); the save may or may "
            f"not have committed: fs.checkpoint.latest(dir) tells",
            "problems": [],
        }
    if store.add(f"{prefix}/read", 1) == world - 1:  # the last reader tidies the store
        store.delete_key(f"{prefix}/outcome")
        store.delete_key(f"{prefix}/read")
    return outcome
