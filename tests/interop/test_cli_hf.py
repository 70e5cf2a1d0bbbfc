"""``funcshard plan --hf-config``: any config transformers can build, on meta, never remote code.

Reference: the Hugging Face model built from the same config (its parameter count and
DeepSpeed's ``largest_layer_params`` over its modules). A failure names the config.
"""

from __future__ import annotations

import json

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
        (lambda: transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=100), ["model/layers/*"]),
        (lambda: transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                            num_local_experts=4, num_experts_per_tok=2), ["model/layers/*"]),
        (lambda: transformers.T5Config(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, vocab_size=40),
         ["encoder/block/*", "decoder/block/*"]),
    ],
    ids=["llama", "mixtral", "t5"],
)  # fmt: skip
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
    assert set(data["strategies"]) == {"no_shard", "shard_grad_op", "full_shard"}
    assert text.startswith(f"{config.model_type} (config.json): {_count(config):,} parameters")


def test_the_folder_deepspeed_and_units_work(tmp_path, capsys):
    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=30)  # fmt: skip
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
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, vocab_size=30).to_dict()  # fmt: skip
    config["auto_map"] = {"AutoModelForCausalLM": "evil.Model"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.main(["plan", "--hf-config", str(tmp_path), "--mesh", "2"]) == 0
    assert "remote code in the config (auto_map) was not run" in capsys.readouterr().out


def test_an_unreadable_config_is_named(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    assert cli.main(["plan", "--hf-config", str(tmp_path), "--mesh", "2"]) == 2
    assert "cannot read a JSON config" in capsys.readouterr().err
