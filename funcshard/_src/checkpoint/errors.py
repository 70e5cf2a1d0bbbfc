"""What can be wrong with a checkpoint: each failure is a :class:`CheckpointError` subclass.

Every message names the directory or file, the entry, and what to do.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked."""


class NotACheckpointError(CheckpointError):
    """No checkpoint there: a missing directory, no manifest, or a save that never committed."""


class CorruptCheckpointError(CheckpointError):
    """The files are damaged or inconsistent: truncated data, digests that differ, a malformed manifest."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A file asks for something a checkpoint never contains: code to run, a path outside it, bytes to unpickle."""


class CheckpointMismatchError(CheckpointError):
    """A sound checkpoint of another tree than the one asked for (paths, shapes, dtypes or kinds differ)."""


class CheckpointWarning(UserWarning):
    """A save committed, but what it does after the commit did not all succeed (``keep=``'s cleanup)."""
