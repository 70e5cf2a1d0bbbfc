"""Sharded leaves and their buffers: a ShardedTensor is one leaf's local shard, a view into its unit's FlatShard.

A sharded pytree (what :func:`funcshard.shard` returns, and gradients and
optimizer state alike) has a :class:`ShardedTensor` per leaf. Leaves of one unit
and dtype share one :class:`FlatShard`, so collectives and optimizers work on
whole flat buffers, never leaf by leaf.

**FlatShard**: one unit's local shards of one dtype, packed in one flat buffer on
this rank.

Collectives and optimizers work on whole flat buffers, never leaf by leaf; a
:class:`~funcshard._src.shard.sharded.ShardedTensor` is one leaf's view into one.
A buffer can be donated (JAX's ``donate_argnums``): the tree that held it then
raises :class:`DonatedError` when read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.dtypes import dtype_name
from funcshard._src.shard.flat import FlatLayout, Slot, local_view, pack_all, padded_view
from funcshard._src.spec.flat_sharding import FlatSharding
from funcshard._src.spec.named_sharding import NamedSharding
from funcshard._src.spec.partition_spec import P


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
    tree that was not donated is written only where the caller asks for it by
    name: the functions that write their input end in ``_`` and say so in their
    first docstring line (``fs.optim.clip_by_global_norm_``, an optimizer's
    ``update_`` of the params and its state); the rest of funcshard never writes it.

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


class ShardedTensor:
    """A leaf held as this rank's shard: global ``shape``, ``sharding`` and the ``local`` view.

    ``local`` is a view into the unit's flat buffer, so writing to it (or to the
    buffer) changes the other. Build sharded trees with :func:`funcshard.shard`.
    """

    __slots__ = ("flat", "slot")

    def __init__(self, flat: FlatShard, slot: Slot) -> None:
        self.flat = flat
        self.slot = slot

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape of the leaf."""
        return self.slot.shape

    @property
    def ndim(self) -> int:
        """Number of dims of the leaf."""
        return len(self.slot.shape)

    @property
    def dtype(self) -> torch.dtype:
        """The stored dtype."""
        return self.flat.layout.dtype

    @property
    def device(self) -> torch.device:
        """Where the local shard lives."""
        return self.flat.data.device

    @property
    def path(self) -> str:
        """The leaf's path in the params tree."""
        return self.slot.path

    @property
    def frozen(self) -> bool:
        """Whether the leaf is frozen (no gradient, no optimizer state)."""
        return self.flat.layout.frozen

    @property
    def unit(self) -> str:
        """The name of the leaf's unit."""
        return self.flat.layout.unit

    @property
    def sharding(self) -> NamedSharding | FlatSharding:
        """The leaf's placement: a :class:`NamedSharding`, or a :class:`FlatSharding` in a flat unit."""
        return self.slot.sharding

    @property
    def spec(self) -> P | None:
        """The leaf's partition spec (``None`` in a flat unit, which no spec describes)."""
        sharding = self.slot.sharding
        return sharding.spec if isinstance(sharding, NamedSharding) else None

    @property
    def local(self) -> torch.Tensor:
        """This rank's unpadded shard: a view into the flat buffer."""
        return local_view(self.flat.data, self.slot, self.flat.rank)

    @property
    def padded(self) -> torch.Tensor:
        """This rank's shard with its zero padding: a view into the flat buffer.

        In a flat unit nothing pads a leaf (the unit's padding is at its end): ``local``.
        """
        if isinstance(self.slot.sharding, FlatSharding):
            return self.local
        return padded_view(self.flat.data, self.slot)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        found = next(x for x in tree.leaves((args, kwargs or {})) if isinstance(x, ShardedTensor))
        raise TypeError(found.misuse(getattr(func, "__name__", str(func))))

    def misuse(self, what: str, /) -> str:
        """The message for using this sharded leaf as if it were a full tensor (``what``)."""
        return (
            f"{self.path}: {what} on a sharded leaf of unit {self.unit!r}. Inside loss_fn, use "
            f"unit leaves through fs.call(fn, <the unit's subtree>, ...), which gathers them "
            f"(or leave the leaf out of plan(units=...) so that it arrives whole); elsewhere use "
            f".local for this rank's shard or fs.unshard(...) for the full tensor"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(self.misuse(f".{name}"))

    def __repr__(self) -> str:
        return (
            f"ShardedTensor(path={self.path!r}, shape={self.shape}, "
            f"dtype={dtype_name(self.dtype)}, "
            f"{'layout=flat' if self.spec is None else f'spec={self.spec!r}'}, "
            f"local_shape={'<donated>' if self.flat.donated else tuple(self.local.shape)})"
        )


def flats_of(sharded: Any, /) -> list[FlatShard]:
    """The distinct flat shards behind the sharded leaves of ``sharded``, in leaf order."""
    # FlatShard hashes by identity: dict keys keep each one once, in order
    leaves = tree.flatten(sharded)[0]
    return list(dict.fromkeys(x.flat for x in leaves if isinstance(x, ShardedTensor)))


def held_bytes(sharded: Any, /) -> int:
    """Bytes this rank holds for ``sharded``: its flat shard buffers (each once) and plain tensors.

    What :func:`funcshard.cost.estimate` predicts for params, grads and optimizer state
    (``memory.params``, ``memory.grads``, ``memory.optimizer``) is exactly this.

    Example:
        >>> import funcshard as fs
        >>> p = {"w": torch.zeros(10, 4), "step": torch.zeros((), dtype=torch.int64)}
        >>> held_bytes(fs.shard(p, fs.plan(p, fs.Mesh({"x": 1}))))
        168
    """
    plain = sum(
        t.numel() * t.element_size()
        for t in tree.leaves(sharded)
        if isinstance(t, torch.Tensor) and not isinstance(t, ShardedTensor)
    )
    return plain + sum(f.nbytes for f in flats_of(sharded))


def map_flats(fn: Callable[[FlatShard], FlatShard], sharded: Any, /) -> Any:
    """A tree like ``sharded`` whose sharded leaves view ``fn(flat)`` instead of ``flat``.

    ``fn`` runs once per distinct flat shard; other leaves pass through.

    Example:
        >>> import funcshard as fs
        >>> params = {"w": torch.ones(4)}
        >>> s = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1})))
        >>> zeros = map_flats(lambda f: f.with_data(torch.zeros_like(f.data)), s)
        >>> zeros["w"].local
        tensor([0., 0., 0., 0.])
    """
    done: dict[int, FlatShard] = {}

    def leaf_fn(leaf: Any) -> Any:
        if not isinstance(leaf, ShardedTensor):
            return leaf
        new = done.get(id(leaf.flat))
        if new is None:
            new = done[id(leaf.flat)] = fn(leaf.flat)
        return ShardedTensor(new, leaf.slot)

    return tree.tree_map(leaf_fn, sharded)


def trainable(sharded: Any, /) -> Any:
    """``sharded`` with ``None`` in place of every frozen leaf: the structure of its gradients.

    Example:
        >>> import funcshard as fs
        >>> params = {"base": torch.ones(2), "lora": torch.zeros(2)}
        >>> s = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1}), frozen=["base"]))
        >>> trainable(s)["base"] is None
        True
    """
    return tree.tree_map(
        lambda x: None if isinstance(x, ShardedTensor) and x.frozen else x, sharded
    )


def _refuse(op: str) -> Callable[..., Any]:
    def refuse(self: ShardedTensor, *_: Any) -> Any:
        raise TypeError(self.misuse(op))

    return refuse


for _op in (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__matmul__",
    "__rmatmul__",
    "__truediv__",
    "__rtruediv__",
    "__pow__",
    "__neg__",
    "__getitem__",
    "__float__",
    "__int__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
):
    setattr(ShardedTensor, _op, _refuse(_op))
