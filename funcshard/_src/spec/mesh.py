"""Mesh: ordered named axes over ranks, laid out row-major (last axis fastest).

The layout is the one of ``torch.distributed.device_mesh.init_device_mesh(device,
shape, mesh_dim_names=names)`` and of ``jax.sharding.Mesh(devices.reshape(shape),
names)`` with devices listed in rank order. A ``Mesh`` is pure data: planning
needs no process group. ``funcshard._src.comm.groups`` binds it to one once
``torch.distributed`` runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

import numpy as np


class Mesh:
    """Ordered named mesh axes; rank ``r`` sits at ``np.unravel_index(r, shape)``.

    Args:
        axes: ``{"dp": 2, "fsdp": 4}`` or ``[("dp", 2), ("fsdp", 4)]``; order matters,
            the first axis is the major one.

    Raises:
        ValueError: no axes, a repeated or empty axis name, or a size below 1.
        TypeError: a name that is not a string or a size that is not an int.

    Example:
        >>> mesh = Mesh({"dp": 2, "fsdp": 2})
        >>> mesh.size, mesh.coords(3), mesh.rank_of((1, 0))
        (4, (1, 1), 2)
    """

    __slots__ = ("_names", "_shape")

    def __init__(self, axes: Mapping[str, int] | Iterable[tuple[str, int]], /) -> None:
        pairs = cast("Mapping[str, int]", axes).items() if isinstance(axes, Mapping) else axes
        items: list[tuple[object, object]] = list(pairs)
        if not items:
            raise ValueError("Mesh needs at least one axis, e.g. Mesh({'fsdp': world_size})")
        names: list[str] = []
        sizes: list[int] = []
        for name, size in items:
            if not isinstance(name, str):
                raise TypeError(f"Mesh axis names must be strings, got {name!r}")
            if not name:
                raise ValueError("Mesh axis names must be non-empty strings")
            if name in names:
                raise ValueError(f"Mesh axis {name!r} appears twice; axis names must be unique")
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
                raise TypeError(f"Mesh axis {name!r}: size must be an int, got {size!r}")
            n = int(size)  # pyright: ignore[reportUnknownArgumentType]
            if n < 1:
                raise ValueError(f"Mesh axis {name!r}: size must be at least 1, got {n}")
            names.append(name)
            sizes.append(n)
        self._names = tuple(names)
        self._shape = tuple(sizes)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Axis names, major first."""
        return self._names

    @property
    def shape(self) -> tuple[int, ...]:
        """Axis sizes in axis order."""
        return self._shape

    @property
    def axes(self) -> dict[str, int]:
        """``{name: size}`` in axis order."""
        return dict(zip(self._names, self._shape))

    @property
    def size(self) -> int:
        """Number of ranks (the product of the axis sizes)."""
        return math.prod(self._shape)

    @property
    def devices(self) -> np.ndarray:
        """Ranks as an array of the mesh's shape, as in ``jax.sharding.Mesh.devices``."""
        return np.arange(self.size).reshape(self._shape)

    def axis_size(self, name: str, /) -> int:
        """Size of axis ``name``.

        Raises:
            ValueError: ``name`` is not an axis of this mesh.
        """
        return self._shape[self.axis_index(name)]

    def axis_index(self, name: str, /) -> int:
        """Position of axis ``name`` in the mesh.

        Raises:
            ValueError: ``name`` is not an axis of this mesh.
        """
        try:
            return self._names.index(name)
        except ValueError:
            raise ValueError(
                f"mesh axis {name!r} is not in the mesh; its axes are {list(self._names)}"
            ) from None

    def coords(self, rank: int, /) -> tuple[int, ...]:
        """Coordinates of ``rank`` along every axis (row-major).

        Raises:
            ValueError: ``rank`` is outside ``[0, size)``.
        """
        self._check_rank(rank)
        return tuple(int(c) for c in np.unravel_index(rank, self._shape))

    def rank_of(self, coords: Sequence[int], /) -> int:
        """The rank at ``coords``; the inverse of :meth:`coords`."""
        if len(coords) != len(self._shape) or any(
            not 0 <= c < s for c, s in zip(coords, self._shape)
        ):
            raise ValueError(f"coords {tuple(coords)} are outside mesh {self!r}")
        return int(np.ravel_multi_index(tuple(coords), self._shape))

    def groups(self, axes: Sequence[str], /) -> list[list[int]]:
        """The rank groups that vary along ``axes`` with every other coordinate fixed.

        Ranks inside a group are ordered row-major over ``axes`` in the order given,
        so ``groups(["fsdp"])`` are the shard groups and ``groups(["dp"])`` the
        replica groups of a ``{"dp", "fsdp"}`` mesh, each in the order
        ``DeviceMesh`` gives them.

        Example:
            >>> Mesh({"dp": 2, "fsdp": 2}).groups(["fsdp"])
            [[0, 1], [2, 3]]
            >>> Mesh({"dp": 2, "fsdp": 2}).groups(["dp"])
            [[0, 2], [1, 3]]
        """
        index = [self.axis_index(a) for a in axes]
        if len(set(index)) != len(index):
            raise ValueError(f"groups({list(axes)}): an axis is repeated")
        others = [i for i in range(len(self._shape)) if i not in index]
        grid = self.devices.transpose(others + index)
        return grid.reshape(-1, math.prod(self._shape[i] for i in index)).tolist()

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside mesh {self!r} of size {self.size}")

    def to_json(self) -> list[list[str | int]]:
        """The mesh as JSON-ready ``[[name, size], ...]``."""
        return [[n, s] for n, s in zip(self._names, self._shape)]

    @classmethod
    def from_json(cls, data: Sequence[Sequence[str | int]], /) -> Mesh:
        """Inverse of :meth:`to_json`."""
        return cls([(str(n), int(s)) for n, s in data])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return self._names == other._names and self._shape == other._shape

    def __hash__(self) -> int:
        return hash((self._names, self._shape))

    def __repr__(self) -> str:
        return f"Mesh({self.axes!r})"
