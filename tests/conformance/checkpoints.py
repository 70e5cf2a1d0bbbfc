"""Save and reload one trained row of the conformance table through every checkpoint path.

On every rank of a pool: the row trained one SGD step under full_shard (float64),
rank 0's buffers made every rank's (``apply.broadcast_state``: a checkpoint holds one
copy), then its trained parameters and buffers (the *trained values*, by the module's
dotted names: ``fs.unshard`` of the params, ``apply.state``) are saved and loaded
back through each path of ``PATHS``:

- ``save``: ``fs.checkpoint.save`` of params and state, ``fs.checkpoint.load``.
- ``dcp``: ``fs.checkpoint.save_dcp`` and ``load_dcp`` (buffers zeroed first).
- ``fsdp2``: FSDP2's ``dcp.load`` of what ``save_dcp`` wrote, into a freshly built
  module (other weights) with each unit and the root ``fully_shard``-ed, through the
  module's ``state_dict`` and ``load_state_dict`` (as torchtitan's checkpointer does).
- ``state_dict``: ``apply.state_dict`` into a freshly built module's ``load_state_dict``.
- ``pretrained``: ``apply.save_pretrained`` and ``apply.load_pretrained``.

Each path's result must equal the trained values bit for bit, by name. A path may
refuse a row only at save time, with the message the row's ``checkpoint_refused`` gives.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import funcshard as fs
from funcshard.interop import functionalize
from tests.conformance.catalog import ROWS, Row
from tests.conformance.harness import LR, MOMENTUM, WEIGHT_DECAY, default_dtype

PATHS = ("save", "dcp", "fsdp2", "state_dict", "pretrained")

Named = dict[str, torch.Tensor]


def run_checkpoints(name: str, directory: str) -> dict[str, dict[str, Any]]:
    """On every rank: the row trained, then each path's outcome (``error`` or ``differ``/``missing``)."""
    row = ROWS[name]
    with warnings.catch_warnings():
        for message in row.quiet:
            warnings.filterwarnings("ignore", message)
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        return _run(row, directory)


def _run(row: Row, directory: str) -> dict[str, dict[str, Any]]:
    with default_dtype(torch.float64):
        torch.manual_seed(0)
        model = row.build()
    params, apply = functionalize(model, units=list(row.units))
    world = fs.world_size()
    plan = fs.plan(params, fs.Mesh({"fsdp": world}), units=apply.units, frozen=apply.frozen)
    sparams = fs.shard(params, plan)
    del params
    opt = fs.optim.sgd(lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    state = opt.init(sparams)

    def loss_fn(p: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        return row.loss(apply(p, *args, **kwargs), args, kwargs)

    with default_dtype(torch.float64):
        args, kwargs = row.batch(fs.rank())
    with row.around():
        _, grads = fs.value_and_grad(loss_fn, plan)(sparams, args, kwargs)
    sparams, state = opt.update_(grads, state, sparams)
    apply.broadcast_state()  # buffers are per rank; a checkpoint holds one copy (rank 0's)
    trained = _named(apply, fs.unshard(sparams), apply.state)
    context = _Context(row, apply, plan, sparams, directory)
    out: dict[str, dict[str, Any]] = {}
    for path in PATHS:
        try:
            got = _PATHS[path](context)
        except Exception as e:
            out[path] = {"error": f"{type(e).__name__}: {e}"}
        else:
            out[path] = {"error": None, **_compare(trained, got)}
        _restore(apply, trained)
    return out


class _Context:
    def __init__(self, row: Row, apply: Any, plan: Any, sparams: Any, directory: str) -> None:
        self.row, self.apply, self.plan, self.sparams = row, apply, plan, sparams
        self.directory = directory

    def at(self, path: str) -> str:
        return os.path.join(self.directory, path)

    def zeros(self) -> Any:
        """Sharded params like the trained ones, every value zero."""
        full = fs.unshard(self.sparams)
        return fs.shard(fs.tree.map(torch.zeros_like, full), self.plan)

    def fresh(self) -> nn.Module:
        """The row's module built again with other weights (not functionalized)."""
        with default_dtype(torch.float64):
            torch.manual_seed(1)
            return self.row.build()


def _save(c: _Context) -> Named:
    target = c.at("save")
    fs.checkpoint.save(target, {"params": c.sparams, "state": c.apply.state}, rng=False)
    like = {"params": c.zeros(), "state": fs.tree.map(torch.zeros_like, c.apply.state)}
    loaded = fs.checkpoint.load(target, like, rng=False)
    return _named(c.apply, fs.unshard(loaded["params"]), loaded["state"])


def _dcp(c: _Context) -> Named:
    target = c.at("dcp")
    fs.checkpoint.save_dcp(target, c.sparams, apply=c.apply)
    _zero_state(c.apply)
    loaded = fs.checkpoint.load_dcp(target, c.zeros(), apply=c.apply)
    return _named(c.apply, fs.unshard(loaded), c.apply.state)


def _fsdp2(c: _Context) -> Named:
    """FSDP2's own load of ``save_dcp``'s checkpoint (written by the ``dcp`` path)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    model = c.fresh()
    for path in c.apply.unit_paths:
        fully_shard(model.get_submodule(path.replace("/", ".")))
    fully_shard(model)
    # the module's own state dict of DTensors, hooks included, as torchtitan's ModelWrapper
    # takes it (torch's get_model_state_dict resolves every key to an attribute, which a
    # hook's keys, wq/wk/wv, are not)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=c.at("dcp"))
    model.load_state_dict(sd)
    return _module_named(model)


def _state_dict(c: _Context) -> Named:
    model = c.fresh()
    model.load_state_dict(c.apply.state_dict(fs.unshard(c.sparams)))
    return _module_named(model)


def _pretrained(c: _Context) -> Named:
    target = c.at("pretrained")
    c.apply.save_pretrained(c.sparams, target)
    _zero_state(c.apply)
    loaded = c.apply.load_pretrained(target, c.plan)
    return _named(c.apply, fs.unshard(loaded), c.apply.state)


_PATHS: dict[str, Callable[[_Context], Named]] = {
    "save": _save,
    "dcp": _dcp,
    "fsdp2": _fsdp2,
    "state_dict": _state_dict,
    "pretrained": _pretrained,
}


def _named(apply: Any, full: Any, state: Any) -> Named:
    """Every parameter and persistent buffer by each of its dotted names, from trees of values."""
    out: Named = {}
    by_path = dict(zip(fs.tree.leaf_paths(full), fs.tree.leaves(full)))
    for leaf in apply._leaves:
        for name in leaf.names:
            out[name] = by_path[leaf.path].detach().clone()
    states = dict(zip(fs.tree.leaf_paths(state), fs.tree.leaves(state)))
    persistent = _persistent(apply.module)
    for leaf in apply._state.leaves:
        for name in leaf.names:
            if name in persistent:
                out[name] = states[leaf.path].detach().clone()
    return out


def _module_named(model: nn.Module) -> Named:
    """A plain or FSDP2 module's parameters and persistent buffers, whole, by dotted name."""
    out: Named = {}
    persistent = _persistent(model)
    for name, t in (
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ):
        if name in persistent or isinstance(t, nn.Parameter):
            full = getattr(t, "full_tensor", None)
            out[name] = (t if full is None else full()).detach().clone()
    return out


def _persistent(model: nn.Module) -> set[str]:
    out = set()
    for path, m in model.named_modules(remove_duplicate=False):
        for attr in m._buffers:
            if attr not in m._non_persistent_buffers_set:
                out.add(f"{path}.{attr}" if path else attr)
    return out


def _compare(trained: Named, got: Named) -> dict[str, list[str]]:
    missing = sorted(set(trained) - set(got))
    differ = sorted(
        n
        for n in set(trained) & set(got)
        if got[n].dtype != trained[n].dtype or not torch.equal(got[n], trained[n])
    )
    return {"missing": missing, "differ": differ}


def _zero_state(apply: Any) -> None:
    with torch.no_grad():
        for t in apply._state.tensors.values():
            if t.device.type != "meta":
                t.zero_()


def _restore(apply: Any, trained: Named) -> None:
    """Puts the trained buffers back into ``apply.state`` (a path may have loaded others)."""
    with torch.no_grad():
        for name, t in apply._state.tensors.items():
            if name in trained and t.device.type != "meta":
                t.copy_(trained[name])
