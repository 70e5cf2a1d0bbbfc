"""Pickles and metadata that cost more than their bytes: refused before the work, in well under a second.

The second audit's cases: dict keys of one hash (integers ``k * (2**61 - 1) + 7``) in a
rank's ``.metadata``, a standard DCP ``.metadata`` and a chunk's ``data.pkl``; a memo
index of ``2**27`` in a 9-byte pickle; metadata with more entries or bytes than a real
checkpoint; a ``.metadata`` naming ``torch._inductor``; a FIFO where a file should be.
A failure names the refusal that no longer happens (or happens late).
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import funcshard as fs
from funcshard._src.checkpoint import dcp_io, dcp_metadata
from funcshard._src.checkpoint.dcp_files import SafeIndex
from funcshard._src.untrusted_pickle import check_pickle
from funcshard.checkpoint import CorruptCheckpointError, UnsafeCheckpointError
from tests import tampering

M = (1 << 61) - 1  # integers that differ by M hash alike


def _colliding(n: int, container: bytes = b"}") -> bytes:
    """A protocol-2 pickle of a dict (or set) of ``n`` integer keys that all hash alike."""

    def long1(v: int) -> bytes:
        b = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8a" + bytes([len(b)]) + b

    body = b"".join(long1(k * M + 7) + b"N" for k in range(1, n + 1))
    return b"\x80\x02" + container + b"(" + body + b"u."


def _params() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(4, 3)}


def _sharded() -> object:
    return fs.shard(_params(), fs.plan(_params(), fs.Mesh({"fsdp": 1})))


def _save(tmp_path: Path) -> Path:
    return fs.checkpoint.save(tmp_path / "ckpt", {"params": _sharded()}, step=1)


def _dcp(tmp_path: Path) -> Path:
    directory = tmp_path / "dcp"
    state_dict_saver._save_state_dict(  # pyright: ignore[reportPrivateUsage]
        {"w": torch.zeros(4, 3)}, storage_writer=dcp.FileSystemWriter(directory), no_dist=True
    )
    return directory


def _fast(call, error: type[Exception], *parts: str) -> None:
    start = time.perf_counter()
    with pytest.raises(error) as info:
        call()
    assert time.perf_counter() - start < 2, "refused, but only after the work it bounds"
    for part in parts:
        assert part in str(info.value), str(info.value)


def test_keys_of_one_hash_in_a_ranks_metadata_are_refused(tmp_path):
    ckpt = _save(tmp_path)
    tampering.replace_file(ckpt, "rank0/.metadata", _colliding(200_000))
    _fast(
        lambda: fs.checkpoint.load(ckpt, like={"params": _sharded()}),
        CorruptCheckpointError,
        "rank0/.metadata: it keys a dict or set by a number",
    )


def test_keys_of_one_hash_in_a_dcp_metadata_are_refused(tmp_path):
    directory = _dcp(tmp_path)
    (directory / ".metadata").write_bytes(_colliding(200_000))
    _fast(
        lambda: fs.checkpoint.load_dcp(directory, {"w": torch.zeros(4, 3)}),
        CorruptCheckpointError,
        ".metadata: it keys a dict or set by a number",
    )


def test_a_set_of_one_hash_is_refused():
    with pytest.raises(ValueError, match="keys a dict or set by a number"):
        check_pickle(b"\x80\x02\x8f(" + b"\x8a\x01\x07" * 3 + b"\x90.", what="x")


def test_a_chunk_whose_data_pkl_keys_a_dict_of_one_hash_is_refused(tmp_path):
    ckpt = _save(tmp_path)
    blob0 = tampering.saved_blob(torch.zeros(4, 3))

    def change(name: str, data: bytes) -> tuple[bytes, int]:
        if name.endswith("data.pkl"):
            return _colliding(3000), zipfile.ZIP_STORED
        return data, zipfile.ZIP_STORED

    blob = tampering.with_records(blob0, change)
    tampering.replace_blobs(ckpt, 0, {"params/w@0,0": (blob, torch.float32, (4, 3))})
    _fast(
        lambda: fs.checkpoint.load(ckpt, like={"params": _sharded()}, verify=False),
        CorruptCheckpointError,
        "data.pkl': it keys a dict or set by a number",
    )


def _called_with(n: int, constructor: bytes, pairs: bool) -> bytes:
    """A protocol-2 pickle calling ``constructor`` (``module\\nName``) on ``n`` keys of one hash.

    ``torch.load(weights_only=True)`` allows ``set``, ``OrderedDict`` and ``Counter``:
    called on a list, they hash its members (or its pairs' first items) as they build.
    """
    members = b"".join(
        pickle.dumps(k * M + 7, protocol=2)[2:-1] + (b"N\x86" if pairs else b"")
        for k in range(1, n + 1)
    )
    return b"\x80\x02c" + constructor + b"](" + members + b"e\x85R."


@pytest.mark.parametrize(
    ("constructor", "pairs"),
    [
        (b"__builtin__\nset\n", False),
        (b"collections\nOrderedDict\n", True),
        (b"collections\nCounter\n", False),
    ],
    ids=["set", "OrderedDict", "Counter"],
)
def test_a_chunk_whose_data_pkl_calls_a_set_or_dict_on_keys_of_one_hash_is_refused(
    tmp_path, constructor, pairs
):
    """Unpickled, 40000 of them take seconds (a larger tensor's chunk: hours); refused first.

    The chunk declares a tensor as large as its blob, so the byte range a chunk may take
    (its tensor's bytes and the serialization's slack) holds it.
    """

    def change(name: str, data: bytes) -> tuple[bytes, int]:
        if name.endswith("data.pkl"):
            return _called_with(40_000, constructor, pairs), zipfile.ZIP_STORED
        return b"" if "/data/" in name else data, zipfile.ZIP_STORED

    blob = tampering.with_records(tampering.saved_blob(torch.zeros(1)), change)
    params = {"w": torch.zeros((len(blob) - 1024) // 4)}
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}))
    ckpt = fs.checkpoint.save(tmp_path / "ckpt", {"params": fs.shard(params, plan)}, step=1)
    tampering.replace_blobs(
        ckpt, 0, {"params/w@0": (blob, torch.float32, tuple(params["w"].shape))}
    )
    _fast(
        lambda: fs.checkpoint.load(ckpt, like={"params": fs.shard(params, plan)}, verify=False),
        CorruptCheckpointError,
        "data.pkl': it builds a set or dict by calling",
    )


def test_offsets_of_one_hash_cannot_slow_a_metadata_index():
    """MetadataIndex hashes its offsets as integers; SafeIndex as a keyed string."""
    a, b = SafeIndex("w", [7, 0]), SafeIndex("w", [7 + M, 0])
    assert hash(MetadataIndex("w", [7, 0])) == hash(MetadataIndex("w", [7 + M, 0]))
    assert hash(a) != hash(b)
    with pytest.raises(TypeError, match="malformed"):
        hash(SafeIndex("w", [1 << 62]))


@pytest.mark.parametrize("opcode", [b"r", b"q", b"p"])
def test_a_memo_index_past_the_pickle_is_refused(opcode):
    """LONG_BINPUT / BINPUT / PUT 2**27 made the unpickler allocate 2**28 pointers (2 GiB)."""
    arg = {b"r": struct.pack("<I", 1 << 27), b"q": b"\xff", b"p": b"134217728\n"}[opcode]
    with pytest.raises(ValueError, match=r"it stores memo entry \d+ after only 3 opcodes"):
        check_pickle(b"\x80\x02N" + opcode + arg + b".", what="x")


def test_a_ranks_metadata_larger_than_any_rank_writes_is_refused(tmp_path):
    ckpt = _save(tmp_path)
    data = (ckpt / "rank0" / ".metadata").read_bytes()
    tampering.replace_file(ckpt, "rank0/.metadata", data + b"\0" * dcp_io.MAX_METADATA_BYTES)
    _fast(
        lambda: fs.checkpoint.load(ckpt, like={"params": _sharded()}),
        CorruptCheckpointError,
        f"more than MAX_METADATA_BYTES ({dcp_io.MAX_METADATA_BYTES})",
    )


def test_a_dcp_metadata_larger_than_a_70b_models_is_refused(tmp_path):
    directory = _dcp(tmp_path)
    with open(directory / ".metadata", "ab") as f:
        f.truncate(dcp_metadata.MAX_METADATA_BYTES + 1)
    _fast(
        lambda: fs.checkpoint.load_dcp(directory, {"w": torch.zeros(4, 3)}),
        CorruptCheckpointError,
        f"more than MAX_METADATA_BYTES of {dcp_metadata.MAX_METADATA_BYTES}",
    )


def test_a_dcp_metadata_with_more_keys_than_a_real_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(dcp_metadata, "MAX_KEYS", 100)
    directory = _dcp(tmp_path)
    entries, storage = {}, {}
    for i in range(101):
        chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))
        props = TensorProperties(dtype=torch.float32)
        entries[f"k{i}"] = TensorStorageMetadata(props, torch.Size([1]), [chunk])
        storage[MetadataIndex(f"k{i}", torch.Size([0]), 0)] = _StorageInfo("__0_0.distcp", 0, 4)
    (directory / ".metadata").write_bytes(pickle.dumps(Metadata(entries, storage_data=storage)))
    _fast(
        lambda: fs.checkpoint.load_dcp(directory, {"w": torch.zeros(4, 3)}),
        CorruptCheckpointError,
        "state_dict_metadata has 101 entries, more than the 100 funcshard reads",
    )


def test_a_metadata_naming_a_lazy_torch_module_imports_nothing(tmp_path):
    """getattr(torch, "_inductor") imports it (seconds of module code) before the refusal."""
    code = (
        "import sys, torch, funcshard as fs\n"
        "from pathlib import Path\n"
        "from tests import tampering\n"
        f"root = Path({str(tmp_path)!r})\n"
        "p = {'w': torch.zeros(4, 3)}\n"
        "sp = fs.shard(p, fs.plan(p, fs.Mesh({'fsdp': 1})))\n"
        "ckpt = fs.checkpoint.save(root / 'c', {'params': sp}, step=1)\n"
        "tampering.replace_file(ckpt, 'rank0/.metadata', b'\\x80\\x02ctorch\\n_inductor\\n.')\n"
        "try:\n    fs.checkpoint.load(ckpt, like={'params': sp})\n"
        "except fs.checkpoint.UnsafeCheckpointError as e:\n    print('refused', e)\n"
        "print('imported' if 'torch._inductor' in sys.modules else 'not imported')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "refers to torch._inductor" in out, out
    assert out.strip().endswith("not imported"), out


def test_a_fifo_in_a_checkpoint_is_refused_without_blocking(tmp_path):
    ckpt = _save(tmp_path)
    (ckpt / "rank0" / "__0_0.distcp").unlink()
    os.mkfifo(ckpt / "rank0" / "__0_0.distcp")
    _fast(
        lambda: fs.checkpoint.load(ckpt, like={"params": _sharded()}),
        UnsafeCheckpointError,
        "rank0/__0_0.distcp is not a regular file",
    )
