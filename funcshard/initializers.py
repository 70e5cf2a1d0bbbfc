"""Initializers for :func:`funcshard.materialize`: values that are a function of ``(seed, path, index)``.

Each is an immutable object; :func:`funcshard.materialize` fills every rank's
shards with it, and called JAX-style, ``init(key, shape, dtype)``, it returns
the whole leaf with the same values (``key``: a :class:`Key` of seed and leaf
path, or an int seed).

Example:
    >>> import torch, funcshard as fs
    >>> init = fs.initializers.normal(std=0.02)
    >>> init
    normal(std=0.02)
    >>> init(fs.initializers.Key(0, "blocks/0/w"), (2, 3), torch.bfloat16).dtype
    torch.bfloat16
    >>> fs.initializers.zeros(0, (2,))
    tensor([0., 0.])
"""

from funcshard._src.shard.fans import fan_in_and_fan_out as fan_in_and_fan_out
from funcshard._src.shard.fans import kaiming_normal as kaiming_normal
from funcshard._src.shard.fans import kaiming_uniform as kaiming_uniform
from funcshard._src.shard.fans import lecun_normal as lecun_normal
from funcshard._src.shard.fans import xavier_normal as xavier_normal
from funcshard._src.shard.fans import xavier_uniform as xavier_uniform
from funcshard._src.shard.initializers import Initializer as Initializer
from funcshard._src.shard.initializers import Key as Key
from funcshard._src.shard.initializers import constant as constant
from funcshard._src.shard.initializers import elementwise as elementwise
from funcshard._src.shard.initializers import normal as normal
from funcshard._src.shard.initializers import ones as ones
from funcshard._src.shard.initializers import truncated_normal as truncated_normal
from funcshard._src.shard.initializers import uniform as uniform
from funcshard._src.shard.initializers import zeros as zeros
from funcshard._src.shard.orthogonal import orthogonal as orthogonal

__all__ = [
    "Initializer",
    "Key",
    "constant",
    "elementwise",
    "fan_in_and_fan_out",
    "kaiming_normal",
    "kaiming_uniform",
    "lecun_normal",
    "normal",
    "ones",
    "orthogonal",
    "truncated_normal",
    "uniform",
    "xavier_normal",
    "xavier_uniform",
    "zeros",
]
