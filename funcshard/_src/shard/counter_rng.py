"""A counter-based random number generator: ``(key, element index) -> 64 random bits``.

Every random value that :func:`funcshard.materialize` generates is a pure
function of the seed, the leaf path, a stream number and the element's index in
the row-major flattened leaf, so it does not depend on which rank generates it,
in which block, or on how the leaf is sharded.

[Note: counter rng v1]
This scheme is a stable contract: it decides which values a seed gives, hence
checkpoint-free reproducibility. Changing it changes every initialized model;
do so only with a new version tag. For ``seed`` (``0 <= seed < 2**64``), leaf
``path`` (a ``str``) and ``stream`` (``0 <= stream < 2**32``), all integers
below taken mod ``2**64``:

1. ``digest = SHA-256(b"funcshard.counter_rng.v1\\x00" + seed.to_bytes(8, "little")
   + stream.to_bytes(4, "little") + path.encode("utf-8"))``;
   ``k0 = int.from_bytes(digest[0:8], "little")``, ``k1 = int.from_bytes(digest[8:16], "little")``.
2. ``mix(z)`` is the splitmix64 finalizer (Stafford's variant 13):
   ``z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9; z = (z ^ (z >> 27)) * 0x94D049BB133111EB;
   z ^ (z >> 31)``.
3. The bits of element ``i`` are ``mix(mix(k0 + (i + 1) * 0x9E3779B97F4A7C15) ^ k1)``: the
   ``(i + 1)``-th splitmix64 output of state ``k0``, mixed once more with ``k1`` so that
   the streams of two keys never overlap by a shift of the counter.
4. The uniform of element ``i`` is ``((bits >> 12) + 0.5) * 2**-52`` in float64: 52
   random bits, every value exact, in ``[2**-53, 1 - 2**-53]``, so strictly inside
   ``(0, 1)`` and symmetric (``1 - u`` is a possible value whenever ``u`` is).

The arithmetic runs on numpy ``uint64`` arrays, whose multiplication wraps mod
``2**64`` by definition (torch's signed int64 would overflow).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

VERSION = b"funcshard.counter_rng.v1\x00"
_MASK = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S12 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(12)


def stream_key(seed: int, path: str, stream: int = 0, /) -> tuple[int, int]:
    """The two 64-bit words ``(k0, k1)`` of ``(seed, path, stream)`` (step 1 of [Note: counter rng v1]).

    Raises:
        TypeError: ``seed`` or ``stream`` is not an int, or ``path`` not a str.
        ValueError: ``seed`` or ``stream`` is out of range.

    Example:
        >>> stream_key(0, "w") == stream_key(0, "w"), stream_key(0, "w") == stream_key(1, "w")
        (True, False)
    """
    check_seed(seed)
    if isinstance(stream, bool) or not isinstance(stream, int) or not 0 <= stream < 2**32:  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ValueError(f"stream must be an int in [0, 2**32), got {stream!r}")
    if not isinstance(path, str):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(f"path must be a str (a leaf path like 'blocks/0/w'), got {path!r}")
    digest = hashlib.sha256(
        VERSION + seed.to_bytes(8, "little") + stream.to_bytes(4, "little") + path.encode("utf-8")
    ).digest()
    return int.from_bytes(digest[0:8], "little"), int.from_bytes(digest[8:16], "little")


def check_seed(seed: object, /) -> int:
    """Returns ``seed`` if it is an int in ``[0, 2**64)``.

    Raises:
        TypeError: not an int (``bool`` included).
        ValueError: out of range.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int in [0, 2**64), got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def bits(key: tuple[int, int], index: np.ndarray, /) -> np.ndarray:
    """The 64 random bits of every element ``index`` (``uint64`` or non-negative ``int64``) under ``key``.

    Example:
        >>> out = bits(stream_key(0, "w"), np.arange(3, dtype=np.uint64))
        >>> out.dtype, out.shape, len(set(out.tolist()))
        (dtype('uint64'), (3,), 3)
    """
    k0, k1 = (np.uint64(k & _MASK) for k in key)
    z = index.astype(np.uint64, copy=True)  # (n,), wraps mod 2**64 below
    z += np.uint64(1)
    z *= _GOLDEN
    z += k0
    _mix(z)
    z ^= k1
    _mix(z)
    return z


def uniform(key: tuple[int, int], index: torch.Tensor, /) -> torch.Tensor:
    """Float64 uniforms in the open interval ``(0, 1)``, one per element of the int64 ``index``.

    ``index`` holds flat row-major element indices of a leaf (on any device; the
    hashing runs on the CPU). The result is a new CPU tensor of ``index``'s shape.

    Example:
        >>> u = uniform(stream_key(0, "w"), torch.arange(4))
        >>> u.dtype, bool(((u > 0) & (u < 1)).all())
        (torch.float64, True)
        >>> torch.equal(u[2:], uniform(stream_key(0, "w"), torch.tensor([2, 3])))
        True
    """
    if index.dtype != torch.int64:
        raise TypeError(f"index must be an int64 tensor, got {index.dtype}")
    flat = index.detach().reshape(-1).cpu().numpy()
    z = bits(key, flat)
    z >>= _S12
    u = z.astype(np.float64)  # exact: below 2**52
    u += 0.5
    u *= 2.0**-52
    return torch.from_numpy(u).reshape(index.shape)


def _mix(z: np.ndarray) -> None:
    """The splitmix64 finalizer, in place on a ``uint64`` array."""
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
