"""Reading safetensors sharded equals ``fs.shard`` of the whole tensors, and reads only each rank's slices.

References: ``fs.shard_for_rank`` of the full tensors (every rank, in one process) and,
for Hugging Face checkpoints, ``functionalize(AutoModelForCausalLM.from_pretrained(dir))``
in one process, bit for bit. A failure names the rank and flat buffer, the leaf, or the
rejected file. Untrusted input (index, headers) is refused with the fix in the message.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import funcshard as fs
from funcshard._src.interop.safetensors_io import load_safetensors_for_rank
from funcshard._src.shard.shard import shard_for_rank
from funcshard._src.shard.sharded import flats_of
from funcshard.interop import functionalize, load_safetensors
from tests.interop.hf_configs import tiny_llama_config

pytestmark = pytest.mark.interop

VOCAB = 64


def llama(seed: int = 0, *, tied: bool = True) -> Any:
    """A 2-layer LlamaForCausalLM of hidden size 32 (one frozen norm), weights drawn from ``seed``."""
    import transformers

    config = tiny_llama_config(vocab=VOCAB, tied=tied)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.get_parameter("model.layers.0.post_attention_layernorm.weight").requires_grad_(False)
    return model


def gpt2(seed: int = 0) -> Any:
    """A 2-layer GPT2LMHeadModel of width 32 (tied embeddings), weights drawn from ``seed``."""
    import transformers

    config = transformers.GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


MODELS = {"llama": (llama, "LlamaDecoderLayer"), "gpt2": (gpt2, "GPT2Block")}


def _full(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(7, 5, generator=g),  # 7 rows: padded at W=2 and 4
        "blocks": [{"w": torch.randn(3, 6, generator=g), "b": torch.randn(3, generator=g)}],
        "scale": torch.randn((), generator=g),
        "step": torch.arange(5),
    }


def _write(tmp: Path, full: dict[str, Any], name: str = "w.safetensors", **kw: Any) -> Path:
    paths, leaves, _ = fs.tree.flatten_with_paths(full)
    tensors = {
        p.replace("/", "."): t.to(kw.get("dtype", t.dtype)) if t.is_floating_point() else t
        for p, t in zip(paths, leaves)
    }
    save_file(tensors, str(tmp / name))
    return tmp / name


def _assert_same_shards(got: Any, want: Any, where: str) -> None:
    for a, b in zip(flats_of(got), flats_of(want), strict=True):
        assert a.layout == b.layout, where
        assert torch.equal(a.data, b.data), f"{where}: flat buffer of unit {a.layout.unit!r}"


@pytest.mark.parametrize(
    ("mesh", "strategy", "layout"),
    [
        ({"fsdp": 1}, "full_shard", "leaf"),
        ({"fsdp": 2}, "full_shard", "leaf"),
        ({"fsdp": 4}, "full_shard", "leaf"),
        ({"dp": 2, "fsdp": 2}, "hybrid_shard", "leaf"),
        ({"fsdp": 2}, "no_shard", "leaf"),
        ({"fsdp": 4}, "full_shard", "flat"),  # ranges cut inside leaves: read as boxes
        ({"dp": 2, "fsdp": 2}, "hybrid_shard", "flat"),
    ],
)
def test_every_rank_reads_what_shard_keeps(tmp_path, mesh, strategy, layout):
    """Padding, scalars, an integer leaf, units and replicas: each rank's flat buffers equal shard's."""
    full = _full()
    file = _write(tmp_path, full)
    plan = fs.plan(full, fs.Mesh(mesh), units=["blocks/*"], strategy=strategy, layout=layout)
    for rank in range(plan.mesh.size):
        got = load_safetensors_for_rank(file, plan, rank)
        _assert_same_shards(got, shard_for_rank(full, plan, rank), f"rank {rank}")


def test_floating_leaves_are_cast_to_the_plans_dtype(tmp_path):
    full = _full()
    file = _write(tmp_path, full, dtype=torch.bfloat16)
    plan = fs.plan(full, fs.Mesh({"fsdp": 2}))
    cast = fs.tree.map(lambda t: t.bfloat16().to(t.dtype) if t.is_floating_point() else t, full)
    for rank in range(2):
        _assert_same_shards(
            load_safetensors_for_rank(file, plan, rank),
            shard_for_rank(cast, plan, rank),
            f"rank {rank}",
        )


def test_files_lists_directories_and_indexes_read_alike(tmp_path):
    full = _full()
    plan = fs.plan(full, fs.Mesh({"fsdp": 1}))
    want = shard_for_rank(full, plan, 0)
    one = tmp_path / "one"
    one.mkdir()
    _write(one, full, "model.safetensors")
    split = tmp_path / "split"
    split.mkdir()
    save_file({"embed": full["embed"], "scale": full["scale"]}, str(split / "a.safetensors"))
    save_file(
        {
            "blocks.0.w": full["blocks"][0]["w"],
            "blocks.0.b": full["blocks"][0]["b"],
            "step": full["step"],
        },
        str(split / "b.safetensors"),
    )
    weight_map = {"embed": "a.safetensors", "scale": "a.safetensors"}
    weight_map |= dict.fromkeys(["blocks.0.w", "blocks.0.b", "step"], "b.safetensors")
    (split / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    for source in (
        one,
        one / "model.safetensors",
        split,
        split / "model.safetensors.index.json",
        [split / "a.safetensors", str(split / "b.safetensors")],
    ):
        _assert_same_shards(load_safetensors(source, plan), want, str(source))


def test_names_map_leaves_to_tensors_and_the_first_present_is_read(tmp_path):
    full = {"head": torch.randn(4, 2), "norm": torch.ones(2)}
    save_file(
        {"model.norm.weight": full["norm"], "tied.b": full["head"]}, str(tmp_path / "x.safetensors")
    )
    plan = fs.plan(full, fs.Mesh({"fsdp": 1}))
    names = {"head": ["tied.a", "tied.b"], "norm": "model.norm.weight"}
    got = load_safetensors(tmp_path / "x.safetensors", plan, names=names)
    _assert_same_shards(got, shard_for_rank(full, plan, 0), "names")
    with pytest.raises(ValueError, match=r"names maps \['nrom'\], which are not leaf paths"):
        load_safetensors(tmp_path / "x.safetensors", plan, names={"nrom": "x"})


def test_missing_unexpected_and_mismatched_tensors_name_the_key_and_the_fix(tmp_path):
    full = _full()
    plan = fs.plan(full, fs.Mesh({"fsdp": 1}))
    file = _write(tmp_path, {**full, "extra": {"rotary": torch.ones(2)}})
    with pytest.raises(
        ValueError,
        match=r"holds tensors that no leaf is named by: extra\.rotary; pass ignore_unexpected=\['extra\.rotary', \.\.\.\]",
    ):
        load_safetensors(file, plan)
    for ignore in (["extra.*"], ["*rotary"], [__import__("re").compile(r"rot")]):
        load_safetensors(file, plan, ignore_unexpected=ignore)
    lacking = _write(
        tmp_path, {k: v for k, v in full.items() if k != "scale"}, "lacking.safetensors"
    )
    with pytest.raises(ValueError, match=r"lacks scale \(as 'scale'\) .*pass names=\{path: \["):
        load_safetensors(lacking, plan)
    bad = _write(tmp_path, {**full, "embed": torch.zeros(5, 7)}, "bad.safetensors")
    with pytest.raises(
        ValueError, match=r"'embed' is \[5, 7\] in the files, but embed is \[7, 5\]"
    ):
        load_safetensors(bad, plan)
    ints = _write(tmp_path, {**full, "scale": torch.tensor(3)}, "ints.safetensors")
    with pytest.raises(
        ValueError, match=r"'scale' is int64 in the files, but scale stores float32"
    ):
        load_safetensors(ints, plan)
    with pytest.raises(ValueError, match=r"has 2 ranks but the world size is 1"):
        load_safetensors(file, fs.plan(full, fs.Mesh({"fsdp": 2})))


_ENTRY = {"w": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 24]}}


def _index(directory: Path, weight_map: Any, **extra: Any) -> Path:
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map, **extra})
    )
    return directory


def test_an_index_may_name_only_files_beside_it(tmp_path):
    """No ``..``, no absolute path, no symlink out of the directory (but into a HF cache's blobs)."""
    full = {"w": torch.ones(2)}
    plan = fs.plan(full, fs.Mesh({"fsdp": 1}))
    outside = tmp_path / "outside.safetensors"
    save_file(full, str(outside))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name, match in [
        (
            "../outside.safetensors",
            r"names the file '\.\./outside\.safetensors', which is not a plain file name; refusing",
        ),
        (str(outside), r"which is not a plain file name; refusing"),
        ("..", r"not a plain file name"),
        (
            "link.safetensors",
            r"'link\.safetensors' links to .*outside\.safetensors, outside .*ckpt; refusing",
        ),
        ("absent.safetensors", r"names 'absent\.safetensors', which is not a file in"),
    ]:
        (ckpt / "link.safetensors").unlink(missing_ok=True)
        os.symlink(outside, ckpt / "link.safetensors")
        with pytest.raises(ValueError, match=match):
            load_safetensors(_index(ckpt, {"w": name}), plan)
    os.symlink(ckpt / "link.safetensors", ckpt / "inner.safetensors")  # a link to a link out
    with pytest.raises(ValueError, match=r"links to .*outside"):
        load_safetensors(_index(ckpt, {"w": "inner.safetensors"}), plan)
    cache = tmp_path / "models--x--y"
    (cache / "blobs").mkdir(parents=True)
    (cache / "snapshots" / "abc").mkdir(parents=True)
    save_file(full, str(cache / "blobs" / "0123"))
    os.symlink("../../blobs/0123", cache / "snapshots" / "abc" / "model.safetensors")
    assert torch.equal(
        load_safetensors(cache / "snapshots" / "abc", plan)["w"].local, torch.ones(2)
    )


def test_malformed_indexes_and_headers_are_refused(tmp_path):
    full = {"w": torch.ones(2)}
    plan = fs.plan(full, fs.Mesh({"fsdp": 1}))
    save_file({"w": torch.ones(2), "v": torch.ones(1)}, str(tmp_path / "a.safetensors"))
    for content, match in [
        ("{not json", r"index\.json: not valid JSON"),
        ('{"weight_map": {}, "metadata": {"total_size": 1e400}}', r"metadata\.total_size is 1e400"),
        ('{"weight_map": ' + "[" * 5000 + "]" * 5000 + "}", r"index\.json: nested more than 64"),
        (
            '{"weight_map": {"w": "a.safetensors"}, "weight_map": {}}',
            r"the key 'weight_map' appears twice",
        ),
        ('{"weight_map": {"w": NaN}}', r"weight_map\.w is NaN, not a finite number"),
        ("[1, 2]", r"not a safetensors index"),
        ('{"weight_map": {"w": 3}}', r"weight_map\['w'\] is 3, not a file name"),
        (
            '{"weight_map": {"w": "a.safetensors", "u": "a.safetensors"}}',
            r"puts 'u' in 'a\.safetensors', which does not hold it; the index is stale",
        ),
        (
            '{"weight_map": {"w": "a.safetensors"}}',
            r"'a\.safetensors' holds 'v', which weight_map omits",
        ),
    ]:
        (tmp_path / "model.safetensors.index.json").write_text(content)
        with pytest.raises(ValueError, match=match):
            load_safetensors(tmp_path, plan)

    def header(h: Any, data: bytes = b"", raw: bytes | None = None) -> Path:
        text = raw if raw is not None else json.dumps(h).encode()
        (tmp_path / "h.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data)
        return tmp_path / "h.safetensors"

    good = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    for args, match in [
        (
            ({"w": {**good, "dtype": "F4"}}, bytes(8)),
            r"tensor 'w': dtype 'F4' cannot be represented in torch",
        ),
        (
            ({"w": {**good, "data_offsets": [0, 4]}}, bytes(4)),
            r"data_offsets \[0, 4\] hold 4 bytes, but \[2\] float32 needs 8",
        ),
        (
            ({"w": good, "v": {**good, "data_offsets": [4, 12]}}, bytes(12)),
            r"starts at byte 4 of the data, not 8: tensors overlap",
        ),
        (({"w": good}, bytes(12)), r"the tensors hold 8 bytes, the data is 12"),
        (
            ({"w": {**good, "shape": [-2]}}, bytes(8)),
            r"shape \[-2\] or data_offsets \[0, 8\] malformed",
        ),
        (({"w": {**good, "code": "x"}}, bytes(8)), r"malformed header entry"),
        (({"__metadata__": {"format": 1}}, b""), r"malformed header entry"),
        ((None, b"", b'{"w": '), r"the header: not valid JSON"),
        ((None, b"", b"\xff\xfe"), r"the header is not UTF-8 without a byte-order mark"),
        (
            (None, b"", b'{"w": {"dtype": "F32", "shape": [1e400]}}'),
            r"the header: w\.shape\[0\] is 1e400",
        ),
        (([1],), r"the header is not a JSON object"),
    ]:
        with pytest.raises(ValueError, match=match):
            load_safetensors(header(*args), plan)
    (tmp_path / "short.safetensors").write_bytes(b"\x10\x00")
    (tmp_path / "long.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    for name in ("short", "long"):
        with pytest.raises(ValueError, match=r"not a safetensors file \(its header length field"):
            load_safetensors(tmp_path / f"{name}.safetensors", plan)
    with pytest.raises(ValueError, match=r"no such file"):
        load_safetensors(tmp_path / "absent.safetensors", plan)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        ValueError, match=r"holds neither model\.safetensors nor model\.safetensors\.index\.json"
    ):
        load_safetensors(empty, plan)


class _Tied(torch.nn.Module):
    """Tied weights, a frozen weight, a persistent and a non-persistent buffer."""

    _keys_to_ignore_on_load_unexpected = [r"^legacy\."]  # noqa: RUF012 (as Hugging Face writes it)

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.BatchNorm1d(4)
        self.norm.weight.requires_grad_(False)
        self.register_buffer("inv_freq", torch.ones(2), persistent=False)


@pytest.mark.parametrize(
    "header",
    [b"\xef\xbb\xbf" + json.dumps(_ENTRY).encode(), json.dumps(_ENTRY).encode("utf-16")],
    ids=["utf-8-bom", "utf-16"],
)
def test_a_header_that_is_not_plain_utf8_is_refused(tmp_path, header):
    """json.loads on bytes took a BOM or UTF-16; safetensors then raised a bare SafetensorError."""
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 24)
    plan = fs.plan({"w": torch.empty(3, 2, device="meta")}, fs.Mesh({"fsdp": 1}))
    with pytest.raises(ValueError, match="the header is not UTF-8 without a byte-order mark"):
        load_safetensors(path, plan)


def test_a_fifo_in_place_of_a_file_is_refused_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "w.safetensors")
    plan = fs.plan({"w": torch.empty(3, 2, device="meta")}, fs.Mesh({"fsdp": 1}))
    with pytest.raises(ValueError, match=r"w\.safetensors: not a regular file \(a fifo\)"):
        load_safetensors(tmp_path / "w.safetensors", plan)


def test_load_pretrained_reads_any_tied_name_buffers_in_place_and_skips_what_hf_skips(tmp_path):
    source = _Tied()
    with torch.no_grad():
        for t in [*source.parameters(), *source.buffers()]:
            t.copy_(torch.randn(t.shape).to(t.dtype) if t.is_floating_point() else t + 7)
    saved = {k: v for k, v in source.state_dict().items() if k != "embed.weight"}  # tied: one name
    save_file(
        {**saved, "inv_freq": torch.zeros(2), "legacy.x": torch.zeros(1)},
        str(tmp_path / "model.safetensors"),
    )
    params, apply = functionalize(_Tied())
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), frozen=apply.frozen)
    sparams = apply.load_pretrained(tmp_path, plan)
    got = apply.state_dict(fs.unshard(sparams))
    for key, value in source.state_dict().items():
        assert torch.equal(got[key], value), key
    assert torch.equal(
        apply.state["norm"]["running_var"], source.get_buffer("norm.running_var")
    )  # in place
    assert torch.equal(apply.state["inv_freq"], torch.ones(2))  # not persistent: not read
    save_file({**saved, "rogue": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no leaf is named by: rogue; pass ignore_unexpected="):
        apply.load_pretrained(tmp_path, plan)
    apply.load_pretrained(tmp_path, plan, ignore_unexpected=["rog*"])
    del saved["norm.running_mean"]
    save_file(saved, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"lacks buffer norm\.running_mean .*check that the checkpoint is of _Tied"
    ):
        apply.load_pretrained(tmp_path, plan)
    with pytest.raises(ValueError, match=r"the plan is not of _Tied's params"):
        apply.load_pretrained(tmp_path, fs.plan({"w": torch.ones(1)}, fs.Mesh({"fsdp": 1})))


def _load_hf(kind: str, directory: str) -> Any:
    build, unit = MODELS[kind]
    params, apply = functionalize(build(seed=1), units=[unit])  # other values than the file's
    plan = fs.plan(
        params, fs.Mesh({"fsdp": fs.world_size()}), units=apply.units, frozen=apply.frozen
    )
    return fs.unshard(apply.load_pretrained(directory, plan))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_load_pretrained_at_w2_equals_from_pretrained(pools, tmp_path, kind):
    """A checkpoint of several files and an index, as Hugging Face writes it (tied weights once)."""
    transformers = pytest.importorskip("transformers", reason="Hugging Face is the `hf` extra")
    MODELS[kind][0]().save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    reference, _ = functionalize(transformers.AutoModelForCausalLM.from_pretrained(tmp_path))
    for rank, got in enumerate(pools.run(2, _load_hf, kind, str(tmp_path))):
        for path, a, b in zip(
            fs.tree.leaf_paths(got), fs.tree.leaves(got), fs.tree.leaves(reference), strict=True
        ):
            assert torch.equal(a, b), f"rank {rank}: {path}"


def _reads(directory: str) -> tuple[list[Any], list[Any], int]:
    """The slices this rank asked safetensors for, those it keeps, and the checkpoint's bytes."""
    import safetensors

    asked: list[Any] = []
    real = safetensors.safe_open

    class Slice:
        def __init__(self, inner: Any, key: str) -> None:
            self.inner, self.key = inner, key

        def __getitem__(self, index: Any) -> torch.Tensor:
            out = self.inner[index]
            shape = self.inner.get_shape()
            asked.append((self.key, [s.indices(n)[:2] for s, n in zip(index, shape)], out.nbytes))
            return out

    class Opened:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = real(*args, **kwargs)

        def __enter__(self) -> Opened:
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.inner.__exit__(*exc)

        def get_slice(self, key: str) -> Slice:
            return Slice(self.handle.get_slice(key), key)

        def get_tensor(self, key: str) -> torch.Tensor:
            asked.append((key, "whole", 0))
            return self.handle.get_tensor(key)

    params, apply = functionalize(llama(seed=1), units=["LlamaDecoderLayer"])
    plan = fs.plan(
        params, fs.Mesh({"fsdp": fs.world_size()}), units=apply.units, frozen=apply.frozen
    )
    safetensors.safe_open = Opened
    try:
        apply.load_pretrained(directory, plan)
    finally:
        safetensors.safe_open = real
    names = {leaf.path: leaf.path.replace("/", ".") for leaf in plan.leaves}
    sharded = shard_for_rank(params, plan, fs.rank())
    kept = [
        (
            names[t.path],
            [s.indices(n)[:2] for s, n in zip(t.sharding.local_index(t.shape, fs.rank()), t.shape)],
        )
        for t in fs.tree.leaves(sharded)
        if t.local.numel() > 0
    ]
    return asked, kept, sum(p.nbytes for p in fs.tree.leaves(params))


def test_each_rank_reads_only_its_slices(pools, tmp_path):
    """Every read is a slice a rank keeps, of about 1/W of the bytes; no whole leaf is read."""
    llama().save_pretrained(tmp_path, max_shard_size="20KB")
    results = pools.run(2, _reads, str(tmp_path))
    for rank, (asked, kept, total) in enumerate(results):
        assert sorted((key, rows) for key, rows, _ in asked) == sorted(kept), f"rank {rank}"
        assert not [a for a in asked if a[1] == "whole"], f"rank {rank} read whole tensors"
        read = sum(n for _, _, n in asked)
        assert 0.45 < read / total < 0.55, f"rank {rank} read {read} of {total} bytes"


def test_base_and_head_checkpoints_load_across_base_model_prefix(tmp_path):
    """As from_pretrained: a LlamaModel checkpoint into LlamaForCausalLM (tied head), and one of
    LlamaForCausalLM into LlamaModel, whose head is then unexpected unless ignored."""
    import transformers

    head = llama(seed=3, tied=True)
    head.model.save_pretrained(tmp_path / "base")  # keys without "model."
    params, apply = functionalize(llama(seed=4, tied=True))
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), frozen=apply.frozen)
    got = apply.state_dict(fs.unshard(apply.load_pretrained(tmp_path / "base", plan)))
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base").state_dict()
    assert set(got) == set(theirs)
    for key, value in theirs.items():
        assert torch.equal(got[key], value), key

    untied = llama(seed=5, tied=False)
    untied.save_pretrained(tmp_path / "head")  # keys with "model.", and lm_head.weight
    params, apply = functionalize(transformers.LlamaModel(untied.config))
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}))
    with pytest.raises(ValueError, match=r"no leaf is named by: lm_head\.weight; pass ignore_"):
        apply.load_pretrained(tmp_path / "head", plan)
    sparams = apply.load_pretrained(tmp_path / "head", plan, ignore_unexpected=["lm_head.*"])
    got = apply.state_dict(fs.unshard(sparams))
    for key, value in untied.model.state_dict().items():
        assert torch.equal(got[key], value), key


def test_tied_names_that_hold_different_tensors_are_refused(tmp_path):
    """A leaf read under one of two names whose tensors differ would drop the other silently;
    from_pretrained would untie them, so funcshard refuses (equal tensors load)."""
    full = {"head": torch.randn(4, 2), "norm": torch.ones(2)}
    plan = fs.plan(full, fs.Mesh({"fsdp": 1}))
    names = {"head": ["tied.a", "tied.b"], "norm": "n"}
    save_file(
        {"n": full["norm"], "tied.a": full["head"], "tied.b": full["head"].clone()},
        str(tmp_path / "same.safetensors"),
    )
    got = load_safetensors(tmp_path / "same.safetensors", plan, names=names)
    _assert_same_shards(got, shard_for_rank(full, plan, 0), "equal tied tensors")
    for other in (full["head"] + 1, full["head"].double(), full["head"][:2].clone()):
        save_file(
            {"n": full["norm"], "tied.a": full["head"], "tied.b": other},
            str(tmp_path / "x.safetensors"),
        )
        with pytest.raises(
            ValueError,
            match=r"head: the checkpoint holds both 'tied\.a' and 'tied\.b', which the model ties",
        ):
            load_safetensors(tmp_path / "x.safetensors", plan, names=names)


def test_load_pretrained_refuses_a_checkpoint_whose_tied_weights_differ(tmp_path):
    model = llama(seed=0, tied=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1  # both names, two values
    save_file(state, str(tmp_path / "model.safetensors"))
    params, apply = functionalize(llama(seed=1, tied=True), units=["LlamaDecoderLayer"])
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
    with pytest.raises(
        ValueError, match=r"holds both 'model\.embed_tokens\.weight' and 'lm_head\.weight'"
    ):
        apply.load_pretrained(tmp_path, plan)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = apply.load_pretrained(tmp_path, plan)
    assert torch.equal(
        loaded["model"]["embed_tokens"]["weight"].local, state["model.embed_tokens.weight"]
    )
