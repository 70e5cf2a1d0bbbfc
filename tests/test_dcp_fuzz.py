"""A damaged or crafted DCP checkpoint loads exactly or fails with a CheckpointError; it never runs code.

The cases of ``tests/test_checkpoint_fuzz.py``, applied to ``fs.checkpoint.load_dcp``.
Reference: a checkpoint that FSDP2 saved with ``dcp.save`` at W=2 (a leaf in two chunks, AdamW
state, torchtitan's pickled ``train_state`` entries), loaded at W=1 before any
mutation, and equal bit for bit to what FSDP2 held. Every field of the ``.metadata``
(rewritten as an attacker would: DCP's files carry no digests, so a crafted file
needs nothing recomputed), every byte region of it, random bytes, and the payloads
an attacker would try end in a :class:`CheckpointError` or in that reference.
Payloads that would run code create a marker file, which must never appear. DCP
stores no checksum of the data itself, so a flipped byte inside a tensor's values
loads as that value (as it does with ``dcp.load``); the data files are mutated here
only where their structure is.
"""

from __future__ import annotations

import copy
import functools
import os
import pickle
import shutil
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

import funcshard as fs
from funcshard.checkpoint import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from tests import fsdp2_runs, tampering

MARKER = Path(tempfile.gettempdir()) / f"funcshard-dcp-fuzz-marker-{os.getpid()}"
NEEDED = ("model.weight", "optimizer.state.weight.exp_avg_sq", "optimizer.state.weight.step")
PICKLED = "train_state.log_steps"


@functools.cache
def _target() -> tuple[Any, Any, Any]:
    params, apply = fs.interop.functionalize(fsdp2_runs.small_model())
    return fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1}))), apply, fs.optim.adamw(lr=0.1)


def _load(directory: Path) -> dict[str, torch.Tensor]:
    like, apply, adamw = _target()
    sparams, state = fs.checkpoint.load_dcp(directory, like, apply=apply, optimizer=adamw)
    return fsdp2_runs.fs_full(apply, sparams, state)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, pools) -> tuple[Path, dict[str, torch.Tensor]]:
    """The checkpoint FSDP2 wrote at W=2, and what it loads as before any mutation."""
    directory = tmp_path_factory.mktemp("dcp-fuzz") / "step-1"
    at_save = pools.run(2, fsdp2_runs.save_small, str(directory))[0]
    loaded = _load(directory)
    assert _same(loaded, at_save)
    return directory, loaded


def _same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return sorted(actual) == sorted(expected) and all(
        actual[k].dtype == v.dtype and torch.equal(actual[k], v) for k, v in expected.items()
    )


def _outcome(directory: Path, reference: dict[str, torch.Tensor]) -> None:
    """Loading ``directory`` either fails with a CheckpointError or equals the reference."""
    try:
        result = _load(directory)
    except CheckpointError:
        result = None
    assert result is None or _same(result, reference), "a mutated checkpoint loaded a wrong value"
    assert not MARKER.exists(), "a payload in the checkpoint ran"


@pytest.fixture
def work(saved, tmp_path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(saved[0], target)
    return target


def _metadata(directory: Path) -> Any:
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)  # the attacker's own copy of a file it wrote


def _write(directory: Path, metadata: Any) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


# -- every field of the metadata, rewritten -----------------------------------------

REPLACEMENTS: list[Any] = [
    *(None, -1, 2**63, 1.5, True, "../../outside", "/etc/passwd", [], {}),
    *(torch.Size([]), torch.Size([2**40]), torch.Size([1, 2, 3]), torch.int64),
    BytesStorageMetadata(),
]


def _fields(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths to the fields of the entries the load needs (and of the metadata itself)."""
    if path:
        yield path
    if isinstance(node, dict):
        for key, value in node.items():  # pyright: ignore[reportUnknownVariableType]
            fqn = key.fqn if isinstance(key, MetadataIndex) else key
            if len(path) == 1 and fqn not in (*NEEDED, PICKLED):
                continue
            yield from _fields(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):  # pyright: ignore[reportUnknownVariableType]
            yield from _fields(value, (*path, i))
    elif hasattr(node, "__dataclass_fields__") and not isinstance(node, torch.Size):
        for name in vars(node):
            yield from _fields(getattr(node, name), (*path, ("attr", name)))


def _apply(metadata: Any, path: tuple[Any, ...], how: str, value: Any) -> None:
    parent = metadata
    for step in path[:-1]:
        parent = getattr(parent, step[1]) if isinstance(step, tuple) else parent[step]
    last = path[-1]
    if isinstance(last, tuple):
        if how == "delete":
            delattr(parent, last[1])
        else:
            object.__setattr__(parent, last[1], copy.deepcopy(value))
    elif how == "delete":
        del parent[last]
    else:
        parent[last] = copy.deepcopy(value)


def _first(metadata: Any) -> list[tuple[Any, ...]]:
    return [(("attr", name),) for name in vars(metadata)]


def test_every_field_of_the_metadata_crafted(saved, work):
    directory, reference = saved
    raw = (directory / ".metadata").read_bytes()
    original = pickle.loads(raw)
    count = 0
    for path in [*_first(original), *_fields(original)]:
        for how, value in [("delete", None), *(("replace", v) for v in REPLACEMENTS)]:
            metadata = pickle.loads(raw)  # a fresh copy, faster than copy.deepcopy
            try:
                _apply(metadata, path, how, value)
                _write(work, metadata)
            except (TypeError, RuntimeError, pickle.PicklingError, AttributeError):
                continue  # not a file anyone can write
            _outcome(work, reference)
            count += 1
    assert count > 500  # every field of every needed entry, many ways


@pytest.mark.parametrize("start", [0, 1])
def test_every_byte_region_of_the_metadata(saved, work, start):
    """Every 8-byte region (two interleaved halves, to share the work) XORed with 0xA5."""
    directory, reference = saved
    raw = (directory / ".metadata").read_bytes()
    for at in range(start * 8, len(raw), 16):
        mutated = bytearray(raw)
        for i in range(at, min(at + 8, len(raw))):
            mutated[i] ^= 0xA5
        (work / ".metadata").write_bytes(bytes(mutated))
        _outcome(work, reference)


@st.composite
def _byte_mutations(draw: st.DrawFn, raw: bytes) -> bytes:
    """``raw`` with a region flipped, replaced, cut, grown or duplicated, or truncated."""
    start = draw(st.integers(0, len(raw) - 1))
    length = draw(st.integers(1, 64))
    how = draw(st.sampled_from(["flip", "random", "delete", "insert", "truncate", "duplicate"]))
    data = bytearray(raw)
    if how == "flip":
        for i in range(start, min(start + length, len(data))):
            data[i] ^= draw(st.integers(1, 255))
    elif how == "random":
        data[start : start + length] = draw(st.binary(min_size=length, max_size=length))
    elif how == "delete":
        del data[start : start + length]
    elif how == "insert":
        data[start:start] = draw(st.binary(min_size=1, max_size=length))
    elif how == "truncate":
        del data[start:]
    else:
        data[start:start] = data[start : start + length]
    return bytes(data)


@settings(max_examples=100)
@given(data=st.data())
def test_random_bytes_of_the_metadata(saved, data):
    directory, reference = saved
    mutated = data.draw(_byte_mutations((directory / ".metadata").read_bytes()))
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "ckpt"
        shutil.copytree(directory, target)
        (target / ".metadata").write_bytes(mutated)
        _outcome(target, reference)


@settings(max_examples=60)
@given(data=st.data(), rank=st.sampled_from([0, 1]))
def test_random_damage_to_the_structure_of_a_data_file(saved, data, rank):
    """Cut, grown or shifted data files: the chunks no longer lie where the metadata says."""
    directory, reference = saved
    name = f"__{rank}_0.distcp"
    raw = (directory / name).read_bytes()
    how = data.draw(st.sampled_from(["truncate", "insert", "delete", "empty"]))
    at = data.draw(st.integers(0, len(raw) - 1))
    mutated = {
        "truncate": raw[:at],
        "insert": raw[:at] + b"\0" * data.draw(st.integers(1, 64)) + raw[at:],
        "delete": raw[:at] + raw[at + data.draw(st.integers(1, 64)) :],
        "empty": b"",
    }[how]
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "ckpt"
        shutil.copytree(directory, target)
        (target / name).write_bytes(mutated)
        _outcome(target, reference)


# -- payloads: what an attacker would try to run code or read outside ---------------


class _Run:
    """Pickles to a call of ``os.system`` that creates the marker."""

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {MARKER}",))


def _storage(work: Path, fqn: str) -> Any:
    return next(v for k, v in _metadata(work).storage_data.items() if k.fqn == fqn)


def _payload_inside(work: Path) -> None:
    """A valid metadata with the payload where DCP keeps free-form data (planner_data)."""
    metadata = _metadata(work)
    metadata.planner_data["model.weight"] = _Run()
    _write(work, metadata)


def _needed_as_bytes(work: Path) -> None:
    """Declares a needed tensor as bytes storage, whose blob is a pickle that runs the payload."""
    metadata = _metadata(work)
    metadata.state_dict_metadata["model.weight"] = BytesStorageMetadata()
    _write(work, metadata)
    info = _storage(work, "model.weight")
    _splice(work / info.relative_path, info.offset, pickle.dumps(_Run()))


def _unneeded_bytes_payload(work: Path) -> None:
    """torchtitan's pickled train_state entry, replaced by a pickle that runs the payload."""
    info = _storage(work, PICKLED)
    _splice(work / info.relative_path, info.offset, pickle.dumps(_Run()))


def _blob_payload(work: Path) -> None:
    """Replaces a needed chunk's torch.save blob with a pickle that runs the payload."""
    info = _storage(work, "model.weight")
    _splice(work / info.relative_path, info.offset, pickle.dumps(_Run()))


def _splice(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def _relative_path(target: str) -> Callable[[Path], None]:
    def attack(work: Path) -> None:
        metadata = _metadata(work)
        for info in metadata.storage_data.values():
            info.relative_path = target
        _write(work, metadata)

    return attack


def _symlink(name: str) -> Callable[[Path], None]:
    def attack(work: Path) -> None:
        outside = work.parent / f"outside-{name}"
        shutil.move(work / name, outside)
        (work / name).symlink_to(outside)

    return attack


def _huge(work: Path) -> None:
    """A step entry that claims 2**40 elements, so that reading it whole would allocate 8 TB."""
    metadata = _metadata(work)
    entry = metadata.state_dict_metadata["optimizer.state.weight.step"]
    entry.size = torch.Size([2**40])
    entry.chunks[0].sizes = torch.Size([2**40])
    entry.chunks[0].offsets = torch.Size([0])
    key = next(k for k in metadata.storage_data if k.fqn == "optimizer.state.weight.step")
    metadata.storage_data[MetadataIndex(key.fqn, [0])] = metadata.storage_data.pop(key)
    _write(work, metadata)


ATTACKS: dict[str, tuple[Callable[[Path], object], bool]] = {  # attack, loads as the reference
    "pickle-global": (lambda w: (w / ".metadata").write_bytes(pickle.dumps(_Run())), False),
    "pickle-inside-metadata": (_payload_inside, False),
    "needed-entry-as-bytes": (_needed_as_bytes, False),
    "unneeded-bytes-entry": (_unneeded_bytes_payload, True),
    "blob-payload": (_blob_payload, False),
    "relative-path-up": (_relative_path("../../outside.distcp"), False),
    "relative-path-absolute": (_relative_path("/etc/passwd"), False),
    "relative-path-nested": (_relative_path("sub/__0_0.distcp"), False),
    "symlink-data-file": (_symlink("__1_0.distcp"), False),
    "symlink-metadata": (_symlink(".metadata"), False),
    "directory-for-data-file": (lambda w: _replace_by_directory(w / "__0_0.distcp"), False),
    "fifo-for-metadata": (lambda w: _replace_by_fifo(w / ".metadata"), False),
    "huge-entry": (_huge, False),
}
UNSAFE = {
    "pickle-global",
    "pickle-inside-metadata",
    "needed-entry-as-bytes",
    "relative-path-up",
    "relative-path-absolute",
    "relative-path-nested",
    "symlink-data-file",
    "symlink-metadata",
    "fifo-for-metadata",
}


def _replace_by_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _replace_by_fifo(path: Path) -> None:
    """A FIFO that nobody writes: opening it for reading would wait forever."""
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_payloads_never_run_and_nothing_outside_is_read(saved, work, attack):
    mutate, loads = ATTACKS[attack]
    mutate(work)
    if loads:
        assert _same(_load(work), saved[1])
    else:
        with pytest.raises(CheckpointError) as info:
            _load(work)
        assert isinstance(info.value, UnsafeCheckpointError) == (attack in UNSAFE), info.value
        assert attack != "huge-entry" or "which cannot hold it" in str(info.value)
    assert not MARKER.exists()


def _shares_bytes(work: Path) -> None:
    """exp_avg_sq's chunks point at exp_avg's bytes (the audit's two_entries_share_bytes)."""
    metadata = _metadata(work)
    for key, info in metadata.storage_data.items():
        if key.fqn == "optimizer.state.weight.exp_avg_sq":
            source = metadata.storage_data[MetadataIndex(key.fqn[:-3], key.offset)]
            info.relative_path, info.offset = source.relative_path, source.offset
            info.length = source.length
    _write(work, metadata)


def _as_chunk(make: Callable[[], Any]) -> Callable[[Path], None]:
    """model.weight's chunk at (0, 0), a (3, 3) float64 tensor, replaced by ``make()`` (a blob, or
    a value to ``torch.save``)."""

    def attack(work: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sparse tensors are beta
            value = make()
            blob = value if isinstance(value, bytes) else tampering.saved_blob(value)
        tampering.point_dcp_entry(work, "model.weight", blob)

    return attack


def _records(data_pkl: bytes | None = None) -> bytes:
    """A (3, 3) chunk's archive with its data.pkl replaced, or else its data record deflated."""

    def change(name: str, data: bytes) -> tuple[bytes, int]:
        if data_pkl is not None and name.endswith("data.pkl"):
            return data_pkl, zipfile.ZIP_STORED
        if data_pkl is None and name.endswith("data/0"):
            return data + bytes(4 << 20), zipfile.ZIP_DEFLATED  # 4 MiB in 4 KB, inflated by load
        return data, zipfile.ZIP_STORED

    return tampering.with_records(tampering.saved_blob(_zeros(3, 3)), change)


def _zeros(*shape: int, device: str = "cpu") -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.float64, device=device)


CRAFTED: dict[str, tuple[Callable[[Path], object], str]] = {  # the audit's cases
    "two-entries-share-bytes": (
        _shares_bytes,
        "at (0, 0) share bytes of __0_0.distcp; every chunk",
    ),
    "metadata-hash-bomb": (
        lambda w: (w / ".metadata").write_bytes(tampering.hash_bomb()),
        ".metadata: a pickle of 402 opcodes whose objects unfold to more than",
    ),
    "chunk-hash-bomb": (
        _as_chunk(lambda: _records(tampering.hash_bomb())),
        "data.pkl': a pickle of 402 opcodes whose objects unfold to more than",
    ),
    "chunk-deflated": (_as_chunk(_records), "data/0' is compressed; torch.save stores its records"),
    "chunk-parameter": (
        _as_chunk(lambda: torch.nn.Parameter(_zeros(3, 3))),
        "(0, 0): a Parameter, not a plain tensor",
    ),
    "chunk-sparse": (_as_chunk(lambda: _zeros(3, 3).to_sparse()), "a torch.sparse_coo tensor"),
    "chunk-meta": (_as_chunk(lambda: _zeros(3, 3, device="meta")), "(0, 0): a tensor on meta"),
    "chunk-expanded": (
        _as_chunk(lambda: _zeros(1, 3).expand(3, 3)),
        "strides (0, 1) over storage of 24 bytes do not cover its 72 bytes once",
    ),
    "chunk-view-of-more-storage": (
        _as_chunk(lambda: _zeros(6, 3)[::2]),
        "strides (6, 1) over storage of 144 bytes do not cover its 72 bytes once",
    ),
}


@pytest.mark.parametrize("kind", sorted(CRAFTED))
def test_crafted_metadata_and_chunks_are_refused_at_once(work, kind):
    """load_dcp checks metadata and chunks as fs.checkpoint.load does (``check_pickle``,
    ``load_tensor``, no shared bytes), in well under a second; hash bombs would take hours."""
    attack, message = CRAFTED[kind]
    attack(work)
    start = time.monotonic()
    error = UnsafeCheckpointError if kind == "two-entries-share-bytes" else CorruptCheckpointError
    with pytest.raises(error) as info:
        _load(work)
    assert time.monotonic() - start < 1.0
    assert message in str(info.value), info.value


def test_the_reference_is_what_fsdp2_saved(saved):
    directory, loaded = saved
    kinds = {k: type(v).__name__ for k, v in _metadata(directory).state_dict_metadata.items()}
    assert kinds[PICKLED] == "BytesStorageMetadata"  # a pickle that load_dcp never opens
    assert sorted(p.name for p in directory.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert loaded["state.weight.step"].item() == 1.0


def test_a_rank_that_cannot_read_its_part_fails_the_load_everywhere(saved, work, pools):
    """At W=2 only rank 1 reads the second chunk: damaged, rank 1 raises and rank 0 learns why."""
    info = _storage(work, "model.weight")  # rank 0's chunk; rank 1's is the other one
    other = next(
        v for k, v in _metadata(work).storage_data.items() if k.fqn == "model.weight" and v != info
    )
    _splice(work / other.relative_path, other.offset, b"\0" * 64)
    rank0, rank1 = pools.run(2, fsdp2_runs.load_small_outcome, str(work))
    assert rank1.startswith("CorruptCheckpointError: ")
    assert "not a torch.save archive" in rank1  # refused before torch.load reads it
    assert rank0.startswith("CorruptCheckpointError: ")
    assert "loading failed on rank 1" in rank0
