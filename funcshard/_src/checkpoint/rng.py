"""Random number generator state of every rank, as one tensor a checkpoint can hold."""

from __future__ import annotations

import torch
import torch.distributed as dist

from funcshard._src.comm import runtime


def rng_states() -> torch.Tensor:
    """Every rank's torch CPU generator state, stacked ``(world_size, n)``; collective.

    Example:
        >>> states = rng_states()
        >>> states.shape[0]
        1
    """
    mine = torch.get_rng_state()
    if not runtime.is_distributed():
        return mine.unsqueeze(0)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return torch.stack(rows)


def set_rng_states(states: torch.Tensor, /) -> None:
    """Restores this rank's generator from :func:`rng_states`; mutates the global generator.

    On more ranks than saved, rank ``r`` takes row ``r % rows``.

    Example:
        >>> saved = rng_states()
        >>> a = torch.rand(2)
        >>> set_rng_states(saved)
        >>> torch.equal(torch.rand(2), a)
        True
    """
    torch.set_rng_state(states[runtime.rank() % states.shape[0]].clone())
