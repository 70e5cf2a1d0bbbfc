"""Module code that runs outside a plain forward: activation checkpoints, hooks, reads across units.

Each row is a small stack (a root input projection, blocks as units, a root
head) that exercises one construct in the module's own code, the way users
write it. See [Note: module code outside the call] in ``funcshard/_src/interop/binding.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint_utils
from torch import nn

from tests.conformance.rows import Row, features, mean_square, register

WIDTH, HIDDEN = 8, 12


class Block(nn.Module):
    """A pre-norm MLP block with a learned gain."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)
        self.gain = nn.Parameter(torch.full((WIDTH,), 0.5))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.gain * self.fc2(F.gelu(self.fc1(self.norm(h))))


class Stack(nn.Module):
    """``inp`` and ``head`` in the root unit, ``blocks`` the units; ``run`` says how blocks are called."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(WIDTH, 4)

    def run(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.run(self.inp(x)))


def stack(run: Callable[[Stack, torch.Tensor], torch.Tensor] | None = None, **kw: Any) -> Any:
    """A builder of a :class:`Stack` whose blocks run as ``run(stack, h)`` does."""

    def build() -> nn.Module:
        model = Stack(**kw)
        if run is not None:
            model.run = functools.partial(run, model)  # type: ignore[method-assign]
        return model

    return build


def _checkpoint(reentrant: bool) -> Callable[[Stack, torch.Tensor], torch.Tensor]:
    def run(model: Stack, h: torch.Tensor) -> torch.Tensor:
        for block in model.blocks:
            h = checkpoint_utils.checkpoint(block, h, use_reentrant=reentrant)
        return h

    return run


def _sequential(model: Stack, h: torch.Tensor) -> torch.Tensor:
    return checkpoint_utils.checkpoint_sequential(
        nn.Sequential(*model.blocks), 2, h, use_reentrant=False
    )


def _selective(model: Stack, h: torch.Tensor) -> torch.Tensor:
    policy = functools.partial(
        checkpoint_utils.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]
    )
    for block in model.blocks:
        h = checkpoint_utils.checkpoint(block, h, use_reentrant=False, context_fn=policy)
    return h


def _spanning(model: Stack, h: torch.Tensor) -> torch.Tensor:
    """One checkpoint over two units and root code between and after them."""

    def two(h: torch.Tensor) -> torch.Tensor:
        return model.inp(model.blocks[1](torch.tanh(model.blocks[0](h))))

    return model.blocks[2](checkpoint_utils.checkpoint(two, h, use_reentrant=False))


def wrapped(impl: str) -> Any:
    """``apply_activation_checkpointing`` on every Block, as FSDP users call it."""

    def build() -> nn.Module:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        model = Stack()
        kind = CheckpointImpl.REENTRANT if impl == "reentrant" else CheckpointImpl.NO_REENTRANT
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=kind),
            check_fn=lambda m: isinstance(m, Block),
        )
        return model

    return build


def composable() -> nn.Module:
    """``torch.distributed._composable.checkpoint`` on every Block (FSDP2's own tests use it)."""
    from torch.distributed._composable import checkpoint

    model = Stack()
    for block in model.blocks:
        checkpoint(block)
    return model


class CheckpointsInside(Block):
    """A unit that checkpoints its own MLP (a region inside the unit's call)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        def mlp(x: torch.Tensor) -> torch.Tensor:
            return self.fc2(F.gelu(self.fc1(x)))

        return h + self.gain * checkpoint_utils.checkpoint(mlp, self.norm(h), use_reentrant=False)


def inside() -> nn.Module:
    model = Stack()
    model.blocks = nn.ModuleList(CheckpointsInside() for _ in range(3))
    return model


def _features() -> Any:
    return features(4, 3, WIDTH)


def _row(name: str, build: Any, construct: str, **kw: Any) -> Row:
    kw.setdefault("units", (Block,))
    return Row(name, build, batch=_features(), loss=mean_square, construct=construct, **kw)


register(
    _row(
        "checkpoint/non-reentrant",
        stack(_checkpoint(False)),
        "checkpoint(block, use_reentrant=False)",
    ),
    _row("checkpoint/reentrant", stack(_checkpoint(True)), "checkpoint(block, use_reentrant=True)"),
    _row("checkpoint/sequential", stack(_sequential), "checkpoint_sequential over the blocks"),
    _row(
        "checkpoint/selective",
        stack(_selective),
        "selective checkpoint (create_selective_checkpoint_contexts, mm saved)",
    ),
    _row(
        "checkpoint/spanning",
        stack(_spanning),
        "one checkpoint over two units and root code",
    ),
    _row(
        "checkpoint/wrapper",
        wrapped("non-reentrant"),
        "apply_activation_checkpointing(checkpoint_wrapper), units = the wrapped blocks",
    ),
    _row(
        "checkpoint/wrapper-reentrant",
        wrapped("reentrant"),
        "apply_activation_checkpointing(CheckpointImpl.REENTRANT)",
    ),
    _row(
        "checkpoint/wrapper-as-unit",
        wrapped("non-reentrant"),
        "apply_activation_checkpointing, units = the CheckpointWrapper modules",
        units=("CheckpointWrapper",),
    ),
    _row("checkpoint/composable", composable, "torch.distributed._composable.checkpoint(block)"),
    _row(
        "checkpoint/inside-a-unit",
        inside,
        "a unit checkpointing its own submodules",
        units=(CheckpointsInside,),
    ),
)
