"""Block-quantized collectives, per unit: what to quantize and the bytes it sends.

[Note: quantized collectives]
ZeRO++ cuts the bytes of the collectives that cross slow links by sending
parameters (qwZ) and gradients (qgZ) in a low-bit format. funcshard does both in
int8 with one fp32 scale per block of ``block`` elements (the last block padded
with zeros): a block ``x`` is sent as ``q = round(x / s)`` with ``s = max|x| / 127``,
and arrives as ``s * q``, within ``s / 2 = max|x| / 254`` of ``x`` element by
element (a block of zeros arrives exact). A block holding a NaN or an infinity
arrives as NaN, so a step that checks for non-finite gradients still sees it.

- Parameters (``weights``): each gather of a unit from its shards sends each rank's
  shard quantized; every rank dequantizes every row into the compute dtype, so all
  ranks compute with the same values. The shards themselves, the optimizer state
  and the update stay exact (the master copy is never quantized). A partial copy
  ([Note: partial copies] in ``strategy.py``) is taken from the dequantized rows and
  re-gathered exactly, inside the last mesh axis.
- Gradients (``gradients``): the reduce-scatter is an all-to-all of quantized rows
  (row ``j`` of the packed gradients to group rank ``j``), each rank dequantizing
  the rows it receives and summing them in fp32 (qgZ's single hop). The error of a
  sum is at most the sum of its terms' bounds. ``hybrid_shard``'s all-reduce across
  replicas stays exact.

Each rank sends ``(g - 1) * quantized_bytes(n, block)`` bytes for a buffer of ``n``
elements over ``g`` ranks, where fp32 sends ``(g - 1) * 4 * n``: ``(1 + 4 / block) / 4``
of it (0.254 at ``block=256``), and 0.508 of bf16's. The ledger counts those bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from funcshard._src.plan.rules import Pattern, check_pattern, matches


@dataclass(frozen=True)
class Quantized:
    """Block-quantized int8 collectives for the units ``units`` names; see [Note: quantized collectives].

    Attributes:
        weights: all-gather parameters from their shards as int8 (qwZ).
        gradients: reduce-scatter gradients as an int8 all-to-all (qgZ).
        block: elements per scale; a positive multiple of 4.
        units: patterns over unit names (``"blocks/*"``; ``"**"`` every unit,
            the root unit ``"<root>"`` included).

    Example:
        >>> q = Quantized(units=("blocks/*",))
        >>> q.applies_to("blocks/3"), q.applies_to("<root>")
        (True, False)
    """

    weights: bool = True
    gradients: bool = True
    block: int = 256
    units: tuple[Pattern, ...] = ("**",)

    def __post_init__(self) -> None:
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

    def applies_to(self, unit: str, /) -> bool:
        """Whether the unit named ``unit`` has its collectives quantized."""
        return (self.weights or self.gradients) and any(matches(p, unit) for p in self.units)


def quantize_for(quantize: Quantized | None, unit: str, /) -> Quantized | None:
    """``quantize`` where it applies to the unit named ``unit``, else ``None`` (exact collectives).

    Example:
        >>> quantize_for(Quantized(units=("blocks/*",)), "head") is None
        True
    """
    return quantize if quantize is not None and quantize.applies_to(unit) else None


def quantized_bytes(numel: int, block: int, /) -> int:
    """Bytes that carry ``numel`` elements quantized: an fp32 scale and ``block`` int8 values per block.

    Example:
        >>> quantized_bytes(1000, 256)  # 4 blocks
        1040
    """
    blocks = -(-numel // block)
    return blocks * (block + 4)
