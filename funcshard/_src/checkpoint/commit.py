"""Atomic commits, runs, rotation and finding the latest checkpoint.

A save writes into a staging directory next to its target and renames it into
place only when every file and the manifest are on disk: a crash at any point
leaves either nothing at the target or a complete checkpoint.

[Note: runs]
Every checkpoint records the *run* that wrote it. A process's run is, in
order: the ``run=`` it passes; the run of the checkpoint it saved or loaded
last (a resumed job continues its run); ``FUNCSHARD_RUN``, or torchrun's
``TORCHELASTIC_RUN_ID`` (the same for every restart of one job); otherwise a
fresh id chosen by rank 0 at the first save. A run's name is a short name of
ASCII letters, digits, ``-``, ``_`` and ``.`` (not first): :data:`RUN_NAME`, checked
where it is given and where a manifest is read, since it becomes part of a staging
directory's name. Rotation (``keep``) deletes only checkpoints and interrupted
saves of the run that saves (compared by equality, never matched as a pattern),
never the checkpoint just written, and only the files a save wrote (see
[Note: what cleanup deletes] in ``cleanup.py``); :func:`latest` returns the newest
checkpoint of the process's run, or of the only run in the directory, and refuses
to guess between runs. So two jobs that save side by side into one directory never
prune or resume each other's checkpoints.
"""

from __future__ import annotations

import os
import stat
import threading
import uuid
from pathlib import Path
from typing import Any

from funcshard._src.checkpoint.cleanup import (
    TMP,
    interrupted_saves,
    remove_saved,
    staging_name,
)
from funcshard._src.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NotACheckpointError,
)
from funcshard._src.checkpoint.manifest import RUN_NAME, is_checkpoint, read_manifest

RUN_ENV = ("FUNCSHARD_RUN", "TORCHELASTIC_RUN_ID")

_current_run: str | None = None  # see [Note: runs]; set by saves and loads
_in_flight: set[str] = set()  # tokens of this process's saves still writing: rotation spares them
_in_flight_lock = threading.Lock()


def check_step(step: object, /) -> int | None:
    """``step`` if it is ``None`` or an integer >= 0.

    Raises:
        TypeError: any other value (a string, a float, a bool).
    """
    if step is None or (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        return step  # pyright: ignore[reportReturnType]
    raise TypeError(
        f"step must be an integer >= 0 (or None), got {step!r}; checkpoints are ordered by it"
    )


def check_keep(keep: object, /) -> int | None:
    """``keep`` if it is ``None`` or an integer >= 1.

    Raises:
        ValueError: ``keep`` < 1 (which would delete the checkpoint just written).
        TypeError: not an integer.
    """
    if keep is None:
        return None
    if not isinstance(keep, int) or isinstance(keep, bool):
        raise TypeError(f"keep must be an integer >= 1 (or None to keep all), got {keep!r}")
    if keep < 1:
        raise ValueError(
            f"keep={keep} would delete the checkpoint just written; keep must be >= 1 (or None "
            f"to keep every checkpoint)"
        )
    return keep


def check_run(run: object, /) -> str | None:
    """``run`` if it is ``None`` or a usable run name (:data:`RUN_NAME`).

    Raises:
        ValueError: an empty or unusable name.
    """
    if run is None:
        return None
    if not isinstance(run, str) or RUN_NAME.fullmatch(run) is None:
        raise ValueError(
            f"run must be a name of ASCII letters, digits, '-', '_' or '.' (not first; at most "
            f"128), got {run!r}"
        )
    return run


def proposed_run(run: str | None, /) -> str:
    """The run a save would record on this rank (see [Note: runs]); rank 0's wins."""
    if run is not None:
        return run
    if _current_run is not None:
        return _current_run
    for name in RUN_ENV:
        value = os.environ.get(name, "")
        if value and check_run_quietly(value):
            return value
    return uuid.uuid4().hex[:16]


def check_run_quietly(run: str, /) -> bool:
    """Whether ``run`` is a usable run name."""
    try:
        check_run(run)
    except ValueError:
        return False
    return True


def adopt_run(run: str, /) -> None:
    """Makes ``run`` this process's run (after a save or a load); mutates process-wide state."""
    global _current_run
    _current_run = run


def writing(token: str, /, *, done: bool = False) -> None:
    """Records that the save ``token`` is (or, with ``done``, no longer is) being written; mutates."""
    with _in_flight_lock:
        if done:
            _in_flight.discard(token)
        else:
            _in_flight.add(token)


def staging_dir(target: Path, run: str, token: str, /) -> Path:
    """Where a save of ``target`` by ``run`` writes before it commits (see ``cleanup.staging_name``)."""
    return target.parent / staging_name(target.name, check_run(run) or "", token)


def commit(staging: Path, target: Path, /) -> None:
    """Renames ``staging`` to ``target`` and syncs the parent: the commit; mutates the disk.

    Raises:
        OSError: the rename or the sync failed (after a failed sync, ``target`` exists).
    """
    rename_into_place(staging, target)
    fsync_dir(target.parent)


def rename_into_place(staging: Path, target: Path, /) -> None:
    """Syncs ``staging`` and renames it to ``target``: once it returns, the save committed; mutates.

    Raises:
        OSError: the rename failed: nothing was committed.
        FileExistsError: ``target`` appeared meanwhile (nothing was committed).
    """
    fsync_dir(staging)
    if os.path.lexists(target):
        raise FileExistsError(f"{target} appeared while the save was being written")
    os.rename(staging, target)  # atomic on one filesystem


def fsync_dir(directory: Path, /) -> None:
    """Flushes a directory's entries to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rotate(parent: Path, run: str, keep: int | None, /, *, written: Path, token: str) -> list[str]:
    """Deletes all but ``keep`` newest checkpoints of ``run`` in ``parent``, and its interrupted saves.

    Never deletes ``written`` (the checkpoint just committed), another run's files,
    or a file no save writes; see [Note: runs] and [Note: what cleanup deletes] in ``checkpoint/cleanup.py``.
    With ``keep=None`` only the interrupted saves go. Mutates the disk.

    Returns:
        What could not be deleted, in words (empty when all went well); the caller
        reports it: the save committed either way.
    """
    problems: list[str] = []
    try:
        with _in_flight_lock:
            alive = {token, *_in_flight}
        stale = sorted(interrupted_saves(parent, run, alive=alive))
    except OSError as e:
        return [f"cannot list {parent} ({e})"]
    for name in stale:
        try:
            remove_saved(parent, name)
        except OSError as e:
            problems.append(f"{parent / name}: {e}")
    if keep is None:
        return problems
    try:
        found = _checkpoints(parent)
    except (OSError, CheckpointError) as e:
        return [*problems, f"cannot list the checkpoints of {parent} ({e})"]
    mine = [(d, m) for d, m in found if m["run"] == run and d.name != written.name]
    mine.sort(key=_order)
    for old, _ in mine[: max(0, len(mine) - (keep - 1))]:
        try:
            remove_saved(parent, old.name)
        except OSError as e:
            problems.append(f"{old}: {e}")
    return problems


def latest(directory: str | os.PathLike[str], /, *, run: str | None = None) -> Path | None:
    """The newest complete checkpoint of this run in ``directory`` (highest step, then newest), or ``None``.

    Directories that are not checkpoints and saves that never committed are
    skipped. "This run" is ``run`` if given, else the run this process saved or
    loaded last, else ``FUNCSHARD_RUN`` / torchrun's run id if the directory holds
    checkpoints of it, else the only run in the directory (see ``docs/checkpoints.md``).

    Raises:
        CheckpointError: the directory holds checkpoints of several runs and none
            is this process's; the message lists them and how to choose.
        CorruptCheckpointError: a checkpoint's manifest is damaged (move it away).

    Example:
        >>> import tempfile, funcshard as fs
        >>> root = tempfile.mkdtemp()
        >>> for step in (1, 2):
        ...     _ = fs.checkpoint.save(f"{root}/step-{step}", {"step": step}, step=step)
        >>> latest(root).name
        'step-2'
    """
    run = check_run(run)
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = _checkpoints(directory)
    if not found:
        return None
    runs = sorted({m["run"] for _, m in found})
    wanted = run or _current_run
    if wanted is None:
        env = [os.environ.get(name, "") for name in RUN_ENV]
        wanted = next((r for r in env if r in runs), None)
    if wanted is None:
        if len(runs) > 1:
            newest = {r: max((dm for dm in found if dm[1]["run"] == r), key=_order) for r in runs}
            listing = ", ".join(f"{r!r} (newest {newest[r][0].name})" for r in runs)
            raise CheckpointError(
                f"{directory} holds checkpoints of {len(runs)} runs ({listing}); say which to "
                f"resume: fs.checkpoint.latest(dir, run=...), and save with the same run=, or "
                f"give each run its own directory"
            )
        wanted = runs[0]
    mine = [(d, m) for d, m in found if m["run"] == wanted]
    return max(mine, key=_order)[0] if mine else None


def _checkpoints(parent: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every committed checkpoint directly in ``parent`` with its manifest.

    Directories without a manifest (not checkpoints, or saves that never
    committed) are skipped; a manifest that does not read raises.
    """
    out: list[tuple[Path, dict[str, Any]]] = []
    for d in sorted(parent.iterdir()):
        try:
            real_dir = stat.S_ISDIR(os.lstat(d).st_mode)
        except FileNotFoundError:  # deleted meanwhile (another run's rotation)
            continue
        if TMP in d.name or not real_dir or not is_checkpoint(d):
            continue  # a symlink to a checkpoint (a ``latest`` link) is not one more checkpoint
        try:
            out.append((d, read_manifest(d)))
        except NotACheckpointError:
            continue
        except CorruptCheckpointError as e:  # UnsafeCheckpointError stays one
            raise type(e)(
                f"{e}. Move or delete {d} to go on with the other checkpoints in {parent}"
            ) from None
    return out


def _order(dm: tuple[Path, dict[str, Any]]) -> tuple[int, int]:
    step = dm[1]["step"]
    return (step if step is not None else -1, dm[0].stat().st_mtime_ns)
