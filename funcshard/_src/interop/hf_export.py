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

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from funcshard._src import tree
from funcshard._src.comm import channel, collectives, groups, runtime, settle
from funcshard._src.comm.channel import Kind
from funcshard._src.dtypes import dtype_name
from funcshard._src.interop.hf_files import PlannedTensor, Writer, staging_dir
from funcshard._src.interop.safetensors_format import (
    NAMES,
    parse_size,
    shard_files,
)
from funcshard._src.interop.safetensors_io import LeafNames
from funcshard._src.interop.state_hooks import named_tensors, probe
from funcshard._src.shard.flat import unpack_gathered, whole_chunk
from funcshard._src.shard.sharded import FlatShard, ShardedTensor, flats_of


@dataclass(frozen=True)
class _Step:
    """One step of the save: a flat buffer to gather and which of its slots are written, or a
    full tensor every rank holds (``whole``); and the tensors written."""

    written: tuple[PlannedTensor, ...]
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
    writer: Writer | None = None
    with settle.operation("save_pretrained"):
        channel.agree_on(
            Kind.UNSHARD,
            "save_pretrained",
            {
                "buffers": [f"{f.layout.unit}:{f.layout.dtype}:{f.layout.numel}" for f in flats],
                "tensors": channel.digest_of({"t": [[t.key, str(t.shape)] for t in planned]}).hex(),
                "max_shard_size": limit,
            },
            hint="Every rank must save the same params with the same options",
        )
        error = None
        if runtime.rank() == 0:
            try:
                writer = Writer(staging_dir(target), files)
            except OSError as e:
                error = f"{type(e).__name__}: {e}"
        error = channel.broadcast_json(error, "save_pretrained: rank 0's staging directory")
        if error is None:
            error = _write_steps(steps, bound, writer)
            if writer is not None:
                error = error or _attempt(writer.finish, parameters, module, dtype, target)
                if error is not None:
                    writer.discard()
            error = channel.broadcast_json(error, "save_pretrained: whether rank 0 wrote it")
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
    layout = probe(module, named_tensors(module))  # See [Note: state-dict hooks] (state_hooks.py)
    if layout.scopes:
        scope = layout.scopes[0]
        raise ValueError(
            f"{scope.path or '<root>'}: {type(scope.module).__name__}'s state-dict hook "
            f"({scope.hooks}) computes {sorted(scope.computed)[:3]} from its parameters, which "
            f"save_pretrained (one file entry per parameter) does not write; save with "
            f"fs.checkpoint.save_dcp(path, sparams, apply=apply), which runs the hook on the "
            f"gathered parameters, or apply.state_dict(fs.unshard(sparams))"
        )
    keys = list(layout.keys)
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
    # a key a hook renamed (checkpoint_wrapper strips its prefix) holds a covered tensor
    other = [k for k in keys if k not in covered and layout.of_key.get(k) not in covered]
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
        written = [
            PlannedTensor(slots[(id(flat), s.index)], flat.layout.dtype, s.shape) for _, s in kept
        ]
        steps.append(_Step(tuple(written), flat, tuple(i for i, _ in kept)))
    for key, value in sorted(whole, key=lambda kv: position[kv[0]]):
        steps.append(_Step((PlannedTensor(key, value.dtype, tuple(value.shape)),), whole=value))
    for t in (t for step in steps for t in step.written):
        if t.dtype not in NAMES:
            raise ValueError(f"{t.key}: {dtype_name(t.dtype)} has no safetensors dtype; cast it")
    return steps, parameters, dtype


def _write_steps(
    steps: Sequence[_Step], bound: groups.BoundMesh | None, writer: Writer | None
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
