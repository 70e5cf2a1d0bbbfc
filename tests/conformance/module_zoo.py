"""The rest of the module zoo: hooks, reads across units, parametrizations, attention, norms, state.

Rows built on :class:`~tests.conformance.constructs.Stack`; a hook or a read
that funcshard cannot serve is a row with ``refused`` set to its error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from tests.conformance.constructs import HIDDEN, WIDTH, Block, Stack
from tests.conformance.rows import BATCH_NORM_IN_BF16, Row, features, mean_square, register

# -- hooks ------------------------------------------------------------------------------


def _pre_hook(module: Block, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * (1 + 0.1 * module.gain.mean()),)


def _pre_hook_kwargs(
    module: Block, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (args[0] + 0.1 * module.fc2.bias,), kwargs


def _post_hook(module: Block, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
    return out * module.norm.weight.sigmoid()


def _post_hook_kwargs(
    module: Block, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor
) -> torch.Tensor:
    return out - 0.1 * module.fc1.weight.mean()


def _backward_hook(module: nn.Module, grad_in: Any, grad_out: Any) -> Any:
    assert isinstance(module, Block)
    return (grad_in[0] * (1 + module.gain.detach().mean()),)


def _backward_pre_hook(module: nn.Module, grad_out: Any) -> Any:
    assert isinstance(module, nn.Linear)
    return (grad_out[0] * (1 + module.weight.detach().square().sum()),)


def _bias_hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    assert isinstance(module, nn.Linear)
    assert module.bias is not None
    return out + module.bias.tanh()


def hooked(kind: str) -> Any:
    def build() -> nn.Module:
        model = Stack()
        for block in model.blocks:
            assert isinstance(block, Block)
            if kind == "pre":
                block.register_forward_pre_hook(_pre_hook)
            elif kind == "pre-kwargs":
                block.register_forward_pre_hook(_pre_hook_kwargs, with_kwargs=True)
            elif kind == "post":
                block.register_forward_hook(_post_hook)
            elif kind == "post-kwargs":
                block.register_forward_hook(_post_hook_kwargs, with_kwargs=True)
            elif kind == "backward":
                block.register_full_backward_hook(_backward_hook)
            elif kind == "backward-pre":
                block.fc1.register_full_backward_pre_hook(_backward_pre_hook)
            elif kind == "inside":  # on a submodule of the unit
                block.fc2.register_forward_hook(_bias_hook)
        return model

    return build


def _scale(module: nn.Module, args: Any, out: Any) -> Any:
    if isinstance(module, nn.Linear):
        return out * (1 + 0.1 * module.weight.mean())
    return None


@contextlib.contextmanager
def global_hook() -> Iterator[None]:
    """A global forward hook (``register_module_forward_hook``) reading every Linear's weight."""
    handle = nn.modules.module.register_module_forward_hook(_scale)
    try:
        yield
    finally:
        handle.remove()


# -- reads outside a module's own call ----------------------------------------------------


class ReadsTheNext(Stack):
    """Each block's output is scaled by the next block's gain: a read of another unit's parameter."""

    def run(self, h: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i + 1 < len(self.blocks):
                h = h * self.blocks[i + 1].gain  # type: ignore[operator]
        return h


class ReadsAcross(nn.Module):
    """A unit whose forward reads a parameter of another unit (via a reference it keeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Block()
        self.second = Block()
        object.__setattr__(self.second, "peer", self.first)  # not a submodule: another unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


class _Peeking(Block):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(h) * self.peer.gain  # type: ignore[attr-defined]


def reads_across() -> nn.Module:
    model = ReadsAcross()
    model.second.__class__ = _Peeking
    return model


class Regularized(Stack):
    """The forward adds a penalty over ``self.parameters()``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + 1e-3 * sum(p.square().sum() for p in self.parameters())


# -- parametrizations, attention, norms, compiled submodules, state ------------------------


class _Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return (w + w.T) / 2


def parametrized(kind: str) -> Any:
    def build() -> nn.Module:
        model = Stack()
        for block in model.blocks:
            assert isinstance(block, Block)
            if kind == "register":
                square = nn.Linear(WIDTH, WIDTH)
                block.fc2 = nn.Sequential(nn.Linear(HIDDEN, WIDTH), square)  # pyright: ignore[reportAttributeAccessIssue]
                parametrize.register_parametrization(square, "weight", _Symmetric())
            elif kind == "weight_norm":
                parametrizations.weight_norm(block.fc1)
            elif kind == "spectral_norm":
                parametrizations.spectral_norm(block.fc2)
        return model

    return build


class AttentionBlock(nn.Module):
    """nn.MultiheadAttention and an MLP, pre-norm, batch first."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        h = h + self.attn(x, x, x, need_weights=False)[0]
        return h + F.gelu(self.mlp(h))


def attention() -> nn.Module:
    model = Stack()
    model.blocks = nn.ModuleList(AttentionBlock() for _ in range(2))
    return model


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.bn(self.fc(h).transpose(1, 2)).transpose(1, 2))


def batch_norm() -> nn.Module:
    model = Stack()
    model.blocks = nn.ModuleList(NormBlock() for _ in range(2))
    return model


def compiled() -> nn.Module:
    model = Stack()
    for block in model.blocks:
        block.compile(backend="aot_eager")
    return model


class Counting(Block):
    """Buffers written in forward: a count in place, a running mean assigned anew."""

    steps: torch.Tensor
    running: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("running", torch.zeros(WIDTH))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        self.running = 0.9 * self.running + 0.1 * h.detach().mean((0, 1))
        return super().forward(h) * (1 + 0.1 * self.steps)


def counting() -> nn.Module:
    model = Stack()
    model.blocks = nn.ModuleList(Counting() for _ in range(2))
    return model


def _row(name: str, build: Any, construct: str, **kw: Any) -> Row:
    kw.setdefault("units", (Block,))
    return Row(
        name, build, batch=features(4, 3, WIDTH), loss=mean_square, construct=construct, **kw
    )


ACROSS = r"was read (inside the call of unit|by the root module's code, outside the call of unit)"

register(
    _row("hook/forward-pre", hooked("pre"), "forward pre-hook on a unit reading its parameter"),
    _row("hook/forward-pre-kwargs", hooked("pre-kwargs"), "forward pre-hook with kwargs"),
    _row("hook/forward", hooked("post"), "forward hook on a unit reading its parameter"),
    _row("hook/forward-kwargs", hooked("post-kwargs"), "forward hook with kwargs"),
    _row("hook/full-backward", hooked("backward"), "full backward hook reading the parameter"),
    _row("hook/backward-pre", hooked("backward-pre"), "backward pre-hook inside a unit"),
    _row("hook/inside-a-unit", hooked("inside"), "forward hook on a submodule of a unit"),
    _row(
        "hook/global",
        Stack,
        "register_module_forward_hook reading module weights",
        around=global_hook,
    ),
    _row(
        "read/next-unit-from-the-root",
        ReadsTheNext,
        "the root's code reads a parameter of a unit outside its call",
        refused=ACROSS,
    ),
    _row(
        "read/another-unit",
        reads_across,
        "a unit's forward reads another unit's parameter",
        units=(Block,),
        refused=ACROSS,
    ),
    _row(
        "read/parameters-in-forward",
        Regularized,
        "a penalty over self.parameters() in forward, with units",
        refused=ACROSS,
    ),
    _row(
        "read/parameters-in-forward-root",
        Regularized,
        "a penalty over self.parameters() in forward, no units",
        units=(),
        variants=("full_shard", "shard_grad_op", "bf16"),
    ),
    _row("param/register_parametrization", parametrized("register"), "a parametrization"),
    _row("param/weight_norm", parametrized("weight_norm"), "parametrizations.weight_norm"),
    _row(
        "param/spectral_norm",
        parametrized("spectral_norm"),
        "parametrizations.spectral_norm",
        bf16_error="addmv input tensors must have the same dtype",  # its float32 vectors
    ),
    _row(
        "attention/MultiheadAttention", attention, "nn.MultiheadAttention", units=(AttentionBlock,)
    ),
    _row(
        "norm/BatchNorm",
        batch_norm,
        "BatchNorm1d in training: statistics per rank",
        units=(NormBlock,),
        bf16_error=BATCH_NORM_IN_BF16,
    ),
    _row(
        "compile/submodule",
        compiled,
        "Block.compile(backend='aot_eager') units",
        # Dynamo reads .grad of its non-leaf inputs (the gathered leaves) as it wraps them
        quiet=("The .grad attribute of a Tensor that is not a leaf",),
    ),
    _row(
        "state/buffers-written",
        counting,
        "buffers updated in place and assigned anew",
        units=(Counting,),
    ),
)
