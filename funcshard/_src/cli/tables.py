"""``funcshard plan``'s two tables: memory per rank by category, and time, throughput and host RAM."""

from __future__ import annotations

import dataclasses

from funcshard._src.cli.host import host_per_node
from funcshard._src.plan.estimates import Estimate, Memory
from funcshard._src.plan.sizes import format_bytes, table


def fits(est: Estimate, usable: int | None) -> bool | None:
    """Whether the estimate fits ``usable`` bytes (``None`` without a budget)."""
    return None if usable is None else est.memory.total <= usable


_OPTIONAL = ("mixed_precision", "frozen", "buffers")  # columns shown where not 0 in every row
_SHORT = {"mixed_precision": "mixed prec", "activations": "activations"}


def memory_table(
    estimates: list[tuple[str, Estimate]], reserve: int | None, usable: int | None, /
) -> list[str]:
    """Per rank, every category the total adds (a category 0 in every row said so), then the reserve."""
    names = [f.name for f in dataclasses.fields(Memory)]
    zero = [
        n for n in names if n in _OPTIONAL and all(getattr(e.memory, n) == 0 for _, e in estimates)
    ]
    shown = [n for n in names if n not in zero]
    heads = ["strategy", *(_SHORT.get(n, n) for n in shown), "total"]
    if reserve is not None:
        heads += ["+ reserve", "fits"]
    rows: list[list[str]] = []
    for label, est in estimates:
        m = est.memory
        row = [label, *(format_bytes(getattr(m, n)) for n in shown), format_bytes(m.total)]
        if reserve is not None:
            row += [format_bytes(m.total + reserve), "yes" if fits(est, usable) else "no"]
        rows.append(row)
    out = ["Memory per rank (total = the columns before it):", table(heads, rows)]
    if zero:
        out.append(f"({', '.join(_SHORT.get(n, n) for n in zero)}: 0 B in every row)")
    if reserve is not None:
        out.append(
            f"+ reserve: the total and the {format_bytes(reserve)} kept back for the runtime "
            f"(CUDA context, NCCL buffers, fragmentation); fits: within the device's memory"
        )
    return out


def time_table(
    estimates: list[tuple[str, Estimate]], ranks: int, per_node: int, async_save: bool, /
) -> list[str]:
    """Per strategy: bytes sent, step time, tokens/s per GPU, MFU and host RAM per node."""
    heads = ["strategy", "sent/step", "step", "tokens/s per GPU", "MFU"]
    heads += ["host/node train", "host/node save, load"]
    rows: list[list[str]] = []
    for label, est in estimates:
        t = est.time
        host = host_per_node(est.memory, per_node, async_checkpoint=async_save)
        rows.append(
            [
                label,
                format_bytes(sum(est.comm.values())),
                "" if t is None else f"{t.step_s:.2f} s",
                "" if t is None else f"{t.tokens_per_s / ranks:,.0f}",
                "" if t is None else f"{t.mfu:.1%}",
                format_bytes(host["train"]),
                format_bytes(host["checkpoint"]),
            ]
        )
    train = (
        "the pinned staging buffers of fs.checkpoint.AsyncCheckpointer (--async-checkpoint)"
        if async_save
        else "nothing of the model (--async-checkpoint adds its pinned staging buffers)"
    )
    return [
        f"Per step, and host RAM per node of {per_node} ranks:",
        table(heads, rows),
        f"host/node: train holds {train}; a save or load copies each rank's params and "
        f"optimizer state through the host (See [Note: host memory] in cli/host.py)",
    ]
