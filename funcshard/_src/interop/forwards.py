"""Running a unit submodule's forward through ``fs.call``: the swap of ``forward`` and its outputs.

``Apply`` replaces each unit submodule's ``forward`` for the duration of one
apply (:func:`replaced_forwards`), runs the original through :class:`Runner`
inside ``torch.func.functional_call``, and hands ``fs.call`` the outputs that
funcshard's tree cannot see (:func:`hidden_tensors`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from funcshard._src import tree
from funcshard._src.execute.run import current_run

_MISSING = object()


@contextlib.contextmanager
def replaced_forwards(
    forwards: Sequence[tuple[nn.Module, Callable[..., Any]]], /
) -> Iterator[None]:
    """Gives each module its new ``forward`` while the block runs; mutates the modules.

    The replacement is an instance attribute, which ``nn.Module.__call__`` finds
    before the class's ``forward``; on exit (return or error) every module gets
    back exactly what it had (no instance attribute, or its own).

    Example:
        >>> lin = nn.Linear(1, 1)
        >>> with replaced_forwards([(lin, lambda x: x + 1)]):
        ...     lin(torch.zeros(1))
        tensor([1.])
        >>> "forward" in vars(lin)
        False
    """
    saved: list[tuple[nn.Module, Any]] = []
    try:
        for module, forward in forwards:
            instance = vars(module)
            saved.append((module, instance.get("forward", _MISSING)))
            instance["forward"] = forward
        yield
    finally:
        for module, forward in saved:
            if forward is _MISSING:
                del vars(module)["forward"]
            else:
                vars(module)["forward"] = forward


class Runner(nn.Module):
    """Runs one submodule's ``forward`` (not its ``__call__``, whose hooks already ran)."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        super().__init__()
        self.m = module
        self._forward = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)


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
