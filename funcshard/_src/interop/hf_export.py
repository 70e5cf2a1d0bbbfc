"""``save_pretrained``: sharded params written as a Hugging Face checkpoint, one flat buffer at a time.

[Note: streaming save]
Every rank takes part; rank 0 alone writes. What is written, and into which file, is
fixed before any data moves, from shapes and dtypes alone: then each flat buffer in
turn is gathered to rank 0, its leaves are appended to the open file (whose header
was written when it was opened) and freed, so no rank ever holds more than one
gathered flat buffer. The files go to a staging directory beside ``path``, which
becomes ``path``; into an existing directory, the old index is removed first and the
new one moved in last, so an index never names a file that is missing. A staging
directory that a killed save to the same ``path`` left behind is removed by the next.
"""

from __future__ import annotations

import copy
import glob
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from funcshard._src import tree
from funcshard._src.comm import agree, collectives, groups, runtime, settle
from funcshard._src.comm.channel import Kind
from funcshard._src.dtypes import dtype_name
from funcshard._src.interop.safetensors_format import (
    INDEX,
    NAMES,
    SINGLE,
    header_bytes,
    index_bytes,
    parse_size,
    shard_files,
)
from funcshard._src.interop.safetensors_io import LeafNames
from funcshard._src.shard.flat import unpack_gathered, whole_chunk
from funcshard._src.shard.flat_shard import FlatShard
from funcshard._src.shard.sharded import ShardedTensor, flats_of

SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
STAGING = re.compile(r"\.[0-9a-f]{12}\.saving")  # after ".{target name}"


@dataclass(frozen=True)
class _Tensor:
    """One tensor to write: its key in the files, stored dtype and shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class _Step:
    """One step of the save: a flat buffer to gather and which of its slots are written, or a
    full tensor every rank holds (``whole``); and the tensors written."""

    written: tuple[_Tensor, ...]
    flat: FlatShard | None = None
    slots: tuple[int, ...] = ()  # positions in flat.layout.slots
    whole: torch.Tensor | None = None


def save_pretrained(
    sparams: Any,
    path: str | os.PathLike[str],
    /,
    *,
    module: nn.Module,
    treedef: tree.TreeDef,
    leaves: Sequence[LeafNames],
    state: Mapping[str, torch.Tensor],
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = True,
) -> Path:
    """``Apply.save_pretrained``: writes what ``from_pretrained`` loads; collective, rank 0 writes.

    The keys are the module's ``state_dict`` keys: a tied weight once, under the name
    Hugging Face keeps (the first of its names not among the module's
    ``_tied_weights_keys``; else its first name), frozen parameters and persistent
    buffers (rank 0's) included. Files of at most ``max_shard_size`` (a tensor larger
    than that alone in its file) are ``model.safetensors``, or
    ``model-00001-of-0000K.safetensors`` with ``model.safetensors.index.json``; then
    ``config.json`` and ``generation_config.json`` (``config.save_pretrained``) if the
    module has a ``config``. See [Note: streaming save].

    Args:
        sparams: the sharded params (a step's result); whole tensors are written too.
        path: the directory written (made, or its checkpoint replaced; other files stay).
        module: the module, for its ``state_dict`` keys, config and tied-weight names.
        treedef: the params' tree structure, which ``sparams`` must have.
        leaves: every leaf's path and dotted names.
        state: the buffers by dotted name (``apply.state``'s tensors).
        max_shard_size: the most bytes of a file, an int or as ``"5GB"`` / ``"500MiB"``.
        safe_serialization: must be ``True`` (pickled ``.bin`` files are not written).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: ``sparams`` is not a tree of this module's params, a state_dict
            key that is neither a parameter nor a buffer, a tensor on ``meta``,
            a bad ``max_shard_size``, or ``safe_serialization=False``.
        OSError: rank 0 could not write (raised on every rank).
        DesyncError: the ranks save different trees or options.

    Example:
        >>> import tempfile, torch, funcshard as fs
        >>> from safetensors.torch import load_file
        >>> params, apply = fs.interop.functionalize(torch.nn.Linear(2, 1))
        >>> sparams = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1})))
        >>> out = apply.save_pretrained(sparams, f"{tempfile.mkdtemp()}/out")
        >>> sorted(load_file(out / "model.safetensors"))
        ['bias', 'weight']
    """
    if not safe_serialization:
        raise ValueError("save_pretrained writes safetensors only; pass safe_serialization=True")
    limit = parse_size(max_shard_size)
    paths, values, got = tree.flatten_with_paths(sparams)
    if got != treedef:
        raise ValueError(
            f"save_pretrained: sparams do not have the structure of {type(module).__name__}'s "
            f"params (got {got}); pass fs.shard of what functionalize returned, or a step's result"
        )
    steps, parameters, dtype = _steps(module, dict(zip(paths, values)), leaves, state)
    planned = [t for step in steps for t in step.written]
    files = [
        (name, planned[part]) for name, part in shard_files([t.nbytes for t in planned], limit)
    ]
    flats = [step.flat for step in steps if step.flat is not None]
    if len({f.layout.mesh for f in flats}) > 1:
        raise ValueError("save_pretrained: the sharded leaves come from different meshes")
    bound = groups.bind(flats[0].layout.mesh) if flats else None
    target = Path(path)
    writer: _Writer | None = None
    with settle.operation("save_pretrained"):
        agree.agree_on(
            Kind.UNSHARD,
            "save_pretrained",
            {
                "buffers": [f"{f.layout.unit}:{f.layout.dtype}:{f.layout.numel}" for f in flats],
                "tensors": agree.digest_of({"t": [[t.key, str(t.shape)] for t in planned]}).hex(),
                "max_shard_size": limit,
            },
            hint="Every rank must save the same params with the same options",
        )
        error = None
        if runtime.rank() == 0:
            try:
                writer = _Writer(_staging(target), files)
            except OSError as e:
                error = f"{type(e).__name__}: {e}"
        error = agree.broadcast_json(error, "save_pretrained: rank 0's staging directory")
        if error is None:
            error = _write_steps(steps, bound, writer)
            if writer is not None:
                error = error or _attempt(writer.finish, parameters, module, dtype, target)
                if error is not None:
                    writer.discard()
            error = agree.broadcast_json(error, "save_pretrained: whether rank 0 wrote it")
    if error is not None:
        raise OSError(f"save_pretrained to {target} failed on rank 0: {error}")
    return target


def _steps(
    module: nn.Module,
    by_path: Mapping[str, Any],
    leaves: Sequence[LeafNames],
    state: Mapping[str, torch.Tensor],
) -> tuple[list[_Step], int, torch.dtype | None]:
    """What is written, in order: every flat buffer's leaves, whole leaves, persistent buffers."""
    keys = list(module.state_dict(keep_vars=True))
    position = {k: i for i, k in enumerate(keys)}
    tied = _tied_patterns(module)
    covered: set[str] = set()
    slots: dict[tuple[int, int], str] = {}
    whole: list[tuple[str, torch.Tensor]] = []
    parameters, dtype = 0, None
    for leaf in leaves:
        value = by_path[leaf.path]
        key = _kept_name(leaf.names, position, tied)
        covered.update(leaf.names)
        parameters += math.prod(value.shape)
        if dtype is None and value.dtype.is_floating_point:
            dtype = value.dtype
        if isinstance(value, ShardedTensor):
            slots[(id(value.flat), value.slot.index)] = key
        else:
            whole.append((key, _real(key, value)))
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    tensors = {id(t): t for t in state.values()}
    for ident, group in by_tensor.items():
        covered.update(group)
        if any(n in position for n in group):
            key = _kept_name(tuple(group), position, ())
            whole.append((key, _real(key, tensors[ident])))
    other = [k for k in keys if k not in covered]
    if other:
        raise ValueError(
            f"{other[0]}: in {type(module).__name__}'s state_dict but neither a parameter nor a "
            f"buffer (extra state), which save_pretrained cannot write; use apply.state_dict"
        )
    steps: list[_Step] = []
    for flat in flats_of(list(by_path.values())):
        kept = [
            (i, slot) for i, slot in enumerate(flat.layout.slots) if (id(flat), slot.index) in slots
        ]
        written = [_Tensor(slots[(id(flat), s.index)], flat.layout.dtype, s.shape) for _, s in kept]
        steps.append(_Step(tuple(written), flat, tuple(i for i, _ in kept)))
    for key, value in sorted(whole, key=lambda kv: position[kv[0]]):
        steps.append(_Step((_Tensor(key, value.dtype, tuple(value.shape)),), whole=value))
    for t in (t for step in steps for t in step.written):
        if t.dtype not in NAMES:
            raise ValueError(f"{t.key}: {dtype_name(t.dtype)} has no safetensors dtype; cast it")
    return steps, parameters, dtype


def _write_steps(
    steps: Sequence[_Step], bound: groups.BoundMesh | None, writer: _Writer | None
) -> str | None:
    """Gathers every step in turn (collective) and writes it on rank 0; rank 0's first error.

    After an error rank 0 goes on gathering, so that every rank learns of it at the end.
    """
    error = None
    for step in steps:
        tensors = _gathered(step, bound)
        if writer is not None and tensors is not None and error is None:
            error = _attempt(writer.write, step.written, tensors)
    return error


def _attempt(fn: Callable[..., object], /, *args: Any) -> str | None:
    """``None`` if ``fn(*args)`` returns, else what it raised (rank 0 then stays in step)."""
    try:
        fn(*args)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _gathered(step: _Step, bound: groups.BoundMesh | None) -> list[torch.Tensor] | None:
    """The full tensors of one step on rank 0 (``None`` elsewhere); collective for a flat buffer."""
    if step.flat is None:
        return [step.whole] if step.whole is not None and runtime.rank() == 0 else None
    assert bound is not None
    data = whole_chunk(step.flat.layout, step.flat.data, step.flat.rank)  # a mask's run, padded
    gathered = collectives.gather_to_rank0(data, bound, tag=step.flat.layout.unit)
    if gathered is None:
        return None
    full = unpack_gathered(step.flat.layout, gathered)  # one unit's leaves; the rows are freed
    return [full[i] for i in step.slots]


class _Writer:
    """The planned files, written in order as tensors arrive (on rank 0); writes to ``directory``."""

    def __init__(self, directory: Path, files: list[tuple[str, list[_Tensor]]]) -> None:
        self.directory = directory
        self._files = files
        self._file = 0  # the file being written
        self._next = 0  # its next tensor
        self._out: IO[bytes] | None = None

    def write(self, tensors: Sequence[_Tensor], values: Sequence[torch.Tensor]) -> None:
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
        _write_config(module, self.directory, dtype)
        if len(self._files) > 1:
            weight_map = {t.key: name for name, ts in self._files for t in ts}
            size = sum(t.nbytes for _, ts in self._files for t in ts)
            _durable(self.directory / INDEX, index_bytes(weight_map, size, parameters))
        _publish(self.directory, target, {name for name, _ in self._files})

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


def _kept_name(names: tuple[str, ...], position: Mapping[str, int], tied: Sequence[str]) -> str:
    """The name a tied tensor is written under: the first not among ``_tied_weights_keys``."""
    present = [n for n in names if n in position] or list(names)
    kept = [n for n in present if not any(re.search(p, n) for p in tied)]
    return (kept or present)[0]


def _tied_patterns(module: nn.Module) -> list[str]:
    found = getattr(module, "_tied_weights_keys", None)
    return [p for p in found or () if isinstance(p, str)]  # a dict (v5) gives its keys


def _real(key: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.is_meta:
        raise ValueError(
            f"{key}: a {'meta tensor' if isinstance(value, torch.Tensor) else type(value).__name__} "
            f"cannot be written; pass sharded params (fs.shard, a step's result) and real buffers"
        )
    return value


def _write_config(module: nn.Module, directory: Path, dtype: torch.dtype | None) -> None:
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


def _staging(target: Path) -> Path:
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target} is a file; save_pretrained writes a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{glob.escape(target.name)}.*.saving"):
        if STAGING.fullmatch(stale.name[len(target.name) + 1 :]) and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)  # a save to target that was killed
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.saving"
    staging.mkdir()
    return staging


def _publish(staging: Path, target: Path, names: set[str]) -> None:
    """``staging`` becomes ``target``; see [Note: streaming save] for an existing directory."""
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


def _durable(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
