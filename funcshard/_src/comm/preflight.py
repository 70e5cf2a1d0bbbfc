"""What every rank checks before a data collective: that all of them move bytes the same way.

[Note: transport settings]
Environment variables choose how a collective crosses between ranks:
``FUNCSHARD_SHM`` (shared memory on one host or gloo's sockets),
``FUNCSHARD_ALL_GATHER`` and ``FUNCSHARD_REDUCE_SCATTER`` (the algorithm) and
``FUNCSHARD_DEBUG`` (an agreement before every collective). Each rank reads its
own environment, and a launcher may hand ranks different ones (a per-node
script, a variable exported on one host). Ranks that differ issue different
sequences of collectives for the same call: one rank's 64-byte descriptor
exchange meets another's all-gather of a unit, which gloo answers with a
timeout, an abort of the process (``gloo::EnforceNotMet``) or the wrong bytes.
So before its first data collective every rank agrees on the settings as it
reads them, and again before the first collective after they change (every rank
must change them at the same point, between the same two collectives, as a test
that sets them for one call does), and ranks that differ raise
:class:`DesyncError` naming each variable and every rank's value. A value that
names no algorithm is agreed on as written: where every rank has it, the
collective then refuses it with the same error on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from funcshard._src.comm import agree, channel, runtime, transport
from funcshard._src.comm.channel import Kind
from funcshard._src.comm.torch_transport import ALL_GATHER, REDUCE_SCATTER

_HINT = (
    "These variables choose how each collective moves its bytes, so every rank must see the "
    "same values: set them (or leave them unset) alike for every rank of the job, in the "
    "launcher's environment rather than a per-node or per-rank script"
)


def settings() -> dict[str, str]:
    """The transport settings as this rank reads them, by variable; see [Note: transport settings].

    Inside a step, the settings it holds, read once ([Note: settings held through a step]
    in ``comm/runtime.py``).

    Example:
        >>> sorted(settings())
        ['FUNCSHARD_ALL_GATHER', 'FUNCSHARD_DEBUG', 'FUNCSHARD_REDUCE_SCATTER', 'FUNCSHARD_SHM']
    """
    global _read
    held = runtime.held()
    if held is not None and _read is not None and _read[0] is held:
        return _read[1]
    mine = {
        transport.SHM_ENV: "on" if transport.shm_enabled() else "off",
        ALL_GATHER.ALGORITHM_ENV: runtime.setting(ALL_GATHER.ALGORITHM_ENV, "auto"),
        REDUCE_SCATTER.ALGORITHM_ENV: runtime.setting(REDUCE_SCATTER.ALGORITHM_ENV, "auto"),
        runtime.DEBUG_ENV: "on" if runtime.debug_collectives() else "off",
    }
    _read = None if held is None else (held, mine)
    return mine


_read: tuple[dict[str, str], dict[str, str]] | None = None  # a step's snapshot, and its settings


def check(
    ch: channel.Channel | None,
    op: str,
    tag: str,
    group: dist.ProcessGroup,
    tensor: torch.Tensor,
    what: Callable[[], str],
    /,
) -> None:
    """Agrees before the data collective ``what()``: the settings if they changed, under FUNCSHARD_DEBUG the collective; collective.

    Raises:
        DesyncError: the ranks' transport settings differ, or (FUNCSHARD_DEBUG)
            they issue different collectives here.
    """
    mine = settings()
    if ch is not None and ch.agreed_settings != mine:
        agree.agree_on(Kind.SETTINGS, f"the transport settings before {what()}", mine, hint=_HINT)
        ch.agreed_settings = mine
    if mine[runtime.DEBUG_ENV] == "on":
        _check_same_collective(op, tag, group, tensor, what())


def _check_same_collective(
    op: str, tag: str, group: dist.ProcessGroup, tensor: torch.Tensor, what: str
) -> None:
    """FUNCSHARD_DEBUG: every rank agrees on (op, tag, shape, dtype) first; see [Note: agreements] in ``comm/channel.py``."""
    mine = [op, tag, list(tensor.shape), str(tensor.dtype)]
    members = dist.get_process_group_ranks(group)
    everyone = agree.all_gather_json(mine, f"the debug check before {what}")
    if any(everyone[r] != everyone[members[0]] for r in members):
        listing = "; ".join(
            f"rank {r}: ({sig[0]!r}, {sig[1]!r}, {tuple(sig[2])}, {sig[3]!r})"
            for r, sig in enumerate(everyone)
            if r in members
        )
        raise runtime.DesyncError(
            f"ranks issue different collectives at {what}: {listing}. "
            f"Every rank must call the same units in the same order"
        )
