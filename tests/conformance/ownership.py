"""What module code does with the parameters it is given: shares, returns, writes, aliases, hooks.

Rows built on :class:`~tests.conformance.constructs.Stack`. A unit called more
than once, an RNN unit and a unit returning a view of its own parameter train
equal to the reference. Writing a parameter in place during forward, reading one
through a reference kept outside the module's parameters, and parameters funcshard
cannot own (tensor hooks, sparse or lazy modules) are refused, each by its error
(see [Note: what a call may do to its parameters] in ``funcshard/_src/execute/call_record.py``
and ``funcshard/_src/interop/module_checks.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.utils.checkpoint as checkpoint_utils
from torch import nn

from tests.conformance.constructs import WIDTH, Block, Stack
from tests.conformance.rows import Row, features, mean_square, register, tokens

WRITTEN = "ParameterWriteError: .* written in place during"
AT_FUNCTIONALIZE = (
    "refused by functionalize, before any step: a `ValueError` naming the {} and the fix"
)

# -- trained equal ----------------------------------------------------------------------


class SharedBlock(Stack):
    """ALBERT's sharing: one block (one unit) called three times, then a block of its own."""

    def __init__(self) -> None:
        super().__init__(layers=2)

    def run(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            h = self.blocks[0](h)
        return self.blocks[1](h)


class Positions(nn.Module):
    """Returns a view of its own parameter: the unit's output lies in its gathered memory."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, WIDTH) * 0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.table[: h.shape[-2]]


class WithPositions(Stack):
    def __init__(self) -> None:
        super().__init__()
        self.positions = Positions()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(self.run(h + self.positions(h)))


class Recurrent(Stack):
    """An LSTM unit between the root's input projection and the blocks."""

    def __init__(self) -> None:
        super().__init__(layers=1)
        self.lstm = nn.LSTM(WIDTH, WIDTH, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.inp(x))
        return self.head(self.run(h))


class CountsInACheckpoint(Block):
    """Assigns buffers anew inside a checkpointed region: torch's recompute assigns them again."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(WIDTH))

    def inner(self, h: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1  # the recompute computes with the count its forward left
        self.mean = 0.5 * self.mean + 0.5 * h.detach().mean(dim=(0, 1))  # per rank: not used
        return super().forward(h * (1 + 0.1 * self.calls))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return checkpoint_utils.checkpoint(self.inner, h, use_reentrant=False)


class SharedModule(Stack):
    """One module object at two paths (T5's ``shared`` and ``encoder.embed_tokens`` shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Sequential(self.inp, nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.run(self.extra(x) + self.inp(x)))


class KeepsAView(Block):
    """Keeps a view of its weight on an attribute, which the root reads after the unit's call."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.kept = self.fc1.weight.T
        return super().forward(h)


class ReadsKeptViews(Stack):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(KeepsAView() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.run(self.inp(x)))
        kept = [b.kept for b in self.blocks if isinstance(b, KeepsAView)]
        return out + 0.01 * sum(k.square().mean() for k in kept)


# -- refused ------------------------------------------------------------------------------


class Clamps(Block):
    """Clips its weight in place inside forward (weight clipping, as in WGAN critics)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc1.weight.clamp_(-0.2, 0.2)
        return super().forward(h)


class AssignsData(Block):
    """Replaces its weight's ``.data`` inside forward."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.fc1.weight.data = self.fc1.weight.data.clamp(-0.2, 0.2)
        return super().forward(h)


class RenormalisedEmbedding(nn.Module):
    """``nn.Embedding(max_norm=...)``: renormalises the rows it looks up, in place, in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, WIDTH, max_norm=0.5)
        self.stack = Stack()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.stack(self.embed(ids))


class SparseEmbedding(RenormalisedEmbedding):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, WIDTH, sparse=True)


class SharesWithNumpy(Block):
    """Hands its weight's memory to numpy in forward (np.asarray of a detached parameter)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        scale = float(np.asarray(self.fc1.weight.detach()).std())
        return super().forward(h) * (1 + 0.01 * scale)


class PenalisesItsInputGradient(Block):
    """Takes an input gradient inside forward (torch.autograd.grad, create_graph=True)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        inner = h.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(self.fc1(inner).square().sum(), inner, create_graph=True)
        return super().forward(h) + 0.01 * g


class KeepsAList(Block):
    """Keeps its weight in a plain list (not a ParameterList) and computes with it."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = [self.fc1.weight]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.gain * torch.tanh(h @ self.weights[0][:WIDTH].t())


def _blocks(kind: type[Block]) -> Any:
    def build() -> nn.Module:
        model = Stack()
        model.blocks = nn.ModuleList(kind() for _ in range(3))
        return model

    return build


def _hooked_parameter() -> nn.Module:
    model = Stack()
    block = model.blocks[0]
    assert isinstance(block, Block)
    block.fc1.weight.register_hook(lambda g: 2 * g)
    return model


def _lazy() -> nn.Module:
    model = Stack()
    model.head = nn.LazyLinear(4)
    return model


def _row(name: str, build: Any, construct: str, **kw: Any) -> Row:
    kw.setdefault("units", (Block,))
    kw.setdefault("batch", features(4, 3, WIDTH))
    return Row(name, build, loss=mean_square, construct=construct, **kw)


register(
    _row("share/unit-called-three-times", SharedBlock, "one unit called three times (ALBERT)"),
    _row(
        "share/output-views-a-parameter",
        WithPositions,
        "a unit returns a view of its own parameter (copied: it outlives the gather); no bf16 "
        "row, as FSDP2 itself reads the freed parameter there and crashes (SIGSEGV)",
        units=(Block, Positions),
        variants=("full_shard", "shard_grad_op", "remat"),
    ),
    _row(
        "share/attribute-views-a-parameter",
        ReadsKeptViews,
        "a unit keeps a view of its weight on an attribute; the root reads it (copied); no bf16 "
        "row, as FSDP2 itself reads the freed parameter there and crashes (SIGSEGV)",
        units=(KeepsAView,),
        variants=("full_shard", "shard_grad_op", "remat"),
    ),
    _row(
        "share/module-at-two-paths",
        SharedModule,
        "one module object registered at two paths in the root",
    ),
    _row(
        "state/assigned-in-a-checkpoint",
        _blocks(CountsInACheckpoint),
        "buffers assigned anew inside a torch checkpoint (kept from the recompute too, as torch)",
        units=(CountsInACheckpoint,),
    ),
    _row(
        "rnn/LSTM",
        Recurrent,
        "a two-layer nn.LSTM unit",
        units=(Block, nn.LSTM),
    ),
    _row(
        "write/clamp-in-forward",
        _blocks(Clamps),
        "weight.clamp_() under no_grad in a unit's forward",
        units=(Clamps,),
        refused=WRITTEN,
        refusal="refused at the first step: `ParameterWriteError` naming the unit's leaves and the fix",
    ),
    _row(
        "write/data-assignment",
        _blocks(AssignsData),
        "weight.data = ... in a unit's forward",
        units=(AssignsData,),
        refused=WRITTEN,
        refusal="refused at the first step: `ParameterWriteError` naming the leaf and the fix",
    ),
    _row(
        "write/Embedding-max_norm",
        RenormalisedEmbedding,
        "nn.Embedding(max_norm=...) in the root (renormalises rows in place)",
        batch=tokens(16, (4, 3)),
        refused=WRITTEN,
        refusal="refused at the first step: `ParameterWriteError` naming the root's leaves and the fix",
    ),
    _row(
        "write/numpy-shares-memory",
        _blocks(SharesWithNumpy),
        "np.asarray(weight.detach()) in a unit's forward (numpy pins the gathered memory)",
        units=(SharesWithNumpy,),
        refused="its gathered parameters cannot be freed",
        refusal="refused at the first step: a `RuntimeError` naming the unit and the fix",
        variants=("full_shard", "shard_grad_op", "remat"),
    ),
    _row(
        "checkpoint/autograd-grad-in-forward",
        _blocks(PenalisesItsInputGradient),
        "torch.autograd.grad inside a unit's forward under remat (the recompute would run in "
        "forward); without remat it trains equal",
        units=(PenalisesItsInputGradient,),
        refused="recomputed during forward",
        refusal="under remat (the only variant run): refused at the first step, a `RuntimeError` "
        "naming the unit and the fix",
        variants=("remat",),
    ),
    _row(
        "alias/plain-list",
        _blocks(KeepsAList),
        "a unit reads its weight through a plain list made in __init__",
        units=(KeepsAList,),
        refused="was read through a reference kept outside the module's parameters",
    ),
    _row(
        "own/parameter-hook",
        _hooked_parameter,
        "weight.register_hook(...) before functionalize",
        refused="has a tensor hook",
        refusal=AT_FUNCTIONALIZE.format("parameter"),
    ),
    _row(
        "own/Embedding-sparse",
        SparseEmbedding,
        "nn.Embedding(sparse=True)",
        batch=tokens(16, (4, 3)),
        refused="has sparse=True",
        refusal=AT_FUNCTIONALIZE.format("submodule"),
    ),
    _row(
        "own/LazyLinear",
        _lazy,
        "nn.LazyLinear never run",
        refused="is uninitialized",
        refusal=AT_FUNCTIONALIZE.format("parameter"),
        quiet=("Lazy modules are a new feature",),
    ),
)
