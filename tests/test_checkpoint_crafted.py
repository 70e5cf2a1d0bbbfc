"""Checkpoints crafted by an attacker who recomputes every digest: refused before anything is allocated.

Reference: the checkpoint as saved (``load_full`` of the untouched copy). Every
case rewrites the files as the ``tests/tampering.py`` helpers do (the manifest's
digest, each ``.metadata``'s size and SHA-256 and the chunks' SHA-256 recomputed),
so only funcshard's checks of the contents stand between the file and harm: a
``CheckpointError`` naming the file and the field, raised by ``load_full`` and by
``load``, or exactly the saved values. A failure names the check that let a
crafted file through (see docs/failures.md).
"""

from __future__ import annotations

import json
import pickle
import shutil
import time
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import funcshard as fs
from funcshard.checkpoint import CorruptCheckpointError, UnsafeCheckpointError
from tests import tampering

W = torch.arange(12.0).reshape(4, 3)
KEY = "params/w@0,0"


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """One process's checkpoint: a sharded leaf, a plain tensor, a value and the RNG states."""
    params = {"w": W.clone()}
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1})))
    state = {"params": sparams, "table": torch.ones(2, 2), "step": 3}
    return fs.checkpoint.save(tmp_path / "ckpt", state, step=3)


def _like() -> Any:
    params = {"w": torch.zeros(4, 3)}
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1})))
    return {"params": sparams, "table": torch.zeros(2, 2), "step": 0}


def _refused(directory: Path, error: type[Exception], *parts: str) -> None:
    """Both readers raise ``error`` with every one of ``parts`` in the message; no generator changes."""
    before = torch.get_rng_state()
    for load in (
        lambda: fs.checkpoint.load_full(directory),
        lambda: fs.checkpoint.load(directory, like=_like()),
    ):
        with pytest.raises(error) as info:
            load()
        for part in parts:
            assert part in str(info.value), str(info.value)
    assert torch.equal(torch.get_rng_state(), before)


def _quietly(make: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():  # torch warns that sparse CSR and quantized tensors are beta
        warnings.simplefilter("ignore")
        return make()


# -- the chunk's tensor itself: a plain dense tensor of the declared dtype and shape ----------

CHUNKS: dict[str, Callable[[], Any]] = {
    "parameter": lambda: torch.nn.Parameter(W.clone()),
    "requires-grad": lambda: W.clone().requires_grad_(),
    "sparse-coo": lambda: W.to_sparse(),
    "sparse-csr": lambda: _quietly(lambda: W.to_sparse_csr()),
    "meta": lambda: torch.empty(4, 3, device="meta"),
    "quantized": lambda: _quietly(lambda: torch.quantize_per_tensor(W, 0.1, 0, torch.qint8)),
    "expanded": lambda: torch.zeros(1, 3).expand(4, 3),  # zero strides over one row
    "a view of more storage": lambda: torch.arange(24.0).reshape(8, 3)[::2],
    "a storage offset": lambda: torch.arange(13.0)[1:].reshape(4, 3),
    "another dtype": lambda: W.double(),
    "another shape": lambda: W.reshape(3, 4),
    "not a tensor": lambda: {"w": W},
}


@pytest.mark.parametrize("kind", sorted(CHUNKS))
def test_a_chunk_that_is_not_a_plain_dense_tensor_is_refused(ckpt, kind):
    blob = _quietly(lambda: tampering.saved_blob(CHUNKS[kind]()))
    tampering.replace_blobs(ckpt, 0, {KEY: (blob, torch.float32, (4, 3))})
    _refused(ckpt, CorruptCheckpointError, "rank0/__0_0.distcp", f"chunk {KEY!r}")


def test_a_transposed_chunk_that_covers_its_bytes_once_loads_exactly(ckpt):
    tampering.rewrite_chunks(ckpt, 0, {KEY: W.T.contiguous().T})  # strides (1, 4): dense
    assert torch.equal(fs.checkpoint.load_full(ckpt)["params"]["w"], W)
    assert torch.equal(fs.checkpoint.load(ckpt, like=_like())["params"]["w"].local, W)


# -- pickles whose unpickling would never end (See [Note: pickles checked before they are unpickled] in ``untrusted_pickle.py``)


def _refused_at_once(directory: Path, *parts: str) -> None:
    start = time.monotonic()
    _refused(directory, CorruptCheckpointError, *parts, "unfold to more than")
    assert time.monotonic() - start < 1.0  # both readers; unpickled, hours each


def test_a_metadata_hash_bomb_is_refused_at_once(ckpt):
    """~800 bytes whose 64**6 memo-reused tuples are a dict key (the audit's metadata_hashbomb)."""
    tampering.replace_file(ckpt, "rank0/.metadata", tampering.hash_bomb())
    _refused_at_once(ckpt, "rank0/.metadata: a pickle of 402 opcodes")


def test_a_chunk_whose_data_pkl_is_a_hash_bomb_is_refused_at_once(ckpt):
    """The chunk's torch.save archive with its data.pkl replaced; ``torch.load(weights_only=True)``
    would hash the tuples before any check of the tensor (the audit's chunk_hashbomb)."""
    bomb = tampering.hash_bomb()
    blob = tampering.with_records(
        tampering.saved_blob(W.clone()),
        lambda name, data: (bomb if name.endswith("data.pkl") else data, zipfile.ZIP_STORED),
    )
    tampering.replace_blobs(ckpt, 0, {KEY: (blob, torch.float32, (4, 3))})
    _refused_at_once(ckpt, "rank0/__0_0.distcp", f"chunk {KEY!r}", "data.pkl'")


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def _cycle() -> list[Any]:
    value: list[Any] = []
    value.append(value)
    return value


PICKLES: dict[str, tuple[bytes, str]] = {
    "nested-150-deep": (pickle.dumps(_nested(150)), "objects nest more than 100 deep"),
    "a-cycle": (pickle.dumps(_cycle()), "objects contain themselves"),
    "memo-never-stored": (b"\x80\x02h\x05.", "reads memo entry 5, which it never stored"),
    "no-mark": (b"\x80\x02t.", "TUPLE finds no mark"),
    "below-the-mark": (b"\x80\x02K\x01(\x85.", "TUPLE1 reads below the stack's bottom"),
    "truncated": (b"\x80\x02X\xff\xff", "not a pickle (ValueError: "),
    # MetadataIndex.__hash__ = None for the whole process: BUILD's slot state sets a class's
    # attributes, and the allowlist admits the class
    "class-poisoning": (
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadataIndex\nN}X\x08\x00\x00\x00"
        b"__hash__Ns\x86b.",
        "BUILD fills or changes a leaf or a class",
    ),
}


@pytest.mark.parametrize("kind", sorted(PICKLES))
def test_a_metadata_pickle_that_check_pickle_refuses(ckpt, kind):
    data, message = PICKLES[kind]
    tampering.replace_file(ckpt, "rank0/.metadata", data)
    _refused(ckpt, CorruptCheckpointError, "rank0/.metadata: ", message)
    assert MetadataIndex.__hash__ is not None


# -- declared sizes that the files do not hold --------------------------------------------


def _declare_huge(
    directory: Path,
    entry_of: Callable[[dict[str, Any]], dict[str, Any]],
    key: str,
    dtype: torch.dtype,
) -> None:
    """Declares the entry of ``key`` 2**20 x 2**20 (4 TiB of float32; the RNG states 1 x 2**40
    bytes) in one chunk of 1.5 KB: a zero-stride tensor that ``weights_only`` loads; every
    digest recomputed."""
    shape: tuple[int, ...] = (1, 2**40) if dtype == torch.uint8 else (2**20, 2**20)
    new_key = key.split("@")[0] + "@0,0"

    def change(m: dict[str, Any]) -> None:
        entry = entry_of(m)
        entry["shape"] = list(shape)
        entry["chunks"] = [dict(entry["chunks"][0], key=new_key, offsets=[0, 0], sizes=list(shape))]

    tampering.edit(directory, change)
    blob = tampering.saved_blob(torch.zeros(1, dtype=dtype).expand(*shape))
    assert len(blob) < 2000
    tampering.replace_blobs(directory, 0, {key: None, new_key: (blob, dtype, shape)})


def test_a_leaf_declared_larger_than_its_file_is_refused_before_allocation(ckpt):
    _declare_huge(
        ckpt,
        lambda m: next(e for e in m["leaves"] if e["path"] == "table"),
        "table@0,0",
        torch.float32,
    )
    with pytest.raises(
        UnsafeCheckpointError, match=r"holding the 4398046511104 bytes of that tensor"
    ):
        fs.checkpoint.load_full(ckpt)


def test_rng_states_declared_larger_than_their_file_are_refused_before_allocation(ckpt):
    _declare_huge(ckpt, lambda m: m["rng"], "<rng>@0,0", torch.uint8)
    like = {"params": _like()["params"], "table": torch.zeros(2, 2), "step": 0}
    with pytest.raises(
        UnsafeCheckpointError, match=r"entry '<rng>@0,0'.*holding the 1099511627776 bytes"
    ):
        fs.checkpoint.load(ckpt, like=like)  # the default load restores the RNGs


def test_two_chunks_that_share_bytes_are_refused(tmp_path):
    state = {"a": torch.ones(4), "b": torch.ones(4)}
    directory = fs.checkpoint.save(tmp_path / "c", state, rng=False)
    blobs = tampering.read_blobs(directory, 0)
    tampering.write_blobs(directory, 0, dict.fromkeys(blobs, (blobs["a@0"], torch.float32, (4,))))
    # the attacker points both entries at one blob: write_blobs lays them out twice; make them one
    from funcshard._src.checkpoint.dcp_io import metadata_unpickler

    with open(directory / "rank0/.metadata", "rb") as f:
        metadata = metadata_unpickler(f).load()
    for info in metadata.storage_data.values():
        info.offset = 0
    tampering.replace_file(directory, "rank0/.metadata", pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match=r"share bytes of __0_0.distcp"):
        fs.checkpoint.load_full(directory)


# -- DCP metadata made of allowlisted classes, without their fields ------------------------


def _bare(cls: type, **fields: Any) -> Any:
    """An instance of ``cls`` built without ``__init__``, with only ``fields`` set: it pickles as
    NEWOBJ of an allowlisted class, with no state or only this state."""
    obj = cls.__new__(cls)  # pyright: ignore[reportCallIssue]
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    return obj


class _ShortProperties:
    """Pickles as ``TensorProperties`` whose state is one field of the five it sets."""

    def __reduce__(self) -> Any:
        return (TensorProperties, (torch.float32,), (torch.float32,))


def _entry() -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size([4, 3]),
        [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 3]))],
    )


METADATA: dict[str, Callable[[Any], Any]] = {
    "metadata-without-fields": lambda info: _bare(Metadata),
    "entry-without-fields": lambda info: _bare(
        Metadata, state_dict_metadata={KEY: _bare(TensorStorageMetadata)}, storage_data={}
    ),
    "properties-of-another-shape": lambda info: _bare(
        Metadata,
        state_dict_metadata={
            KEY: _bare(
                TensorStorageMetadata, properties=_ShortProperties(), size=torch.Size([4, 3])
            )
        },
        storage_data={},
    ),
    "storage-without-fields": lambda info: _bare(
        Metadata,
        state_dict_metadata={KEY: _entry()},
        storage_data={MetadataIndex(KEY, torch.Size([0, 0]), 0): _bare(_StorageInfo)},
    ),
    "storage-of-strings": lambda info: _bare(
        Metadata,
        state_dict_metadata={KEY: _entry()},
        storage_data={
            MetadataIndex(KEY, torch.Size([0, 0]), 0): _bare(
                _StorageInfo, relative_path="__0_0.distcp", offset="0", length="9"
            )
        },
    ),
}


@pytest.mark.parametrize("kind", sorted(METADATA))
def test_metadata_of_allowlisted_classes_without_their_fields_is_refused(ckpt, kind):
    from funcshard._src.checkpoint.dcp_io import metadata_unpickler

    with open(ckpt / "rank0/.metadata", "rb") as f:
        info = next(iter(metadata_unpickler(f).load().storage_data.values()))
    tampering.replace_file(ckpt, "rank0/.metadata", pickle.dumps(METADATA[kind](info)))
    _refused(ckpt, CorruptCheckpointError, "rank0")


# -- the manifest: strict JSON, no symlink, no dtype that is not plain data -----------------


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ('"step":3', '"step":1e400', "step is 1e400"),
        ('"step":3', '"step":-1e999', "step is -1e999"),
        ('"step":3', '"step":NaN', "step is NaN"),
        ('"world_size":1', '"world_size":Infinity', "world_size is Infinity"),
    ],
)
def test_numbers_that_are_not_finite_are_refused_naming_the_field(ckpt, old, new, field):
    text = (ckpt / "manifest.json").read_text()
    assert old in text
    (ckpt / "manifest.json").write_text(text.replace(old, new))
    _refused(ckpt, CorruptCheckpointError, "manifest.json", field)


@pytest.mark.parametrize("depth", [300, 100_000])
def test_a_deeply_nested_manifest_is_refused(ckpt, depth):
    manifest = tampering.read(ckpt)
    text = json.dumps(manifest)
    nested = "[" * depth + "]" * depth
    (ckpt / "manifest.json").write_text(text[:-1] + f', "extra": {nested}}}')
    _refused(ckpt, CorruptCheckpointError, "manifest.json", "nested more than 256")


@pytest.mark.parametrize("dtype", ["qint8", "quint4x2", "bits8", "int4", "float4_e2m1fn_x2"])
def test_a_dtype_that_is_not_plain_data_is_refused(ckpt, dtype):
    tampering.edit(
        ckpt, lambda m: next(e for e in m["leaves"] if e["path"] == "table").update(dtype=dtype)
    )
    _refused(ckpt, CorruptCheckpointError, "manifest.json", "not a dtype of plain dense data")


def _outside_copy(ckpt: Path, name: str) -> Path:
    outside = ckpt.parent / f"outside-{name.replace('/', '-')}"
    if (ckpt / name).is_dir():
        shutil.copytree(ckpt / name, outside)
        shutil.rmtree(ckpt / name)
    else:
        shutil.copy(ckpt / name, outside)
        (ckpt / name).unlink()
    return outside


@pytest.mark.parametrize(
    "name", ["manifest.json", "rank0", "rank0/__0_0.distcp", "rank0/.metadata"]
)
@pytest.mark.parametrize("where", ["outside", "inside"])
def test_no_symlink_anywhere_in_a_checkpoint(ckpt, name, where):
    target = _outside_copy(ckpt, name)
    if where == "inside":  # a link that stays inside is refused too: a checkpoint holds none
        inner = ckpt / f"moved-{target.name}"
        shutil.move(target, inner)
        target = inner
    (ckpt / name).symlink_to(target, target_is_directory=target.is_dir())
    _refused(ckpt, UnsafeCheckpointError, "symlink")


def test_latest_refuses_a_symlinked_manifest_rather_than_reading_it(ckpt):
    target = _outside_copy(ckpt, "manifest.json")
    (ckpt / "manifest.json").symlink_to(target)
    with pytest.raises(UnsafeCheckpointError, match=r"symlink"):
        fs.checkpoint.latest(ckpt.parent)


def test_the_untouched_checkpoint_loads(ckpt):
    """The reference: without tampering, both readers return the saved values."""
    assert torch.equal(fs.checkpoint.load_full(ckpt)["params"]["w"], W)
    assert torch.equal(fs.checkpoint.load(ckpt, like=_like())["params"]["w"].local, W)
