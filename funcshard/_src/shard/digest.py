"""Digests of tensor contents: equal bytes, equal digest, in every process."""

from __future__ import annotations

import hashlib

import torch


def tensor_digest(tensor: torch.Tensor, /) -> str:
    """The SHA-256 (hex) of ``tensor``'s dtype, shape and bytes in row-major order.

    Example:
        >>> tensor_digest(torch.zeros(2)) == tensor_digest(torch.zeros(2))
        True
        >>> tensor_digest(torch.zeros(2)) == tensor_digest(torch.zeros(2, dtype=torch.float64))
        False
    """
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    flat = tensor.detach().reshape(-1)
    if flat.numel():
        if flat.device.type != "cpu":
            flat = flat.cpu()
        digest.update(flat.contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()
