"""Random number generator state of every rank, as one tensor a checkpoint can hold."""

from __future__ import annotations

import base64

import torch

from funcshard._src.comm import agree, runtime, settle


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
    with settle.operation("fs.checkpoint.rng_states"):
        rows = agree.all_gather_json(
            base64.b64encode(mine.numpy().tobytes()).decode(), "fs.checkpoint.rng_states"
        )
    return torch.stack(
        [torch.frombuffer(bytearray(base64.b64decode(row)), dtype=torch.uint8) for row in rows]
    )


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
