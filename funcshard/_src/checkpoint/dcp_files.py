"""A DCP checkpoint's files, opened as untrusted input: regular files inside it, never through a link.

See [Note: reading DCP files] in ``dcp_metadata.py``. A data file's name must be
``__<rank>_<n>.distcp``; every file is opened with ``O_NOFOLLOW`` (and ``O_NONBLOCK``,
so that a FIFO cannot stall the open) and checked to be a regular file once it is open,
so that neither a symlink nor a file swapped in between leads outside the checkpoint.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import BinaryIO

from funcshard._src.checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError

DATA_FILE = re.compile(r"__(0|[1-9][0-9]{0,6})_(0|[1-9][0-9]{0,6})\.distcp")


def open_regular(path: Path, /) -> BinaryIO:
    """``path`` opened for reading, if it is a regular file and not a symlink.

    Raises:
        UnsafeCheckpointError: ``path`` is a symlink or not a regular file.
        CorruptCheckpointError: it is missing or unreadable.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "f"
        >>> _ = path.write_bytes(b"data")
        >>> with open_regular(path) as f:
        ...     f.read()
        b'data'
    """
    try:  # O_NONBLOCK: a FIFO put in a file's place must not block the open
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: missing; the checkpoint is incomplete") from None
    except OSError as e:
        if os.path.islink(path):
            raise UnsafeCheckpointError(
                f"{path}: a symlink; a checkpoint's files are regular files, refusing to follow it"
            ) from None
        raise CorruptCheckpointError(f"{path}: unreadable ({e})") from None
    stream = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(stream.fileno()).st_mode):
        stream.close()
        raise UnsafeCheckpointError(f"{path}: not a regular file; refusing to read it")
    return stream


def read_regular(path: Path, limit: int, /) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes (see :func:`open_regular`).

    Raises:
        UnsafeCheckpointError: ``path`` is a symlink or not a regular file.
        CorruptCheckpointError: it is missing, unreadable or larger than ``limit``.
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CorruptCheckpointError(f"{path}: {size} bytes, more than {limit}")
        return f.read(limit + 1)


def data_files(root: Path, /) -> tuple[dict[str, int], set[str]]:
    """The data files directly in ``root``: the size of each regular one, and the names of links."""
    files: dict[str, int] = {}
    links: set[str] = set()
    with os.scandir(root) as listing:
        for item in listing:
            if DATA_FILE.fullmatch(item.name) is None:
                continue
            if item.is_symlink():
                links.add(item.name)
            elif item.is_file(follow_symlinks=False):
                files[item.name] = item.stat(follow_symlinks=False).st_size
    return files, links
