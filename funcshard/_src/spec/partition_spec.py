"""PartitionSpec ``P``: how each dim of a leaf maps onto mesh axes (JAX's semantics).

``P("fsdp", None)`` shards dim 0 over mesh axis ``fsdp`` and keeps dim 1 whole;
an entry may be a tuple of axes, the first one major: ``P(("dp", "fsdp"))``.
Missing trailing entries are ``None``, so ``P("a") == P("a", None)``; a
one-axis tuple equals the bare axis, ``P(("a",)) == P("a")``, and an empty tuple
is ``None``. Mesh axes a spec does not name replicate the leaf.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal, TypeAlias

from funcshard._src.spec.mesh import Mesh

Entry: TypeAlias = "str | tuple[str, ...] | None"
SpecErrorKind = Literal["unknown_axis", "duplicate_axis", "too_many_entries", "uneven"]


class SpecError(ValueError):
    """A spec that does not fit its leaf or mesh; ``kind`` says which rule it breaks.

    ``kind`` is ``"unknown_axis"``, ``"duplicate_axis"``, ``"too_many_entries"``
    or ``"uneven"`` (a dim not divisible by its shard count, refused only with
    ``strict=True``), the categories of JAX's errors for the same specs.
    """

    def __init__(self, message: str, *, kind: SpecErrorKind) -> None:
        super().__init__(message)
        self.kind: SpecErrorKind = kind


class P:
    """A partition spec: one entry per leading dim, each ``None``, an axis or a tuple of axes.

    Args:
        *entries: per dim, ``None`` (not sharded), a mesh axis name, or a tuple of
            axis names (the dim is split over their product, the first major).

    Raises:
        TypeError: an entry is not ``None``, a string or a tuple of strings.

    Example:
        >>> spec = P(None, ("dp", "fsdp"))
        >>> spec.axes, len(spec), spec == P(None, ("dp", "fsdp"), None)
        (('dp', 'fsdp'), 2, True)
    """

    __slots__ = ("_entries",)

    def __init__(self, *entries: str | Sequence[str] | None) -> None:
        self._entries: tuple[Entry, ...] = tuple(_normalize(e, entries) for e in entries)

    @property
    def entries(self) -> tuple[Entry, ...]:
        """The entries as given (one-axis tuples are bare names, empty tuples ``None``)."""
        return self._entries

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis the spec names, in order of appearance (repeats kept)."""
        return tuple(a for entry in self._entries for a in dim_axes(entry))

    def dims(self, ndim: int, /) -> tuple[tuple[str, ...], ...]:
        """Per dim of a rank-``ndim`` leaf, the axes that split it (``()`` for none).

        Example:
            >>> P("a", ("b", "c")).dims(3)
            (('a',), ('b', 'c'), ())
        """
        padded = self._entries + (None,) * max(0, ndim - len(self._entries))
        return tuple(dim_axes(e) for e in padded[:ndim])

    def validate(self, mesh: Mesh, ndim: int, /, *, path: str = "") -> None:
        """Checks this spec against a leaf of rank ``ndim`` on ``mesh``.

        Raises:
            SpecError: an axis not in ``mesh`` (``kind="unknown_axis"``), an axis used
                twice (``"duplicate_axis"``), or more non-trivial entries than ``ndim``
                (``"too_many_entries"``). The message starts with ``path``.

        Example:
            >>> P("fsdp", "fsdp").validate(Mesh({"fsdp": 2}), 2, path="blocks/3/mlp/w1")
            Traceback (most recent call last):
            ...
            funcshard._src.spec.partition_spec.SpecError: blocks/3/mlp/w1: P('fsdp', 'fsdp') uses mesh axis 'fsdp' twice; each mesh axis may shard at most one dim
        """
        where = f"{path}: " if path else ""
        axes = self.axes
        # duplicates first, then unknown axes: the order in which JAX reports them
        twice = next((a for i, a in enumerate(axes) if a in axes[:i]), None)
        if twice is not None:
            raise SpecError(
                f"{where}{self!r} uses mesh axis {twice!r} twice; each mesh axis may "
                f"shard at most one dim",
                kind="duplicate_axis",
            )
        unknown = next((a for a in axes if a not in mesh.axis_names), None)
        if unknown is not None:
            raise SpecError(
                f"{where}{self!r} names mesh axis {unknown!r}, which is not in the mesh "
                f"(axes {list(mesh.axis_names)}); use one of those axes or None",
                kind="unknown_axis",
            )
        if len(self._entries) > ndim:
            raise SpecError(
                f"{where}{self!r} has {len(self._entries)} entr{'y' if len(self._entries) == 1 else 'ies'} "
                f"but the leaf has {ndim} "
                f"dim{'s' if ndim != 1 else ''}; give at most one entry per dim",
                kind="too_many_entries",
            )

    def to_json(self) -> list[str | list[str] | None]:
        """JSON-ready entries: ``None``, a name or a list of names."""
        return [list(e) if isinstance(e, tuple) else e for e in self._entries]

    @classmethod
    def from_json(cls, data: Sequence[str | Sequence[str] | None], /) -> P:
        """Inverse of :meth:`to_json`."""
        return cls(*data)

    def _key(self) -> tuple[Entry, ...]:
        entries = list(self._entries)
        while entries and entries[-1] is None:
            entries.pop()
        return tuple(entries)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, P):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries)

    def __getitem__(self, index: int) -> Entry:
        return self._entries[index]

    def __repr__(self) -> str:
        return f"P({', '.join(repr(e) for e in self._entries)})"


def dim_axes(entry: Entry) -> tuple[str, ...]:
    """The axes of one spec entry as a tuple (``None`` is ``()``)."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return entry


def _normalize(entry: object, entries: tuple[object, ...]) -> Entry:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)):
        names: tuple[object, ...] = tuple(entry)  # pyright: ignore[reportUnknownArgumentType, reportUnknownVariableType]
        if all(isinstance(n, str) for n in names):
            axes = tuple(str(n) for n in names)
            if not axes:
                return None
            return axes[0] if len(axes) == 1 else axes
    raise TypeError(
        f"P{entries!r}: entry {entry!r} must be None, a mesh axis name or a tuple of axis names"
    )
