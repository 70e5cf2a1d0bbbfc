"""``save_pretrained`` of a peft model: its adapters, as ``PeftModel.from_pretrained`` loads them.

A peft model (``get_peft_model(base, config)``) saves only what it trains: the
adapters (LoRA's ``lora_A``/``lora_B``, IA3's vectors, ``modules_to_save`` copies)
and ``adapter_config.json``, through peft's own ``save_pretrained``. funcshard
gathers the trainable leaves alone (the frozen base is never gathered), binds them
to the module's names on rank 0, and hands peft their state-dict entries; peft
filters, renames and writes them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from funcshard._src.comm import channel, runtime, settle
from funcshard._src.interop.binding import swapped
from funcshard._src.interop.leaf_check import Leaf
from funcshard._src.interop.state_hooks import StateLayout
from funcshard._src.shard.shard import unshard

__all__ = ["is_peft", "save_adapters"]


def is_peft(module: nn.Module, /) -> bool:
    """Whether ``module`` is a peft model (``PeftModel`` and its task subclasses).

    Example:
        >>> is_peft(nn.Linear(1, 1))
        False
    """
    return type(module).__module__.startswith("peft.") and hasattr(module, "peft_config")


def save_adapters(
    by_path: Mapping[str, Any],
    path: str | os.PathLike[str],
    /,
    *,
    module: nn.Module,
    leaves: Sequence[Leaf],
    layout: StateLayout,
) -> Path:
    """Writes the trainable leaves of ``by_path`` through peft's ``save_pretrained``; collective.

    Rank 0 writes; every rank learns whether it did.

    Raises:
        ValueError: the model trains nothing (every leaf frozen).
        OSError: peft's save failed on rank 0 (its message).
    """
    trained = [leaf for leaf in leaves if not leaf.frozen]
    if not trained:
        raise ValueError(
            f"save_pretrained: {type(module).__name__} is a peft model that trains nothing (every "
            f"parameter is frozen); peft saves adapters only"
        )
    target = Path(path)
    full = unshard({leaf.path: by_path[leaf.path] for leaf in trained}, rank0_only=True)
    error: str | None = None
    with settle.operation("save_pretrained"):
        if runtime.rank() == 0:
            assert full is not None
            names = {name: leaf for leaf in trained for name in leaf.names}
            values = {name: full[leaf.path] for name, leaf in names.items()}
            state = {k: values[n].detach() for k, n in layout.of_key.items() if n in values}
            try:
                with swapped(module, dict(values)), torch.no_grad():
                    module.save_pretrained(str(target), state_dict=state, safe_serialization=True)  # pyright: ignore[reportCallIssue]
            except Exception as e:  # every rank must learn of it
                error = f"{type(e).__name__}: {e}"
        error = channel.broadcast_json(error, "save_pretrained: whether rank 0 wrote the adapters")
    if error is not None:
        raise OSError(f"save_pretrained of the peft adapters to {target} failed on rank 0: {error}")
    return target
