"""Safetensors files and Hugging Face's layout of them: headers and indexes, read (untrusted) and written.

[Note: untrusted safetensors]
A checkpoint's index and headers are untrusted input. A header is read by funcshard
before ``safetensors`` maps the file: at most 100 MiB of strict JSON (no duplicate keys,
no ``NaN``, ``Infinity`` or ``1e400``, nested at most 64 deep: see
[Note: reader discipline] in ``untrusted.py``), every entry a dtype torch represents, a shape of non-negative ints and
byte offsets that tile the data exactly. An index's ``weight_map`` may name only plain
file names beside it (a symlink may not leave the directory, except into the ``blobs``
folder of a Hugging Face cache snapshot), and must agree with the files' headers.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import torch

from funcshard._src.dtypes import dtype_name
from funcshard._src.untrusted import loads_json, open_file, read_json

Files: TypeAlias = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100 * 2**20  # safetensors' own limit
MAX_INDEX = 64 * 2**20
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint: the file holding it, its dtype and its shape."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def checkpoint_tensors(files: Files, /) -> dict[str, Entry]:
    """Every tensor of a checkpoint by name, read from its headers (and its index) alone.

    ``files`` as :func:`funcshard.interop.load_safetensors` takes them; everything read
    is checked as [Note: untrusted safetensors] says.

    Raises:
        ValueError: a missing, malformed or unsafe file or index, or a tensor in two files.
    """
    if isinstance(files, (str, os.PathLike)):
        path = Path(files)
        if path.is_dir():
            if (path / SINGLE).exists():
                return _from_files([_member(path, SINGLE, path)])
            if (path / INDEX).exists():
                return _from_index(path / INDEX)
            raise ValueError(
                f"{path}: holds neither {SINGLE} nor {INDEX}; pass a directory that "
                f"save_pretrained wrote, or the .safetensors files themselves"
            )
        if path.name.endswith(".index.json"):
            return _from_index(path)
        return _from_files([path])
    paths = [Path(f) for f in files]
    if not paths:
        raise ValueError("load_safetensors: no files given; pass a file, a list or a directory")
    return _from_files(paths)


def read_header(file: Path, /) -> dict[str, Entry]:
    """The tensors of one safetensors file, from its header (see [Note: untrusted safetensors]).

    Raises:
        ValueError: the file is missing, not a safetensors file, or its header is malformed.
    """
    try:  # opened once: what fstat checks is what is read (a FIFO is refused, never waited on)
        f = open_file(file, symlinks=True, missing=FileNotFoundError)
    except FileNotFoundError:
        raise ValueError(f"{file}: no such file; pass existing .safetensors files") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(MAX_HEADER, size - 8):
            raise ValueError(
                f"{file}: not a safetensors file (its header length field says {n} bytes, the "
                f"file has {size}); pass .safetensors files"
            )
        raw = f.read(n)
    try:  # safetensors reads UTF-8 only; json.loads on bytes would also take a BOM or UTF-16
        text = raw.decode("utf-8") if not raw.startswith(b"\xef\xbb\xbf") else None
    except UnicodeDecodeError:
        text = None
    if text is None:
        raise ValueError(
            f"{file}: the header is not UTF-8 without a byte-order mark, as safetensors writes "
            f"it; the file is damaged or was not written by safetensors"
        )
    header = _strict_json(text, f"{file}: the header", MAX_HEADER)
    if not isinstance(header, dict):
        raise ValueError(f"{file}: the header is not a JSON object; not a safetensors file")
    data = size - 8 - n
    entries: dict[str, Entry] = {}
    spans: list[tuple[int, int, str]] = []
    for key, info in header.items():
        meta = key == "__metadata__"
        if meta and isinstance(info, dict) and all(isinstance(v, str) for v in info.values()):
            continue
        where = f"{file}: tensor {key!r}"
        if meta or not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{where}: malformed header entry {str(info)[:80]!r}")
        dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise ValueError(
                f"{where}: dtype {info['dtype']!r} cannot be represented in torch (funcshard "
                f"reads {sorted(DTYPES)}); convert the checkpoint to one of them"
            )
        shape, offsets = info["shape"], info["data_offsets"]
        if not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
            raise ValueError(f"{where}: shape {shape!r} or data_offsets {offsets!r} malformed")
        start, stop = offsets
        if stop - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(
                f"{where}: data_offsets {offsets} hold {stop - start} bytes, but "
                f"{shape} {dtype_name(dtype)} needs {math.prod(shape) * dtype.itemsize}"
            )
        entries[key] = Entry(file, dtype, tuple(shape))
        spans.append((start, stop, key))
    end = 0
    for start, stop, key in sorted(spans):
        if start != end:
            raise ValueError(
                f"{file}: tensor {key!r} starts at byte {start} of the data, not {end}: "
                f"tensors overlap or leave gaps; the file is corrupted"
            )
        end = stop
    if end != data:
        raise ValueError(f"{file}: the tensors hold {end} bytes, the data is {data}; corrupted")
    return entries


def _from_files(files: Sequence[Path]) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for file in files:
        for key, entry in read_header(file).items():
            if key in entries:
                raise ValueError(
                    f"{key!r} is in both {entries[key].file} and {file}; pass one of them"
                )
            entries[key] = entry
    return entries


def _from_index(index: Path) -> dict[str, Entry]:
    if not index.is_file():
        raise ValueError(f"{index}: not a file; pass an index file")
    # opened once: [Note: reader discipline] in untrusted.py
    content = read_json(index, max_bytes=MAX_INDEX)
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    metadata = content.get("metadata", {}) if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not isinstance(metadata, dict):
        raise ValueError(
            f"{index}: not a safetensors index (an object with a weight_map object and an "
            f"optional metadata object)"
        )
    by_file: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise ValueError(f"{index}: weight_map[{key!r}] is {name!r}, not a file name")
        by_file.setdefault(name, []).append(key)
    entries: dict[str, Entry] = {}
    for name, keys in by_file.items():
        header = read_header(_member(index.parent, name, index))
        for key in keys:
            if key not in header:
                raise ValueError(
                    f"{index}: weight_map puts {key!r} in {name!r}, which does not hold it; the "
                    f"index is stale: write the checkpoint again or pass its files"
                )
        for key in header:
            if weight_map.get(key) != name:
                raise ValueError(
                    f"{index}: {name!r} holds {key!r}, which weight_map "
                    f"{'puts in ' + repr(weight_map[key]) if key in weight_map else 'omits'}; "
                    f"the index is stale: write the checkpoint again or pass its files"
                )
        entries.update(header)
    return entries


def _member(directory: Path, name: str, where: Path) -> Path:
    """``directory / name`` if ``name`` is a plain file name whose target stays inside ``directory``."""
    if name in ("", ".", "..") or any(c in name for c in "/\\\0") or os.path.isabs(name):
        raise ValueError(
            f"{where}: names the file {name!r}, which is not a plain file name; refusing (an "
            f"index may only name files beside it)"
        )
    real = Path(os.path.realpath(directory / name))
    home = Path(os.path.realpath(directory))
    roots = [home, *([home.parent.parent / "blobs"] if home.parent.name == "snapshots" else [])]
    if not any(real.parent == root or root in real.parents for root in roots):
        raise ValueError(
            f"{where}: {name!r} links to {real}, outside {directory}; refusing (copy the "
            f"file into the checkpoint directory if it is meant to be read)"
        )
    if not real.is_file():
        raise ValueError(f"{where}: names {name!r}, which is not a file in {directory}")
    return real


def _strict_json(raw: bytes | str, what: str, max_bytes: int) -> Any:
    """Strict JSON (See [Note: reader discipline] in ``funcshard/_src/untrusted.py``)."""
    return loads_json(raw, what=what, max_bytes=max_bytes)


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for v in value  # pyright: ignore[reportUnknownVariableType]
    )


def header_bytes(tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], /) -> bytes:
    """The 8-byte length and JSON header of a file holding ``tensors`` (name, dtype, shape) in order.

    Their data follows back to back, each tensor's bytes C-contiguous and little-endian;
    the header is padded with spaces to a multiple of 8 bytes, as ``safetensors`` does.

    Raises:
        ValueError: a dtype safetensors has no name for.

    Example:
        >>> header_bytes([("w", torch.float32, (2,))])[8:].decode().strip()
        '{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        if dtype not in NAMES:
            raise ValueError(f"{name}: {dtype_name(dtype)} has no safetensors dtype; cast it first")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def parse_size(size: int | str, /) -> int:
    """Bytes in ``size``: an int, or a size as Hugging Face writes it (``"5GB"``; ``"500MiB"``).

    Raises:
        ValueError: not a positive size.

    Example:
        >>> parse_size("20KB"), parse_size("1.5GiB"), parse_size(1000)
        (20000, 1610612736, 1000)
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    text = size.strip().upper() if isinstance(size, str) else ""
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if text.endswith(u)), None)
    try:
        value = float(text[: -len(unit)]) if unit else -1.0
    except ValueError:
        value = -1.0
    if unit is None or not 0 < value * _UNITS[unit] < 2**63:
        raise ValueError(
            f"max_shard_size={size!r} is not a size; pass bytes or a string like '5GB' or '500MiB'"
        )
    return int(value * _UNITS[unit])


def shard_files(sizes: Sequence[int], limit: int, /) -> list[tuple[str, slice]]:
    """Hugging Face's split of tensors of ``sizes`` bytes, in order, into files of at most ``limit``.

    Greedy: a file takes tensors until the next would pass ``limit`` (a larger tensor
    gets a file of its own). Returns each file's name and its tensors' positions;
    one file is ``model.safetensors``, more are ``model-0000i-of-0000K.safetensors``.

    Example:
        >>> [(name[6:11], part) for name, part in shard_files([6, 6, 2, 12, 1], 10)]
        [('00001', slice(0, 1, None)), ('00002', slice(1, 3, None)), ('00003', slice(3, 4, None)), ('00004', slice(4, 5, None))]
        >>> shard_files([1, 2], 10)
        [('model.safetensors', slice(0, 2, None))]
    """
    starts: list[int] = []
    size = 0
    for i, n in enumerate(sizes):
        if not starts or size + n > limit:
            starts.append(i)
            size = 0
        size += n
    bounds = list(zip(starts, [*starts[1:], len(sizes)])) or [(0, 0)]
    if len(bounds) == 1:
        return [(SINGLE, slice(*bounds[0]))]
    return [
        (f"model-{i + 1:05d}-of-{len(bounds):05d}.safetensors", slice(a, b))
        for i, (a, b) in enumerate(bounds)
    ]


def index_bytes(weight_map: Mapping[str, str], total_size: int, total_parameters: int, /) -> bytes:
    """``model.safetensors.index.json`` as Hugging Face writes it.

    Example:
        >>> json.loads(index_bytes({"w": "model-00001-of-00002.safetensors"}, 8, 2))["metadata"]
        {'total_parameters': 2, 'total_size': 8}
    """
    index = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": dict(weight_map),
    }
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
