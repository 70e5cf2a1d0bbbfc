"""Exporting a checkpoint's full tensors to one safetensors file."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from funcshard._src import tree
from funcshard._src.checkpoint.load import load_full


def export_safetensors(path: str | os.PathLike[str], out: str | os.PathLike[str], /) -> Path:
    """Writes the full tensors of a checkpoint to one safetensors file, keys are leaf paths with dots.

    Raises:
        ImportError: the ``safetensors`` package is missing (``pip install safetensors``).
        CheckpointError: see :func:`funcshard.checkpoint.load`.

    Example:
        >>> import tempfile, funcshard as fs
        >>> root = tempfile.mkdtemp()
        >>> ckpt = fs.checkpoint.save(f"{root}/c", {"blocks": [{"w": torch.ones(2)}]})
        >>> from safetensors.torch import load_file
        >>> load_file(export_safetensors(ckpt, f"{root}/full.safetensors"))
        {'blocks.0.w': tensor([1., 1.])}
    """
    try:
        from safetensors.torch import save_file  # pyright: ignore[reportMissingImports]
    except ImportError:
        raise ImportError(
            "export_safetensors needs the safetensors package: pip install safetensors"
        ) from None
    full = load_full(path)
    paths, leaves, _ = tree.flatten_with_paths(full)
    tensors = {
        p.replace("/", "."): t.contiguous()
        for p, t in zip(paths, leaves)
        if isinstance(t, torch.Tensor)
    }
    save_file(tensors, str(out))
    return Path(out)
