"""``funcshard plan --hf-config``: any config transformers can build, on meta, never remote code.

Reference: the Hugging Face model built from the same config (its parameter count and
DeepSpeed's ``largest_layer_params`` over its modules). A failure names the config.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch

from funcshard import cli

transformers = pytest.importorskip("transformers", reason="pip install transformers")
pytestmark = pytest.mark.interop


def _count(config) -> int:
    auto = (
        transformers.AutoModelForSeq2SeqLM
        if config.is_encoder_decoder
        else transformers.AutoModelForCausalLM
    )
    with torch.device("meta"):
        model = auto.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("config", "units"),
    [
        (
            lambda: transformers.LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=100,
            ),
            ["model/layers/*"],
        ),
        (
            lambda: transformers.MixtralConfig(
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=50,
                num_local_experts=4,
                num_experts_per_tok=2,
            ),
            ["model/layers/*"],
        ),
        (
            lambda: transformers.T5Config(
                d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, vocab_size=40
            ),
            ["encoder/block/*", "decoder/block/*"],
        ),
    ],
    ids=["llama", "mixtral", "t5"],
)
def test_a_config_is_planned_with_one_unit_per_decoder_layer(config, units, tmp_path, capsys):
    config = config()
    config.save_pretrained(tmp_path)
    out = tmp_path / "plan.json"
    argv = ["plan", "--hf-config", str(tmp_path / "config.json"), "--mesh", "4", "--json", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["n_params"] == _count(config)
    assert data["units"] == units
    assert set(data["strategies"]) == {"no_shard", "shard_grad_op", "shard_optimizer", "full_shard"}
    assert text.startswith(f"{config.model_type} (config.json): {_count(config):,} parameters")


def test_the_folder_deepspeed_and_units_work(tmp_path, capsys):
    config = transformers.Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=30,
    )
    config.save_pretrained(tmp_path)
    out = tmp_path / "plan.json"
    argv = ["plan", "--hf-config", str(tmp_path), "--mesh", "2", "--deepspeed", "--json", str(out)]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert data["deepspeed"]["largest_layer_params"] == largest
    z3 = data["deepspeed"]["zero3"]["terms"]
    assert z3["partitioned"]["funcshard"] >= z3["partitioned"]["deepspeed"]  # padding at most
    argv = [
        "plan",
        "--hf-config",
        str(tmp_path),
        "--mesh",
        "2",
        "--units",
        "Qwen2Attention,Qwen2MLP",
    ]
    assert cli.main(argv) == 0
    assert "full_shard" in capsys.readouterr().out


def test_remote_code_is_never_run(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({"model_type": "my_custom_model", "auto_map": {"AutoConfig": "x.Y"}})
    )
    assert cli.main(["plan", "--hf-config", str(path), "--mesh", "8"]) == 2
    err = capsys.readouterr().err
    assert "model_type 'my_custom_model' is not one transformers" in err
    assert "never runs a config's own code (trust_remote_code)" in err


def test_auto_map_on_a_built_in_model_type_is_ignored(tmp_path, capsys):
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=30,
    ).to_dict()
    config["auto_map"] = {"AutoModelForCausalLM": "evil.Model"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.main(["plan", "--hf-config", str(tmp_path), "--mesh", "2"]) == 0
    assert "remote code in the config (auto_map) was not run" in capsys.readouterr().out


def test_an_unreadable_config_is_named(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    assert cli.main(["plan", "--hf-config", str(tmp_path), "--mesh", "2"]) == 2
    assert "config.json: not valid JSON" in capsys.readouterr().err


def test_a_config_that_is_a_fifo_is_refused_without_waiting(tmp_path, capsys):
    """A folder (a tarball's) whose config.json is a FIFO: the open waited for a writer."""
    os.mkfifo(tmp_path / "config.json")
    assert cli.main(["plan", "--hf-config", str(tmp_path), "--mesh", "2"]) == 2
    assert "config.json: not a regular file (a fifo)" in capsys.readouterr().err


# -- untrusted configs (See [Note: untrusted configs] in ``cli/hf_config.py``) -------------------------------------


def _llama(**changes) -> dict:
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=30,
    ).to_dict()
    config.update(changes)
    return config


def _plan(tmp_path, config: dict, capsys) -> tuple[int, str]:
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = cli.main(["plan", "--hf-config", str(tmp_path), "--mesh", "2"])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_code_fields_are_removed_at_every_depth():
    from funcshard._src.cli.hf_config import sanitize

    evil = {"AutoConfig": "evil.Config", "AutoModelForCausalLM": "evil.Model"}
    config = {
        "model_type": "llava",
        "auto_map": evil,
        "trust_remote_code": True,
        "text_config": {
            "model_type": "llama",
            "auto_map": evil,
            "attn_implementation": "kernels-community/flash-attn",
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "layers": [{"auto_map": evil}],
            "_attn_implementation": "x/y",
        },
        "quantization_config": {"quant_method": "bitsandbytes"},
        "custom_pipelines": {"p": {"impl": "evil.P"}},
    }
    clean, notes = sanitize(config, where="c.json", known=transformers.CONFIG_MAPPING)
    text = json.dumps(clean)
    for key in (
        "auto_map",
        "trust_remote_code",
        "attn_implementation",
        "quantization_config",
        "custom_pipelines",
        "evil",
    ):
        assert key not in text, key
    assert notes[0] == (
        "remote code in the config (auto_map, auto_map at text_config, auto_map at "
        "vision_config.layers[0], custom_pipelines, trust_remote_code) was not run"
    )
    assert any("'kernels-community/flash-attn' at text_config ignored" in n for n in notes)
    assert any("quantization_config ignored" in n for n in notes)


def test_a_hub_kernel_attention_is_never_fetched(tmp_path, capsys, monkeypatch):
    """transformers would download the kernel (and run it); offline it fails: planning needs none."""
    import transformers.dynamic_module_utils as dynamic

    def never(*a, **kw):
        raise AssertionError("a config's code was imported")

    monkeypatch.setattr(dynamic, "get_class_from_dynamic_module", never)
    config = _llama(
        attn_implementation="kernels-community/flash-attn",
        auto_map={"AutoModelForCausalLM": "evil.M"},
    )
    config["rope_parameters"] = {
        **(config.get("rope_parameters") or {}),
        "auto_map": {"x": "evil.Y"},
    }
    code, out = _plan(tmp_path, config, capsys)
    assert code == 0, out
    assert "attention implementation 'kernels-community/flash-attn' ignored" in out
    assert "remote code in the config (auto_map, auto_map at rope_parameters) was not run" in out


def test_a_sub_config_of_a_model_type_transformers_lacks_is_refused(tmp_path, capsys):
    code, out = _plan(
        tmp_path, _llama(text_config={"model_type": "evil_model", "hidden_size": 8}), capsys
    )
    assert code == 2
    assert "text_config.model_type 'evil_model' is not one transformers implements" in out


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"hidden_size": 10**12},
            r"hidden_size is 1000000000000; it must be an integer in \[1, 1048576\]",
        ),
        ({"hidden_size": -4}, r"hidden_size is -4; it must be an integer"),
        (
            {"num_attention_heads": 0},
            r"num_attention_heads is 0; it must be an integer in \[1, 65536\]",
        ),
        ({"hidden_size": 32.5}, r"hidden_size is 32.5; it must be an integer"),
        ({"hidden_size": True}, r"hidden_size is True; it must be an integer"),
        ({"vocab_size": "30"}, r"vocab_size is 30; it must be an integer"),
        (
            {"num_key_value_heads": 3},
            r"num_attention_heads = 4 is not a multiple of num_key_value_heads = 3",
        ),
        ({"num_hidden_layers": 10**9}, r"num_hidden_layers is 1000000000"),
        (
            {"text_config": {"model_type": "llama", "hidden_size": 0}},
            r"text_config.hidden_size is 0",
        ),
        (
            {"hidden_size": 33, "head_dim": None},
            r"hidden_size = 33 is not a multiple of num_attention_heads = 4",
        ),
    ],
)
def test_dims_are_checked_before_transformers_sees_them(tmp_path, capsys, changes, message):
    code, out = _plan(tmp_path, _llama(**changes), capsys)
    assert code == 2, out
    assert re.search(message, out), out
    assert "Traceback" not in out


_XGLM = {"model_type": "xglm", "d_model": 8, "attention_heads": 2, "ffn_dim": 8, "num_layers": 1}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (  # an alias DIMS does not list: checked under transformers' name
            {**_XGLM, "attention_heads": 0},
            r"attention_heads \(transformers' num_attention_heads\) is 0; it must be an integer "
            r"in \[1, 65536\]",
        ),
        (
            {**_XGLM, "d_model": 10, "attention_heads": 3},
            r"hidden_size = 10 is not a multiple of num_attention_heads = 3",
        ),
        (
            {"model_type": "distilbert", "dim": 10**12},
            r"dim \(transformers' hidden_size\) is 1000000000000; it must be an integer in "
            r"\[1, 1048576\]",
        ),
        (  # built 10**9 blocks: hung
            {"model_type": "mpt", "n_layers": 10**9, "d_model": 8, "n_heads": 2},
            r"n_layers is 1000000000; it must be an integer in \[0, 1024\]",
        ),
        (
            _llama(num_hidden_layers=1025),
            r"num_hidden_layers is 1025; it must be an integer in \[0, 1024\]",
        ),
    ],
    ids=["xglm-heads", "xglm-divisible", "distilbert-dim", "mpt-layers", "llama-layers"],
)
def test_dims_are_checked_under_every_name_before_a_model_is_built(
    tmp_path, capsys, monkeypatch, config, message
):
    """Models spell dims their own way (``attribute_map``): each is checked as transformers
    reads it, after the config object is made and before any model is built."""

    def never(*_, **__):
        raise AssertionError("a model was built")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", never)
    code, out = _plan(tmp_path, config, capsys)
    assert code == 2, out
    assert re.search(message, out), out


def test_the_most_layers_admitted_plan_in_seconds(tmp_path, capsys):
    """MAX_LAYERS is what a plan can afford: transformers builds every layer (on meta) and the
    report walks the modules once per module (pairwise walks took a minute at 1024 layers)."""
    from funcshard._src.cli.hf_config import MAX_LAYERS

    start = time.perf_counter()
    code, out = _plan(tmp_path, _llama(num_hidden_layers=MAX_LAYERS), capsys)
    assert code == 0, out
    assert time.perf_counter() - start < 30, "10 s expected; pairwise walks took over 60 s"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"model_type": "llama", "hidden_size": NaN}',
            r"config.json: hidden_size is NaN, not a finite number",
        ),
        (
            '{"model_type": "llama", "rope_theta": 1e400}',
            r"config.json: rope_theta is 1e400, not a finite number",
        ),
        (
            '{"model_type": "llama", "x": ' + "[" * 5000 + "]" * 5000 + "}",
            r"config.json: nested more than 64",
        ),
        (
            '{"model_type": "llama", "x": ' + "[" * 70 + "]" * 70 + "}",
            r"config.json: x\[0\]\[0\]\[0\]... is nested more than 64",
        ),
        (
            '{"model_type": "llama", "model_type": "t5"}',
            r"config.json: not valid JSON \(the key 'model_type' appears twice",
        ),
    ],
)
def test_a_malformed_config_file_is_named_with_the_field(tmp_path, capsys, text, message):
    (tmp_path / "config.json").write_text(text)
    assert cli.main(["plan", "--hf-config", str(tmp_path), "--mesh", "2"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "Traceback" not in err


def test_whatever_transformers_raises_is_named(tmp_path, capsys):
    """A config that passes funcshard's checks but not the model's own: its error, named."""
    code, out = _plan(
        tmp_path, _llama(hidden_size=33), capsys
    )  # head_dim given: transformers refuses
    assert code == 2, out
    assert "transformers cannot build it: " in out
    assert "Traceback" not in out
