"""``Apply``'s weights in and out: the state dict, Hugging Face safetensors, the module's own init.

:class:`Weights` holds the methods of :class:`~funcshard._src.interop.apply.Apply`
that read or write weights rather than run the module; ``Apply`` inherits them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from funcshard._src import tree
from funcshard._src.comm import runtime
from funcshard._src.interop.binding import swapped
from funcshard._src.interop.leaf_check import Leaf
from funcshard._src.interop.module_init import materialize_buffers, materialize_module
from funcshard._src.interop.module_layout import bind_once
from funcshard._src.interop.module_state import ModuleState
from funcshard._src.interop.state_hooks import StateLayout, named_tensors, probe, run_state_dict
from funcshard._src.plan.plan import Plan

__all__ = ["Weights"]

Params = Any


class Weights:
    """The weight I/O of an ``Apply``: what it needs of it, and the methods."""

    _module: nn.Module
    _treedef: tree.TreeDef
    _leaves: tuple[Leaf, ...]
    _state: ModuleState
    _redundant: frozenset[str]
    _state_layout: StateLayout | None = None

    def _leaf_values(self, params: Params, *, what: str = "apply") -> dict[str, Any]:
        raise NotImplementedError

    def state_dict(self, params: Params, /) -> dict[str, torch.Tensor]:
        """The module's ``state_dict`` with the values of ``params`` (and of the state).

        For ``module.load_state_dict`` or a Hugging Face ``save_pretrained``: every key
        of ``module.state_dict()``, tied names included.

        Raises:
            ValueError: ``params`` has another structure or holds sharded leaves
                (``fs.unshard`` them first).

        Example:
            >>> import funcshard as fs
            >>> lin = torch.nn.Linear(2, 1)
            >>> keys = sorted(lin.state_dict())
            >>> params, apply = fs.interop.functionalize(lin)
            >>> sorted(apply.state_dict(params)) == keys
            True
        """
        by_path = self._leaf_values(params, what="state_dict")
        tensors: dict[str, Any] = dict(self._state.tensors)
        for leaf in self._leaves:
            tensors.update(dict.fromkeys(leaf.names, by_path[leaf.path]))
        bind_once(tensors, self._redundant)
        leaf_ids = {id(v) for v in by_path.values()}
        # the module's own state_dict with the values bound: its hooks (renaming keys, or
        # computing them from parameters) run on these tensors; see [Note: state-dict hooks] in ``interop/state_hooks.py``
        with swapped(self._module, tensors):
            out = run_state_dict(self._module)
        return {k: v if id(v) in leaf_ids else v.detach() for k, v in out.items()}

    def state_layout(self) -> StateLayout:
        """What the module's ``state_dict`` holds, learned on the meta device (computed once).

        Which key holds which parameter or buffer, and which keys a state-dict hook
        computes ([Note: state-dict hooks] in ``state_hooks.py``).

        Example:
            >>> import funcshard as fs
            >>> params, apply = fs.interop.functionalize(torch.nn.Linear(2, 1))
            >>> apply.state_layout().keys
            ('weight', 'bias')
        """
        if self._state_layout is None:
            self._state_layout = probe(self._module, named_tensors(self._module))
        return self._state_layout

    def load_pretrained(
        self,
        path: str | os.PathLike[str],
        plan: Plan,
        /,
        *,
        ignore_unexpected: Sequence[str | re.Pattern[str]] = (),
        device: torch.device | str | None = None,
    ) -> Params:
        """This rank's shards of a Hugging Face safetensors checkpoint; mutates ``apply.state``.

        Each rank reads only its slices, a leaf under any of its module's names; meta
        buffers get values first (:meth:`materialize_state`), then persistent ones are
        copied from the file. Arguments, unexpected keys and errors:
        ``funcshard._src.interop.safetensors_io.load_pretrained``, which has an example.
        """
        from funcshard._src.interop.safetensors_io import load_pretrained

        if any(t.device.type == "meta" for t in self._state.tensors.values()):
            self.materialize_state(device=device)
        return load_pretrained(
            path,
            plan,
            module=self._module,
            treedef=self._treedef,
            leaves=self._leaves,
            state=self._state.tensors,
            ignore_unexpected=ignore_unexpected,
            device=device,
        )

    def save_pretrained(
        self,
        sparams: Params,
        path: str | os.PathLike[str],
        /,
        *,
        max_shard_size: int | str = "5GB",
        safe_serialization: bool = True,
    ) -> os.PathLike[str]:
        """Writes ``sparams`` as ``from_pretrained`` loads them; collective, rank 0 writes.

        HF key names, tied weights once, frozen parameters and persistent buffers, in files
        of at most ``max_shard_size``, one flat buffer gathered at a time. Returns the
        directory (a ``Path``). Details and an example:
        ``funcshard._src.interop.hf_export.save_pretrained``. A peft model (``get_peft_model``)
        saves its adapters through peft's own ``save_pretrained`` (the trainable leaves alone
        are gathered), for ``PeftModel.from_pretrained``: ``peft_export.py``.
        """
        from funcshard._src.interop.hf_export import save_pretrained
        from funcshard._src.interop.peft_export import is_peft, save_adapters

        if is_peft(self._module):  # peft's layout: the adapters and adapter_config.json
            paths, values, got = tree.flatten_with_paths(sparams)
            by_path = dict(zip(paths, values))
            if got != self._treedef:
                raise ValueError(
                    f"save_pretrained: sparams do not have the structure of "
                    f"{type(self._module).__name__}'s params; pass fs.shard of what "
                    f"functionalize returned, or a step's result"
                )
            return save_adapters(
                by_path,
                path,
                module=self._module,
                leaves=self._leaves,
                layout=self.state_layout(),
            )
        return save_pretrained(
            sparams,
            path,
            module=self._module,
            treedef=self._treedef,
            leaves=self._leaves,
            state=self._state.tensors,
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
        )

    def materialize(
        self, plan: Plan, /, *, seed: int = 0, device: torch.device | str | None = None
    ) -> Params:
        """This rank's sharded params from the module's own initialization, one submodule at a time.

        For a module built on the meta device: each submodule that owns tensors is
        initialized in turn by the module's own code (Hugging Face ``_init_weights``,
        else ``reset_parameters``); this rank keeps its shards, so the peak is its
        shards plus one submodule. Values depend only on ``(seed, submodule name)``,
        not on the world size, mesh or units ([Note: materializing a module] in ``interop/module_init.py``).
        Buffers become real too (mutates ``apply.state``). No collective.

        Args:
            plan: the plan of the params :func:`functionalize` returned.
            seed: the seed every rank uses.
            device: where the shards and buffers go (default: ``fs.device()``, the GPU of this rank under NCCL, else the CPU).

        Returns:
            Sharded params, as ``fs.shard`` of the initialized params would return.

        Raises:
            ValueError: the plan is for other params, or the module's initialization
                left a tensor unset (the message names it).

        Example:
            >>> import funcshard as fs
            >>> with torch.device("meta"):
            ...     net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
            >>> params, apply = fs.interop.functionalize(net, units=[torch.nn.Linear])
            >>> plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
            >>> sparams = apply.materialize(plan, seed=0)
            >>> apply(fs.unshard(sparams), torch.ones(1, 4)).shape
            torch.Size([1, 2])
        """
        sparams, buffers = materialize_module(
            self._module,
            plan,
            {leaf.path: leaf.names for leaf in self._leaves},
            [leaf.names for leaf in self._state.leaves],
            seed=seed,
            device=_device(device),
        )
        self._state.replace(buffers)
        return sparams

    def materialize_state(self, *, device: torch.device | str | None = None) -> None:
        """Gives meta buffers values from the module's own initialization; mutates ``apply.state``.

        For params made without :meth:`materialize` (``fs.materialize``) on a meta
        module. Buffers that have values keep them; every rank builds them alike.
        """
        target = _device(device)
        names = [leaf.names for leaf in self._state.leaves]
        self._state.replace(materialize_buffers(self._module, names, device=target))


def _device(device: torch.device | str | None, /) -> torch.device:
    """``device``, or by default where shards go: ``fs.device()`` ([Note: devices and backends] in ``comm/runtime.py``)."""
    return runtime.default_device() if device is None else torch.device(device)
