"""The unsharded reference: whole params on this rank, autograd gradients, the same optimizer.

It computes what ``funcshard.testing.reference_value_and_grad`` does (the mean
loss over every rank's batch and its gradient, by autograd, in a plain scope:
``fs.call`` is a plain call and a functionalized module runs as plain PyTorch, see
[Note: plain references] in ``execute/reference.py``), and trains with the verified optimizer itself: the
params live in a plan over a mesh of one rank, so ``update_`` runs on one flat
buffer holding every leaf whole, with no process group. Autograd rather than
``torch.func``: a model with activation checkpoints (saved-tensor hooks) or
hooks trains under autograd, and so must its reference.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.execute.reference import plain
from funcshard._src.optim.base import Optimizer
from funcshard._src.plan.plan import Plan
from funcshard._src.plan.planner import plan as make_plan
from funcshard._src.plan.precision import MixedPrecision
from funcshard._src.shard.shard import shard_for_rank
from funcshard._src.shard.sharded import trainable
from funcshard._src.spec.mesh import Mesh


class Reference:
    """A training run on the whole params in this process; :meth:`step` is one optimizer step."""

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        params: Any,
        plan: Plan,
        optimizer: Optimizer,
        *,
        mixed_precision: MixedPrecision,
        has_aux: bool,
    ) -> None:
        self.loss_fn = loss_fn
        self.has_aux = has_aux
        self.compute = mixed_precision.param_dtype
        frozen = [
            re.compile("^" + re.escape(leaf.path) + "$") for leaf in plan.leaves if leaf.frozen
        ]
        self.plan = make_plan(params, Mesh({"reference": 1}), frozen=frozen)
        self.sparams = shard_for_rank(params, self.plan, 0)
        self.optimizer = optimizer
        self.state = optimizer.init(self.sparams)
        # differentiated: floating leaves the plan trains (integer and frozen leaves are constants)
        self.trained = [leaf.trained for leaf in self.plan.leaves]

    def params(self) -> list[torch.Tensor]:
        """The whole leaves now, in tree order (views of the reference's flat buffer)."""
        return [leaf.local for leaf in tree.leaves(self.sparams)]

    def value_and_grad(self, batches: Sequence[Any], /) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The mean loss over ``batches`` (one per rank) and its gradient per leaf (zeros where untrained)."""
        leaves = [x.detach() for x in self.params()]
        index = [i for i, t in enumerate(self.trained) if t]
        diff = [leaves[i].clone().requires_grad_() for i in index]
        full = list(leaves)
        for i, x in zip(index, diff):
            full[i] = x
        with plain(), torch.enable_grad():
            if self.compute is not None:  # a step gathers and computes every float leaf so
                full = [x.to(self.compute) if x.is_floating_point() else x for x in full]
            p = tree.unflatten(self.plan.treedef, full)
            losses = []
            for batch in batches:
                out = self.loss_fn(p, batch)
                loss = out[0] if self.has_aux else out
                losses.append(loss.reshape(()).float())
            loss = torch.stack(losses).mean()
            if diff:  # backward(), not autograd.grad: a reentrant checkpoint allows only that
                loss.backward()
        out = [torch.zeros_like(x) for x in leaves]
        for i, x in zip(index, diff):
            if x.grad is not None:
                out[i] = x.grad.to(leaves[i].dtype)
        return loss.detach(), out

    def update_(self, grads: list[torch.Tensor], /) -> None:
        """One optimizer step with ``grads`` (one per leaf, in tree order); mutates the reference."""
        packed = shard_for_rank(tree.unflatten(self.plan.treedef, grads), self.plan, 0)
        self.sparams, self.state = self.optimizer.update_(
            trainable(packed), self.state, self.sparams
        )


def fingerprint(x: torch.Tensor, /) -> tuple[float, float, float]:
    """``(sum, sum of |x|, a weighted sum)`` in float64: equal on two ranks for equal tensors.

    Cheap to compare across ranks, unlike the tensor: a rank-dependent loss moves
    the sums even where it moves the values only a little.

    Example:
        >>> fingerprint(torch.tensor([1.0, -2.0]))
        (-1.0, 3.0, -0.08060461173627953)
    """
    flat = x.detach().reshape(-1).double()
    weights = torch.cos(torch.arange(flat.numel(), dtype=torch.float64, device=flat.device))
    return (float(flat.sum()), float(flat.abs().sum()), float((flat * weights).sum()))
