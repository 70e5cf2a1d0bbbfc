"""``funcshard plan``: the table, JSON and chart, and a clear message for each bad argument."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from funcshard import cli
from funcshard._src.plan.hardware import Hardware, get_hardware
from funcshard._src.plan.sizes import parse_bytes

LLAMA_13B = [
    "plan",
    "--model",
    "llama-13b",
    "--mesh",
    "dp=2,fsdp=8",
    "--device-memory",
    "80GiB",
    "--optimizer",
    "adamw",
    "--mixed-precision",
    "bf16",
]


def test_plan_prints_every_strategy_and_writes_json_and_a_chart(tmp_path, capsys):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "mem.png"
    argv = [*LLAMA_13B, "--hardware", "a100-80gb", "--remat", "--json", str(out_json)]
    assert cli.main([*argv, "--plot", str(out_png)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("llama-13b: 13,015,864,320 parameters on Mesh({'dp': 2, 'fsdp': 8})")
    for strategy in ["no_shard", "shard_grad_op", "hybrid_shard", "full_shard", "auto:"]:
        assert f"\n{strategy}" in text, strategy
    assert "tokens/s" in text
    assert "Assumptions:" in text
    assert "50% of 312 TFLOP/s" in text
    data = json.loads(out_json.read_text())
    assert data["n_params"] == 13_015_864_320
    assert data["mesh"] == {"dp": 2, "fsdp": 8}
    full = data["strategies"]["full_shard"]
    assert set(full["memory"]) == {
        "params",
        "grads",
        "optimizer",
        "mixed_precision",
        "gathered",
        "activations",
        "frozen",
        "buffers",
    }
    assert full["fits"] is True
    assert full["time"]["tokens_per_s"] > 0
    assert data["strategies"]["no_shard"]["fits"] is False
    assert data["auto"]["total"] <= 80 * 2**30
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_console_script_runs(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "funcshard.cli", "plan", "--model", "t5-11b", "--mesh", "8"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "t5-11b" in done.stdout
    assert "full_shard" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "llama-12b", "--mesh", "fsdp=8"], "unknown preset 'llama-12b'; did you mean"),
        (
            ["--model", "llama-7b", "--mesh", "dp:2,fsdp:8"],
            "--mesh 'dp:2,fsdp:8': write named axes",
        ),
        (["--model", "llama-7b", "--mesh", "fsdp=0"], "with positive sizes"),
        (["--model", "llama-7b", "--mesh", "fsdp=2,fsdp=4"], "axis 'fsdp' appears twice"),
        (["--model", "llama-7b", "--mesh", "8", "--device-memory", "lots"], "cannot read 'lots'"),
        (["--model", "llama-7b", "--mesh", "8", "--hardware", "tpu-v9"], "unknown hardware"),
    ],
)
def test_bad_arguments_get_a_clear_message(args, message, capsys):
    assert cli.main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("funcshard plan: error: "), err
    assert message in err, err


def test_a_hardware_file_missing_a_field_is_named(tmp_path, capsys):
    spec = {"name": "mine", "peak_flops": 1e15, "memory_bytes": "96GiB", "devices_per_node": 8}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(spec))
    assert cli.main(["plan", "--model", "llama-7b", "--mesh", "8", "--hardware", str(path)]) == 2
    err = capsys.readouterr().err
    assert "missing ['memory_bandwidth', 'intra_node_bandwidth', 'inter_node_bandwidth']" in err, (
        err
    )


def test_a_complete_hardware_file_is_used(tmp_path, capsys):
    spec = {**get_hardware("h100-80gb").__dict__, "name": "mine", "efficiency": 0.4}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(spec))
    assert cli.main(["plan", "--model", "llama-7b", "--mesh", "8", "--hardware", str(path)]) == 0
    assert "time on mine: 40% of 989 TFLOP/s" in capsys.readouterr().out


# -- hardware descriptions and sizes ------------------------------------------------------------


def test_sizes_parse_with_binary_and_decimal_units():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes("512MiB") == 2**29
    assert parse_bytes("1024B") == parse_bytes(1024) == 1024


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("80", "'80' has no unit: write '80GiB' (80 * 2**30 bytes) or '80GB' (80 * 10**9 bytes), or '80B' for bytes"),
        ("80G", "'80G' does not say whether 'G' is binary or decimal: write '80GiB' (80 * 2**30 bytes) or '80GB'"),
        ("1.5k", "write '1.5KiB' (1.5 * 2**10 bytes) or '1.5kB' (1.5 * 10**3 bytes)"),
    ],
)  # fmt: skip
def test_a_size_without_a_unit_names_the_binary_and_the_decimal_reading(text, message):
    """Another reading of "80" (80 bytes, 80 GiB?) would silently plan for the wrong device."""
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_bytes(text)


def test_a_device_memory_without_a_unit_is_refused(capsys):
    assert cli.main(["plan", "--model", "llama-7b", "--mesh", "8", "--device-memory", "80"]) == 2
    assert "'80' has no unit: write '80GiB'" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "GiB", "-3GiB", "0", "12 parsecs", "1e3GB"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError, match=r"cannot read .* as a size|must be positive"):
        parse_bytes(text)


def test_a_hardware_description_refuses_unknown_and_non_positive_fields():
    base = dict(get_hardware("a100-80gb").__dict__)
    with pytest.raises(ValueError, match=r"unknown \['tflops'\]"):
        Hardware.from_dict({**base, "tflops": 3})
    with pytest.raises(ValueError, match="peak_flops must be positive"):
        Hardware.from_dict({**base, "peak_flops": 0})
    with pytest.raises(ValueError, match=r"efficiency is a fraction of peak"):
        Hardware.from_dict({**base, "efficiency": 50})


def test_version(capsys):
    import importlib.metadata

    import funcshard as fs
    from funcshard.cli import main

    assert fs.__version__ == importlib.metadata.version("funcshard")
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"funcshard {fs.__version__}"
