"""Presets: published parameter counts, leaf shapes and paths, meta-only building, plans, activations.

The counts are pinned integers: the Hugging Face model's, instantiated on the meta
device from the public config (``tests/interop/test_presets_hf.py`` recomputes them
leaf by leaf), which are the published totals where those are exact (LLaMA). A
failure names the preset and the quantity.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import funcshard as fs
from funcshard._src import tree
from funcshard._src.plan.activations import activation_bytes
from funcshard._src.plan.model_config import ARCHS, ModelConfig
from funcshard._src.plan.presets import PRESETS, Preset, get_preset

N_PARAMS = {
    "llama-7b": 6_738_415_616,  # LLaMA paper, "6.7B"; HF huggyllama/llama-7b
    "llama-13b": 13_015_864_320,
    "llama-70b": 68_976_648_192,  # Llama 2 70B
    "llama-3-8b": 8_030_261_248,  # Llama 3 8B, the published total (the "8B" of the model card)
    "llama-3-70b": 70_553_706_496,  # Llama 3 70B
    "mistral-7b": 7_241_732_096,  # mistralai/Mistral-7B-v0.1, "7.24B"
    "mixtral-8x7b": 46_702_792_704,  # mistralai/Mixtral-8x7B-v0.1, "46.7B total parameters"
    "qwen2.5-7b": 7_615_616_512,  # Qwen/Qwen2.5-7B, "7.61B"
    "bloom-7b": 7_069_016_064,  # bigscience/bloom-7b1
    "gpt-neox-20b": 20_554_567_680,  # EleutherAI/gpt-neox-20b
    "t5-11b": 11_307_321_344,  # HF T5ForConditionalGeneration, tied lm_head
    "gpt-175b": 174_604_259_328,  # GPT-3 shapes on vocab 50257; the paper rounds to 175.0B
}
# DeepSpeed's largest_layer_params (the most parameters one nn.Module holds directly),
# computed on the Hugging Face models: the embedding everywhere but T5, where it is wi.
LARGEST_LAYER = {
    "llama-7b": 32000 * 4096,
    "llama-13b": 32000 * 5120,
    "llama-70b": 32000 * 8192,
    "llama-3-8b": 128256 * 4096,
    "llama-3-70b": 128256 * 8192,
    "mistral-7b": 32000 * 4096,
    "mixtral-8x7b": 3 * 8 * 4096 * 14336,  # transformers 5: one module holds every expert
    "qwen2.5-7b": 152064 * 3584,
    "bloom-7b": 250880 * 4096,
    "gpt-neox-20b": 50432 * 6144,
    "t5-11b": 1024 * 65536,
    "gpt-175b": 50257 * 12288,
}


def test_the_presets_are_the_published_models():
    """Reference: the task's list; a failure names a preset added or dropped without its count."""
    assert sorted(PRESETS) == sorted(N_PARAMS)
    assert all(name == p.name == name.lower() for name, p in PRESETS.items())


@pytest.mark.parametrize("name", sorted(N_PARAMS))
def test_parameter_counts_are_exact(name: str):
    """Reference: the published / Hugging Face count; a failure names the preset's shapes."""
    preset = PRESETS[name]
    assert preset.n_params == N_PARAMS[name]
    assert sum(leaf.numel() for leaf in tree.leaves(preset.params())) == N_PARAMS[name]
    assert preset.largest_layer_params == LARGEST_LAYER[name]


@pytest.mark.parametrize("name", sorted(N_PARAMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_params_are_meta_tensors_of_the_dtype(name: str, dtype: torch.dtype):
    """Building allocates nothing: every leaf lives on the meta device, in the dtype asked for."""
    leaves = tree.leaves(PRESETS[name].params(dtype=dtype))
    assert all(isinstance(x, torch.Tensor) and x.is_meta for x in leaves)
    assert {x.dtype for x in leaves} == {dtype}


def test_the_default_dtype_is_float32_and_other_arguments_are_refused():
    preset = get_preset("llama-7b")
    assert tree.leaves(preset.params())[0].dtype == torch.float32
    with pytest.raises(TypeError, match=r"llama-7b: dtype must be a torch\.dtype"):
        preset.params(dtype="bfloat16")  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("name", sorted(N_PARAMS))
def test_plan_over_eight_ranks_is_fast(name: str):
    """fs.plan reads the meta pytree: one unit per block plus the root, in well under 2 s."""
    preset = PRESETS[name]
    params = preset.params(dtype=torch.bfloat16)
    start = time.perf_counter()
    plan = fs.plan(params, fs.Mesh({"fsdp": 8}), units=[preset.unit_pattern])
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"{name}: planning took {elapsed:.2f}s"
    assert plan.units[0].is_root
    assert len(plan.units) == preset.config.n_layers + 1
    assert sum(leaf.numel for leaf in plan.leaves) == preset.n_params


def test_building_every_preset_is_fast():
    """No tensor is materialised, so all twelve (465B parameters) build in well under a second."""
    start = time.perf_counter()
    for preset in PRESETS.values():
        preset.params()
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    ("name", "path", "shape"),
    [
        ("llama-7b", "layers/31/attn/wq", (4096, 4096)),
        ("llama-7b", "layers/0/mlp/w3", (4096, 11008)),
        ("llama-7b", "head/w", (4096, 32000)),
        ("llama-70b", "layers/0/attn/wk", (8192, 1024)),  # 8 kv heads of 128
        ("llama-70b", "layers/79/mlp/w2", (28672, 8192)),
        ("llama-3-8b", "layers/0/attn/wk", (4096, 1024)),  # 8 kv heads of 128
        ("llama-3-8b", "head/w", (4096, 128256)),
        ("llama-3-70b", "embed/tokens", (128256, 8192)),
        ("mistral-7b", "layers/31/mlp/w1", (4096, 14336)),
        ("mixtral-8x7b", "layers/0/mlp/router", (4096, 8)),
        ("mixtral-8x7b", "layers/31/mlp/experts/w13", (8, 4096, 2 * 14336)),
        ("mixtral-8x7b", "layers/31/mlp/experts/w2", (8, 14336, 4096)),
        ("qwen2.5-7b", "layers/27/attn/bk", (512,)),  # 4 kv heads of 128, with biases
        ("qwen2.5-7b", "layers/0/attn/bq", (3584,)),
        ("bloom-7b", "embed/norm/bias", (4096,)),
        ("bloom-7b", "layers/29/attn/bqkv", (12288,)),
        ("gpt-neox-20b", "layers/43/attn/wqkv", (6144, 18432)),
        ("gpt-neox-20b", "head/w", (6144, 50432)),
        ("t5-11b", "encoder/layers/0/attn/rel_bias", (32, 128)),
        ("t5-11b", "decoder/layers/0/attn/rel_bias", (32, 128)),
        ("t5-11b", "decoder/layers/23/cross/wo", (16384, 1024)),
        ("t5-11b", "encoder/layers/5/mlp/w1", (1024, 65536)),
        ("gpt-175b", "embed/pos", (2048, 12288)),
        ("gpt-175b", "layers/95/mlp/b1", (49152,)),
    ],
)
def test_leaf_paths_and_shapes(name: str, path: str, shape: tuple[int, ...]):
    """Reference: the module docstring's path vocabulary and each model's config.json."""
    paths, leaves, _ = tree.flatten_with_paths(PRESETS[name].params())
    assert tuple(dict(zip(paths, leaves))[path].shape) == shape


@pytest.mark.parametrize(
    ("name", "absent"),
    [
        ("bloom-7b", "head/w"),  # tied to embed/tokens
        ("gpt-175b", "head/w"),
        ("t5-11b", "head/w"),
        ("llama-7b", "layers/0/attn/bqkv"),  # no biases
        ("llama-3-8b", "layers/0/attn/bq"),
        ("qwen2.5-7b", "layers/0/attn/bo"),  # Qwen2: biases on q, k and v only
        ("mixtral-8x7b", "layers/0/mlp/w1"),  # the experts hold the MLP
        ("t5-11b", "encoder/layers/1/attn/rel_bias"),  # only the first layer of a stack
        ("t5-11b", "encoder/layers/0/cross/wq"),  # cross-attention is the decoder's
    ],
)
def test_leaves_the_model_does_not_have(name: str, absent: str):
    assert absent not in tree.leaf_paths(PRESETS[name].params())


def test_t5_units_cover_both_stacks():
    """One pattern, ``*/layers/*``, makes each encoder and decoder block a unit."""
    preset = get_preset("t5-11b")
    plan = fs.plan(preset.params(), fs.Mesh({"fsdp": 4}), units=[preset.unit_pattern])
    names = [u.name for u in plan.units]
    assert names[:2] == ["<root>", "decoder/layers/0"]  # dict keys sort: decoder < encoder
    assert sum(n.startswith("encoder/layers/") for n in names) == 24
    assert plan.unit("<root>").paths == ("decoder/norm/scale", "embed/tokens", "encoder/norm/scale")


def test_get_preset_is_case_insensitive_and_suggests_the_closest_name():
    assert get_preset("GPT-NeoX-20B") is PRESETS["gpt-neox-20b"]
    with pytest.raises(
        ValueError, match=r"'llama-8b'; did you mean 'llama-3-8b'\? Known presets: "
    ):
        get_preset("llama-8b")
    with pytest.raises(ValueError, match=r"'llama-6b'; did you mean 'llama-7b'\?"):
        get_preset("llama-6b")
    with pytest.raises(ValueError, match=r"did you mean 't5-11b'.*gpt-175b"):
        get_preset("t5-3b")


def _config(arch: str = "llama", **changes: Any) -> ModelConfig:
    shape = {
        "n_layers": 2,
        "hidden": 8,
        "ffn_hidden": 16,
        "n_heads": 2,
        "n_kv_heads": 2,
        "head_dim": 4,
        "vocab": 10,
        "seq_len": 6,
        "n_encoder_layers": 1 if arch == "t5" else 0,
    }
    return ModelConfig(arch, **(shape | changes))  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize(
    ("arch", "changes", "message"),
    [
        ("bert", {}, "unknown 'bert'"),
        ("llama", {"hidden": 0}, "ModelConfig.hidden must be an int >= 1, got 0"),
        ("llama", {"n_kv_heads": 3}, "n_heads=2 is not a multiple of n_kv_heads=3"),
        ("llama", {"n_encoder_layers": 1}, "only t5 has an encoder"),
        ("t5", {"n_encoder_layers": 2}, "only t5 has an encoder, and it has both stacks"),
        ("llama", {"n_experts": 8}, "n_experts=8 with experts_per_token=0"),
        ("llama", {"n_experts": 2, "experts_per_token": 3}, "routes each token to 1..n_experts"),
        ("llama", {"experts_per_token": 1}, "a dense one has 0 of both"),
        ("gpt", {"n_experts": 2, "experts_per_token": 1}, "options of the llama layout"),
        ("bloom", {"qkv_bias": True}, "options of the llama layout"),
        ("llama", {"qkv_bias": 1}, "qkv_bias must be a bool"),
    ],
)
def test_model_config_refuses_bad_shapes(arch: str, changes: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        _config(arch, **changes)


sizes = st.integers(1, 6)


@st.composite
def configs(draw: st.DrawFn, arch: str | None = None) -> ModelConfig:
    """Small configs of every arch, with grouped-query attention and odd widths."""
    arch = arch or draw(st.sampled_from(ARCHS))
    kv = draw(sizes)
    n_layers = draw(st.integers(2 if arch == "t5" else 1, 5))
    return ModelConfig(
        arch,  # pyright: ignore[reportArgumentType]
        n_layers=n_layers,
        hidden=draw(sizes),
        ffn_hidden=draw(sizes),
        n_heads=kv * draw(st.integers(1, 3)),
        n_kv_heads=kv,
        head_dim=draw(sizes),
        vocab=draw(sizes),
        seq_len=draw(sizes),
        n_encoder_layers=draw(st.integers(1, n_layers - 1)) if arch == "t5" else 0,
        **(_llama_options(draw) if arch == "llama" else {}),
    )


def _llama_options(draw: st.DrawFn) -> dict[str, Any]:
    """Mixture of experts (Mixtral) and q/k/v biases (Qwen2), the llama layout's options."""
    experts = draw(st.sampled_from([0, 0, 1, 4]))
    top_k = draw(st.integers(1, experts)) if experts else 0
    return {"n_experts": experts, "experts_per_token": top_k, "qkv_bias": draw(st.booleans())}


@given(configs())
def test_each_extra_layer_adds_the_same_parameters(cfg: ModelConfig):
    """Invariant: blocks are alike (T5: after the first of each stack), so counts are affine in depth."""
    deeper = [dataclasses.replace(cfg, n_layers=cfg.n_layers + k) for k in range(3)]
    counts = [Preset("x", c).n_params for c in deeper]  # one more block of the last stack each
    assert counts[2] - counts[1] == counts[1] - counts[0] > 0


@given(configs(), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_structure_does_not_depend_on_dtype(cfg: ModelConfig, dtype: torch.dtype):
    preset = Preset("x", cfg)
    paths, leaves, treedef = tree.flatten_with_paths(preset.params(dtype=dtype))
    ref_paths, ref_leaves, ref_treedef = tree.flatten_with_paths(preset.params())
    assert (paths, treedef) == (ref_paths, ref_treedef)
    assert [x.shape for x in leaves] == [x.shape for x in ref_leaves]


@given(configs(arch="gpt"))
def test_gpt_count_is_the_textbook_formula(cfg: ModelConfig):
    """Reference: V*h + S*h + L*(4h*(attn) + 2hF + biases) + 2h, i.e. 12h²L + 13hL for F = 4h."""
    h, f, qkv = cfg.hidden, cfg.ffn_hidden, cfg.attn_dim + 2 * cfg.kv_dim
    layer = h * qkv + qkv + cfg.attn_dim * h + h + 2 * h * f + f + h + 4 * h
    expected = cfg.vocab * h + cfg.seq_len * h + cfg.n_layers * layer + 2 * h
    assert Preset("x", cfg).n_params == expected


@given(configs(arch="llama"))
def test_llama_count_is_the_textbook_formula(cfg: ModelConfig):
    """Reference: 2Vh + h + L*(h*(2*attn_dim + 2*kv_dim) + 3hF + 2h); with E experts the MLP
    is E*3hF plus a router hE; q/k/v biases add attn_dim + 2*kv_dim."""
    h, e = cfg.hidden, cfg.n_experts
    mlp = e * 3 * h * cfg.ffn_hidden + h * e if e else 3 * h * cfg.ffn_hidden
    biases = cfg.attn_dim + 2 * cfg.kv_dim if cfg.qkv_bias else 0
    layer = h * (2 * cfg.attn_dim + 2 * cfg.kv_dim) + mlp + 2 * h + biases
    assert Preset("x", cfg).n_params == 2 * cfg.vocab * h + h + cfg.n_layers * layer


@given(configs())
def test_largest_layer_is_one_leaf_with_its_bias(cfg: ModelConfig):
    """Invariant: a layer is a weight and at most one bias, which is no bigger than the weight."""
    preset = Preset("x", cfg)
    biggest = max(x.numel() for x in tree.leaves(preset.params()))
    assert biggest <= preset.largest_layer_params <= 2 * biggest


# --- activations --------------------------------------------------------------


@st.composite
def gpt_configs(draw: st.DrawFn) -> ModelConfig:
    """GPT-style shapes, the case Korthikanti et al. derive: F = 4h, a * head_dim = h, no GQA."""
    heads, head_dim = draw(st.integers(1, 16)), draw(st.integers(1, 128))
    h = heads * head_dim
    layers, seq = draw(st.integers(1, 96)), draw(st.integers(1, 4096))
    return ModelConfig("gpt", layers, h, 4 * h, heads, heads, head_dim, 50, seq)


@given(gpt_configs(), st.integers(1, 64))
def test_activations_are_korthikanti_equation_1(cfg: ModelConfig, batch: int):
    """Reference: Korthikanti et al. 2022, Sec. 4.1: sbh(34 + 5as/h) per layer, 2sbh with full remat."""
    s, b, h, a, n = cfg.seq_len, batch, cfg.hidden, cfg.n_heads, cfg.n_layers
    per_layer = s * b * h * 34 + 5 * a * s * s * b  # sbh(34 + 5as/h), kept in integers
    assert activation_bytes(cfg, batch) == n * per_layer
    assert activation_bytes(cfg, batch, remat=True) == n * 2 * s * b * h + per_layer


@given(configs(), st.integers(1, 8), st.integers(1, 64), st.sampled_from([1, 2, 4]))
def test_activations_are_linear_in_batch_and_remat_keeps_less(
    cfg: ModelConfig, batch: int, seq: int, p: int
):
    for remat in (False, True):
        one = activation_bytes(cfg, 1, seq, dtype_bytes=p, remat=remat)
        assert activation_bytes(cfg, batch, seq, dtype_bytes=p, remat=remat) == batch * one
    if cfg.n_layers >= 2:
        kept = activation_bytes(cfg, batch, seq, dtype_bytes=p, remat=True)
        assert kept < activation_bytes(cfg, batch, seq, dtype_bytes=p)
    assert activation_bytes(cfg, batch, seq, dtype_bytes=4) > activation_bytes(cfg, batch, seq)


def test_activations_of_the_presets():
    """Pinned values; the seq_len default is the model's own (2048, 4096 for Llama 2, 512 for T5)."""
    gpt = get_preset("gpt-175b").config
    assert activation_bytes(gpt, 1) == 96 * 2048 * 12288 * (34 + 80)
    assert activation_bytes(gpt, 1) == activation_bytes(gpt, 1, 2048)
    llama = get_preset("llama-70b").config
    assert activation_bytes(llama, 1) == activation_bytes(llama, 1, 4096)
    t5 = get_preset("t5-11b").config
    s, h, a, f, inner = 512, 1024, 128, 65536, 16384
    attn = 2 * s * (h + 4 * inner) + 4 * a * s * s + s * h + a * s * s
    layer = attn + 2 * s * (h + 2 * f) + s * h + 4 * s * h
    decoder_layer = layer + attn + 2 * s * h
    assert activation_bytes(t5, 1) == 24 * layer + 24 * decoder_layer + 2 * s * h
    assert activation_bytes(t5, 1, remat=True) == 48 * 2 * s * h + decoder_layer + 2 * s * h


@pytest.mark.parametrize(
    ("batch", "seq_len", "dtype_bytes"), [(0, 8, 2), (1, 0, 2), (1, 8, 0), (-1, 8, 2)]
)
def test_activations_refuse_empty_shapes(batch: int, seq_len: int, dtype_bytes: int):
    with pytest.raises(ValueError, match="must be >= 1"):
        activation_bytes(_config(), batch, seq_len, dtype_bytes=dtype_bytes)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_flash_attention_makes_activations_linear_in_the_sequence(name):
    """Without (s, s) scores every term is per token: twice the tokens, twice the bytes."""
    config = get_preset(name).config
    flash = [activation_bytes(config, 2, s, flash_attention=True) for s in (512, 1024)]
    eager = [activation_bytes(config, 2, s) for s in (512, 1024)]
    assert flash[1] == 2 * flash[0]
    assert eager[1] > 2 * eager[0]
    assert flash[0] < eager[0]
    per_token_lse = 4 * config.n_heads * config.n_layers  # the fp32 log-sum-exp of each head
    assert flash[0] >= per_token_lse * 2 * 512
