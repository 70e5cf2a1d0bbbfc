"""A damaged or crafted checkpoint loads exactly or fails with a CheckpointError; it never runs code.

Reference: the checkpoint as saved at W=2 (``load_full`` and ``load`` into a
single-process ``like`` before any mutation). Every mutation of the manifest
and of each rank's DCP ``.metadata`` — every field, every byte region, random
bytes — ends in a :class:`CheckpointError` subclass or in a result equal to the
reference (leaf types and values exactly, tensors bit for bit); where the
mutation changes a saved value itself, equal to the reference with that value.
"Damaged" mutations leave the digests as they were; "crafted" ones recompute
every digest, as an attacker would, so only funcshard's checks of the contents
stand in the way. Payloads that would run code create a marker file, which
must never appear.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcshard as fs
from funcshard._src import tree
from funcshard.checkpoint import CheckpointError, UnsafeCheckpointError
from tests import tampering

MARKER = Path(tempfile.gettempdir()) / f"funcshard-fuzz-marker-{os.getpid()}"


def _state(world: int, seed: int) -> Any:
    """Every kind of leaf: sharded float32, bfloat16 and int64 (two chunks each at W=2), a
    namedtuple node, plain tensors (one chunk, written by rank 0) and JSON scalars."""
    gen = torch.Generator().manual_seed(seed)
    params = {
        "w": torch.randn(4, 3, generator=gen),
        "h": torch.randn(5, generator=gen).to(torch.bfloat16),
        "i": torch.randint(0, 9, (6,), generator=gen),
    }
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": world})))
    return {
        "params": sparams,
        "opt": fs.optim.sgd(lr=0.1, momentum=0.9).init(sparams),
        "step": 3,
        "lr": 0.5,
        "name": "run-a",
        "flag": True,
        "table": torch.randint(0, 9, (2, 3), generator=gen),
        "scale": torch.tensor(1.5),
    }


def _save(directory: str) -> None:
    state = _state(fs.world_size(), seed=1)
    state["opt"].momentum["w"].local.add_(1.0)  # a state that differs from its init
    fs.checkpoint.save(directory, state, step=3)


@functools.cache
def _like() -> Any:
    """What loads ask for, in this process (other values: everything must come from the checkpoint)."""
    return _state(1, seed=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, pools) -> tuple[Path, Any, Any]:
    """A checkpoint written by two ranks, and what it loads as before any mutation."""
    directory = tmp_path_factory.mktemp("fuzz") / "ckpt"
    pools.run(2, _save, str(directory))
    full = fs.checkpoint.load_full(directory)
    into = fs.unshard(fs.checkpoint.load(directory, like=_like()))
    return directory, full, into


def _same(actual: Any, expected: Any) -> bool:
    """Equal structure, leaf types and values; tensors bit for bit."""
    a_paths, a_leaves, a_def = tree.flatten_with_paths(actual)
    _, b_leaves, b_def = tree.flatten_with_paths(expected)
    if a_def != b_def:
        return False
    for a, b in zip(a_leaves, b_leaves):
        if type(a) is not type(b):
            return False
        if isinstance(a, torch.Tensor):
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                return False
        elif a != b:
            return False
    return bool(a_paths) or True


def _outcome(directory: Path, full: Any, into: Any, changed: dict[str, Any]) -> None:
    """Loading ``directory`` either fails with a CheckpointError or equals the reference.

    ``changed`` maps a leaf path to the value a mutation put in the checkpoint itself.
    """

    def with_changes(reference: Any) -> Any:
        paths, leaves, treedef = tree.flatten_with_paths(reference)
        return tree.unflatten(treedef, [changed.get(p, x) for p, x in zip(paths, leaves)])

    for load, reference in (
        (lambda: fs.checkpoint.load_full(directory), full),
        (lambda: fs.unshard(fs.checkpoint.load(directory, like=_like())), into),
    ):
        try:
            result = load()
        except CheckpointError:
            continue
        assert _same(result, with_changes(reference)), "a mutated checkpoint loaded a wrong value"
    assert not MARKER.exists(), "a payload in the checkpoint ran"


@pytest.fixture
def copy_of(saved, tmp_path) -> Callable[[], Path]:
    def make() -> Path:
        target = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(saved[0], target)
        return target

    return make


# -- every field of the manifest ----------------------------------------------------


def _field_paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _field_paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _field_paths(v, (*prefix, i))


REPLACEMENTS: list[Any] = [
    *(None, -1, 0, 1, 2**63, 1.5, "", "x", True),
    *("../../outside", "/etc/passwd", "x/../../victim/*", "qint8"),
    *([], {}, [[[[[]]]]], {"leaf": None}, {"namedtuple": "os:system", "children": []}),
]


def _repeats(manifest: dict[str, Any]) -> set[int]:
    """Indices of leaf entries whose kind, dtype and value type an earlier entry already has.

    Their fields are read by the same code as the earlier entry's, so mutating them
    again adds time and no case; every distinct kind of entry is still mutated.
    """
    seen: set[tuple[Any, ...]] = set()
    repeats = set()
    for i, leaf in enumerate(manifest["leaves"]):
        kind = (leaf.get("kind"), leaf.get("dtype"), type(leaf.get("value")).__name__)
        if kind in seen:
            repeats.add(i)
        seen.add(kind)
    return repeats


def _mutations(manifest: dict[str, Any]) -> Iterator[tuple[tuple[Any, ...], str, Any]]:
    repeats = _repeats(manifest)
    for path in _field_paths(manifest):
        if not path or (len(path) > 1 and path[0] == "leaves" and path[1] in repeats):
            continue
        yield path, "delete", None
        for value in REPLACEMENTS:
            yield path, "replace", value
        current = _get(manifest, path)
        if isinstance(current, int) and not isinstance(current, bool):
            yield path, "replace", current + 1


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        node = node[key]
    return node


def _apply(manifest: dict[str, Any], path: tuple[Any, ...], how: str, value: Any) -> None:
    parent = _get(manifest, path[:-1])
    if how == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = copy.deepcopy(value)


def test_every_field_of_the_manifest_crafted(saved, tmp_path):
    """Every field deleted or replaced (with the manifest's digest recomputed).

    Leaf entries of a kind already mutated are skipped (``_repeats``).
    """
    directory, full, into = saved
    original = tampering.read(directory)
    work = tmp_path / "work"
    shutil.copytree(directory, work)
    count = 0
    for path, how, value in _mutations(original):
        manifest = copy.deepcopy(original)
        _apply(manifest, path, how, value)
        tampering.write(work, manifest)
        changed: dict[str, Any] = {}
        if len(path) == 3 and path[0] == "leaves" and path[2] == "value" and how == "replace":
            changed[original["leaves"][path[1]]["path"]] = value  # the checkpoint now says so
        _outcome(work, full, into, changed)
        count += 1
    assert count > 1000  # every field, many ways


@settings(max_examples=150)
@given(data=st.data())
def test_random_bytes_of_the_manifest_damaged(saved, data):
    directory, full, into = saved
    raw = (directory / "manifest.json").read_bytes()
    mutated = data.draw(_byte_mutations(raw))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "ckpt"
        shutil.copytree(directory, work)
        (work / "manifest.json").write_bytes(mutated)
        _outcome(work, full, into, {})


# -- every byte region of each rank's metadata --------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("crafted", [False, True], ids=["damaged", "crafted"])
def test_every_byte_region_of_the_metadata(saved, tmp_path, rank, crafted):
    directory, full, into = saved
    name = f"rank{rank}/.metadata"
    raw = (directory / name).read_bytes()
    work = tmp_path / "work"
    shutil.copytree(directory, work)
    for start in range(0, len(raw), 8):
        mutated = bytearray(raw)
        for i in range(start, min(start + 8, len(raw))):
            mutated[i] ^= 0xA5
        if crafted:
            shutil.copy(directory / "manifest.json", work / "manifest.json")
            tampering.replace_file(work, name, bytes(mutated))
        else:
            (work / name).write_bytes(bytes(mutated))
        _outcome(work, full, into, {})


@settings(max_examples=150)
@given(data=st.data(), rank=st.sampled_from([0, 1]), crafted=st.booleans())
def test_random_bytes_of_the_metadata(saved, data, rank, crafted):
    directory, full, into = saved
    name = f"rank{rank}/.metadata"
    mutated = data.draw(_byte_mutations((directory / name).read_bytes()))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "ckpt"
        shutil.copytree(directory, work)
        if crafted:
            tampering.replace_file(work, name, mutated)
        else:
            (work / name).write_bytes(mutated)
        _outcome(work, full, into, {})


@st.composite
def _byte_mutations(draw: st.DrawFn, raw: bytes) -> bytes:
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


# -- payloads: what an attacker would try to run code or read outside ---------------


class _Run:
    """Pickles to a call of ``os.system`` that creates the marker."""

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {MARKER}",))


def _metadata(work: Path, rank: int) -> Any:
    from funcshard._src.checkpoint.dcp_io import metadata_unpickler

    with open(work / f"rank{rank}/.metadata", "rb") as f:
        return metadata_unpickler(f).load()


def _bytes_entry(work: Path) -> None:
    """Declares the first chunk as bytes storage, whose blob is a pickle that runs the payload."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = _metadata(work, 0)
    key = next(iter(metadata.state_dict_metadata))
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    tampering.replace_file(work, "rank0/.metadata", pickle.dumps(metadata))
    data = work / "rank0/__0_0.distcp"
    data.write_bytes(pickle.dumps(_Run()) + data.read_bytes())
    tampering.edit(
        work, lambda m: m["files"]["rank0/__0_0.distcp"].update(size=data.stat().st_size)
    )


def _blob_payload(work: Path) -> None:
    """Replaces a chunk's torch.save blob with a pickle that runs the payload."""
    metadata = _metadata(work, 0)
    index, info = next(iter(metadata.storage_data.items()))
    data = work / "rank0/__0_0.distcp"
    raw = bytearray(data.read_bytes())
    payload = pickle.dumps(_Run())
    raw[info.offset : info.offset + len(payload)] = payload
    data.write_bytes(bytes(raw))
    del index


def _relative_path(target: str) -> Callable[[Path], None]:
    def attack(work: Path) -> None:
        metadata = _metadata(work, 0)
        for info in metadata.storage_data.values():
            info.relative_path = target
        tampering.replace_file(work, "rank0/.metadata", pickle.dumps(metadata))

    return attack


def _file_name(name: str) -> Callable[[Path], None]:
    def attack(work: Path) -> None:
        def change(m: dict[str, Any]) -> None:
            m["files"][name] = m["files"].pop("rank0/__0_0.distcp")

        tampering.edit(work, change)

    return attack


def _symlink(work: Path) -> None:
    outside = work.parent / "outside"
    shutil.move(work / "rank1", outside)
    (work / "rank1").symlink_to(outside, target_is_directory=True)


def _tree_type(node: dict[str, Any]) -> Callable[[Path], None]:
    def attack(work: Path) -> None:
        tampering.edit(work, lambda m: m.update(tree={"dict": [["x", node]]}))

    return attack


def _manifest_symlink(work: Path) -> None:
    outside = work.parent / f"{work.name}-manifest.json"
    shutil.move(work / "manifest.json", outside)
    (work / "manifest.json").symlink_to(outside)


def _rank_dir_symlink_inside(work: Path) -> None:
    shutil.move(work / "rank1", work / "moved")
    (work / "rank1").symlink_to(work / "moved", target_is_directory=True)


def _chunk(value: Callable[[Any], Any]) -> Callable[[Path], None]:
    """Replaces rank 0's first chunk with ``value(its tensor)``, saved as it is, digests recomputed."""

    def attack(work: Path) -> None:
        key, (dtype, shape) = next(
            (k, v) for k, v in tampering.declared(work, 0).items() if len(v[1]) == 2
        )
        plain = torch.zeros(shape, dtype=dtype)
        tampering.replace_blobs(work, 0, {key: (tampering.saved_blob(value(plain)), dtype, shape)})

    return attack


def _declared_huge(work: Path) -> None:
    """A plain tensor declared 2**20 x 2**20 in a 1.5 KB zero-stride chunk, digests recomputed."""
    shape = (2**20, 2**20)

    def change(m: dict[str, Any]) -> None:
        entry = next(e for e in m["leaves"] if e["path"] == "table")
        entry.update(shape=list(shape))
        entry["chunks"] = [dict(entry["chunks"][0], sizes=list(shape))]

    tampering.edit(work, change)
    blob = tampering.saved_blob(torch.zeros(1, dtype=torch.int64).expand(*shape))
    tampering.replace_blobs(work, 0, {"table@0,0": (blob, torch.int64, shape)})


ATTACKS: dict[str, Callable[[Path], None]] = {
    "pickle-global": lambda w: tampering.replace_file(w, "rank0/.metadata", pickle.dumps(_Run())),
    "bytes-storage": _bytes_entry,
    "blob-payload": _blob_payload,
    "relative-path-up": _relative_path("../../outside.distcp"),
    "relative-path-absolute": _relative_path("/etc/passwd"),
    "file-name-up": _file_name("rank0/../../outside"),
    "file-name-absolute": _file_name("/etc/passwd"),
    "symlink-outside": _symlink,
    "tree-namedtuple": _tree_type({"namedtuple": "os:system", "children": [{"leaf": None}]}),
    "tree-defaultdict": _tree_type({"defaultdict": [], "factory": "os:system"}),
    "tree-dataclass": _tree_type({"dataclass": "subprocess:Popen", "meta": [], "children": []}),
    "manifest-symlink": _manifest_symlink,
    "rank-dir-symlink-inside": _rank_dir_symlink_inside,
    "run-outside": lambda w: tampering.edit(w, lambda m: m.update(run="x/../../victim/*")),
    "declared-huge": _declared_huge,
    "chunk-parameter": _chunk(torch.nn.Parameter),
    "chunk-expanded": _chunk(lambda t: t.reshape(-1)[:1].expand(t.shape)),
    "chunk-sparse": _chunk(lambda t: t.to_sparse()),
    "chunk-meta": _chunk(lambda t: t.to("meta")),
}
CORRUPT_ONLY = ("blob-payload", "chunk-parameter", "chunk-expanded", "chunk-sparse", "chunk-meta")


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_payloads_never_run_and_nothing_outside_is_read(saved, copy_of, attack):
    into = saved[2]
    work = copy_of()
    ATTACKS[attack](work)
    with pytest.raises(CheckpointError) as info:
        fs.checkpoint.load_full(work)
    if attack.startswith("tree-"):  # load takes the structure from `like`, not from the file
        assert _same(fs.unshard(fs.checkpoint.load(work, like=_like())), into)
    else:  # load compares shapes with `like` first: the declared-huge leaf is a mismatch there
        with pytest.raises(CheckpointError if attack == "declared-huge" else type(info.value)):
            fs.checkpoint.load(work, like=_like())
    if attack not in CORRUPT_ONLY and not attack.startswith("tree-"):
        assert isinstance(info.value, UnsafeCheckpointError), info.value
    assert "is not known to funcshard" in str(info.value) or not attack.startswith("tree-")
    assert not MARKER.exists()


def test_the_reference_itself_loads(saved):
    directory, full, into = saved
    assert full["step"] == 3
    assert full["flag"] is True
    assert full["params"]["h"].dtype == torch.bfloat16
    assert _same(into["params"], full["params"])
    assert json.loads((directory / "manifest.json").read_text())["world_size"] == 2
