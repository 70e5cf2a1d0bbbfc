"""What ``funcshard plan`` plans: a preset, or any Hugging Face config built on the meta device.

``--model llama-70b`` takes a preset's parameter tree; ``--hf-config path/config.json``
builds the model that ``transformers`` makes of the config (``AutoModelForCausalLM``,
or ``AutoModelForSeq2SeqLM`` for an encoder-decoder) under ``torch.device("meta")``,
offline and without allocating, and functionalizes it with ``fs.interop.functionalize``,
one unit per decoder layer (the model's ``_no_split_modules``). The config is untrusted
input: see [Note: untrusted configs] in ``hf_config.py`` (strict JSON; every field that
runs or fetches code removed at every depth; dims checked before transformers sees them,
and under its canonical names on the config object before any model is built; a
``model_type`` transformers itself implements).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.cli.hf_config import check_built, read_config, sanitize
from funcshard._src.interop.module import functionalize
from funcshard._src.plan.model_config import ModelConfig
from funcshard._src.plan.presets import Preset, get_preset


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A model to plan: its parameter tree (meta tensors) and what the report says of it.

    Attributes:
        name: the preset's name or the config's ``model_type`` and path.
        params: the parameter pytree, meta tensors in the dtype asked for.
        units: unit patterns for ``fs.plan`` (or ``"auto"``).
        frozen: frozen leaves (``apply.frozen``), for ``fs.plan(frozen=...)``.
        n_params: parameters in all (tied weights once).
        largest_layer_params: DeepSpeed's ``largest_layer_params``: the most
            parameters one module holds directly.
        config: the shapes for activations and FLOPs; ``None`` when unknown.
        module_units: one unit per module that holds parameters directly, as
            DeepSpeed gathers them (``--deepspeed``).
        notes: what the report should say about how the model was read.
    """

    name: str
    params: Any
    units: Sequence[Any] | str
    frozen: Sequence[str]
    n_params: int
    largest_layer_params: int
    config: ModelConfig | None
    module_units: Sequence[Any]
    notes: tuple[str, ...] = ()


def from_preset(
    name: str, /, *, dtype: torch.dtype, units: Sequence[str] | None = None
) -> ModelSource:
    """A preset as a :class:`ModelSource`; ``units`` replaces its one-unit-per-block pattern.

    Example:
        >>> s = from_preset("llama-7b", dtype=torch.bfloat16)
        >>> s.units, s.n_params, len(s.module_units)
        (['layers/*'], 6738415616, 291)
    """
    preset: Preset = get_preset(name)
    params = preset.params(dtype=dtype)
    return ModelSource(
        preset.name,
        params,
        _units(units) if units else [preset.unit_pattern],
        (),
        preset.n_params,
        preset.largest_layer_params,
        preset.config,
        tree.leaf_paths(params),
    )


def from_hf_config(
    path: str | Path, /, *, dtype: torch.dtype, units: Sequence[str] | None = None
) -> ModelSource:
    """The model ``transformers`` builds from ``path`` (a config.json or its folder), on meta.

    Raises:
        ValueError: an unreadable config, a ``model_type`` transformers does not
            implement (remote code is never run), transformers missing, or units that
            name no submodule.
    """
    data = read_config(Path(path))
    try:
        import transformers
        from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
    except ImportError:
        raise ValueError("--hf-config needs transformers: pip install 'funcshard[hf]'") from None
    model_type = data.get("model_type")
    known = transformers.CONFIG_MAPPING
    if not isinstance(model_type, str) or model_type not in known:
        raise ValueError(
            f"--hf-config {path}: model_type {model_type!r} is not one transformers "
            f"{transformers.__version__} implements, and funcshard never runs a config's own "
            f"code (trust_remote_code); use a config of a built-in model_type"
        )
    where = f"--hf-config {path}"
    clean, notes = sanitize(data, where=where, known=known)
    fields = {k: v for k, v in clean.items() if k != "model_type"}
    try:
        config = known[model_type].from_dict(fields)
    except Exception as e:  # whatever transformers raises of a config it cannot read
        raise ValueError(
            f"{where}: transformers cannot build it: {type(e).__name__}: {str(e)[:300]}"
        ) from None
    check_built(config, fields, where=where)  # by transformers' names, before any model
    try:
        auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
        with torch.device("meta"):
            model = auto.from_config(config, trust_remote_code=False)
    except Exception as e:  # whatever transformers raises of a config it cannot build
        raise ValueError(
            f"--hf-config {path}: transformers cannot build it: {type(e).__name__}: {str(e)[:300]}"
        ) from None
    classes = sorted(getattr(model, "_no_split_modules", None) or [])
    wanted: Sequence[Any] = _units(units) if units else classes
    params, apply = functionalize(model, units=[] if wanted == "auto" else wanted)
    params = tree.tree_map(lambda x: x.to(dtype) if x.is_floating_point() else x, params)
    leaves = tree.leaves(params)
    direct = [
        (name.replace(".", "/"), sum(p.numel() for p in m.parameters(recurse=False)))
        for name, m in model.named_modules()
    ]
    holders = [n for n, k in direct if k and n]
    held = set(holders)  # by ancestor, not by pairs: a 1000-layer model has ~10**4 holders
    outer = [n for n in holders if not any(a in held for a in _ancestors(n))]
    name = f"{model_type} ({Path(path).name})"
    shapes = _model_config(config)
    notes.append(
        "activations and FLOPs: no transformer shapes in the config"
        if shapes is None
        else f"activations and FLOPs as a {shapes.arch}-shaped model of its widths"
    )
    return ModelSource(
        name,
        params,
        "auto" if wanted == "auto" else list(apply.units),
        list(apply.frozen),
        sum(x.numel() for x in leaves),
        max(k for _, k in direct),
        shapes,
        outer,
        (*notes, f"built by transformers {transformers.__version__} as {type(model).__name__}"),
    )


def _ancestors(path: str) -> list[str]:
    """``"a/b/c"`` -> ``["a", "a/b"]``."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _units(units: Sequence[str]) -> Sequence[str] | str:
    return "auto" if list(units) == ["auto"] else list(units)


def _first(config: Any, *names: str) -> Any:
    return next((v for n in names if isinstance(v := getattr(config, n, None), int)), None)


def _model_config(config: Any) -> ModelConfig | None:
    """The shapes activations and FLOPs are estimated from, as far as the config gives them."""
    hidden = _first(config, "hidden_size", "d_model", "n_embd")
    heads = _first(config, "num_attention_heads", "n_head", "num_heads")
    if hidden is None or heads is None:
        return None
    enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    enc = _first(config, "num_layers", "encoder_layers") if enc_dec else 0
    dec = _first(config, "num_decoder_layers", "decoder_layers") if enc_dec else None
    layers = (enc or 0) + (dec or enc or 0) if enc_dec else _first(config, "num_hidden_layers")
    experts = _first(config, "num_local_experts", "num_experts") or 0
    gated = str(getattr(config, "hidden_act", "")) in ("silu", "swiglu") and not enc_dec
    try:
        return ModelConfig(
            "t5" if enc_dec else ("llama" if gated else "gpt_neox"),
            layers,
            hidden,
            _first(config, "intermediate_size", "ffn_dim", "d_ff", "n_inner") or 4 * hidden,
            heads,
            (_first(config, "num_key_value_heads") or heads) if gated else heads,
            _first(config, "head_dim", "d_kv") or hidden // heads,
            _first(config, "vocab_size") or 1,
            _first(config, "max_position_embeddings", "n_positions") or 2048,
            n_encoder_layers=enc or 0,
            n_experts=experts if gated else 0,
            experts_per_token=(_first(config, "num_experts_per_tok") or 1)
            if experts and gated
            else 0,
        )
    except (ValueError, TypeError):
        return None
