"""What ``loss_fn`` returned: the loss (and aux), checked before backward runs."""

from __future__ import annotations

from typing import Any

import torch


def split_loss(out: Any, *, has_aux: bool) -> tuple[torch.Tensor, Any]:
    """``(loss, aux)`` from what ``loss_fn`` returned, checked: a floating scalar that needs grad."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"has_aux=True: loss_fn must return (loss, aux), got {type(out).__name__}"
            )
        loss, aux = out
    else:
        loss, aux = out, None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        hint = (
            "; to return (loss, aux), pass has_aux=True"
            if not has_aux and isinstance(loss, tuple)
            else ""
        )
        raise TypeError(
            f"loss_fn must return a floating-point scalar tensor as the loss, got {_kind(loss)}{hint}"
        )
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not depend on any parameter (it does not require grad); use the params "
            "loss_fn receives, through fs.call for unit leaves"
        )
    return loss.reshape(()), aux


def _kind(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"
