"""Every rank's batch on every rank: the global batch that the unsharded reference runs on."""

from __future__ import annotations

import json
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.comm import channel, collectives, groups
from funcshard._src.dtypes import dtype_name, dtype_of
from funcshard._src.spec.mesh import Mesh


def gather_batches(batch: Any, mesh: Mesh, /, *, device: torch.device | None = None) -> list[Any]:
    """Every rank's ``batch``, in rank order; collective (one agreement, at most one all-gather).

    Tensor leaves travel as bytes in one buffer (on ``device``, default: the first
    tensor's); other leaves must be JSON-able and travel as JSON. Each rank's own
    entry is its ``batch`` itself. One process: ``[batch]``.

    Raises:
        TypeError: a leaf is neither a tensor nor JSON-able (the message names its path).
        ValueError: the ranks' batches have different tree structures.

    Example:
        >>> gather_batches({"x": torch.ones(2)}, Mesh({"fsdp": 1}))
        [{'x': tensor([1., 1.])}]
    """
    bound = groups.bind(mesh)
    if not bound.distributed:
        return [batch]
    paths, leaves, treedef = tree.flatten_with_paths(batch)
    described: list[dict[str, Any]] = []
    data: list[torch.Tensor] = []
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor):
            raw = leaf.detach().contiguous().reshape(-1).view(torch.uint8)
            described.append({"shape": list(leaf.shape), "dtype": dtype_name(leaf.dtype)})
            data.append(raw)
            continue
        try:
            json.dumps(leaf)
        except (TypeError, ValueError):
            raise TypeError(
                f"fs.verify: batch leaf {path or '<root>'} is a {type(leaf).__name__}; a batch holds "
                f"tensors and JSON-able values (numbers, strings), which every rank can send"
            ) from None
        described.append({"value": leaf})
    everyone = channel.all_gather_json(
        {"tree": str(treedef), "leaves": described}, "fs.verify: every rank's batch"
    )
    if any(theirs["tree"] != str(treedef) for theirs in everyone):
        listing = "; ".join(f"rank {r}: {theirs['tree']}" for r, theirs in enumerate(everyone))
        raise ValueError(
            f"fs.verify: the ranks' batches have different tree structures ({listing}); give every "
            f"rank a batch of the same structure"
        )
    sizes = [sum(_nbytes(d) for d in theirs["leaves"]) for theirs in everyone]
    width = max(sizes)
    rows: torch.Tensor | None = None
    if width > 0:
        where = device or (data[0].device if data else torch.device("cpu"))
        mine = torch.zeros(width, dtype=torch.uint8, device=where)  # (width,), padded
        if data:
            mine[: sizes[bound.rank]] = torch.cat([d.to(where) for d in data])
        rows = collectives.all_gather(mine, bound, mesh.axis_names, tag="verify batch").wait()
    out: list[Any] = []
    for r, theirs in enumerate(everyone):
        if r == bound.rank:
            out.append(batch)
            continue
        offset, rebuilt = 0, []
        for d in theirs["leaves"]:
            if "value" in d:
                rebuilt.append(d["value"])
                continue
            n = _nbytes(d)
            assert rows is not None
            chunk = rows[r, offset : offset + n].clone()
            rebuilt.append(chunk.view(_dtype(d)).reshape(d["shape"]))
            offset += n
        out.append(tree.unflatten(treedef, rebuilt))
    return out


def _nbytes(described: dict[str, Any]) -> int:
    if "value" in described:
        return 0
    numel = 1
    for size in described["shape"]:
        numel *= size
    return numel * _dtype(described).itemsize


def _dtype(described: dict[str, Any]) -> torch.dtype:
    dtype = dtype_of(described["dtype"])
    if dtype is None:
        raise ValueError(
            f"fs.verify: a rank sent a batch leaf of unknown dtype {described['dtype']!r}"
        )
    return dtype
