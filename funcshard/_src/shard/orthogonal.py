"""``orthogonal``: an initializer that needs its whole leaf, as ``torch.nn.init.orthogonal_``.

An orthogonal matrix is not a function of one element's index: its QR couples
every element. So this initializer generates its whole leaf (counter-based
normals, one leaf at a time, in float64), orthogonalizes it, and then keeps the
box that is asked for. A rank's transient memory for such a leaf is the leaf
(twice, for QR), not a block; the values are still the same on every mesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from funcshard._src.shard import fill
from funcshard._src.shard.initializers import Initializer, Key


@dataclass(frozen=True, repr=False)
class Orthogonal(Initializer):
    """A (semi-)orthogonal leaf times ``gain``: :func:`orthogonal`."""

    gain: float = 1.0
    name: ClassVar[str] = "orthogonal"

    def check(self, path: str, shape: tuple[int, ...], dtype: torch.dtype, /) -> None:
        super().check(path, shape, dtype)
        if len(shape) < 2 and math.prod(shape) > 0:
            raise ValueError(
                f"{path or '<root>'}: {self!r} needs a leaf of 2 dims or more (rows, *cols), "
                f"got shape {shape}; give it another initializer, e.g. a rule "
                f"({path!r}, fs.initializers.zeros)"
            )

    def fill_(
        self, out: torch.Tensor, key: Key, shape: tuple[int, ...], starts: Sequence[int], /
    ) -> None:
        self.check(key.path, shape, out.dtype)
        if math.prod(out.shape) == 0:
            return
        whole = self.whole(key, shape)  # the leaf, whatever box is asked for
        box = tuple(slice(s, s + n) for s, n in zip(starts, out.shape))
        out.copy_(whole[box].to(out.dtype))

    def values(self, key: Key, shape: tuple[int, ...], index: torch.Tensor, /) -> torch.Tensor:
        return self.whole(key, shape).reshape(-1)[index]

    def whole(self, key: Key, shape: tuple[int, ...], /) -> torch.Tensor:
        """The whole float64 leaf, as ``torch.nn.init.orthogonal_`` computes it from its normals."""
        normals = torch.empty(shape, dtype=torch.float64)
        fill.fill_blocks_(normals, shape, (0,) * len(shape), key.normal)
        rows = shape[0]
        flat = normals.reshape(rows, -1)
        if rows < flat.shape[1]:
            flat = flat.t()
        q, r = torch.linalg.qr(flat)
        q = q * torch.diag(r, 0).sign()  # a unique factorization: r's diagonal positive
        if rows < normals.numel() // rows:
            q = q.t()
        return (q * self.gain).reshape(shape)


def orthogonal(gain: float = 1.0) -> Initializer:
    """``torch.nn.init.orthogonal_``: a (semi-)orthogonal leaf, seen as ``(rows, prod(rest))``, times ``gain``.

    Cannot be generated piecewise: each rank builds the whole leaf (one leaf at
    a time) and keeps its shard, so it costs a leaf of memory and a QR on every
    rank. Bit-identical across meshes on one machine; across machines, as
    reproducible as their LAPACK's QR.

    Example:
        >>> q = orthogonal()(0, (3, 5))
        >>> torch.allclose(q @ q.T, torch.eye(3, dtype=q.dtype), atol=1e-6)
        True
    """
    if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not math.isfinite(gain):
        raise TypeError(f"orthogonal: gain must be a finite number, got {gain!r}")
    return Orthogonal(float(gain))
