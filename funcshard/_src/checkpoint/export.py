"""Exporting a checkpoint's full tensors (its ``params`` by default) to one safetensors file."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from funcshard._src import tree
from funcshard._src.checkpoint.load import load_full


def export_safetensors(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    /,
    *,
    subtree: str | None = "params",
    names: Mapping[str, str] | Callable[[str], str] | None = None,
) -> Path:
    """Writes the full tensors of a checkpoint's ``subtree`` to one safetensors file.

    The keys are the leaf paths inside ``subtree`` with ``.`` for ``/``
    (``blocks.0.w``), or what ``names`` makes of them; JSON scalars (a step counter)
    are left out. Changed: only ``params`` is exported by default, keyed from inside
    it (``w``, not ``params.w``); ``subtree=None`` exports the whole checkpoint keyed
    from its root, as before.

    Args:
        path: a checkpoint directory (:func:`funcshard.checkpoint.save`).
        out: the file to write.
        subtree: the top-level key of the saved tree to export (``"params"`` of a
            checkpoint of ``{"params", "opt", "step"}``); ``None``: all of it.
        names: leaf path -> the key written: a mapping (paths it lacks keep the
            default key) or a function of the path.

    Returns:
        ``out`` as a ``Path``.

    Raises:
        ImportError: the ``safetensors`` package is missing (``pip install safetensors``).
        ValueError: the checkpoint has no top-level ``subtree``, ``names`` maps paths
            the subtree lacks, or two leaves get the same key.
        CheckpointError: see :func:`funcshard.checkpoint.load`.

    Example:
        >>> import tempfile, funcshard as fs
        >>> from safetensors.torch import load_file
        >>> root = tempfile.mkdtemp()
        >>> state = {"params": {"blocks": [{"w": torch.ones(2)}]}, "step": 3}
        >>> ckpt = fs.checkpoint.save(f"{root}/c", state)
        >>> load_file(export_safetensors(ckpt, f"{root}/params.safetensors"))
        {'blocks.0.w': tensor([1., 1.])}
        >>> sorted(load_file(export_safetensors(ckpt, f"{root}/all.safetensors", subtree=None)))
        ['params.blocks.0.w']
        >>> sorted(load_file(export_safetensors(ckpt, f"{root}/hf.safetensors",
        ...                                     names=lambda p: "model." + p.replace("/", "."))))
        ['model.blocks.0.w']
    """
    try:
        from safetensors.torch import save_file  # pyright: ignore[reportMissingImports]
    except ImportError:
        raise ImportError(
            "export_safetensors needs the safetensors package: pip install safetensors"
        ) from None
    full = load_full(path, subtree=subtree)  # only the subtree's tensors are read
    paths, leaves, _ = tree.flatten_with_paths(full)
    tensors = {p: t for p, t in zip(paths, leaves) if isinstance(t, torch.Tensor)}
    if isinstance(names, Mapping):
        unknown = sorted(set(names) - set(tensors))
        if unknown:
            raise ValueError(
                f"names maps {unknown[:5]}, which are not tensor leaves of the exported tree "
                f"(it has {sorted(tensors)[:5]}...); name leaves by their path"
            )
    keys: dict[str, str] = {}
    for p in tensors:
        key = _key(p, names)
        if not key or key in keys:
            why = f"the same key as {keys[key]!r}" if key in keys else "an empty key"
            raise ValueError(f"{p or '<root>'}: gets {why}; pass names= giving every leaf its own")
        keys[key] = p
    save_file({key: tensors[p].contiguous() for key, p in keys.items()}, str(out))
    return Path(out)


def _key(path: str, names: Mapping[str, str] | Callable[[str], str] | None) -> str:
    if isinstance(names, Mapping):
        return names.get(path, path.replace("/", "."))
    if names is not None:
        return names(path)
    return path.replace("/", ".")
