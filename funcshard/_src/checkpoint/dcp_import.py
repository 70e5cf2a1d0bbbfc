"""Reading a standard DCP checkpoint's tensors into funcshard leaves: each rank only its slices.

A :class:`Request` names a target (a sharded leaf to fill, or a whole tensor as
saved) and the DCP keys that may hold it. :func:`resolve` checks every
request against the index before anything is read (missing keys, shapes and
dtypes, all listed in one error); :func:`read_into` then reads, on this rank,
only the chunks that overlap the boxes the rank holds, from files opened as [Note: reading DCP files] in ``checkpoint/dcp_metadata.py`` says, and checks
each chunk it decodes. :func:`agreed` runs a load on every rank and lets all of
them fail alike when one fails, as ``fs.checkpoint.load`` does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import torch

from funcshard._src.checkpoint import errors as errors_module
from funcshard._src.checkpoint.chunks import Chunk, Region, local_pieces, overlap, whole
from funcshard._src.checkpoint.dcp_files import open_regular
from funcshard._src.checkpoint.dcp_metadata import (
    DcpIndex,
    StoredChunk,
    StoredTensor,
    check_read_once,
    stored_tensor,
)
from funcshard._src.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
)
from funcshard._src.comm import channel, settle
from funcshard._src.dtypes import dtype_name
from funcshard._src.shard.sharded import ShardedTensor
from funcshard._src.untrusted_tensor import load_tensor

T = TypeVar("T")


@dataclass(frozen=True)
class Request:
    """One tensor to read: the first of ``keys`` the checkpoint holds, into ``target``."""

    label: str  # what messages call it: a leaf path, "exp_avg of blocks/0/w"
    keys: tuple[str, ...]  # DCP keys that may hold it, in order of preference
    target: ShardedTensor | torch.Tensor | None  # filled in place; None: a 0-d value, as saved


def resolve(
    index: DcpIndex, requests: Sequence[Request], /, *, unexpected: Sequence[str] = ()
) -> list[StoredTensor]:
    """The checked entry of every request, before anything is read.

    Raises:
        CheckpointMismatchError: keys the checkpoint lacks, tensors whose shape or dtype
            differ from the target's, and the ``unexpected`` keys, every one listed.
        CorruptCheckpointError, UnsafeCheckpointError: see :func:`stored_tensor`; two
            chunks to read share bytes (``check_read_once``).
    """
    missing: list[str] = []
    mismatched: list[str] = []
    resolved: list[StoredTensor] = []
    for request in requests:
        key = present(index, request.keys)
        if key is None:
            missing.append(f"{request.label} ({' or '.join(map(repr, request.keys))})")
            continue
        stored = stored_tensor(index, key)
        resolved.append(stored)
        target = request.target
        if target is None and stored.shape != ():  # the file's shape is never allocated
            mismatched.append(
                f"{request.label}: {key!r} holds a tensor of shape {stored.shape}, where torch "
                f"keeps one number"
            )
        elif target is not None and (
            tuple(target.shape) != stored.shape or target.dtype != stored.dtype
        ):
            mismatched.append(
                f"{request.label}: {key!r} holds {stored.shape} {dtype_name(stored.dtype)}, "
                f"asked for {tuple(target.shape)} {dtype_name(target.dtype)}"
            )
    if missing or mismatched or unexpected:
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint: {', '.join(missing)}")
        if unexpected:
            more = "..." if len(unexpected) > 8 else ""
            problems.append(
                f"{len(unexpected)} entries of the model that it does not have: "
                f"{list(unexpected[:8])}{more}"
            )
        if mismatched:
            problems.append("shape or dtype mismatches: " + "; ".join(mismatched))
        raise CheckpointMismatchError(
            f"{index.directory} does not hold what was asked for: " + " | ".join(problems)
        )
    check_read_once(index, resolved)
    return resolved


def read_into(
    index: DcpIndex, requests: Sequence[Request], resolved: Sequence[StoredTensor], /
) -> list[torch.Tensor | None]:
    """Fills every request's target from its entry (:func:`resolve`'s); mutates the targets' storage.

    Returns:
        Per request, the 0-d tensor as saved where ``target`` is ``None``, else ``None``.

    Raises:
        CorruptCheckpointError, UnsafeCheckpointError: a data file that changed since it
            was listed, is a symlink, or a chunk that does not decode to the tensor its
            entry describes.
    """
    out: list[torch.Tensor | None] = []
    with _DataFiles(index) as files:
        for request, stored in zip(requests, resolved):
            target = request.target
            if target is None:
                value = torch.zeros((), dtype=stored.dtype)  # resolve checked: 0-d
                _fill(files, stored, [((), value)])
                out.append(value)
                continue
            if isinstance(target, ShardedTensor):
                pieces = local_pieces(target)  # views of the target's flat buffer
            else:
                pieces = [(whole(stored.shape), target)]
            with torch.no_grad():
                _fill(files, stored, pieces)
            out.append(None)
    return out


def present(index: DcpIndex, keys: Sequence[str], /) -> str | None:
    """The first of ``keys`` that ``index`` holds, or ``None``."""
    return next((k for k in keys if k in index.kinds), None)


def agreed(what: str, directory: Path, body: Callable[[], tuple[str, T]], /) -> T:
    """``body()``'s result once every rank ran it without error and read the same checkpoint; collective.

    ``body`` returns ``(digest of what it read, result)``.

    Raises:
        Exception: ``body``'s own error on the rank where it failed; on the others a
            :class:`CheckpointError` (the same subclass where it is one) naming that rank.
        CheckpointError: the ranks read different checkpoints.
    """
    with settle.operation(what):
        failure: Exception | None = None
        result: Any = None
        digest = None
        try:
            digest, result = body()
        except Exception as e:  # every rank must learn of it
            failure = e
        status = {
            "error": None if failure is None else f"{type(failure).__name__}: {failure}",
            "class": None if failure is None else type(failure).__name__,
            "checkpoint": digest,
            "path": str(directory),
        }
        everyone = channel.all_gather_json(status, what)
        if failure is not None:
            raise failure
        failed = [(r, s) for r, s in enumerate(everyone) if s["error"]]
        if failed:
            r, s = failed[0]
            named = getattr(errors_module, str(s["class"]), None)
            error = (
                named
                if isinstance(named, type) and issubclass(named, CheckpointError)
                else CheckpointError
            )
            raise error(f"{directory}: loading failed on rank {r}: {s['error']}")
        if any(s["checkpoint"] != digest for s in everyone):
            listing = "; ".join(f"rank {r}: {s['path']}" for r, s in enumerate(everyone))
            raise CheckpointError(
                f"the ranks read different checkpoints ({listing}); every rank must read the same "
                f"one, from a directory every rank sees"
            )
    return result


# -- helpers -----------------------------------------------------------------------


def _fill(
    files: _DataFiles, stored: StoredTensor, pieces: Sequence[tuple[Region, torch.Tensor]]
) -> None:
    """Copies each chunk's overlap with each piece into the piece's view; mutates the views."""
    for chunk in stored.chunks:
        box = Chunk(stored.key, chunk.offsets, chunk.sizes, 0)
        hits = [(view, overlap(region, box)) for region, view in pieces]
        hits = [(view, hit) for view, hit in hits if hit is not None]
        if not hits:
            continue
        data = files.read(stored, chunk)
        for view, (dst, src) in hits:
            view[dst].copy_(data[src])


class _DataFiles:
    """The checkpoint's data files, each opened once without following links, checked as listed."""

    def __init__(self, index: DcpIndex) -> None:
        self._index = index
        self._open: dict[str, BinaryIO] = {}

    def __enter__(self) -> _DataFiles:
        return self

    def __exit__(self, *_: object) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def read(self, stored: StoredTensor, chunk: StoredChunk) -> torch.Tensor:
        """The tensor of one chunk, checked as funcshard's own chunks are (``load_tensor``)."""
        stream = self._stream(chunk.file)
        stream.seek(chunk.offset)
        blob = stream.read(chunk.length)
        return load_tensor(
            blob,
            dtype=stored.dtype,
            shape=chunk.sizes,
            where=f"{self._index.directory / chunk.file}, entry {stored.key!r} at {chunk.offsets}",
            declared_by="its entry in .metadata",
            error=CorruptCheckpointError,
        )

    def _stream(self, name: str) -> BinaryIO:
        stream = self._open.get(name)
        if stream is not None:
            return stream
        path = self._index.directory / name
        stream = open_regular(path)
        size = os.fstat(stream.fileno()).st_size
        if size != self._index.files.get(name):
            stream.close()
            raise CorruptCheckpointError(
                f"{path}: changed while the checkpoint was read ({size} bytes, listed "
                f"{self._index.files.get(name)}); read it again once nothing writes it"
            )
        self._open[name] = stream
        return stream
