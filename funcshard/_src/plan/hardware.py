"""Hardware descriptions for the step-time estimate: devices, their links, and how a mesh maps onto them.

A :class:`Hardware` gives per-device compute, memory and memory bandwidth, and a
topology: ``devices_per_node`` ranks share a node's fast links (NVLink), and
nodes talk through their NICs. Presets hold published figures (dense 16-bit
FLOP/s, HBM bandwidth, per-direction NVLink, one NIC per GPU as in NVIDIA's DGX
systems); ``funcshard calibrate`` measures a machine and writes the same fields
as JSON, which :meth:`Hardware.from_json` reads back.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from funcshard._src.plan.sizes import GiB, parse_bytes
from funcshard._src.untrusted import read_json

_MAX_JSON_BYTES = 1 << 20  # a description is a few hundred bytes; refuse anything huge
_FRACTIONS = ("efficiency", "overlap")  # in (0, 1] and [0, 1]
_OPTIONAL_RATES = ("node_bandwidth", "copy_bandwidth")  # None: derived from the others
# [Note: plausible hardware]
# Every number of a description must lie in a range that any real device and link does,
# with room on both sides, so that the step-time model's products and quotients stay finite:
# a rate of 1e-308 divided into bytes overflows to inf (and 1 / inf underflows to 0, a
# ZeroDivisionError further on), a latency of 1e308 times the ring steps is inf, and inf -
# inf is NaN: "nan s" steps, automatic plans chosen on NaN scores, NaN in --json. Rates are
# bytes or FLOP per second.
_BANDWIDTH = (1e3, 1e16)  # 1 kB/s (a laptop's worst link) .. 10 PB/s
_RANGES: Mapping[str, tuple[float, float]] = {
    "peak_flops": (1e3, 1e19),  # a microcontroller .. 10 EFLOP/s in one device
    "memory_bytes": (float(1 << 20), float(1 << 50)),  # 1 MiB .. 1 PiB
    "memory_bandwidth": _BANDWIDTH,
    "intra_node_bandwidth": _BANDWIDTH,
    "inter_node_bandwidth": _BANDWIDTH,
    "node_bandwidth": _BANDWIDTH,
    "copy_bandwidth": _BANDWIDTH,
    "devices_per_node": (1, 1 << 16),
    "efficiency": (1e-6, 1.0),
    "latency": (0.0, 60.0),  # seconds per ring step
    "overlap": (0.0, 1.0),
}


@dataclass(frozen=True)
class Hardware:
    """One accelerator type and its links; every rate is per direction.

    Attributes:
        name: a label for reports.
        peak_flops: dense FLOP/s of one device in the compute dtype (16-bit on GPUs);
            for a calibrated machine, its measured matmul rate.
        memory_bytes: device memory.
        memory_bandwidth: device memory bytes/s (the optimizer streams its state at it).
        intra_node_bandwidth: bytes/s one rank sends to peers in its node (NVLink).
        inter_node_bandwidth: bytes/s one rank sends to other nodes: its own NIC
            (DGX A100: one 200 Gb/s HDR NIC per GPU, 25 GB/s).
        devices_per_node: ranks that share the fast intra-node links.
        efficiency: the fraction of ``peak_flops`` the model's compute achieves: an
            assumption for a preset, a measurement for a calibrated machine.
        node_bandwidth: bytes/s one node sends to other nodes, all its NICs together
            (default ``devices_per_node * inter_node_bandwidth``).
        latency: seconds per step of a ring collective (``g - 1`` steps for a gather).
        overlap: the fraction of communication that can run under compute without
            slowing it: 1 where a DMA engine or its own SMs move the bytes (NCCL), less
            where the same CPU cores that compute also drive the transport (gloo).
        copy_bandwidth: bytes/s of the copies around collectives (unpacking gathered
            leaves, packing gradients), reads and writes counted (default
            ``memory_bandwidth``).
        source: where the numbers come from.
    """

    name: str
    peak_flops: float
    memory_bytes: int
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int
    efficiency: float = 0.5
    node_bandwidth: float | None = None
    latency: float = 1e-5
    overlap: float = 1.0
    copy_bandwidth: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "source") or (value is None and f.name in _OPTIONAL_RATES):
                continue
            low_ok = f.name in ("latency", "overlap")  # these may be 0
            if not (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
                and (value >= 0 if low_ok else value > 0)
            ):
                raise ValueError(
                    f"hardware {self.name!r}: {f.name} must be "
                    f"{'>= 0' if low_ok else 'positive'}, got {value!r}"
                )
        if isinstance(self.devices_per_node, float) and not self.devices_per_node.is_integer():
            raise ValueError(
                f"hardware {self.name!r}: devices_per_node must be a whole number, got "
                f"{self.devices_per_node}"
            )
        for name in _FRACTIONS:
            if getattr(self, name) > 1:
                what = "a fraction of peak" if name == "efficiency" else "a fraction"
                raise ValueError(
                    f"hardware {self.name!r}: {name} is {what} in (0, 1], got {getattr(self, name)}"
                )
        for name, (low, high) in _RANGES.items():  # See [Note: plausible hardware]
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise ValueError(
                    f"hardware {self.name!r}: {name} is {value:g}, outside [{low:g}, {high:g}], the "
                    f"range of any real device or link; check the unit (bytes and FLOP per second, "
                    f"seconds)"
                )

    @property
    def node_share(self) -> float:
        """Bytes/s of inter-node bandwidth one rank gets when every rank of its node sends."""
        per_node = self.node_bandwidth or self.devices_per_node * self.inter_node_bandwidth
        return min(self.inter_node_bandwidth, per_node / self.devices_per_node)

    @property
    def copy_rate(self) -> float:
        """Bytes/s of copies around collectives (``copy_bandwidth`` or ``memory_bandwidth``)."""
        return self.copy_bandwidth or self.memory_bandwidth

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], /) -> Hardware:
        """Builds a description from a mapping (a JSON object); sizes may be strings like ``"80GiB"``.

        The mapping is untrusted input: every field is checked for its type and range,
        and nothing in it is evaluated.

        Raises:
            ValueError: a missing or unknown field, or a value of the wrong type or range.

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
            optional = [n for n in names if n not in required]
            raise ValueError(
                f"hardware description: {'; '.join(p for p in parts if p)}; a description needs "
                f"{required} (and optionally {optional})"
            )
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key in ("name", "source"):
                if not isinstance(value, str) or len(value) > 1000:
                    raise ValueError(f"hardware description: {key} must be a short string")
                values[key] = value
            elif key == "memory_bytes" and isinstance(value, str):
                values[key] = parse_bytes(value)
            elif key in _OPTIONAL_RATES and value is None:
                values[key] = None
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                values[key] = value
            else:
                raise ValueError(f"hardware description: {key} must be a number, got {value!r}")
        if isinstance(values["devices_per_node"], float):
            if not values["devices_per_node"].is_integer():
                raise ValueError(
                    f"hardware description: devices_per_node must be a whole number, got "
                    f"{values['devices_per_node']}"
                )
            values["devices_per_node"] = int(values["devices_per_node"])
        if isinstance(values["memory_bytes"], float):
            values["memory_bytes"] = int(values["memory_bytes"])
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], /) -> Hardware:
        """Reads a description that :meth:`to_json` (or ``funcshard calibrate``) wrote.

        Raises:
            ValueError: the file cannot be read, is not strict JSON (see
                [Note: reader discipline] in ``untrusted.py``), is over 1 MiB, or is not an object of valid fields.
        """
        p = Path(path)
        data: object = read_json(  # strict: no NaN, Infinity or 1e400; at most 1 MiB, 64 deep
            p, what=f"hardware description {p}", max_bytes=_MAX_JSON_BYTES
        )
        if not isinstance(data, dict):
            raise ValueError(f"hardware description {p}: the JSON must be an object of fields")
        try:
            return cls.from_dict(data)  # pyright: ignore[reportUnknownArgumentType]
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None

    def to_json(self) -> dict[str, Any]:
        """Every field by name: what :meth:`from_dict` reads back.

        Example:
            >>> hw = get_hardware("a100-80gb")
            >>> Hardware.from_dict(hw.to_json()) == hw
            True
        """
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# [Note: device memory]
# A preset's memory_bytes is the device memory the device reports, nvidia-smi's memory.total
# (a whole number of MiB), not the marketing figure: "80GB" A100s report 81920 MiB (80 GiB),
# "40GB" A100s 40960 MiB, H100 SXM "80GB" 81559 MiB (79.6 GiB), H200 "141GB" 143771 MiB
# (140.4 GiB). Sources: nvidia-smi output quoted in modal-labs/modal-client#2797 (H100,
# A100 80GB and 40GB), NVIDIA/nccl#1264 (H100 80GB HBM3: 81559MiB) and in H200 nvidia-smi
# listings (143771MiB). CUDA's totalGlobalMem can be a little less (an A100-SXM4-40GB:
# 42298834944 bytes, 40339 MiB, in bottlerocket-os/bottlerocket#3873), and the CUDA
# context and allocator take more: the planner's reserve (``usable_budget``) covers those.
# [Note: published links]
# Per direction, per GPU, from NVIDIA's datasheets: A100 SXM 312 TFLOP/s dense bf16, NVLink3
# 600 GB/s both directions (300 each); H100/H200 SXM 989 TFLOP/s, NVLink4 900 GB/s (450).
# HBM: A100 40GB 1.555 TB/s, 80GB 2.039 TB/s; H100 3.35 TB/s; H200 4.8 TB/s. DGX A100 has
# eight 200 Gb/s HDR InfiniBand NICs for compute traffic, one per GPU (25 GB/s each, 200 GB/s
# a node); DGX H100 and H200 eight 400 Gb/s NDR NICs (50 GB/s each, 400 GB/s a node). A ring
# across nodes uses every NIC of the node at once (NCCL builds one ring per NIC), so a group
# with m ranks in each node gets m NICs' worth per rank: see link_bandwidth. Latency: ~10 us
# per ring step, an assumption. efficiency 0.5 is the default profile, 'tuned', which
# reproduces published runs of tuned kernels (See [Note: efficiency profiles] in
# efficiency.py); overlap 1: NCCL moves bytes on its own SMs and engines.
_DGX_NOTE = (
    "published peak figures (See [Note: published links] in plan/hardware.py); efficiency 0.5: "
    "the default profile 'tuned' (See [Note: efficiency profiles] in plan/efficiency.py)"
)
HARDWARE: Mapping[str, Hardware] = {
    h.name: h
    for h in (
        # Memory: nvidia-smi's memory.total, 40960 and 81920 MiB (See [Note: device memory]).
        Hardware("a100-40gb", 312e12, 40 * GiB, 1.555e12, 300e9, 25e9, 8, source=_DGX_NOTE),
        Hardware("a100-80gb", 312e12, 80 * GiB, 2.039e12, 300e9, 25e9, 8, source=_DGX_NOTE),
        Hardware("h100-80gb", 989e12, 81559 * 2**20, 3.35e12, 450e9, 50e9, 8, source=_DGX_NOTE),
        # H200 SXM: the H100's compute with "141 GB" of HBM3e; nvidia-smi reports 143771 MiB (140.4
        # GiB), the H100 81559 MiB (See [Note: device memory]).
        Hardware("h200-141gb", 989e12, 143771 * 2**20, 4.8e12, 450e9, 50e9, 8, source=_DGX_NOTE),
    )
}


def get_hardware(name: str | os.PathLike[str], /) -> Hardware:
    """The preset called ``name``, or the description in the JSON file at that path.

    Raises:
        ValueError: an unknown name (the message lists the presets) or an invalid file.

    Example:
        >>> get_hardware("a100-80gb").devices_per_node
        8
    """
    text = os.fspath(name)
    if text.lower() in HARDWARE:
        return HARDWARE[text.lower()]
    if text.endswith(".json") or Path(text).is_file():
        return Hardware.from_json(text)
    raise ValueError(
        f"unknown hardware {text!r}; presets are {sorted(HARDWARE)}, or describe it with "
        f"Hardware(...) / a JSON file of its fields (funcshard calibrate writes one)"
    )


def ranks_per_node(mesh_axes: Mapping[str, int], axes: tuple[str, ...], hw: Hardware, /) -> int:
    """How many ranks of one group over ``axes`` share a node (the group's size if it fits in one).

    Ranks are row-major: the last axis varies fastest, so the inner axes lie within
    a node as long as their product is at most ``devices_per_node``.

    Example:
        >>> hw = get_hardware("a100-80gb")
        >>> [ranks_per_node({"dp": 16, "fsdp": 8}, a, hw) for a in [("fsdp",), ("dp",), ("dp", "fsdp")]]
        [8, 1, 8]
    """
    names = list(mesh_axes)
    offsets = [0]  # ranks of the group that holds rank 0, relative to it
    for a in axes:
        stride = math.prod(mesh_axes[b] for b in names[names.index(a) + 1 :])
        offsets = [o + k * stride for o in offsets for k in range(mesh_axes[a])]
    return sum(1 for o in offsets if o < hw.devices_per_node)


def link_bandwidth(mesh_axes: Mapping[str, int], axes: tuple[str, ...], hw: Hardware, /) -> float:
    """Bytes/s per rank of a ring collective over ``axes`` (its bus bandwidth).

    Inside one node it is the intra-node link. A ring over ``g`` ranks with ``m`` in
    each node crosses between nodes ``g / m`` times; NCCL runs one ring per NIC, so
    the ``m`` ranks of a node send through ``m`` NICs at once, and every rank moves
    its bytes at ``m`` times its NIC share, at most the intra-node link.

    Example:
        >>> hw = get_hardware("a100-80gb")  # 16 nodes of 8
        >>> link_bandwidth({"fsdp": 128}, ("fsdp",), hw) / 1e9  # 8 NICs of 25 GB/s
        200.0
        >>> link_bandwidth({"dp": 16, "fsdp": 8}, ("dp",), hw) / 1e9  # one NIC
        25.0
        >>> link_bandwidth({"dp": 16, "fsdp": 8}, ("fsdp",), hw) / 1e9  # NVLink
        300.0
    """
    group = math.prod(mesh_axes[a] for a in axes)
    local = ranks_per_node(mesh_axes, axes, hw)
    if local >= group:
        return hw.intra_node_bandwidth
    return min(hw.intra_node_bandwidth, local * hw.node_share)


def axes_bandwidth(mesh_axes: Mapping[str, int], axes: tuple[str, ...], hw: Hardware, /) -> float:
    """Bytes/s per rank for a collective over ``axes``: :func:`link_bandwidth` (kept for callers).

    Example:
        >>> hw = get_hardware("a100-80gb")
        >>> axes_bandwidth({"dp": 2, "fsdp": 8}, ("fsdp",), hw) == hw.intra_node_bandwidth
        True
        >>> axes_bandwidth({"dp": 2, "fsdp": 8}, ("dp",), hw) == hw.inter_node_bandwidth
        True
    """
    return link_bandwidth(mesh_axes, axes, hw)
