"""What ``keep=`` may delete: the files a save wrote, by their exact names, and nothing else.

[Note: what cleanup deletes]
Rotation removes interrupted saves of the saving run after every committed save, and
with ``save(..., keep=k)`` old checkpoints too. No string read from a file reaches a path: the directories are the
entries of the checkpoint's parent as the operating system lists them, an
interrupted save is recognised by the exact staging name this run gives its saves
(:func:`staging_name`, whose run part follows the last ``@``, a character no run
name holds), and inside a directory only the names a save writes are deleted:
``manifest.json`` (first, so that a crash midway leaves no checkpoint with files
missing), then ``rank<r>/.metadata``, ``rank<r>/.metadata.tmp`` and
``rank<r>/__0_0.distcp``, each only if it is a regular file. A ``rank<r>`` folder and
the checkpoint's folder are removed only once empty: a file a user added (``NOTES.txt``)
stays, in a folder that is no checkpoint any more (it has no manifest). The parent
directory is opened as given (it is the user's path); below it, every step opens the
directory it works in without following symlinks (``O_NOFOLLOW``) and deletes relative
to it, so a symlink is never followed and nothing outside the
parent directory is touched: a symlinked checkpoint (a ``latest`` link) is neither
counted nor deleted.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator, Set
from pathlib import Path

from funcshard._src.checkpoint.manifest import MANIFEST, RUN_NAME

TMP = ".tmp-"
RANK_DIR = re.compile(r"rank(0|[1-9][0-9]{0,5})")
RANK_FILES = frozenset({".metadata", ".metadata.tmp", "__0_0.distcp"})  # what one writer leaves
_STAGING = re.compile(r"\.(?P<name>.+)\.tmp-(?P<token>[0-9a-f]{32})@(?P<run>[^@]+)")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def staging_name(target: str, run: str, token: str, /) -> str:
    """The name of the directory a save of ``target`` by ``run`` writes before it commits.

    Example:
        >>> staging_name("step-5", "job-2", "0" * 32)
        '.step-5.tmp-00000000000000000000000000000000@job-2'
    """
    return f".{target}{TMP}{token}@{run}"


def parse_staging(name: str, /) -> tuple[str, str] | None:
    """``(run, token)`` of a staging directory's name, or ``None`` if it is not one.

    The run is everything after the last ``@``: a run named ``job`` never claims the
    saves of ``job-2`` or ``x.tmp-job``.

    Example:
        >>> parse_staging(staging_name("s", "job-2", "a" * 32))
        ('job-2', 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa')
        >>> parse_staging(".s.tmp-job-2-" + "a" * 32) is None  # funcshard 0.1's names: left alone
        True
    """
    found = _STAGING.fullmatch(name)
    if found is None or RUN_NAME.fullmatch(found["run"]) is None:
        return None
    return found["run"], found["token"]


def interrupted_saves(parent: Path, run: str, /, *, alive: Set[str]) -> Iterator[str]:
    """Names in ``parent`` of ``run``'s staging directories but those of saves ``alive`` (no symlinks)."""
    for entry in os.scandir(parent):
        found = parse_staging(entry.name)
        if (
            found is not None
            and found[0] == run
            and found[1] not in alive
            and entry.is_dir(follow_symlinks=False)
        ):
            yield entry.name


def remove_saved(parent: Path, name: str, /) -> list[str]:
    """Deletes what a save wrote in ``parent/name`` (see [Note: what cleanup deletes]); mutates the disk.

    Returns:
        What stayed because no save writes it (relative to ``parent``); empty when
        the folder itself is gone.

    Raises:
        OSError: a deletion failed (what was deleted stays deleted).
    """
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except (NotADirectoryError, FileNotFoundError):
            return []  # a symlink or gone: not ours to delete
        try:
            left = _remove_inside(fd, name)
        finally:
            os.close(fd)
        if not left:
            os.rmdir(name, dir_fd=parent_fd)
        os.fsync(parent_fd)
        return left
    finally:
        os.close(parent_fd)


def _remove_inside(fd: int, name: str) -> list[str]:
    """Deletes the manifest, then every writer's files, in the directory open as ``fd``."""
    if _unlink_regular(fd, MANIFEST):
        os.fsync(fd)  # the checkpoint is gone before any of its files is
    left: list[str] = []
    for entry in sorted(os.scandir(fd), key=lambda e: e.name):
        if entry.name == MANIFEST:
            left.append(f"{name}/{entry.name}")  # not a regular file: not ours
            continue
        if RANK_DIR.fullmatch(entry.name) is None or not entry.is_dir(follow_symlinks=False):
            left.append(f"{name}/{entry.name}")
            continue
        try:
            sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
        except (NotADirectoryError, FileNotFoundError):
            left.append(f"{name}/{entry.name}")
            continue
        try:
            mine = [e.name for e in os.scandir(sub)]
            for file in mine:
                if file not in RANK_FILES or not _unlink_regular(sub, file):
                    left.append(f"{name}/{entry.name}/{file}")
        finally:
            os.close(sub)
        if not any(x.startswith(f"{name}/{entry.name}/") for x in left):
            os.rmdir(entry.name, dir_fd=fd)
    return left


def _unlink_regular(fd: int, name: str) -> bool:
    """Deletes ``name`` in the directory ``fd`` if it is a regular file; whether it did."""
    try:
        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode):
        return False
    os.unlink(name, dir_fd=fd)
    return True
