"""Ledger: the bytes every collective moves, per rank, by operation and mesh axes.

Counts follow the bandwidth-optimal (ring) algorithms, which is what a step costs
on a real interconnect whatever the backend does internally: over a group of
``g`` ranks and a full buffer of ``B`` bytes, an all-gather and a
reduce-scatter each send ``(g - 1) / g * B`` bytes per rank and an all-reduce
twice that. A gather to one rank sends ``B / g`` from every other rank.

What "sent" means per algorithm: the rings send exactly these counts; gloo's
own reduce-scatter (an all-reduce) moves twice its count. Through shared memory
(``shm/__init__.py``) a rank sends nothing over a link: its peers read what it published,
``(g - 1) / g * B`` for an all-gather or a reduce-scatter as counted, and for an
all-reduce ``(g - 1) * B`` (each peer reads the whole buffer), which equals the
count at ``g = 2``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Ledger:
    """A running count of bytes sent per rank, keyed by ``(op, axes)``.

    Example:
        >>> ledger = Ledger()
        >>> ledger.record("all_gather", ("fsdp",), group_size=2, full_bytes=1024)
        >>> ledger.total()
        512
    """

    bytes_by_key: Counter[tuple[str, tuple[str, ...]]] = field(default_factory=Counter)

    def record(self, op: str, axes: tuple[str, ...], *, group_size: int, full_bytes: int) -> None:
        """Counts one collective of ``op`` over ``axes`` on a full buffer of ``full_bytes``."""
        self.bytes_by_key[(op, axes)] += sent_bytes(op, group_size, full_bytes)

    def total(self, op: str | None = None) -> int:
        """Bytes sent, over every op or only ``op``."""
        return sum(n for (o, _), n in self.bytes_by_key.items() if op is None or o == op)

    def reset(self) -> None:
        """Forgets everything counted so far; mutates the ledger."""
        self.bytes_by_key.clear()


def sent_bytes(op: str, group_size: int, full_bytes: int) -> int:
    """Bytes one rank sends for ``op`` over ``group_size`` ranks on ``full_bytes``.

    ``full_bytes`` is the gathered output of an all-gather, the input of a
    reduce-scatter or all-reduce, and the gathered result of a gather.
    """
    g = group_size
    if op in ("all_gather", "reduce_scatter"):
        return full_bytes * (g - 1) // g
    if op == "all_reduce":
        return 2 * full_bytes * (g - 1) // g
    if op == "gather":
        return full_bytes // g
    raise ValueError(f"unknown collective {op!r}")
