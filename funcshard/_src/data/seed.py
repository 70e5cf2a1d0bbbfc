"""One seed for every generator a training loop draws from, on every rank."""

from __future__ import annotations

import random

import numpy as np
import torch

from funcshard._src.comm import runtime


def seed(value: int, /, *, per_rank: bool = False) -> int:
    """Seeds Python's ``random``, numpy's global generator and torch (CPU and every CUDA device); mutates them.

    Every rank gets the same seed, so that what the ranks draw alike (an
    initialization, a data order) agrees; ``per_rank=True`` adds the rank, for
    what should differ (dropout masks of different examples). As
    ``accelerate.utils.set_seed``. ``fs.checkpoint.save`` keeps the generators'
    states and ``fs.checkpoint.load`` restores them, so a resumed run continues
    the same draws.

    Args:
        value: the seed, an integer in ``[0, 2**32 - world_size)``.
        per_rank: seed each rank with ``value + rank``.

    Returns:
        The seed this rank used.

    Raises:
        ValueError: a seed that is not such an integer.

    Example:
        >>> import funcshard as fs, torch
        >>> fs.seed(0)
        0
        >>> a = torch.rand(2)
        >>> _ = fs.seed(0)
        >>> torch.equal(torch.rand(2), a)
        True
    """
    world = runtime.world_size()
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32 - world:
        raise ValueError(
            f"fs.seed: the seed must be an integer in [0, 2**32 - {world}) (numpy's limit, less "
            f"the ranks), got {value!r}"
        )
    mine = value + runtime.rank() if per_rank else value
    random.seed(mine)
    np.random.seed(mine)
    torch.manual_seed(mine)  # every CUDA device too
    return mine
