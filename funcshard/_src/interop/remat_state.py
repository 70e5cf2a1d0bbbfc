"""funcshard's remat and a unit's buffers: the recompute sees them as the forward did, and changes nothing.

[Note: remat and buffers]
``remat=True`` runs a unit's forward again in backward. A forward that updates a
buffer in place (BatchNorm's running statistics, spectral_norm's power
iteration) would update it a second time there, and would recompute from the
updated value: the statistics would drift from the unsharded model's, and the
recomputed activations from the forward's. So each call of a rematerialized unit
keeps copies of the unit's buffers, taken before its forward
(:func:`kept_buffers`), and its recompute runs on copies of those: it computes
what the forward computed, and the state is updated once per call, as without
remat. The copies cost the unit's buffer bytes from the forward to the recompute
(norm statistics: a few vectors). Which buffers a forward updates cannot be told
from their version counters (native BatchNorm kernels update running statistics
without bumping them), so every buffer of the unit is kept. A buffer the forward
assigns anew (``self.n = self.n + 1``) needs no copy: the recompute binds the
tensors the call started with. torch's own checkpoints keep torch's semantics
(their recompute updates again), as the unsharded model with the same
checkpoints does.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["kept_buffers", "recompute_buffers"]


def kept_buffers(module: nn.Module, /) -> dict[str, torch.Tensor]:
    """Copies of ``module``'s buffers (by name under it), before a rematerialized forward.

    Example:
        >>> bn = nn.BatchNorm1d(2)
        >>> kept = kept_buffers(bn)
        >>> _ = bn(torch.randn(4, 2))
        >>> sorted(kept), float(kept["running_mean"].abs().sum())
        (['num_batches_tracked', 'running_mean', 'running_var'], 0.0)
    """
    return {name: b.detach().clone() for name, b in module.named_buffers()}


def recompute_buffers(kept: Mapping[str, torch.Tensor], /) -> dict[str, torch.Tensor]:
    """Copies of ``kept`` for one recompute to bind (and update, unseen)."""
    return {name: t.clone() for name, t in kept.items()}
