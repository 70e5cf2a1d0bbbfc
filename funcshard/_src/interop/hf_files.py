"""The files of a Hugging Face checkpoint: written in order into a staging directory, then published.

See [Note: streaming save] in ``hf_export.py``. A :class:`Writer` appends each
planned tensor to its file as it arrives (the header written when the file opens,
each file synced when full); :func:`publish` makes the staging directory the target,
an index never naming a file that is missing.
"""

from __future__ import annotations

import copy
import glob
import math
import os
import re
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch
from torch import nn

from funcshard._src.dtypes import dtype_name
from funcshard._src.interop.safetensors_format import (
    INDEX,
    SINGLE,
    header_bytes,
    index_bytes,
)

SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
STAGING = re.compile(r"\.[0-9a-f]{12}\.saving")  # after ".{target name}"


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor to write: its key in the files, stored dtype and shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Writer:
    """The planned files, written in order as tensors arrive (on rank 0); writes to ``directory``."""

    def __init__(self, directory: Path, files: list[tuple[str, list[PlannedTensor]]]) -> None:
        self.directory = directory
        self._files = files
        self._file = 0  # the file being written
        self._next = 0  # its next tensor
        self._out: IO[bytes] | None = None

    def write(self, tensors: Sequence[PlannedTensor], values: Sequence[torch.Tensor]) -> None:
        """Appends ``values`` as ``tensors``, the next ones planned; opens and closes files."""
        for tensor, value in zip(tensors, values, strict=True):
            name, planned = self._files[self._file]
            assert planned[self._next] == tensor, (planned[self._next], tensor)
            if self._out is None:
                self._out = open(self.directory / name, "xb")  # noqa: SIM115 (closed when full)
                self._out.write(header_bytes([(t.key, t.dtype, t.shape) for t in planned]))
            data = value.detach().to("cpu", tensor.dtype).contiguous().reshape(-1)
            self._out.write(data.view(torch.uint8).numpy().data)
            self._next += 1
            if self._next == len(planned):
                self._close()

    def finish(
        self, parameters: int, module: nn.Module, dtype: torch.dtype | None, target: Path
    ) -> None:
        """Writes the index and the config, then publishes the directory as ``target``."""
        assert self._file == len(self._files) or self._files == [(SINGLE, [])], "tensors missing"
        if self._files == [(SINGLE, [])]:
            (self.directory / SINGLE).write_bytes(header_bytes([]))
        write_config(module, self.directory, dtype)
        if len(self._files) > 1:
            weight_map = {t.key: name for name, ts in self._files for t in ts}
            size = sum(t.nbytes for _, ts in self._files for t in ts)
            durable(self.directory / INDEX, index_bytes(weight_map, size, parameters))
        publish(self.directory, target, {name for name, _ in self._files})

    def discard(self) -> None:
        """Closes what is open and removes the staging directory."""
        if self._out is not None:
            self._out.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _close(self) -> None:
        assert self._out is not None
        self._out.flush()
        os.fsync(self._out.fileno())
        self._out.close()
        self._out = None
        self._file += 1
        self._next = 0


def write_config(module: nn.Module, directory: Path, dtype: torch.dtype | None) -> None:
    """``config.json`` (and ``generation_config.json``) as Hugging Face's save_pretrained writes them."""
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return
    config = copy.deepcopy(config)  # Hugging Face sets these on the model's own config
    config.architectures = [type(module).__name__]
    if dtype is not None:
        setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype_name(dtype))
    config.save_pretrained(str(directory))
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(str(directory))


def staging_dir(target: Path) -> Path:
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target} is a file; save_pretrained writes a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{glob.escape(target.name)}.*.saving"):
        if STAGING.fullmatch(stale.name[len(target.name) + 1 :]) and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)  # a save to target that was killed
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.saving"
    staging.mkdir()
    return staging


def publish(staging: Path, target: Path, names: set[str]) -> None:
    """``staging`` becomes ``target``; see [Note: streaming save] in ``interop/hf_export.py`` for an existing directory."""
    if not target.exists():
        staging.rename(target)
        return
    for entry in (INDEX, SINGLE):  # first, so that no index names a file being replaced
        (target / entry).unlink(missing_ok=True)
    for file in sorted(staging.iterdir()):
        if file.name != INDEX:
            os.replace(file, target / file.name)
    for stale in target.iterdir():
        if SHARD_FILE.fullmatch(stale.name) and stale.name not in names:
            stale.unlink()
    if (staging / INDEX).exists():
        os.replace(staging / INDEX, target / INDEX)
    staging.rmdir()


def durable(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
