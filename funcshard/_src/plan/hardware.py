"""Hardware descriptions for the step-time estimate.

A :class:`Hardware` gives per-device peak FLOP/s, memory and memory bandwidth,
and the bandwidth of links within and across nodes. Presets hold vendor peak
numbers (dense 16-bit tensor FLOP/s, HBM bandwidth, per-direction NVLink and
network bandwidth per device); the achieved fraction of peak compute is an
explicit assumption (``efficiency``) that every estimate states.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from funcshard._src.plan.sizes import GiB, parse_bytes


@dataclass(frozen=True)
class Hardware:
    """One accelerator type and its links; every rate is per device, per direction.

    Attributes:
        name: a label for reports.
        peak_flops: dense FLOP/s in the compute dtype (16-bit on GPUs).
        memory_bytes: device memory.
        memory_bandwidth: device memory bytes/s.
        intra_node_bandwidth: bytes/s one device sends to peers in its node (NVLink).
        inter_node_bandwidth: bytes/s one device sends to other nodes (its share of the NICs).
        devices_per_node: devices that share the fast intra-node links.
        efficiency: the fraction of ``peak_flops`` assumed achieved (an assumption,
            stated in every estimate).
    """

    name: str
    peak_flops: float
    memory_bytes: int
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int
    efficiency: float = 0.5

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(
                    f"hardware {self.name!r}: {f.name} must be positive, got {value!r}"
                )
        if self.efficiency > 1:
            raise ValueError(
                f"hardware {self.name!r}: efficiency is a fraction of peak in (0, 1], got {self.efficiency}"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], /) -> Hardware:
        """Builds a description from a mapping (a JSON object); sizes may be strings like ``"80GiB"``.

        Raises:
            ValueError: a missing or unknown field, or a value that is not a positive number.

        Example:
            >>> Hardware.from_dict({"name": "x", "peak_flops": 1e12, "memory_bytes": "16GiB",
            ...     "memory_bandwidth": 1e11, "intra_node_bandwidth": 1e10,
            ...     "inter_node_bandwidth": 1e9, "devices_per_node": 4}).memory_bytes
            17179869184
        """
        names = [f.name for f in dataclasses.fields(cls)]
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [n for n in required if n not in data]
        unknown = [k for k in data if k not in names]
        if missing or unknown:
            parts = [
                f"missing {missing}" if missing else "",
                f"unknown {unknown}" if unknown else "",
            ]
            raise ValueError(
                f"hardware description: {'; '.join(p for p in parts if p)}; a description needs "
                f"{required} (and optionally 'efficiency')"
            )
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key == "name":
                values[key] = str(value)
            elif key == "memory_bytes" and isinstance(value, str):
                values[key] = parse_bytes(value)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                values[key] = value
            else:
                raise ValueError(f"hardware description: {key} must be a number, got {value!r}")
        return cls(**values)


HARDWARE: Mapping[str, Hardware] = {
    h.name: h
    for h in (
        # A100 SXM: 312 TFLOP/s bf16 dense; NVLink3 600 GB/s total = 300 GB/s per direction;
        # one 200 Gb/s HDR NIC per GPU = 25 GB/s.
        Hardware("a100-40gb", 312e12, 40 * GiB, 1.555e12, 300e9, 25e9, 8),
        Hardware("a100-80gb", 312e12, 80 * GiB, 2.039e12, 300e9, 25e9, 8),
        # H100 SXM: 989 TFLOP/s bf16 dense; NVLink4 900 GB/s total; one 400 Gb/s NDR NIC per GPU.
        Hardware("h100-80gb", 989e12, 80 * GiB, 3.35e12, 450e9, 50e9, 8),
        # H200 SXM: the H100's compute with 141 GB of HBM3e.
        Hardware("h200-141gb", 989e12, 141 * 10**9, 4.8e12, 450e9, 50e9, 8),
    )
}


def get_hardware(name: str, /) -> Hardware:
    """The preset called ``name``.

    Raises:
        ValueError: an unknown name; the message lists the presets.

    Example:
        >>> get_hardware("a100-80gb").devices_per_node
        8
    """
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown hardware {name!r}; presets are {sorted(HARDWARE)}, or describe it with "
            f"Hardware(...) / a JSON file of its fields"
        ) from None


def axes_bandwidth(mesh_axes: Mapping[str, int], axes: tuple[str, ...], hw: Hardware, /) -> float:
    """Bytes/s per rank for a collective over ``axes``: intra-node when the group fits in a node.

    Ranks are laid out row-major, so a group over some axes stays inside one node
    when the axes from its outermost one inwards hold at most ``devices_per_node`` ranks.

    Example:
        >>> hw = get_hardware("a100-80gb")
        >>> axes_bandwidth({"dp": 2, "fsdp": 8}, ("fsdp",), hw) == hw.intra_node_bandwidth
        True
        >>> axes_bandwidth({"dp": 2, "fsdp": 8}, ("dp",), hw) == hw.inter_node_bandwidth
        True
    """
    names = list(mesh_axes)
    outer = min(names.index(a) for a in axes)
    span = math.prod(mesh_axes[a] for a in names[outer:])
    return hw.intra_node_bandwidth if span <= hw.devices_per_node else hw.inter_node_bandwidth
