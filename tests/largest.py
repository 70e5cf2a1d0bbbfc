"""A dispatch mode that records the largest tensor any op creates: memory bounds checked on tensors."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import funcshard as fs


class Largest(TorchDispatchMode):
    """Records the bytes of the largest (non-meta) tensor any op creates, and which op."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.op = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in fs.tree.leaves(out):
            nbytes = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
            if nbytes > self.largest and t.device.type != "meta":
                self.largest, self.op = nbytes, str(func)
        return out
