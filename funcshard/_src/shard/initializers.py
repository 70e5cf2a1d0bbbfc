"""Initializers: immutable recipes that give every element of a leaf from ``(seed, path, index)``.

An :class:`Initializer` fills any box of a leaf (one rank's shard, or the whole
leaf) with the values that box has in the whole leaf: random ones come from
:mod:`~funcshard._src.shard.counter_rng` uniforms of the element's flat index,
computed in float64 and cast to the leaf's dtype. Called JAX-style,
``init(key, shape, dtype)`` returns the whole leaf; :func:`funcshard.materialize`
fills each rank's shards with the same values.

This module holds the base class and the element-wise initializers;
:mod:`~funcshard._src.shard.fans` the ones scaled by the leaf's fans
(``xavier_*``, ``kaiming_*``, ``lecun_normal``) and
:mod:`~funcshard._src.shard.orthogonal` one that needs its whole leaf.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from funcshard._src.shard import counter_rng, fill

_SQRT2 = math.sqrt(2.0)


@dataclass(frozen=True)
class Key:
    """What a leaf's values are a function of: a ``seed`` and the leaf's ``path``.

    Example:
        >>> Key(0, "blocks/0/w")
        Key(seed=0, path='blocks/0/w')
    """

    seed: int
    path: str = ""

    def __post_init__(self) -> None:
        counter_rng.check_seed(self.seed)
        if not isinstance(self.path, str):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"Key: path must be a str like 'blocks/0/w', got {self.path!r}")

    def uniform(self, index: torch.Tensor, /, stream: int = 0) -> torch.Tensor:
        """Float64 uniforms in ``(0, 1)`` of stream ``stream`` at the int64 flat ``index``."""
        return counter_rng.uniform(counter_rng.stream_key(self.seed, self.path, stream), index)

    def normal(self, index: torch.Tensor, /, stream: int = 0) -> torch.Tensor:
        """Float64 standard normals at ``index``: ``sqrt(2) * erfinv(2u - 1)`` of :meth:`uniform`."""
        return torch.special.erfinv(self.uniform(index, stream) * 2.0 - 1.0) * _SQRT2


def as_key(key: Key | int, /) -> Key:
    """``key`` as a :class:`Key`; a bare int is a seed with path ``""``.

    Raises:
        TypeError: neither a :class:`Key` nor an int.
    """
    if isinstance(key, Key):
        return key
    if isinstance(key, bool) or not isinstance(key, int):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(
            f"an initializer's key must be fs.initializers.Key(seed, path) or an int seed, "
            f"got {type(key).__name__}"
        )
    return Key(key)


class Initializer(abc.ABC):
    """Gives every element of a leaf as a function of its :class:`Key` and flat index.

    Subclasses are frozen dataclasses and implement :meth:`values`; one that
    cannot be generated piecewise overrides :meth:`fill_` instead. ``random``
    says whether it needs a floating-point leaf.
    """

    random: ClassVar[bool] = True
    name: ClassVar[str] = "initializer"

    def __call__(
        self,
        key: Key | int,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        *,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The whole leaf of ``shape`` and ``dtype`` under ``key``, JAX-style.

        Args:
            key: a :class:`Key` (seed and leaf path), or an int seed (path ``""``).
            shape: the leaf's shape.
            dtype: the leaf's dtype; values are computed in float64, then cast.
            device: where the result goes (default CPU); values do not depend on it.

        Raises:
            TypeError: a random initializer on a non-floating dtype, or a bad key.
            ValueError: a shape the initializer does not support.
        """
        key = as_key(key)
        dims = check_shape(shape, key.path)
        out = torch.empty(dims, dtype=dtype, device=device)
        self.fill_(out, key, dims, (0,) * len(dims))
        return out

    def check(self, path: str, shape: tuple[int, ...], dtype: torch.dtype, /) -> None:
        """Refuses a leaf this initializer cannot fill, whatever box of it is asked for.

        Raises:
            TypeError: a random initializer on a dtype that is not floating point.
        """
        if self.random and not dtype.is_floating_point:
            raise TypeError(
                f"{path or '<root>'}: {self!r} draws random values but the leaf is {dtype}; "
                f"give integer and bool leaves fs.initializers.zeros, ones or constant(...) "
                f"(or elementwise(fn) to compute them yourself)"
            )

    def fill_(
        self, out: torch.Tensor, key: Key, shape: tuple[int, ...], starts: Sequence[int], /
    ) -> None:
        """Writes the box of the leaf at corner ``starts`` (shape ``out.shape``) into ``out``; mutates ``out``.

        The leaf has global ``shape``; generation runs in blocks of at most
        ``fill.BLOCK_NUMEL`` elements on the CPU and is then copied to ``out``.
        """
        self.check(key.path, shape, out.dtype)
        # cast here, on the CPU: the bits never depend on the device's conversion kernels
        fill.fill_blocks_(
            out, shape, starts, lambda index: self.values(key, shape, index).to(out.dtype)
        )

    @abc.abstractmethod
    def values(self, key: Key, shape: tuple[int, ...], index: torch.Tensor, /) -> torch.Tensor:
        """The elements at the int64 flat ``index`` of the leaf (float64, or the fill value's dtype)."""

    def __repr__(self) -> str:
        args: list[str] = []
        for f in dataclasses.fields(self):  # pyright: ignore[reportArgumentType]
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING:
                args.append(repr(value))  # required arguments are positional
            elif value != f.default:
                args.append(f"{f.name}={value!r}")
        return f"{self.name}({', '.join(args)})"


def check_shape(shape: object, path: str = "", /) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints.

    Raises:
        TypeError: not a sequence of ints.
    """
    where = path or "<root>"
    if isinstance(shape, torch.Size):
        return tuple(shape)
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0
        for n in shape  # pyright: ignore[reportUnknownVariableType]
    ):
        raise TypeError(f"{where}: shape must be a tuple of non-negative ints, got {shape!r}")
    return tuple(shape)  # pyright: ignore[reportUnknownArgumentType]


@dataclass(frozen=True, repr=False)
class Constant(Initializer):
    """Every element ``value``: :func:`constant`."""

    value: float | int | bool
    random: ClassVar[bool] = False
    name: ClassVar[str] = "constant"

    def values(self, key: Key, shape: tuple[int, ...], index: torch.Tensor, /) -> torch.Tensor:
        return torch.full(
            index.shape, self.value, dtype=torch.float64 if isinstance(self.value, float) else None
        )

    def fill_(
        self, out: torch.Tensor, key: Key, shape: tuple[int, ...], starts: Sequence[int], /
    ) -> None:
        self.check(key.path, shape, out.dtype)
        out.fill_(self.value)  # no block is generated: nothing transient


@dataclass(frozen=True, repr=False)
class Named(Constant):
    """``zeros`` and ``ones``: constants that are initializers themselves."""

    label: str = ""

    def __repr__(self) -> str:
        return self.label


zeros: Initializer = Named(0, "zeros")
ones: Initializer = Named(1, "ones")


def constant(value: float, /) -> Initializer:
    """Every element ``value`` (any dtype; integers stay exact).

    Example:
        >>> constant(0.5)(0, (2,))
        tensor([0.5000, 0.5000])
    """
    if isinstance(value, torch.Tensor) or not isinstance(value, (int, float, bool)):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(f"constant: value must be a Python number, got {type(value).__name__}")
    return Constant(value)


@dataclass(frozen=True, repr=False)
class Normal(Initializer):
    """Normal with ``std`` and ``mean``: :func:`normal`."""

    std: float = 1.0
    mean: float = 0.0
    name: ClassVar[str] = "normal"

    def values(self, key: Key, shape: tuple[int, ...], index: torch.Tensor, /) -> torch.Tensor:
        return key.normal(index) * self.std + self.mean


def normal(std: float = 1.0, mean: float = 0.0) -> Initializer:
    """Normal with standard deviation ``std`` and mean ``mean`` (inverse CDF of a counter uniform).

    Example:
        >>> init = normal(std=0.02)
        >>> init
        normal(std=0.02)
        >>> torch.equal(init(Key(0, "w"), (3,)), init(Key(0, "w"), (3,)))
        True
    """
    return Normal(_number(std, "normal", "std", nonneg=True), _number(mean, "normal", "mean"))


@dataclass(frozen=True, repr=False)
class Uniform(Initializer):
    """Uniform on ``(low, high)``: :func:`uniform`."""

    low: float = 0.0
    high: float = 1.0
    name: ClassVar[str] = "uniform"

    def values(self, key: Key, shape: tuple[int, ...], index: torch.Tensor, /) -> torch.Tensor:
        return key.uniform(index) * (self.high - self.low) + self.low


def uniform(low: float = 0.0, high: float = 1.0) -> Initializer:
    """Uniform on ``(low, high)``.

    Example:
        >>> x = uniform(-1.0, 1.0)(0, (1000,))
        >>> bool((x > -1).all() and (x < 1).all())
        True
    """
    low, high = _number(low, "uniform", "low"), _number(high, "uniform", "high")
    if not low < high:
        raise ValueError(f"uniform: low={low} must be below high={high}")
    return Uniform(low, high)


@dataclass(frozen=True, repr=False)
class TruncatedNormal(Initializer):
    """Normal truncated to ``[lower, upper]`` stds: :func:`truncated_normal`."""

    std: float = 1.0
    lower: float = -2.0
    upper: float = 2.0
    name: ClassVar[str] = "truncated_normal"

    def values(self, key: Key, shape: tuple[int, ...], index: torch.Tensor, /) -> torch.Tensor:
        low, high = _phi(self.lower), _phi(self.upper)
        u = key.uniform(index) * (high - low) + low  # in (Φ(lower), Φ(upper))
        z = torch.special.erfinv(u * 2.0 - 1.0) * _SQRT2
        return z.clamp_(self.lower, self.upper) * self.std


def truncated_normal(std: float = 1.0, lower: float = -2.0, upper: float = 2.0) -> Initializer:
    """A normal truncated to ``[lower * std, upper * std]``, as ``jax.nn.initializers.truncated_normal``.

    ``std`` is the standard deviation of the normal before truncation (as in
    JAX), ``lower`` and ``upper`` are in units of it. Inverse CDF: ``u`` uniform
    in ``(Φ(lower), Φ(upper))``, then ``sqrt(2) * erfinv(2u - 1)``, in float64.

    Example:
        >>> x = truncated_normal(std=0.5)(0, (1000,))
        >>> bool(x.abs().max() <= 1.0)
        True
    """
    std = _number(std, "truncated_normal", "std", nonneg=True)
    lower = _number(lower, "truncated_normal", "lower", finite=False)
    upper = _number(upper, "truncated_normal", "upper", finite=False)
    if not lower < upper:
        raise ValueError(f"truncated_normal: lower={lower} must be below upper={upper}")
    return TruncatedNormal(std, lower, upper)


@dataclass(frozen=True, repr=False)
class Elementwise(Initializer):
    """``fn(u, index, shape)`` per block: :func:`elementwise`."""

    fn: Callable[[torch.Tensor, torch.Tensor, tuple[int, ...]], torch.Tensor]
    random: ClassVar[bool] = False
    name: ClassVar[str] = "elementwise"

    def values(self, key: Key, shape: tuple[int, ...], index: torch.Tensor, /) -> torch.Tensor:
        out: Any = self.fn(key.uniform(index), index, shape)
        if not isinstance(out, torch.Tensor) or out.numel() != index.numel():
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"{key.path or '<root>'}: {self!r} returned {got} for a block of "
                f"{index.numel()} elements; fn(u, index, shape) must return one value per "
                f"element of u (a tensor of u's shape)"
            )
        return out

    def __repr__(self) -> str:
        return f"elementwise({getattr(self.fn, '__qualname__', repr(self.fn))})"


def elementwise(
    fn: Callable[[torch.Tensor, torch.Tensor, tuple[int, ...]], torch.Tensor], /
) -> Initializer:
    """An initializer of your own: ``fn(u, index, shape)`` gives a block of elements.

    ``u`` holds float64 uniforms in ``(0, 1)`` for the block's elements, ``index``
    their int64 flat row-major indices in the leaf, ``shape`` the leaf's global
    shape. ``fn`` must be element-wise (element ``k`` of its result depends only
    on ``u[k]``, ``index[k]`` and ``shape``) for the values to be the same on
    every mesh. Its result is cast to the leaf's dtype, whatever that is.

    Example:
        >>> rows = elementwise(lambda u, index, shape: (index // shape[-1]).double())
        >>> rows(0, (2, 3))
        tensor([[0., 0., 0.],
                [1., 1., 1.]])
    """
    if not callable(fn):
        raise TypeError(f"elementwise: fn must be callable fn(u, index, shape), got {fn!r}")
    return Elementwise(fn)


def _phi(x: float) -> float:
    """The standard normal CDF."""
    return 0.5 * (1.0 + math.erf(x / _SQRT2))


def _number(
    value: object, what: str, arg: str, *, nonneg: bool = False, finite: bool = True
) -> float:
    """``value`` as a float if it is a real number: finite unless ``finite=False``, ``>= 0`` with ``nonneg``.

    Raises:
        TypeError: not an int or float.
        ValueError: out of range; ``what`` and ``arg`` name the argument.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what}: {arg} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if math.isnan(number) or (finite and math.isinf(number)) or (nonneg and number < 0):
        kind = "non-negative finite" if nonneg else "finite" if finite else "non-NaN"
        raise ValueError(f"{what}: {arg}={value!r} must be a {kind} number")
    return number
