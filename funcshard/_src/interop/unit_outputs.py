"""A unit's outputs that funcshard's tree cannot see: handed to ``fs.call`` to hook for backward."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.execute.run import current_run


def hidden_tensors(out: Any, unit: str) -> list[torch.Tensor]:
    """Tensors that need grad in ``out`` but that funcshard's tree does not flatten to.

    fs.call hooks a unit's outputs to re-gather the unit before its backward; outputs
    inside containers the tree does not know (a Hugging Face ``ModelOutput``) are
    handed to it here as well.
    """
    reachable = {id(t) for t in tree.leaves(out) if isinstance(t, torch.Tensor)}
    found: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.requires_grad and id(x) not in reachable:
                found.append(x)
        elif isinstance(x, Mapping):
            for v in x.values():  # pyright: ignore[reportUnknownVariableType]
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:  # pyright: ignore[reportUnknownVariableType]
                walk(v)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))

    walk(out)
    run = current_run()
    if found and run is not None and run.output_dtype is not None:
        raise ValueError(
            f"unit {unit!r} returned a {type(out).__name__}, whose tensors funcshard's tree "
            f"does not reach, so MixedPrecision(output_dtype=...) cannot cast them; return "
            f"tensors, tuples or dicts from the unit's forward, or leave output_dtype unset"
        )
    return found
