"""Meshes the planner refuses with the fix: a hybrid strategy on one axis, nodes cut unevenly."""

from __future__ import annotations

from funcshard._src.plan.hardware import Hardware
from funcshard._src.spec.mesh import Mesh

# the strategies that differ from full_shard only on a mesh of several axes
TWO_AXES: dict[str, str] = {
    "hybrid_shard": "shards over the last mesh axis and replicates over the others",
    "partial_reshard": "keeps a copy sharded over the last mesh axis from forward to backward",
    "hybrid_shard_optimizer": "keeps a copy sharded over the last mesh axis for the step",
}


def check_strategy_axes(strategy: str, mesh: Mesh, text: str, hardware: Hardware | None, /) -> None:
    """Refuses a strategy of :data:`TWO_AXES` on a mesh of one axis, where it is ``full_shard``.

    Raises:
        ValueError: naming the strategy, the mesh and a mesh of two axes of the same size.

    Example:
        >>> check_strategy_axes("hybrid_shard", Mesh({"fsdp": 8}), "fsdp=8", None)
        Traceback (most recent call last):
        ...
        ValueError: --strategy hybrid_shard shards over the last mesh axis and replicates over the others, so it needs a mesh of two axes; on --mesh 'fsdp=8' it would be full_shard. Pass e.g. --mesh dp=2,fsdp=4, or --strategy full_shard
    """
    if strategy in TWO_AXES and len(mesh.axes) < 2:
        raise ValueError(
            f"--strategy {strategy} {TWO_AXES[strategy]}, so it needs a mesh of two "
            f"axes; on --mesh {text!r} it would be full_shard. Pass e.g. --mesh "
            f"{_two_axes_example(mesh.size, hardware)}, or --strategy full_shard"
        )


def check_nodes(mesh: Mesh, hardware: Hardware, /) -> None:
    """Refuses a mesh whose groups a node boundary would cut unevenly, with a mesh that does not.

    Ranks are row-major: the last axes lie within a node. Every node must hold whole
    groups of some last axes and be a whole fraction of one more, else the same axis
    runs at NVLink speed in one group and across NICs in the next.

    Raises:
        ValueError: naming the mesh, the node size and a mesh of the same size that tiles.
    """
    node = hardware.devices_per_node
    if mesh.size <= node:
        return  # one node
    inner = 1
    for size in reversed(list(mesh.axes.values())):
        if node % inner == 0 and (inner * size) % node == 0:
            return
        inner *= size
    text = ",".join(f"{a}={n}" for a, n in mesh.axes.items())
    fix = (
        f"e.g. --mesh dp={mesh.size // node},fsdp={node}"
        if mesh.size % node == 0
        else f"a mesh of a multiple of {node} ranks, e.g. --mesh dp={-(-mesh.size // node)},fsdp={node}"
    )
    raise ValueError(
        f"--mesh {text} on {hardware.name} ({node} devices per node): node boundaries cut its "
        f"groups unevenly (ranks are row-major, the last axes inside a node), so one group of "
        f"an axis would run over NVLink and the next across nodes. Make the last axes' sizes "
        f"multiply to a divisor or a multiple of {node}: {fix}"
    )


def _two_axes_example(n: int, hardware: Hardware | None, /) -> str:
    node = hardware.devices_per_node if hardware is not None else 8
    inner = node if n % node == 0 and n > node else max(1, n // 2)
    return f"dp={n // inner},fsdp={inner}"
