"""A Hugging Face config read as untrusted input: no field that runs or fetches code, dims checked.

[Note: untrusted configs]
``funcshard plan --hf-config`` hands a config to ``transformers`` only after
:func:`sanitize` has, at every depth (the config itself and every sub-config:
``text_config``, ``decoder``, ...):

- removed every field that makes transformers run or fetch code: ``auto_map`` and
  ``trust_remote_code`` (custom classes), ``custom_pipelines``, the attention and
  experts implementations (a name like ``kernels-community/flash-attn`` is a Hub
  kernel that transformers downloads and imports; planning builds on the meta device
  and needs none), ``use_kernels``/``kernel_config`` and ``quantization_config``
  (quantizers import their own packages);
- refused a sub-config's ``model_type`` that transformers does not implement itself
  (the config's own is refused before, by ``from_hf_config`` in ``model_source.py``);
- checked every dimension it knows by name (:data:`DIMS`): an integer (not a bool or
  a float) in its range, and divisible where the model needs it (the hidden size by
  the heads when no ``head_dim`` is given; the heads by the key/value heads).

Then, once transformers has made the config object (``from_dict``) and before any
model is built, :func:`check_built` checks the same dims on that object under
transformers' canonical names (``num_hidden_layers``, ``hidden_size``, ...), which
``getattr`` maps through the class's ``attribute_map`` to the model's own field
(MPT's ``n_layers``, DistilBERT's ``dim``), for every field the file gave under either
name: no model's spelling of a dim reaches the build unchecked. The layer bound,
:data:`MAX_LAYERS`, keeps a plan to seconds: transformers builds every layer's modules
(on meta, about 3 ms each) and funcshard walks them, ~8 s for 1024 layers; the largest
real models have about 200.

The file itself is read by ``funcshard/_src/untrusted.py`` (strict JSON, at most
:data:`MAX_CONFIG_BYTES`, nested at most 64 deep). Every refusal is a ``ValueError``
naming the file and the field (``decoder.num_attention_heads``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from funcshard._src.untrusted import field_name, read_json

MAX_CONFIG_BYTES = 16 << 20
REMOTE_CODE = ("auto_map", "trust_remote_code", "custom_pipelines")
IMPLEMENTATIONS = (
    "attn_implementation",
    "_attn_implementation",
    "_attn_implementation_internal",
    "_attn_implementation_autoset",
    "experts_implementation",
    "_experts_implementation",
    "_experts_implementation_internal",
    "use_kernels",
    "kernel_config",
)
QUANTIZATION = ("quantization_config",)
_WIDTH = (1, 1 << 20)
_HEADS = (1, 1 << 16)
MAX_LAYERS = 1024  # see [Note: untrusted configs]
_LAYERS = (0, MAX_LAYERS)
_EXPERTS = (0, 1 << 16)
DIMS: Mapping[str, tuple[int, int]] = {
    **dict.fromkeys(
        (
            "hidden_size",
            "n_embd",
            "d_model",
            "intermediate_size",
            "ffn_dim",
            "d_ff",
            "n_inner",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "head_dim",
            "d_kv",
            "kv_channels",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "embedding_size",
            "kv_lora_rank",
            "q_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "hidden_dim",  # DistilBERT's feed-forward width
            "ffn_hidden_size",  # DBRX's ffn_config
        ),
        _WIDTH,
    ),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "num_heads",
            "num_key_value_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "n_head_kv",
            "multi_query_group_num",
            "n_heads",  # MPT, DBRX, DistilBERT
            "kv_n_heads",  # MPT's and DBRX's attn_config
        ),
        _HEADS,
    ),
    **dict.fromkeys(
        (
            "num_hidden_layers",
            "n_layer",
            "num_layers",
            "num_decoder_layers",
            "encoder_layers",
            "decoder_layers",
            "n_layers",  # MPT, DBRX, DistilBERT
            "num_nextn_predict_layers",
        ),
        _LAYERS,
    ),
    **dict.fromkeys(
        (
            "num_local_experts",
            "num_experts",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_shared_experts",
            "moe_topk",
            "moe_num_experts",  # DBRX's ffn_config
            "moe_top_k",
        ),
        _EXPERTS,
    ),
    "vocab_size": (1, 1 << 26),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx"), (1, 1 << 30)),
}


def read_config(path: Path, /) -> dict[str, Any]:
    """The JSON object of the config at ``path`` (a ``config.json`` or its folder).

    Raises:
        ValueError: unreadable, not strict JSON, too large or deep, or not an object.
    """
    file = path / "config.json" if path.is_dir() else path
    data = read_json(file, what=f"--hf-config {file}", max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(data, dict):
        raise ValueError(f"--hf-config {file}: a config is a JSON object of fields")
    return data  # pyright: ignore[reportUnknownVariableType]


def sanitize(
    data: Mapping[str, Any], /, *, where: str, known: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """``data`` without the fields that run or fetch code, its dims checked (see [Note: untrusted configs]).

    Args:
        data: the config's JSON object.
        where: how messages name the file (``--hf-config path``).
        known: the ``model_type`` s transformers implements (``CONFIG_MAPPING``).

    Returns:
        The clean config and notes saying what was removed, for the report.

    Raises:
        ValueError: a sub-config's ``model_type`` transformers does not implement, or a
            dimension of the wrong type, out of range, or not divisible as needed.

    Example:
        >>> clean, notes = sanitize({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2,
        ...     "text_config": {"auto_map": {"AutoModel": "evil.M"}, "attn_implementation": "x/y"}},
        ...     where="config.json", known={"llama": None})
        >>> clean, notes
        ({'model_type': 'llama', 'hidden_size': 8, 'num_attention_heads': 2, 'text_config': {}}, ['remote code in the config (auto_map at text_config) was not run', "attention implementation 'x/y' at text_config ignored (planning builds on the meta device; a Hub kernel is never fetched)"])
    """
    removed: dict[str, list[tuple[str, str, Any]]] = {}
    clean = _clean(dict(data), (), removed, where, known)
    notes: list[str] = []
    if removed.get("code"):
        places = ", ".join(sorted({f"{k} at {p}" if p else k for k, p in _named(removed["code"])}))
        notes.append(f"remote code in the config ({places}) was not run")
    for key, place, value in removed.get("implementation", []):
        at = f" at {place}" if place else ""
        if value not in (None, False, {}):
            notes.append(
                f"{'attention' if 'attn' in key else key.strip('_').replace('_', ' ')} "
                f"implementation {str(value)[:80]!r}{at} ignored (planning builds on the meta "
                f"device; a Hub kernel is never fetched)"
                if "implementation" in key
                else f"{key}{at} ignored (no kernel is fetched)"
            )
    if removed.get("quantization"):
        notes.append("quantization_config ignored: the plan is for the dtype given (--param-dtype)")
    return clean, notes


def check_built(config: Any, data: Mapping[str, Any], /, *, where: str) -> None:
    """The dims of ``config``, the object transformers made of ``data``, by their canonical names.

    For every name in :data:`DIMS` that ``data`` gives, itself or as the model's own
    name for it (``config.attribute_map``: MPT's ``n_layers`` for ``num_hidden_layers``),
    the value transformers keeps must be in range, at every depth (sub-configs). Call it
    before any model is built: a dim out of range would build for hours.

    Raises:
        ValueError: a dim of the wrong type, out of range, or not divisible as needed;
            the message names the file's field, transformers' name and the range.

    Example:
        >>> from types import SimpleNamespace as Config
        >>> mpt = Config(attribute_map={"num_hidden_layers": "n_layers"}, num_hidden_layers=10**9)
        >>> check_built(mpt, {"n_layers": 10**9}, where="config.json")
        Traceback (most recent call last):
        ...
        ValueError: config.json: n_layers (transformers' num_hidden_layers) is 1000000000; it must be an integer in [0, 1024]
    """
    _check_built(config, data, (), where)


def _check_built(config: Any, data: Mapping[str, Any], path: tuple[Any, ...], where: str) -> None:
    own: Mapping[str, str] = getattr(config, "attribute_map", None) or {}
    given: dict[str, Any] = {}
    for name in DIMS:
        raw = own.get(name, name)
        if raw not in data and name not in data:
            continue  # transformers' own default
        value = _attribute(config, name)
        label = name if raw == name else f"{raw} (transformers' {name})"
        _check_dim((*path, label), value, where, limits=DIMS[name])
        given[name] = value
    if "head_dim" not in given:
        given["head_dim"] = _attribute(config, "head_dim")
    _check_divisible(given, path, where)
    for key, value in data.items():
        child = getattr(config, key, None) if isinstance(value, dict) else None
        if child is not None and hasattr(child, "attribute_map"):  # a sub-config
            _check_built(child, value, (*path, key), where)  # pyright: ignore[reportUnknownArgumentType]


def _attribute(config: Any, name: str) -> Any:
    """``config.name`` as transformers reads it (through ``attribute_map``), or ``None``."""
    try:
        return getattr(config, name, None)
    except Exception:  # a property of the model's that cannot say: the build will
        return None


def _named(items: list[tuple[str, str, Any]]) -> list[tuple[str, str]]:
    return [(key, place) for key, place, _ in items]


def _clean(
    node: dict[str, Any],
    path: tuple[Any, ...],
    removed: dict[str, list[Any]],
    where: str,
    known: Mapping[str, Any],
) -> dict[str, Any]:
    place = field_name(path) if path else ""
    model_type = node.get("model_type")
    if (
        path
        and "model_type" in node
        and (not isinstance(model_type, str) or model_type not in known)
    ):
        raise ValueError(
            f"{where}: {place}.model_type {model_type!r} is not one transformers implements, and "
            f"funcshard never runs a config's own code (trust_remote_code); use a built-in model_type"
        )
    out: dict[str, Any] = {}
    for key, value in node.items():
        kind = (
            "code"
            if key in REMOTE_CODE
            else "implementation"
            if key in IMPLEMENTATIONS
            else "quantization"
            if key in QUANTIZATION
            else None
        )
        if kind is not None:
            removed.setdefault(kind, []).append((key, place, value))
            continue
        if key in DIMS:
            _check_dim((*path, key), value, where)
        if isinstance(value, dict):
            out[key] = _clean(value, (*path, key), removed, where, known)  # pyright: ignore[reportUnknownArgumentType]
        elif isinstance(value, list):
            out[key] = [
                _clean(v, (*path, key, i), removed, where, known) if isinstance(v, dict) else v  # pyright: ignore[reportUnknownArgumentType]
                for i, v in enumerate(value)  # pyright: ignore[reportUnknownArgumentType, reportUnknownVariableType]
            ]
        else:
            out[key] = value
    _check_divisible(out, path, where)
    return out


def _check_dim(
    path: tuple[Any, ...], value: object, where: str, *, limits: tuple[int, int] | None = None
) -> None:
    if value is None:
        return  # the model's default
    low, high = DIMS[path[-1]] if limits is None else limits
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(
            f"{where}: {field_name(path)} is {str(value)[:40]}; it must be an integer in "
            f"[{low}, {high}]"
        )


def _check_divisible(node: dict[str, Any], path: tuple[Any, ...], where: str) -> None:
    heads = node.get("num_attention_heads")
    kv = node.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv and heads % kv:
        raise ValueError(
            f"{where}: {field_name((*path, 'num_attention_heads'))} = {heads} is not a multiple of "
            f"num_key_value_heads = {kv}; each key/value head serves a whole group of heads"
        )
    for width, count in (("hidden_size", "num_attention_heads"), ("n_embd", "n_head")):
        h, a = node.get(width), node.get(count)
        if (
            isinstance(h, int)
            and isinstance(a, int)
            and a
            and node.get("head_dim") is None
            and h % a
        ):
            raise ValueError(
                f"{where}: {field_name((*path, width))} = {h} is not a multiple of {count} = {a}, "
                f"and no head_dim is given; give a divisible size or head_dim"
            )
