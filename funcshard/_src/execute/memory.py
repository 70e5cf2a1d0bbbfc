"""Gathered memory: the bytes of gathered parameters alive on this rank, counted as units move."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GatheredMemory:
    """Bytes of gathered parameters alive on this rank, and their peak; optionally a trace.

    With ``events`` a list, every unit transition appends ``(event, unit name)``:
    ``start`` (all-gather issued), ``finish`` (gathered), ``free`` and ``reduce``.
    """

    current: int = 0
    peak: int = 0
    events: list[tuple[str, str]] | None = None

    def log(self, event: str, unit: str) -> None:
        """Appends to ``events`` when tracing; mutates."""
        if self.events is not None:
            self.events.append((event, unit))

    def add(self, nbytes: int) -> None:
        """Counts ``nbytes`` more; mutates."""
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def sub(self, nbytes: int) -> None:
        """Counts ``nbytes`` fewer; mutates."""
        self.current -= nbytes
