"""Orbax checkpoints written from funcshard trees through TensorStore, every rank its own shards.

[Note: Orbax layout written]
:func:`save_orbax` writes what ``ocp.StandardCheckpointer().save`` writes with its
defaults (OCDBT, zarr v2, zstd), so that plain Orbax restores it:

- every process writes its arrays' chunks into its own OCDBT database,
  ``ocdbt.process_<rank>/``, as Orbax's processes do; rank 0 also writes each array's
  ``.zarray``. A chunk is written by exactly one rank: the lowest rank holding it
  (replicas skip), and the chunk grid of a leaf is chosen so that every rank's boxes
  are whole chunks (per dim, the greatest common divisor of the boxes' starts and
  stops), so no chunk is ever written twice or read back to be completed. For the
  leaf layout that grid is the shard shape (uneven dims included: the last chunk
  is the short one); the flat layout's ranges cut inside rows give finer grids;
- after a barrier, rank 0 merges the per-process databases into the root one
  (``manifest.ocdbt``; the data files stay where they are, referenced) and writes
  ``_METADATA`` (every leaf's keys, sequence or dict, and ``jax.Array`` or
  ``scalar``) and ``_CHECKPOINT_METADATA``; a second barrier ends the save.

Leaves are named by their keys joined with ``.``, as Orbax names them, so a key
holding ``.`` or ``/`` is refused, as is a name two leaves would share.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import optree
import torch

from funcshard._src import tree
from funcshard._src.comm import channel, runtime, settle
from funcshard._src.comm.channel import Kind
from funcshard._src.interop.orbax import tensorstore
from funcshard._src.shard.flat import piece_indices, pieces
from funcshard._src.shard.sharded import ShardedTensor

_SEQUENCE, _DICT = 1, 2  # orbax's KeyType
_PROCESS_DIR = "ocdbt.process_{}"
_OCDBT_CONFIG = {  # as Orbax configures its databases
    "max_inline_value_bytes": 1024,
    "max_decoded_node_bytes": 100000000,
    "manifest_kind": "single",
}
_COMPRESSOR = {"id": "zstd", "level": 1}


@dataclass(frozen=True)
class _Leaf:
    path: str
    keys: tuple[tuple[str, int], ...]  # (key, orbax key type) per level
    value: Any

    @property
    def name(self) -> str:
        return ".".join(k for k, _ in self.keys)


def save_orbax(directory: str | os.PathLike[str], tree_: Any, /) -> Path:
    """Writes ``tree_`` as an Orbax checkpoint that ``StandardCheckpointer().restore`` reads; collective.

    Every rank writes only the shards it holds of each sharded leaf (the lowest rank
    of replicas writes them); rank 0 writes the whole tensors and scalars and the
    metadata. The format is Orbax's default (OCDBT, zarr v2; see [Note: Orbax layout
    written]), so JAX restores it with any target shardings. JAX is not needed.

    Args:
        directory: a new or empty folder (made if missing).
        tree_: dicts (string keys), lists and tuples of :class:`funcshard.ShardedTensor`
            leaves (from ``fs.shard``, ``fs.materialize``, a step), tensors, and Python
            ``int``/``float`` scalars. Every rank passes the same structure.

    Returns:
        The checkpoint's folder.

    Raises:
        ValueError: ``directory`` is not empty, a key holds ``.`` or ``/``, or two
            leaves would have the same Orbax name.
        TypeError: a leaf of another type, or a node other than a dict, list or tuple.
        OSError: writing failed on some rank (every rank raises).
        ImportError: TensorStore is not installed.

    Example (needs TensorStore; ``tests/interop/test_orbax.py`` runs it):
        >>> import tempfile, torch, funcshard as fs
        >>> params = {"w": torch.arange(6.0).reshape(3, 2), "blocks": [{"b": torch.ones(5)}]}
        >>> sparams = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1})))
        >>> path = fs.interop.save_orbax(f"{tempfile.mkdtemp()}/ckpt", {"params": sparams, "step": 3})  # doctest: +SKIP
        >>> fs.interop.load_orbax(path)["params"]["blocks"][0]["b"]  # doctest: +SKIP
        tensor([1., 1., 1., 1., 1.])
    """
    root = Path(directory).resolve()
    leaves = _leaves(tree_)
    ts = tensorstore("save_orbax writes Orbax checkpoints")
    rank = runtime.rank()
    with settle.operation("save_orbax"):
        channel.agree_on(
            Kind.CHECKPOINT,
            "save_orbax",
            {
                "directory": str(root),
                "leaves": channel.digest_of(
                    {"l": [[x.name, str(_shape_dtype(x.value))] for x in leaves]}
                ).hex(),
            },
            hint="Every rank must save the same tree to the same directory",
        )
        taken = _attempt(_check_empty, root) if rank == 0 else None
        taken = channel.broadcast_json(taken, "save_orbax: whether the directory is free")
        error = None
        if taken is None:
            error = _gathered(_attempt(_write_own, ts, root, leaves, rank), "writing shards")
        if error is None:
            error = _attempt(_finish, ts, root, leaves) if rank == 0 else None
            error = channel.broadcast_json(error, "save_orbax: whether rank 0 finished it")
    if taken is not None:
        raise ValueError(taken)
    if error is not None:
        raise OSError(f"save_orbax to {root} failed: {error}")
    return root


# -- the tree ---------------------------------------------------------------------------


def _leaves(tree_: Any) -> list[_Leaf]:
    accessors, values, _ = optree.tree_flatten_with_accessor(
        tree_, none_is_leaf=False, namespace=tree.NAMESPACE
    )
    paths = tree.leaf_paths(tree_)
    out: list[_Leaf] = []
    seen: dict[str, str] = {}
    for accessor, value, path in zip(accessors, values, paths):
        keys: list[tuple[str, int]] = []
        for entry in accessor:
            if isinstance(entry, (optree.NamedTupleEntry, optree.DataclassEntry)):
                keys.append((str(entry.field), _DICT))  # pyright: ignore[reportUnknownMemberType]
            elif isinstance(entry, optree.SequenceEntry):
                keys.append((str(entry.entry), _SEQUENCE))
            elif isinstance(entry, optree.MappingEntry) and isinstance(entry.entry, str):
                keys.append((entry.entry, _DICT))
            else:
                raise TypeError(
                    f"{path or '<root>'}: a {entry.type.__name__} node (key {entry.entry!r}); "
                    f"save_orbax writes dicts with string keys, lists and tuples"
                )
            if "." in keys[-1][0] or not keys[-1][0]:
                raise ValueError(
                    f"{path}: key {keys[-1][0]!r} is empty or holds '.', which Orbax uses to "
                    f"join keys into array names; rename the key"
                )
        if not keys:
            raise TypeError("save_orbax: the tree is a single leaf; put it in a dict")
        if not isinstance(value, (ShardedTensor, torch.Tensor, int, float)) or isinstance(
            value, bool
        ):
            raise TypeError(
                f"{path}: a {type(value).__name__} leaf; save_orbax writes sharded leaves, "
                f"tensors and int or float scalars"
            )
        leaf = _Leaf(path, tuple(keys), value)
        if leaf.name in seen:
            raise ValueError(f"{path} and {seen[leaf.name]} are both named {leaf.name!r} in Orbax")
        seen[leaf.name] = path
        out.append(leaf)
    return out


def _shape_dtype(value: Any) -> tuple[tuple[int, ...], str]:
    if isinstance(value, (ShardedTensor, torch.Tensor)):
        return tuple(value.shape), str(value.dtype)
    return (), type(value).__name__


# -- writing ----------------------------------------------------------------------------


def _check_empty(root: Path) -> None:
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ValueError(f"save_orbax: {root} exists and is not an empty folder; save to a new one")
    root.mkdir(parents=True, exist_ok=True)


def _kvstore(base: Path, name: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": "ocdbt",
        "base": {"driver": "file", "path": f"{base}/"},
        "config": _OCDBT_CONFIG,
    }
    if name is not None:
        spec["path"] = name
    return spec


def _write_own(ts: Any, root: Path, leaves: Sequence[_Leaf], rank: int) -> None:
    """This rank's chunks of every leaf, and (rank 0) every array's ``.zarray``, in its database.

    Each chunk from exactly one rank, in ``ocdbt.process_<rank>/``: [Note: Orbax layout written].
    """
    base = root / _PROCESS_DIR.format(rank)
    base.mkdir()
    context = ts.Context()
    for leaf in leaves:
        writes = _own_pieces(leaf.value, rank)
        if rank != 0 and not writes:
            continue
        array, shape, chunks = _array_of(leaf.value)
        spec = {
            "driver": "zarr",
            "kvstore": _kvstore(base, leaf.name),
            "dtype": array,
            "metadata": {
                "shape": list(shape),
                "chunks": list(chunks),
                "compressor": _COMPRESSOR,
                "dimension_separator": ".",
            },
        }
        if rank == 0:
            store = ts.open(spec, create=True, context=context).result()
        else:
            store = ts.open(spec, assume_metadata=True, context=context).result()
        for index, values in writes:
            store[index].write(_numpy(values, store.dtype.numpy_dtype)).result()


def _own_pieces(value: Any, rank: int) -> list[tuple[tuple[slice, ...], Any]]:
    """``(index, values)`` of what ``rank`` writes of a leaf: its own boxes nobody lower holds."""
    if not isinstance(value, ShardedTensor):
        return [((), value)] if rank == 0 else []
    slot = value.slot
    if value.flat.rank != rank:
        raise ValueError(
            f"{value.path}: a shard of mesh rank {value.flat.rank} on process rank {rank}; "
            f"save_orbax writes each rank's own shards"
        )
    lower = {_box(i, slot.shape) for r in range(rank) for i in piece_indices(slot, r)}
    out: list[tuple[tuple[slice, ...], Any]] = []
    for index, view in pieces(value.flat.data, slot, rank):
        box = _box(index, slot.shape)
        if view.numel() and box not in lower:
            out.append((tuple(slice(a, b) for a, b in box), view))
    return out


def _box(index: Sequence[slice], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for d, n in enumerate(shape):
        start, stop, _ = (index[d] if d < len(index) else slice(None)).indices(n)
        out.append((start, max(start, stop)))
    return tuple(out)


def _array_of(value: Any) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """The TensorStore dtype, shape and chunk shape a leaf is written with."""
    if not isinstance(value, (ShardedTensor, torch.Tensor)):
        return ("int64" if isinstance(value, int) else "float64"), (), ()
    dtype = str(value.dtype).removeprefix("torch.")
    shape = tuple(value.shape)
    if not isinstance(value, ShardedTensor):
        return dtype, shape, tuple(max(n, 1) for n in shape)
    slot = value.slot
    world = slot.sharding.mesh.size
    boxes = [_box(i, shape) for r in range(world) for i in piece_indices(slot, r)]
    chunks = tuple(
        max(1, math.gcd(*(e for box in boxes for e in box[d] if e < n)) or n)
        for d, n in enumerate(shape)
    )
    return dtype, shape, chunks


def _numpy(values: Any, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    if not isinstance(values, torch.Tensor):
        return np.asarray(values, dtype)
    t = values.detach().cpu().contiguous()
    if t.dtype.itemsize == dtype.itemsize and dtype.kind not in "biufc":  # bfloat16, float8
        bits = {1: torch.uint8, 2: torch.int16}[t.dtype.itemsize]
        return t.view(bits).numpy().view(dtype)
    return t.numpy()


def _finish(ts: Any, root: Path, leaves: Sequence[_Leaf]) -> None:
    """Rank 0, after every rank wrote: one database over all, then the metadata files."""
    context = ts.Context()  # one for all: the merged database references the children's files
    parent = ts.KvStore.open(_kvstore(root), context=context).result()
    txn = ts.Transaction(atomic=True)
    for child in sorted(root.glob(_PROCESS_DIR.format("*"))):
        ts.KvStore.open(_kvstore(child), context=context).result().experimental_copy_range_to(
            parent.with_transaction(txn)
        ).result()
    txn.commit_async().result()
    metadata = {
        "tree_metadata": {
            str(tuple(k for k, _ in leaf.keys)): {
                "key_metadata": [{"key": k, "key_type": t} for k, t in leaf.keys],
                "value_metadata": {
                    "value_type": "jax.Array"
                    if isinstance(leaf.value, (ShardedTensor, torch.Tensor))
                    else "scalar",
                    "skip_deserialize": False,
                    **(
                        {"write_shape": list(leaf.value.shape)}
                        if isinstance(leaf.value, (ShardedTensor, torch.Tensor))
                        else {}
                    ),
                },
            }
            for leaf in leaves
        },
        "use_ocdbt": True,
        "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }
    now = time.time_ns()
    (root / "_METADATA").write_text(json.dumps(metadata))
    (root / "_CHECKPOINT_METADATA").write_text(
        json.dumps(
            {
                "item_handlers": "orbax.checkpoint._src.handlers.standard_checkpoint_handler."
                "StandardCheckpointHandler",
                "metrics": {},
                "performance_metrics": {},
                "init_timestamp_nsecs": now,
                "commit_timestamp_nsecs": now,
                "custom_metadata": {},
            }
        )
    )


def _attempt(fn: Any, *args: Any) -> str | None:
    try:
        fn(*args)
    except (OSError, ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _gathered(error: str | None, what: str) -> str | None:
    """The first rank's error of every rank's; collective (a barrier)."""
    errors = channel.all_gather_json(error, f"save_orbax: {what}")
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)
