"""ShardedTensor: one leaf's local shard, a view into its unit's flat buffer.

A sharded pytree (what :func:`funcshard.shard` returns, and gradients and
optimizer state alike) has a :class:`ShardedTensor` per leaf. Leaves of one unit
and dtype share one :class:`FlatShard`, so collectives and optimizers work on
whole flat buffers, never leaf by leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.dtypes import dtype_name
from funcshard._src.shard.flat import Slot, local_view, padded_view
from funcshard._src.shard.flat_shard import FlatShard
from funcshard._src.spec.flat_sharding import FlatSharding
from funcshard._src.spec.named_sharding import NamedSharding
from funcshard._src.spec.partition_spec import P


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
