"""FlatShard: one unit's local shards of one dtype, packed in one flat buffer on this rank.

Collectives and optimizers work on whole flat buffers, never leaf by leaf; a
:class:`~funcshard._src.shard.sharded.ShardedTensor` is one leaf's view into one.
A buffer can be donated (JAX's ``donate_argnums``): the tree that held it then
raises :class:`DonatedError` when read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from funcshard._src.shard.flat import FlatLayout, pack_all


class DonatedError(RuntimeError):
    """A tree whose buffers were donated was used again (JAX: "Array has been deleted")."""


class FlatShard:
    """One rank's flat buffer (``data``, shape ``(layout.numel,)``) of one unit and dtype.

    Immutable but for one transition: :meth:`donate` hands the buffer to a new
    owner, after which reading ``data`` (through any leaf of the tree) raises
    :class:`DonatedError`. See [Note: donation].

    [Note: donation]
    A buffer is reused only where its owner handed it over at the call site, as
    with ``jax.jit(..., donate_argnums=...)``: ``fs.value_and_grad(...,
    donate_grads=True)`` donates the gradients a call returned to the next call,
    which writes its gradients into them. The donated tree is then dead: every
    read raises, so nothing holding it can see values change underneath it. A
    tree that was not donated is never written by funcshard.

    [Note: gradients held as leaves]
    A unit that needs no communication (a mesh of one rank) gets its gradients
    from autograd one tensor per leaf. Copying them into one flat buffer was most
    of such a unit's cost over plain PyTorch, so its gradient shard keeps them as
    they are (:meth:`of_leaves`): :attr:`leaves` hands them to consumers that
    work leaf by leaf (AdamW's fused update), and the first read of :attr:`data`
    concatenates them into the flat buffer once, from which every later read
    and every leaf's ``local`` view comes. The value is the same either way.
    """

    __slots__ = ("_data", "_donated", "_leaves", "_views", "layout", "rank")

    def __init__(self, layout: FlatLayout, data: torch.Tensor, rank: int) -> None:
        self.layout = layout
        self._data: torch.Tensor | None = data
        self._leaves: tuple[torch.Tensor, ...] | None = None
        self._views: tuple[torch.Tensor, ...] | None = None
        self._donated = False
        self.rank = rank

    @classmethod
    def of_leaves(
        cls, layout: FlatLayout, leaves: Sequence[torch.Tensor], rank: int, /
    ) -> FlatShard:
        """The flat shard of a one-rank group held as its leaves, in slot order.

        Each leaf must be whole (the slot's ``shape``), contiguous and of the
        layout's dtype; this is not checked (it is built once per unit and step,
        from autograd's gradients). See [Note: gradients held as leaves].

        Example:
            >>> import funcshard as fs
            >>> p = {"a": torch.zeros(2), "b": torch.zeros(3)}
            >>> s = fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))
            >>> flat = FlatShard.of_leaves(s["a"].flat.layout, [torch.ones(2), torch.full((3,), 2.0)], 0)
            >>> flat.leaves is not None, flat.data
            (True, tensor([1., 1., 2., 2., 2.]))
            >>> flat.leaves is None  # read as one buffer from now on
            True
        """
        flat = cls.__new__(cls)
        flat.layout, flat.rank, flat._donated = layout, rank, False
        flat._data, flat._leaves, flat._views = None, tuple(leaves), None
        return flat

    @property
    def data(self) -> torch.Tensor:
        """The flat buffer (concatenated on first read where it is held as leaves).

        Raises:
            DonatedError: the buffer was donated.
        """
        self._live()
        if self._data is None:
            self._data = concatenate_leaves(self.layout, self._leaves or ())
            self._leaves = None
        return self._data

    @property
    def leaves(self) -> tuple[torch.Tensor, ...] | None:
        """Its leaves, whole and contiguous, where it is held as leaves and was never read as one buffer; else ``None``.

        Raises:
            DonatedError: the buffer was donated.
        """
        self._live()
        return self._leaves

    def held(self) -> tuple[torch.Tensor, ...]:
        """What it holds, read without concatenating: its leaves if held as leaves, else ``(data,)``.

        For elementwise reads and in-place scaling of the whole shard (clipping,
        finiteness checks).

        Raises:
            DonatedError: the buffer was donated.
        """
        leaves = self.leaves
        return leaves if leaves is not None else (self.data,)

    def whole_leaves(self) -> tuple[torch.Tensor, ...]:
        """Its buffer as one view per slot in the leaf's shape, made once; for a one-rank group.

        What elementwise updates pair with gradients held as leaves (see
        :func:`funcshard._src.optim.base.floating_flats`).

        Raises:
            DonatedError: the buffer was donated.
            ValueError: a slot is not whole on this rank.
        """
        if self._views is None:
            data = self.data
            if any(s.numel != math.prod(s.shape) for s in self.layout.slots):
                raise ValueError(
                    f"unit {self.layout.unit!r}: its leaves are not whole on this rank"
                )
            self._views = tuple(
                data[s.offset : s.offset + s.numel].view(s.shape) for s in self.layout.slots
            )
        return self._views  # donate() drops them: a donated shard raises above

    @property
    def nbytes(self) -> int:
        """Bytes it holds, without concatenating leaves.

        Raises:
            DonatedError: the buffer was donated.
        """
        if self._data is None and not self._donated:
            return self.layout.numel * self.layout.dtype.itemsize
        return self.data.numel() * self.data.element_size()

    @property
    def donated(self) -> bool:
        """Whether :meth:`donate` was called."""
        return self._donated

    def donate(self) -> torch.Tensor | None:
        """Hands over the buffer (``None`` where it is held as leaves: no buffer to reuse); mutates.

        Its ``data`` raises from now on.
        """
        self._live()  # a check only: held leaves are not concatenated to be dropped
        data = self._data if self._leaves is None else None
        self._data, self._leaves, self._views, self._donated = None, None, None, True
        return data

    def _live(self) -> None:
        """Raises :class:`DonatedError` once the buffer was donated."""
        if self._donated:
            raise DonatedError(
                f"unit {self.layout.unit!r}: this tree's buffers were donated (a step with "
                f"donate_grads=True reused these gradients for the next call's), so they are no "
                f"longer this tree's; use the tree that call returned, or clone what you keep "
                f"before the next step"
            )

    def with_data(self, data: torch.Tensor, /) -> FlatShard:
        """A flat shard of the same layout and rank holding ``data``."""
        return FlatShard(self.layout, data, self.rank)


def concatenate_leaves(layout: FlatLayout, leaves: Sequence[torch.Tensor], /) -> torch.Tensor:
    """The flat buffer of ``leaves`` held by :meth:`FlatShard.of_leaves`: the one row a one-rank group packs."""
    return pack_all(layout, leaves).view(-1)


def held_leaves(
    layout: FlatLayout, grads: Sequence[torch.Tensor | None], device: torch.device, /
) -> tuple[torch.Tensor, ...]:
    """A one-rank part's gradients as its leaves: autograd's tensors where they are whole and their own.

    A view (of some other tensor autograd or the caller may hold), a
    non-contiguous gradient or one given for two leaves (autograd hands ``x + w``'s
    gradient to both) is copied, so that each leaf's tensor is its own (clipping
    scales them in place); a missing one is zeros.
    """
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for slot, g in zip(layout.slots, grads):
        if g is None:
            g = torch.zeros(slot.shape, dtype=layout.dtype, device=device)
        elif g.dtype != layout.dtype:
            g = g.to(layout.dtype)
        elif g._base is not None or not g.is_contiguous() or id(g) in seen:
            g = g.clone(memory_format=torch.contiguous_format)
        seen.add(id(g))
        out.append(g)
    return tuple(out)
