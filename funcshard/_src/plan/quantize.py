"""Block-quantized collectives, per unit: what to quantize, in which format, and the bytes it sends.

[Note: quantized collectives]
ZeRO++ cuts the bytes of the collectives that cross slow links by sending
parameters (qwZ) and gradients (qgZ) in a low-bit format. funcshard sends a buffer
as blocks of ``block`` elements (the last block padded with zeros), each block an
fp32 scale ``s`` and its values in one of three formats, chosen per direction:

- ``"int8"``: ``s = max|x| / 127``, ``q = round(x / s)`` in [-127, 127]; arrives as
  ``s * q``, within ``max|x| / 254`` of ``x``.
- ``"int4"`` (qgZ's format): ``s = max|x| / 7``, ``q`` in [-7, 7], two values a
  byte; within ``max|x| / 14``.
- ``"fp8"``: ``s = max|x| / 448``, ``x / s`` rounded to float8 e4m3 (three mantissa
  bits); within ``|x| / 16 + s / 512`` (relative to each value, where the integer
  formats are relative to the block's largest). It needs torch's float8 casts on
  the device; :func:`~funcshard._src.comm.quantized.check_format` says where not.

A block of zeros arrives exact. A block holding a NaN or an infinity arrives as
NaN, so a step that checks for non-finite gradients still sees it.

- Parameters (``weights``): each gather of a unit from its shards sends each rank's
  shard quantized; every rank dequantizes every row into the compute dtype, so all
  ranks compute with the same values. The shards themselves, the optimizer state
  and the update stay exact (the master copy is never quantized). A partial copy
  ([Note: partial copies] in ``strategy.py``) is taken from the dequantized rows and
  re-gathered exactly, inside the last mesh axis.
- Gradients (``gradients``): the reduce-scatter is an all-to-all of quantized rows
  (row ``j`` of the packed gradients to group rank ``j``), each rank dequantizing
  the rows it receives and summing them in fp32 (qgZ's single hop). The error of a
  sum is at most the sum of its terms' bounds. A ``hybrid_shard_optimizer`` unit's
  reduction takes two hops, each quantized (qgZ's hierarchical reduction; [Note:
  two-hop reductions] in ``execute/param_group.py``). ``hybrid_shard``'s all-reduce across
  replicas stays exact.

Each rank sends ``(g - 1) * quantized_bytes(n, block, format)`` bytes for a buffer
of ``n`` elements over ``g`` ranks, where fp32 sends ``(g - 1) * 4 * n``: at
``block=256``, 0.254 of it for int8 and fp8, 0.129 for int4. The ledger counts those
bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

from funcshard._src.plan.rules import Pattern, check_pattern, matches

Format = Literal["int8", "int4", "fp8"]
FORMATS: tuple[Format, ...] = ("int8", "int4", "fp8")


def _format(value: object, what: str, /) -> Format | None:
    """``True`` as ``"int8"``, ``False`` or ``None`` as ``None``, a format as itself."""
    if value is True:
        return "int8"
    if value is False or value is None:
        return None
    if value in FORMATS:
        return value
    raise ValueError(
        f"Quantized({what}={value!r}): give one of {', '.join(map(repr, FORMATS))}, "
        f"True (int8) or False (exact)"
    )


@dataclass(frozen=True)
class Quantized:
    """Block-quantized collectives for the units ``units`` names; see [Note: quantized collectives].

    Attributes:
        weights: the format of parameter all-gathers from their shards (qwZ):
            ``"int8"``, ``"int4"`` or ``"fp8"``; ``True`` is ``"int8"``, ``False``
            or ``None`` gathers exactly. Stored as the format or ``None``.
        gradients: the format of the gradients' all-to-all reduce-scatter (qgZ),
            spelled the same way.
        block: elements per scale; a positive multiple of 4.
        units: patterns over unit names (``"blocks/*"``; ``"**"`` every unit,
            the root unit ``"<root>"`` included).

    Example:
        >>> q = Quantized(gradients="int4", units=("blocks/*",))
        >>> q.weights, q.gradients, q.applies_to("blocks/3"), q.applies_to("<root>")
        ('int8', 'int4', True, False)
    """

    weights: Format | bool | None = "int8"
    gradients: Format | bool | None = "int8"
    block: int = 256
    units: tuple[Pattern, ...] = ("**",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", _format(self.weights, "weights"))
        object.__setattr__(self, "gradients", _format(self.gradients, "gradients"))
        if not isinstance(self.block, int) or self.block < 4 or self.block % 4:  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(
                f"Quantized(block={self.block!r}): the block must be a positive multiple of "
                f"4 elements (one fp32 scale per block), e.g. 256"
            )
        if isinstance(self.units, (str, bytes)) or not isinstance(self.units, Sequence):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(
                f"Quantized(units={self.units!r}) must be a tuple of patterns, e.g. ('blocks/*',)"
            )
        for i, pattern in enumerate(self.units):
            check_pattern(pattern, what=f"Quantized(units)[{i}]")
        object.__setattr__(self, "units", tuple(self.units))

    @property
    def weight_format(self) -> Format | None:
        """The format of parameter gathers, or ``None`` where they are exact."""
        return cast("Format | None", self.weights)

    @property
    def gradient_format(self) -> Format | None:
        """The format of gradient reductions, or ``None`` where they are exact."""
        return cast("Format | None", self.gradients)

    def applies_to(self, unit: str, /) -> bool:
        """Whether the unit named ``unit`` has its collectives quantized."""
        return bool(self.weights or self.gradients) and any(matches(p, unit) for p in self.units)


def quantize_for(quantize: Quantized | None, unit: str, /) -> Quantized | None:
    """``quantize`` where it applies to the unit named ``unit``, else ``None`` (exact collectives).

    Example:
        >>> quantize_for(Quantized(units=("blocks/*",)), "head") is None
        True
    """
    return quantize if quantize is not None and quantize.applies_to(unit) else None


def value_bytes(numel: int, format: Format, /) -> int:
    """Bytes that carry ``numel`` values of ``format`` (a whole number of blocks, so ``numel`` is even for int4).

    Example:
        >>> value_bytes(256, "int8"), value_bytes(256, "int4"), value_bytes(256, "fp8")
        (256, 128, 256)
    """
    return numel // 2 if format == "int4" else numel


def quantized_bytes(numel: int, block: int, format: Format = "int8", /) -> int:
    """Bytes that carry ``numel`` elements quantized: an fp32 scale and ``block`` values per block.

    Example:
        >>> quantized_bytes(1000, 256)  # 4 blocks of int8
        1040
        >>> quantized_bytes(1000, 256, "int4")
        528
    """
    blocks = -(-numel // block)
    return blocks * (value_bytes(block, format) + 4)
