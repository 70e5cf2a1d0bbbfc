"""Initializers scaled by a leaf's fans: ``xavier_*``, ``kaiming_*`` (as ``torch.nn.init``) and ``lecun_normal``.

[Note: fans]
Fans follow ``torch.nn.init._calculate_fan_in_and_fan_out``: a leaf of shape
``(out, in, *receptive)`` (an ``nn.Linear`` weight, a conv kernel) has
``fan_in = in * prod(receptive)`` and ``fan_out = out * prod(receptive)``; a
leaf of fewer than two dims has none (ValueError, as in torch). A leaf with no
elements is left empty, as torch leaves it. JAX's ``(in, out)`` convention
would swap the two: transpose-free torch weights use this one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from funcshard._src.shard.initializers import (
    Initializer,
    Key,
    Normal,
    TruncatedNormal,
    Uniform,
    check_shape,
)

Mode = Literal["fan_in", "fan_out"]
# std of a standard normal truncated to (-2, 2): JAX's variance_scaling divides by it
_TRUNCATED_STD = 0.87962566103423978


def fan_in_and_fan_out(shape: Sequence[int], /) -> tuple[int, int]:
    """``(fan_in, fan_out)`` of a leaf of ``shape``, as torch computes them (see [Note: fans]).

    Raises:
        ValueError: fewer than two dims.

    Example:
        >>> fan_in_and_fan_out((16, 8, 3, 3))
        (72, 144)
    """
    dims = check_shape(tuple(shape))
    if len(dims) < 2:
        raise ValueError(
            f"fans need a leaf of at least 2 dims (out, in, *receptive), got shape {dims}"
        )
    receptive = math.prod(dims[2:])
    return dims[1] * receptive, dims[0] * receptive


class _Scaled(Initializer):
    """Draws from :meth:`scaled`, a distribution chosen from the leaf's shape."""

    def check(self, path: str, shape: tuple[int, ...], dtype: torch.dtype, /) -> None:
        super().check(path, shape, dtype)
        if len(shape) < 2 and math.prod(shape) > 0:  # See [Note: fans]
            raise ValueError(
                f"{path or '<root>'}: {self!r} scales by fan_in/fan_out, which a leaf of "
                f"shape {shape} does not have (it needs 2 dims or more: (out, in, *receptive)); "
                f"give it another initializer, e.g. a rule ({path!r}, fs.initializers.zeros)"
            )

    def values(self, key: Key, shape: tuple[int, ...], index: torch.Tensor, /) -> torch.Tensor:
        return self.scaled(shape).values(key, shape, index)

    def scaled(self, shape: tuple[int, ...], /) -> Initializer:
        """The element-wise initializer this one is on a leaf of ``shape``."""
        raise NotImplementedError


@dataclass(frozen=True, repr=False)
class _Xavier(_Scaled):
    gain: float = 1.0
    name: ClassVar[str] = "xavier_uniform"

    def scaled(self, shape: tuple[int, ...], /) -> Initializer:
        fan_in, fan_out = fan_in_and_fan_out(shape)
        bound = math.sqrt(3.0) * self.gain * math.sqrt(2.0 / float(fan_in + fan_out))
        return Uniform(-bound, bound)


@dataclass(frozen=True, repr=False)
class _XavierNormal(_Xavier):
    name: ClassVar[str] = "xavier_normal"

    def scaled(self, shape: tuple[int, ...], /) -> Initializer:
        fan_in, fan_out = fan_in_and_fan_out(shape)
        return Normal(self.gain * math.sqrt(2.0 / float(fan_in + fan_out)))


def xavier_uniform(gain: float = 1.0) -> Initializer:
    """``torch.nn.init.xavier_uniform_``: uniform on ``±gain * sqrt(6 / (fan_in + fan_out))``.

    Example:
        >>> w = xavier_uniform()(0, (4, 8))
        >>> bool(w.abs().max() <= (6 / 12) ** 0.5)
        True
    """
    return _Xavier(_gain(gain, "xavier_uniform"))


def xavier_normal(gain: float = 1.0) -> Initializer:
    """``torch.nn.init.xavier_normal_``: normal with std ``gain * sqrt(2 / (fan_in + fan_out))``.

    Example:
        >>> xavier_normal(gain=2.0)
        xavier_normal(gain=2.0)
    """
    return _XavierNormal(_gain(gain, "xavier_normal"))


@dataclass(frozen=True, repr=False)
class _Kaiming(_Scaled):
    a: float = 0.0
    mode: Mode = "fan_in"
    nonlinearity: str = "leaky_relu"
    name: ClassVar[str] = "kaiming_uniform"

    def std(self, shape: tuple[int, ...], /) -> float:
        """``gain / sqrt(fan)``, as ``torch.nn.init`` computes it."""
        fan_in, fan_out = fan_in_and_fan_out(shape)
        gain = torch.nn.init.calculate_gain(self.nonlinearity, self.a)  # pyright: ignore[reportArgumentType]
        return gain / math.sqrt(fan_in if self.mode == "fan_in" else fan_out)

    def scaled(self, shape: tuple[int, ...], /) -> Initializer:
        bound = math.sqrt(3.0) * self.std(shape)
        return Uniform(-bound, bound)


@dataclass(frozen=True, repr=False)
class _KaimingNormal(_Kaiming):
    name: ClassVar[str] = "kaiming_normal"

    def scaled(self, shape: tuple[int, ...], /) -> Initializer:
        return Normal(self.std(shape))


def kaiming_uniform(
    a: float = 0.0, mode: Mode = "fan_in", nonlinearity: str = "leaky_relu"
) -> Initializer:
    """``torch.nn.init.kaiming_uniform_``: uniform on ``±sqrt(3) * gain / sqrt(fan)``.

    ``gain`` is ``torch.nn.init.calculate_gain(nonlinearity, a)``; ``fan`` the
    leaf's ``fan_in`` or ``fan_out`` (``mode``, see [Note: fans]).

    Example:
        >>> kaiming_uniform(mode="fan_out", nonlinearity="relu")
        kaiming_uniform(mode='fan_out', nonlinearity='relu')
    """
    return _Kaiming(*_kaiming_args(a, mode, nonlinearity, "kaiming_uniform"))


def kaiming_normal(
    a: float = 0.0, mode: Mode = "fan_in", nonlinearity: str = "leaky_relu"
) -> Initializer:
    """``torch.nn.init.kaiming_normal_``: normal with std ``gain / sqrt(fan)`` (see :func:`kaiming_uniform`).

    Example:
        >>> w = kaiming_normal()(0, (256, 512))
        >>> abs(w.std().item() - (2 / 512) ** 0.5) < 0.002
        True
    """
    return _KaimingNormal(*_kaiming_args(a, mode, nonlinearity, "kaiming_normal"))


@dataclass(frozen=True, repr=False)
class _Lecun(_Scaled):
    name: ClassVar[str] = "lecun_normal"

    def scaled(self, shape: tuple[int, ...], /) -> Initializer:
        fan_in, _ = fan_in_and_fan_out(shape)
        return TruncatedNormal(math.sqrt(1.0 / fan_in) / _TRUNCATED_STD)


def lecun_normal() -> Initializer:
    """``jax.nn.initializers.lecun_normal``: truncated normal (±2 std) of variance ``1 / fan_in``.

    As JAX's: the std before truncation is ``sqrt(1 / fan_in) / 0.8796...`` so that
    the truncated values have variance ``1 / fan_in``; but ``fan_in`` follows
    torch's ``(out, in, *receptive)`` convention (see [Note: fans]), so a torch
    ``nn.Linear`` weight gets the same law as the JAX kernel it transposes.

    Example:
        >>> w = lecun_normal()(0, (256, 512))
        >>> abs(w.std().item() - (1 / 512) ** 0.5) < 0.002
        True
    """
    return _Lecun()


def _gain(gain: object, what: str) -> float:
    if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not math.isfinite(gain):
        raise TypeError(f"{what}: gain must be a finite number, got {gain!r}")
    return float(gain)


def _kaiming_args(
    a: object, mode: object, nonlinearity: object, what: str
) -> tuple[float, Mode, str]:
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
        raise TypeError(f"{what}: a (the negative slope) must be a finite number, got {a!r}")
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"{what}: mode must be 'fan_in' or 'fan_out', got {mode!r}")
    try:
        torch.nn.init.calculate_gain(nonlinearity, float(a))  # pyright: ignore[reportArgumentType]
    except ValueError as e:
        raise ValueError(
            f"{what}: {e}; use one of torch.nn.init.calculate_gain's: 'linear', 'conv1d', "
            f"'conv2d', 'conv3d', 'sigmoid', 'tanh', 'relu', 'leaky_relu', 'selu'"
        ) from None
    return float(a), mode, str(nonlinearity)  # pyright: ignore[reportReturnType]
