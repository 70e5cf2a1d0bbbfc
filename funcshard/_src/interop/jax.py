"""Tensors to JAX arrays and back, zero-copy through DLPack where the memory allows it.

JAX is imported only when these functions run (``pip install 'funcshard[jax]'``).

[Note: zero-copy]
A tensor's memory is handed to JAX as it is when it is compact (contiguous) and its
first byte is 64-byte aligned, which XLA needs on the CPU (JAX copies anything less
aligned itself); otherwise it is copied into fresh, aligned memory first. A JAX array
is handed to torch as it is (JAX arrays are always compact). Zero-copy results share
memory with their source: an in-place update of the tensor (an optimizer step, which
donates its inputs) shows through in the JAX array, and writing to a tensor made from
a JAX array breaks JAX's immutability. Pass ``copy=True`` to take a snapshot.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.interop.host import tensor_from_numpy
from funcshard._src.shard.sharded import ShardedTensor

ALIGNMENT = 64  # bytes; XLA's CPU client needs it to alias a buffer


def to_jax(tree_: Any, /, *, copy: bool | None = None) -> Any:
    """The tree with every tensor leaf as a ``jax.Array``, sharing memory where it can.

    A :class:`funcshard.ShardedTensor` leaf becomes this rank's shard (its ``local``
    tensor); other leaves (Python numbers, strings) stay as they are. Tensors that
    require grad are detached first.

    Args:
        tree_: a pytree of tensors, sharded or not.
        copy: ``None`` shares memory where the tensor is compact and 64-byte aligned
            and copies otherwise; ``True`` always copies; ``False`` never copies and
            raises instead (see ``[Note: zero-copy]``).

    Returns:
        A pytree like ``tree_`` with ``jax.Array`` leaves (on the JAX device of the
        tensor's device: the CPU for CPU tensors).

    Raises:
        ValueError: ``copy=False`` and a leaf that cannot be shared; the message names
            the leaf path and why (strided, misaligned, or a dtype JAX converts).
        ImportError: JAX is not installed.

    Example:
        >>> import torch  # doctest: +SKIP
        >>> arrays = to_jax({"w": torch.arange(4.0)})  # doctest: +SKIP
        >>> arrays["w"]  # doctest: +SKIP
        Array([0., 1., 2., 3.], dtype=float32)
    """
    jax_dlpack = _jax("dlpack")
    paths, leaves, treedef = tree.flatten_with_paths(tree_)
    out = [
        _tensor_to_jax(jax_dlpack, path or "<root>", leaf, copy)
        if isinstance(leaf, (torch.Tensor, ShardedTensor))
        else leaf
        for path, leaf in zip(paths, leaves)
    ]
    return tree.unflatten(treedef, out)


def from_jax(tree_: Any, /, *, rank: int | None = None, copy: bool | None = None) -> Any:
    """The tree with every ``jax.Array`` leaf as a torch tensor, sharing memory where it can.

    An array on one device, or replicated on several, becomes one tensor. An array
    sharded over several devices needs ``rank``: the tensor is then that array's shard
    on the device whose id is ``rank`` (funcshard's convention, device id = rank, under
    which :meth:`funcshard.Plan.to_jax_shardings` places each rank's shard of a leaf
    where :class:`funcshard.NamedSharding` puts it). Other leaves stay as they are.

    Args:
        tree_: a pytree of ``jax.Array`` s.
        rank: take each sharded array's shard on the device with this id.
        copy: ``None`` shares memory where DLPack can and copies otherwise; ``True``
            always copies (a tensor safe to write to); ``False`` never copies and raises
            instead.

    Returns:
        A pytree like ``tree_`` with tensor leaves.

    Raises:
        ValueError: an array sharded over several devices and no ``rank``, a ``rank``
            with no shard of the array in this process, or ``copy=False`` and an array
            DLPack cannot share; the message names the leaf path and the fix.
        ImportError: JAX is not installed.

    Example:
        >>> import jax.numpy as jnp  # doctest: +SKIP
        >>> from_jax({"w": jnp.arange(3.0)})  # doctest: +SKIP
        {'w': tensor([0., 1., 2.])}
    """
    jax = _jax()
    paths, leaves, treedef = tree.flatten_with_paths(tree_)
    out = [
        _array_to_torch(path or "<root>", leaf, rank, copy) if isinstance(leaf, jax.Array) else leaf
        for path, leaf in zip(paths, leaves)
    ]
    return tree.unflatten(treedef, out)


def zero_copy_obstacle(t: torch.Tensor, /) -> str | None:
    """Why ``t`` cannot be handed to JAX without a copy, or ``None`` if it can.

    Example:
        >>> t = torch.zeros(16)
        >>> zero_copy_obstacle(t) is None, zero_copy_obstacle(t[::2])
        (True, 'it is not contiguous (strides (2,))')
    """
    if not t.is_contiguous():
        return f"it is not contiguous (strides {tuple(t.stride())})"
    if t.numel() and t.data_ptr() % ALIGNMENT:
        return (
            f"its first byte is {t.data_ptr() % ALIGNMENT} bytes past a {ALIGNMENT}-byte boundary "
            f"(XLA aliases only {ALIGNMENT}-byte aligned memory)"
        )
    return None


# -- helpers ---------------------------------------------------------------------------


def _jax(submodule: str | None = None) -> Any:
    name = f"jax.{submodule}" if submodule else "jax"
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(
            f"funcshard's JAX interop needs JAX ({e}); install it: pip install 'funcshard[jax]'"
        ) from None


def _tensor_to_jax(jax_dlpack: Any, path: str, leaf: Any, copy: bool | None) -> Any:
    if isinstance(leaf, ShardedTensor) and leaf.spec is None:
        raise ValueError(
            f"{path}: unit {leaf.unit!r} is in the flat layout, where this rank holds a range "
            f"of the leaf's elements that no jax.sharding describes; pass fs.unshard(tree) "
            f"(full leaves), or plan with layout='leaf' for shards that "
            f"Plan.to_jax_shardings places"
        )
    t = (leaf.local if isinstance(leaf, ShardedTensor) else leaf).detach()
    obstacle = zero_copy_obstacle(t)
    if copy is False and obstacle is not None:
        raise ValueError(
            f"{path}: cannot hand this {t.dtype} tensor to JAX without a copy: {obstacle}; "
            f"pass copy=None to copy where needed, or make it compact and aligned first "
            f"(t.clone())"
        )
    if copy or obstacle is not None:
        t = t.clone(memory_format=torch.contiguous_format)  # fresh memory: 64-byte aligned
    array = jax_dlpack.from_dlpack(t)
    if copy is False and t.numel() and array.unsafe_buffer_pointer() != t.data_ptr():
        raise ValueError(
            f"{path}: JAX copied this {t.dtype} tensor into a {array.dtype} array (with "
            f"jax_enable_x64 off, JAX keeps 64-bit values in 32 bits); pass copy=None to "
            f"allow it, or enable x64 in JAX"
        )
    return array


def _array_to_torch(path: str, array: Any, rank: int | None, copy: bool | None) -> torch.Tensor:
    sharding = array.sharding
    if len(sharding.device_set) > 1 and not sharding.is_fully_replicated:
        if rank is None:
            raise ValueError(
                f"{path}: a jax.Array of shape {tuple(array.shape)} sharded over "
                f"{len(sharding.device_set)} devices ({sharding}); from_jax converts one "
                f"buffer per leaf: pass rank=<device id> to take that device's shard, or put "
                f"the array on one device first (jax.device_put(x, jax.devices()[0]))"
            )
        shard = next((s for s in array.addressable_shards if s.device.id == rank), None)
        if shard is None:
            held = sorted(s.device.id for s in array.addressable_shards)
            raise ValueError(
                f"{path}: no shard of this array is on device {rank} in this process "
                f"(it holds shards on devices {held}); pass the rank of one of them"
            )
        array = shard.data
    elif len(sharding.device_set) > 1:
        array = array.addressable_shards[0].data  # replicated: every copy is the whole array
    try:
        tensor = torch.from_dlpack(array)
    except (BufferError, RuntimeError, TypeError) as e:
        if copy is False:
            raise ValueError(
                f"{path}: DLPack cannot share this {array.dtype} array with torch ({e}); pass "
                f"copy=None to copy it"
            ) from None
        return _copy_via_numpy(array)
    return tensor.clone() if copy else tensor


def _copy_via_numpy(array: Any) -> torch.Tensor:
    import numpy as np

    return tensor_from_numpy(np.array(array))  # np.array copies out of JAX's buffer
