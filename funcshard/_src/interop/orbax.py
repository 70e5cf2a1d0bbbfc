"""Orbax checkpoints read into funcshard trees through TensorStore, without JAX.

An Orbax PyTree checkpoint (``ocp.StandardCheckpointer``, ``PyTreeCheckpointer``,
one item of a ``CheckpointManager`` step) is a directory with a ``_METADATA`` file
naming every leaf by its keys and one zarr array per array leaf, named by the keys
joined with ``.`` (``params.layers.0.w``), in an OCDBT database (Orbax's default) or
in a folder each. TensorStore reads them (``pip install 'funcshard[orbax]'``); each
rank of a sharded ``like`` reads only the slices it holds.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.comm import runtime
from funcshard._src.interop.host import tensor_from_numpy, torch_dtype
from funcshard._src.shard.flat import pieces
from funcshard._src.shard.sharded import ShardedTensor, map_flats
from funcshard._src.untrusted import read_json

_ARRAY_TYPES = frozenset({"jax.Array", "np.ndarray", "scalar"})
_SEQUENCE_KEY = 1  # orbax's KeyType.SEQUENCE; 2 is a dict key
MAX_METADATA_BYTES = 256 << 20  # _METADATA: about 300 bytes a leaf, so a million leaves fit
_NOT_ORBAX = "this is not a checkpoint Orbax wrote"


@dataclass(frozen=True)
class _Entry:
    path: str  # funcshard path: keys joined by "/"
    keys: tuple[str | int, ...]
    param_name: str  # orbax's name: keys joined by "."
    value_type: str


def load_orbax(directory: str | os.PathLike[str], /, like: Any = None, *, prefix: str = "") -> Any:
    """Reads the arrays of an Orbax checkpoint into torch tensors, or into ``like``'s shards.

    Args:
        directory: an Orbax PyTree checkpoint (the folder holding ``_METADATA``).
        like: ``None`` for the whole checkpoint as nested dicts and lists of tensors
            (scalars as Python numbers); or a pytree whose leaf paths name checkpoint
            leaves (under ``prefix``) with the same shapes and dtypes. Its tensor leaves
            (``meta`` ones too) give full tensors on their device (``meta``: ``fs.device()``);
            its :class:`funcshard.ShardedTensor` leaves give new sharded leaves, each
            rank reading only its own slices. Nothing of ``like`` is modified.
        prefix: the path in the checkpoint of the subtree to load, or of ``like``'s
            root (``"params"`` to load the params out of a checkpoint of
            ``{"params": ..., "opt_state": ...}``); keys are then relative to it.

    Returns:
        The loaded tree (``like``'s structure if given).

    Raises:
        ValueError: not an Orbax PyTree checkpoint, or ``like`` does not fit it: the
            message lists missing and unexpected paths and shape or dtype mismatches;
            or ``prefix`` names no subtree of the checkpoint.
        ImportError: TensorStore is not installed.

    Example:
        >>> import funcshard as fs  # doctest: +SKIP
        >>> everything = fs.interop.load_orbax("ckpt/100/default")  # doctest: +SKIP
        >>> sparams = fs.interop.load_orbax("ckpt/100/default", sparams, prefix="params")  # doctest: +SKIP
    """
    root = Path(directory)
    meta = _metadata(root)
    entries = _entries(root, meta)
    ts = tensorstore()
    spec = _spec_for(root, meta)
    base = prefix.strip("/")
    if like is None:
        return _load_whole(ts, spec, _under_prefix(entries, base, root))

    under = {
        e.path[len(base) + 1 :] if base else e.path: e
        for e in entries
        if not base or e.path.startswith(base + "/")
    }
    paths, leaves, treedef = tree.flatten_with_paths(like)
    stores = _check_fits(ts, spec, under, paths, leaves, root, base)
    fresh = map_flats(lambda f: f.with_data(torch.zeros_like(f.data)), like)
    out: list[Any] = []
    for path, leaf, target in zip(paths, leaves, tree.leaves(fresh)):
        store = stores[path]
        if under[path].value_type == "scalar" and not isinstance(
            leaf, (torch.Tensor, ShardedTensor)
        ):
            out.append(tensor_from_numpy(store.read().result()).item())
        elif isinstance(target, ShardedTensor):
            for index, view in pieces(target.flat.data, target.slot, target.flat.rank):
                view.copy_(tensor_from_numpy(store[index].read().result()))
            out.append(target)
        else:
            # a meta leaf: where shards go, [Note: devices and backends] in comm/runtime.py
            device = leaf.device if leaf.device.type != "meta" else runtime.default_device()
            out.append(tensor_from_numpy(store.read().result()).to(device))
    return tree.unflatten(treedef, out)


# -- helpers ---------------------------------------------------------------------------


def tensorstore(what: str = "load_orbax reads Orbax checkpoints", /) -> Any:
    """The ``tensorstore`` module; ``what`` needs it (said when it is missing)."""
    try:
        return importlib.import_module("tensorstore")
    except ImportError as e:
        raise ImportError(
            f"{what} with TensorStore ({e}); install it: pip install 'funcshard[orbax]'"
        ) from None


def _metadata(root: Path) -> dict[str, Any]:
    """``root/_METADATA``, untrusted: strict JSON read once, through no symlink ([Note: reader
    discipline] in ``untrusted.py``)."""
    meta_file = root / "_METADATA"
    if not meta_file.is_file():
        inner = sorted(p.parent.name for p in root.glob("*/_METADATA"))
        hint = (
            f"; the checkpoint items here are {inner}: pass {root / inner[0]}"
            if inner
            else (
                "; this looks like an old msgpack Orbax checkpoint, which is not supported"
                if (root / "checkpoint").is_file()
                else ""
            )
        )
        raise ValueError(
            f"{root} is not an Orbax PyTree checkpoint: it has no _METADATA file{hint}"
        )
    meta = read_json(meta_file, symlinks=False, max_bytes=MAX_METADATA_BYTES)
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_file}: not a JSON object; {_NOT_ORBAX}")
    return meta


def _entries(root: Path, meta: dict[str, Any]) -> list[_Entry]:
    """The checkpoint's leaves, as its ``_METADATA`` lists them (checked: [Note: reader
    discipline] in ``untrusted.py``)."""
    items = meta.get("tree_metadata", {})
    if not isinstance(items, dict):
        raise ValueError(f"{root}/_METADATA: tree_metadata is not an object; {_NOT_ORBAX}")
    entries: list[_Entry] = []
    for name, item in items.items():
        where = f"{root}/_METADATA: tree_metadata[{name!r}]"
        key_metadata = item.get("key_metadata") if isinstance(item, dict) else None
        value = item.get("value_metadata") if isinstance(item, dict) else None
        if not isinstance(key_metadata, list) or not isinstance(value, dict):
            raise ValueError(
                f"{where}: no key_metadata list and value_metadata object; {_NOT_ORBAX}"
            )
        keys: list[str | int] = []
        for k in key_metadata:
            key = k.get("key") if isinstance(k, dict) else None
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise ValueError(f"{where}: a key is not a string or an integer; {_NOT_ORBAX}")
            sequence = k.get("key_type") == _SEQUENCE_KEY
            if sequence and not (isinstance(key, int) or key.isdecimal()):
                raise ValueError(f"{where}: a sequence key {key!r} is not an index; {_NOT_ORBAX}")
            keys.append(int(key) if sequence else str(key))
        if value.get("skip_deserialize"):
            continue
        _check_keys(root, keys)
        entries.append(
            _Entry(
                "/".join(str(k) for k in keys),
                tuple(keys),
                ".".join(str(k) for k in keys),
                str(value.get("value_type", "")),
            )
        )
    return entries


def _check_keys(root: Path, keys: Sequence[str | int]) -> None:
    """Refuses keys that would leave the checkpoint: the array's name becomes a file path.

    A folder-per-array checkpoint opens ``root/<keys joined by '.'>/``, so no key may
    hold a path separator or NUL, and the name may not be ``.`` or ``..``.
    """
    name = ".".join(str(k) for k in keys)
    if not keys or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(
            f"{root}/_METADATA: leaf keys {list(keys)!r} do not name an array inside the "
            f"checkpoint (a key holds '/', '\\' or NUL, or the name is '.' or '..'); "
            f"this is not a checkpoint Orbax wrote"
        )


def _spec_for(root: Path, meta: dict[str, Any]) -> dict[str, Any]:
    ocdbt = meta.get("use_ocdbt", (root / "manifest.ocdbt").is_file())
    return {
        "driver": "zarr3" if meta.get("use_zarr3", False) else "zarr",
        "ocdbt": bool(ocdbt),
        "base": root.resolve().as_uri() + "/",
    }


def _open(ts: Any, spec: dict[str, Any], entry: _Entry) -> Any:
    if spec["ocdbt"]:
        kvstore = {"driver": "ocdbt", "base": spec["base"], "path": entry.param_name}
    else:
        kvstore = spec["base"] + entry.param_name + "/"
    return ts.open({"driver": spec["driver"], "kvstore": kvstore}, open=True, read=True).result()


def _under_prefix(entries: Sequence[_Entry], base: str, root: Path) -> list[_Entry]:
    """The entries under the path ``base`` ("params/blocks"), keyed from there; all for ""."""
    if not base:
        return list(entries)
    depth = len(base.split("/"))
    under = [
        replace(e, keys=e.keys[depth:], path=e.path[len(base) + 1 :])
        for e in entries
        if e.path.startswith(base + "/")
    ]
    if not under:
        if any(e.path == base for e in entries):
            raise ValueError(f"{root}: prefix {base!r} is a leaf; pass the path of a subtree")
        top = sorted({e.path.split("/")[0] for e in entries})
        raise ValueError(
            f"{root}: no checkpoint leaf is under prefix {base!r} (its top-level keys: {top}); "
            f"pass one of them, or no prefix for the whole checkpoint"
        )
    return under


def _load_whole(ts: Any, spec: dict[str, Any], entries: Sequence[_Entry]) -> Any:
    root: dict[str | int, Any] = {}
    for entry in entries:
        if entry.value_type not in _ARRAY_TYPES:
            raise ValueError(
                f"{entry.path}: a {entry.value_type!r} leaf, which load_orbax does not read; "
                f"pass like= a tree of the array leaves you need"
            )
        value = tensor_from_numpy(_open(ts, spec, entry).read().result())
        node = root
        for key in entry.keys[:-1]:
            node = node.setdefault(key, {})
        node[entry.keys[-1]] = value.item() if entry.value_type == "scalar" else value
    return _lists(root)


def _lists(node: Any) -> Any:
    """Nested dicts keyed by sequence indices (ints) become lists."""
    if not isinstance(node, dict):
        return node
    items = {k: _lists(v) for k, v in node.items()}  # pyright: ignore[reportUnknownVariableType]
    if items and all(isinstance(k, int) for k in items):
        return [items.get(i) for i in range(max(items) + 1)]  # pyright: ignore[reportUnknownArgumentType]
    return {str(k): v for k, v in items.items()}  # pyright: ignore[reportUnknownVariableType]


def _check_fits(
    ts: Any,
    spec: dict[str, Any],
    under: dict[str, _Entry],
    paths: list[str],
    leaves: list[Any],
    root: Path,
    base: str,
) -> dict[str, Any]:
    where = f"{root}" + (f" under {base!r}" if base else "")
    missing = [p for p in paths if p not in under]
    unexpected = sorted(set(under) - set(paths))
    stores: dict[str, Any] = {}
    mismatched: list[str] = []
    for path, leaf in zip(paths, leaves):
        if path not in under:
            continue
        entry = under[path]
        if entry.value_type not in _ARRAY_TYPES:
            mismatched.append(f"{path}: a {entry.value_type!r} leaf, not an array")
            continue
        store = _open(ts, spec, entry)
        stores[path] = store
        if not isinstance(leaf, (torch.Tensor, ShardedTensor)):
            continue
        shape = tuple(int(n) for n in store.shape)
        dtype = torch_dtype(store.dtype.numpy_dtype)
        if shape != tuple(leaf.shape) or dtype != leaf.dtype:
            mismatched.append(
                f"{path}: saved {dtype} {shape}, like has {leaf.dtype} {tuple(leaf.shape)}"
            )
    problems = [
        f"{what} {items[:8]}{' ...' if len(items) > 8 else ''}"
        for what, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("mismatched", mismatched),
        )
        if items
    ]
    if problems:
        raise ValueError(
            f"like does not fit the Orbax checkpoint {where}: {'; '.join(problems)}. Build like "
            f"with the checkpoint's paths, shapes and dtypes, or pass prefix= for a subtree"
        )
    return stores
