"""FSDP2 runs for the DCP interop tests: two small models, trained by FSDP2 and by funcshard.

References: PyTorch FSDP2 (``fully_shard`` per block, then the root) with
``torch.optim.AdamW``, saved and loaded with ``dcp.save`` / ``dcp.load`` of
``get_model_state_dict`` and ``get_optimizer_state_dict``. :func:`round_trip`
runs on every rank of a gloo pool: FSDP2 trains 3 steps and saves; FSDP2 (a
fresh model) and funcshard (``load_dcp``) each continue 3 steps from that
checkpoint; funcshard's result goes back through ``save_dcp`` into a fresh FSDP2
model and optimizer. It returns full tensors of every state for the test to
compare.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

import funcshard as fs

LR, BETAS, WEIGHT_DECAY = 0.05, (0.8, 0.95), 0.1
STEPS = 3


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))


class Stack(nn.Module):
    """Model A: embedding, residual blocks, a norm and an untied head."""

    vocab = 11

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocab, 6)
        self.blocks = nn.ModuleList([Block(6, 9) for _ in range(2)])
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, self.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class Tied(nn.Module):
    """Model B: a head tied to the embedding, a frozen parameter, a persistent buffer,
    uneven dims and a one-row parameter (one rank's shard of it is empty at W=2)."""

    vocab = 13

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocab, 5)
        self.pos = nn.Parameter(torch.randn(4, 5), requires_grad=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))
        self.layers = nn.ModuleList([Block(5, 3) for _ in range(3)])
        self.gate = nn.Parameter(torch.randn(1, 5))
        self.head = nn.Linear(5, self.vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos[: ids.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.head(h * self.scale * torch.sigmoid(self.gate))


MODELS: dict[str, Any] = {"stack": (Stack, "blocks"), "tied": (Tied, "layers")}


def build(name: str, dtype: torch.dtype, seed: int) -> nn.Module:
    """Model ``name`` in ``dtype``, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return MODELS[name][0]().to(dtype)


def batch(name: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens and targets at ``step`` (3 sequences of 4)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    vocab = MODELS[name][0].vocab
    return torch.randint(0, vocab, (3, 4), generator=gen), torch.randint(
        0, vocab, (3, 4), generator=gen
    )


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def fsdp2(name: str, dtype: torch.dtype, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An FSDP2 model (each block, then the root) and its AdamW."""
    from torch.distributed.fsdp import fully_shard

    model = build(name, dtype, seed)
    for block in getattr(model, MODELS[name][1]):
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    return model, opt


def fsdp2_steps(name: str, model: nn.Module, opt: torch.optim.Optimizer, first: int) -> None:
    """``STEPS`` FSDP2 training steps on this rank's batches from step ``first``; mutates both."""
    import torch.distributed as dist

    for step in range(first, first + STEPS):
        ids, targets = batch(name, step, dist.get_rank())
        loss_of(model(ids), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def state_dicts(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and the optimizer's (flattened) state dicts, as torchtitan checkpoints them."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, opt, options=flat),
    }


def fsdp2_full(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and AdamW state of an FSDP2 model as full tensors, by torch's names."""
    sd = state_dicts(model, opt)
    out = {key: _full(value) for key, value in sd["model"].items()}
    out.update({k: _full(v) for k, v in sd["optimizer"].items() if k.startswith("state.")})
    return out


def fs_full(apply: Any, sparams: Any, state: Any) -> dict[str, torch.Tensor]:
    """funcshard's params, buffers and AdamW state as full tensors, by torch's names."""
    full = fs.unshard(sparams)
    out = {k: v.detach().clone() for k, v in apply.state_dict(full).items()}
    mu, nu = fs.unshard(state.mu), fs.unshard(state.nu)
    for path, leaf in zip(fs.tree.leaf_paths(full), fs.tree.leaves(full)):
        del leaf
        name = path.replace("/", ".")
        if _at(mu, path) is None:
            continue
        out[f"state.{name}.exp_avg"] = _at(mu, path)
        out[f"state.{name}.exp_avg_sq"] = _at(nu, path)
        out[f"state.{name}.step"] = state.count.to(torch.float32)
    return out


def save_torchtitan(name: str, model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """``dcp.save`` of the run in one of torchtitan's layouts, with entries funcshard skips.

    ``stack``: the model under ``model.`` (torchtitan before its model moved to the top
    level); ``tied``: the model at the top level. Both with ``optimizer.``, a
    ``train_state`` (a tensor and a pickled list) and an ``lr_scheduler`` entry.
    """
    import torch.distributed.checkpoint as dcp

    sd = state_dicts(model, opt)
    steps = io.BytesIO()
    torch.save([1, 2, 3], steps)
    state: dict[str, Any] = {
        "optimizer": sd["optimizer"],
        "train_state": {"step": torch.tensor(STEPS, dtype=torch.int32), "log_steps": steps},
        "lr_scheduler": {"last_epoch": STEPS},
    }
    if name == "stack":
        state["model"] = sd["model"]
    else:
        state.update(sd["model"])
    dcp.save(state, checkpoint_id=path)


def fsdp2_load(name: str, dtype: torch.dtype, path: str, prefix: str) -> tuple[nn.Module, Any]:
    """A fresh FSDP2 model and AdamW (other weights), loaded from ``path`` with ``dcp.load``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = fsdp2(name, dtype, seed=99)
    sd = state_dicts(model, opt)
    # the optimizer's state entries; param_groups keep this optimizer's hyperparameters
    state = {k: v for k, v in sd["optimizer"].items() if k.startswith("state.")}
    target: dict[str, Any] = {"optimizer": state}
    if prefix:
        target[prefix.rstrip(".")] = sd["model"]
    else:
        target.update(sd["model"])
    dcp.load(target, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    set_optimizer_state_dict(model, opt, {**sd["optimizer"], **state}, options=flat)
    return model, opt


def round_trip(name: str, dtype: torch.dtype, directory: str) -> dict[str, Any]:
    """The whole story on this rank; returns every state as full tensors (see the module docstring)."""
    import torch.distributed as dist

    saved, out = f"{directory}/fsdp2-step-{STEPS}", f"{directory}/funcshard-step-{2 * STEPS}"
    model, opt = fsdp2(name, dtype, seed=0)
    fsdp2_steps(name, model, opt, first=0)
    save_torchtitan(name, model, opt, saved)
    at_save = fsdp2_full(model, opt)

    prefix = "model." if name == "stack" else ""
    model2, opt2 = fsdp2_load(name, dtype, saved, prefix)
    fsdp2_steps(name, model2, opt2, first=STEPS)
    fsdp2_after = fsdp2_full(model2, opt2)

    params, apply = fs.interop.functionalize(build(name, dtype, seed=7), units=[Block])
    layout = "flat" if name == "tied" else "leaf"  # FSDP2 cuts dim 0; a flat unit cuts ranges
    mesh = fs.Mesh({"fsdp": dist.get_world_size()})
    plan = fs.plan(params, mesh, units=apply.units, frozen=apply.frozen, layout=layout)
    adamw = fs.optim.adamw(lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=False)
    sparams, state = fs.checkpoint.load_dcp(
        saved, fs.shard(params, plan), apply=apply, optimizer=adamw
    )
    loaded = fs_full(apply, sparams, state)
    step = fs.value_and_grad(lambda p, ids, targets: loss_of(apply(p, ids), targets), plan)
    for i in range(STEPS, 2 * STEPS):
        _, grads = step(sparams, *batch(name, i, dist.get_rank()))
        sparams, state = adamw.update_(grads, state, sparams)
    fs_after = fs_full(apply, sparams, state)

    fs.checkpoint.save_dcp(out, sparams, apply=apply, opt_state=state)
    model3, opt3 = fsdp2_load(name, dtype, out, prefix="")
    return {
        "at_save": at_save,
        "loaded": loaded,
        "fsdp2_after": fsdp2_after,
        "fs_after": fs_after,
        "fsdp2_from_fs": fsdp2_full(model3, opt3),
        "saved": saved,
    }


def _full(value: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    tensor = value.full_tensor() if isinstance(value, DTensor) else value
    return tensor.detach().clone()


def _at(node: Any, path: str) -> Any:
    for key in path.split("/"):
        node = node[int(key)] if isinstance(node, list) else node[key]
    return node


def save_small(path: str) -> dict[str, torch.Tensor]:
    """A small FSDP2 run's checkpoint for the fuzz tests: one leaf (a chunk per rank), one AdamW
    step, torchtitan's layout with pickled entries; returns what it saved, as full tensors."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Linear(3, 5, bias=False).double()
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model(torch.ones(2, 3, dtype=torch.float64)).square().sum().backward()
    opt.step()
    save_torchtitan("stack", model, opt, path)
    return fsdp2_full(model, opt)


def small_model() -> nn.Module:
    """The module :func:`save_small` trains, with other weights."""
    torch.manual_seed(1)
    return nn.Linear(3, 5, bias=False).double()


def load_small_outcome(path: str) -> str:
    """This rank's load of a :func:`save_small` checkpoint at W=2: ``"ok"`` or the error."""
    import torch.distributed as dist

    params, apply = fs.interop.functionalize(small_model())
    plan = fs.plan(params, fs.Mesh({"fsdp": dist.get_world_size()}))
    try:
        fs.checkpoint.load_dcp(path, fs.shard(params, plan), apply=apply)
    except fs.checkpoint.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def save_outcome(directory: str) -> str:
    """Every rank saves to a path of its own: the ranks must refuse alike."""
    import torch.distributed as dist

    params = {"w": torch.ones(4)}
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": dist.get_world_size()})))
    try:
        fs.checkpoint.save_dcp(f"{directory}/rank-{dist.get_rank()}", sparams)
    except fs.DesyncError as e:
        return f"DesyncError: {e}"
    return "saved"


def save_in_either_key_order(directory: str) -> str:
    """A ``from_torch`` Adam state whose tensors rank 1 lists in the other order (as another
    PYTHONHASHSEED listed them when they came from a set): the ranks must still save alike."""
    import torch.distributed as dist

    params = {"w": torch.ones(4, 3)}
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": dist.get_world_size()})))
    state = fs.optim.from_torch(torch.optim.Adam, lr=0.1).init(sparams)
    if dist.get_rank() == 1:
        state = state._replace(tensors=dict(reversed(state.tensors.items())))
    fs.checkpoint.save_dcp(f"{directory}/c", sparams, opt_state=state)
    return "saved"


def load_on_another_mesh(saved: str) -> dict[str, torch.Tensor]:
    """Model A's checkpoint loaded at W=4 on a {dp: 2, fsdp: 2} mesh, hybrid_shard, with a
    dim-1 rule: chunk boxes that cut FSDP2's across; returns the full tensors."""
    params, apply = fs.interop.functionalize(build("stack", torch.float64, seed=3), units=[Block])
    rules = [("blocks/*/fc1/weight", fs.P(None, "fsdp"))]
    mesh = fs.Mesh({"dp": 2, "fsdp": 2})
    plan = fs.plan(params, mesh, units=apply.units, strategy="hybrid_shard", rules=rules)
    adamw = fs.optim.adamw(lr=LR)
    sparams, state = fs.checkpoint.load_dcp(
        saved, fs.shard(params, plan), apply=apply, optimizer=adamw
    )
    return fs_full(apply, sparams, state)
