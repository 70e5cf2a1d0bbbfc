"""``funcshard plan``: the table, JSON and chart, and a clear message for each bad argument."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

import pytest

from funcshard import cli
from funcshard._src.plan.hardware import Hardware, get_hardware
from funcshard._src.plan.sizes import describe_size, format_bytes, parse_bytes

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
        "logits",
        "staging",
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
    assert parse_bytes("1.5TiB") == 3 * 2**39


@pytest.mark.parametrize("text", ["80G", "80g", "80 G"])
def test_a_bare_prefix_is_binary_as_nvidia_smi_and_deepspeed_mean_it(text):
    """Reference: nvidia-smi's "81920MiB" for an "80GB" A100 and DeepSpeed's GB = 2**30 prints."""
    assert parse_bytes(text) == 80 * 2**30
    assert (
        describe_size(text)
        == f"{text} = 80 * 2**30 bytes (binary, as nvidia-smi means G) = 80.00 GiB"
    )


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("80GB", "--device-memory 80GB = 80 * 10**9 bytes (decimal) = 74.51 GiB"),
        (
            "80G",
            "--device-memory 80G = 80 * 2**30 bytes (binary, as nvidia-smi means G) = 80.00 GiB",
        ),
    ],
)
def test_the_output_says_how_a_device_memory_was_read(text, said, capsys):
    assert cli.main(["plan", "--model", "llama-7b", "--mesh", "8", "--device-memory", text]) == 0
    out = capsys.readouterr().out
    assert said in out.splitlines()[1], out


@pytest.mark.parametrize(
    ("name", "mib"),
    [("a100-40gb", 40960), ("a100-80gb", 81920), ("h100-80gb", 81559), ("h200-141gb", 143771)],
)
def test_hardware_presets_hold_the_memory_the_devices_report(name, mib):
    """Reference: nvidia-smi's memory.total (See [Note: device memory] in hardware.py)."""
    assert get_hardware(name).memory_bytes == mib * 2**20


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "80",
            "'80' has no unit: write '80GiB' (80 * 2**30 bytes) or '80GB' (80 * 10**9 bytes), or '80B' for bytes",
        ),
        (
            "1.5",
            "'1.5' has no unit: write '1.5GiB' (1.5 * 2**30 bytes) or '1.5GB' (1.5 * 10**9 bytes)",
        ),
    ],
)
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


# -- --deepspeed: DeepSpeed's estimators, term by term ----------------------------------------

LLAMA_7B_P, LLAMA_7B_LARGEST = 6_738_415_616, 32000 * 4096


@pytest.mark.parametrize("gpus", [1, 8, 64, 256])
def test_deepspeed_layout_matches_deepspeeds_formulas_term_by_term(gpus, tmp_path, capsys):
    """Reference: estimate_zero3/zero2_model_states_mem_needs (deepspeed/runtime/zero/stage3.py,
    stage_1_and_2.py), no offload, LLaMA-7B; the differences are those of [Note: DeepSpeed's
    formulas] in funcshard/_src/cli/deepspeed.py: the 8-byte step counter always; ZeRO-2's
    largest-unit fp16 gradients; and at world size 1 no gathered copy of a whole shard."""
    out = tmp_path / "ds.json"
    argv = [
        "plan",
        "--model",
        "llama-7b",
        "--mesh",
        f"fsdp={gpus}",
        "--deepspeed",
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    assert "DeepSpeed's estimators (no offload)" in capsys.readouterr().out
    ds = json.loads(out.read_text())["deepspeed"]
    p, largest = LLAMA_7B_P, LLAMA_7B_LARGEST
    assert (ds["total_params"], ds["largest_layer_params"], ds["world_size"]) == (p, largest, gpus)
    z3, z2 = ds["zero3"], ds["zero2"]
    assert z3["deepspeed"] == 4 * largest + int(18 * p / gpus)
    assert z2["deepspeed"] == 2 * p + int(18 * p / gpus)
    for stage in (z3, z2):  # the 18 bytes per parameter partitioned agree exactly
        partitioned = stage["terms"]["partitioned"]
        assert partitioned["funcshard"] == partitioned["deepspeed"] == int(18 * p / gpus)
        assert stage["terms"]["step counter"]["funcshard"] == 8
    whole = gpus > 1  # world size 1: the shard is the parameter, nothing is gathered again
    assert z3["terms"]["gathered"]["funcshard"] == (4 if whole else 2) * largest
    assert z2["terms"]["gathered"]["funcshard"] == (2 * p if whole else 0) + 2 * largest
    # and the executor's staging buffers for collectives, which DeepSpeed's model states omit
    staging = [s["terms"].get("staging", {"funcshard": 0})["funcshard"] for s in (z3, z2)]
    assert z3["funcshard"] - z3["deepspeed"] == 8 + staging[0] - (0 if whole else 2 * largest)
    assert z2["funcshard"] - z2["deepspeed"] == 8 + staging[1] + 2 * largest - (
        0 if whole else 2 * p
    )
    # one estimator for stages 1 and 2; shard_optimizer holds shard_grad_op's bytes at one
    # micro-batch ([Note: shard_optimizer] in ``plan/strategy.py``)
    z1 = ds["zero1"]
    assert (z1["strategy"], z1["deepspeed"], z1["funcshard"]) == (
        "shard_optimizer",
        z2["deepspeed"],
        z2["funcshard"],
    )


def test_zero1_with_micro_batches_keeps_whole_gradients_and_sends_less(tmp_path):
    """--micro-batches 4: shard_optimizer keeps every unit's fp32 gradients whole (4 bytes a
    parameter, padding aside) until the last micro-batch, and sends a quarter of
    shard_grad_op's gathers and reductions."""
    out = tmp_path / "ds.json"
    argv = ["plan", "--model", "llama-7b", "--mesh", "fsdp=8", "--deepspeed"]
    assert cli.main([*argv, "--micro-batches", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    ds = data["deepspeed"]
    extra = (
        ds["zero1"]["terms"]["gathered"]["funcshard"]
        - ds["zero2"]["terms"]["gathered"]["funcshard"]
    )
    assert 4 * LLAMA_7B_P <= extra <= 4 * LLAMA_7B_P * 1.001
    sent = {s: sum(row["comm"].values()) for s, row in data["strategies"].items() if s != "auto"}
    assert sent["shard_optimizer"] * 4 == sent["shard_grad_op"]
    assert sent["full_shard"] > sent["shard_grad_op"] > sent["shard_optimizer"]


def test_micro_batches_must_be_positive(capsys):
    argv = ["plan", "--model", "llama-7b", "--mesh", "fsdp=8", "--micro-batches", "0"]
    assert cli.main(argv) == 2
    assert "--micro-batches 0" in capsys.readouterr().err


def test_quantized_collectives_send_about_a_quarter_of_fp32(tmp_path):
    """--quantize both: full_shard's gathers and reductions as int8 blocks of 256 with an fp32
    scale each, (1 + 4/256) / 4 of the fp32 bytes; --quantize weights quantizes only gathers."""
    argv = ["plan", "--model", "llama-7b", "--mesh", "fsdp=8", "--strategy", "full_shard"]
    sent = {}
    for which in ("none", "weights", "both"):
        out = tmp_path / f"{which}.json"
        assert cli.main([*argv, "--quantize", which, "--json", str(out)]) == 0
        sent[which] = json.loads(out.read_text())["strategies"]["full_shard"]["comm"]
    for key, exact in sent["none"].items():
        assert sent["both"][key] / exact == pytest.approx((1 + 4 / 256) / 4, rel=1e-3), key
    gathers = [k for k in sent["none"] if k.startswith("all_gather")]
    reductions = [k for k in sent["none"] if k.startswith("reduce_scatter")]
    assert all(sent["weights"][k] < sent["none"][k] for k in gathers)
    assert all(sent["weights"][k] == sent["none"][k] for k in reductions)


def test_quantized_formats_send_their_bytes(tmp_path):
    """--gradient-format int4 halves the reductions' values (qgZ: (0.5 + 4/256) / 4 of fp32);
    --weight-format fp8 sends int8's bytes."""
    argv = ["plan", "--model", "llama-7b", "--mesh", "fsdp=8", "--strategy", "full_shard"]
    out = tmp_path / "plan.json"
    formats = ["--weight-format", "fp8", "--gradient-format", "int4"]
    assert cli.main([*argv, "--quantize", "both", *formats, "--json", str(out)]) == 0
    quantized = json.loads(out.read_text())["strategies"]["full_shard"]["comm"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    exact = json.loads(out.read_text())["strategies"]["full_shard"]["comm"]
    for key, n in exact.items():
        ratio = (0.5 + 4 / 256) / 4 if key.startswith("reduce_scatter") else (1 + 4 / 256) / 4
        assert quantized[key] / n == pytest.approx(ratio, rel=1e-3), key


@pytest.mark.parametrize(
    ("quantize", "flag", "hint"),
    [
        ("none", "--weight-format", "--quantize weights"),
        ("gradients", "--weight-format", "--quantize both"),
        ("weights", "--gradient-format", "--quantize both"),
    ],
)
def test_a_format_for_an_exact_direction_is_refused(capsys, quantize, flag, hint):
    argv = ["plan", "--model", "llama-7b", "--mesh", "fsdp=8", "--quantize", quantize]
    assert cli.main([*argv, flag, "fp8"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} fp8 with --quantize {quantize}" in err
    assert hint in err


def test_a_quantize_block_that_is_not_a_multiple_of_4_is_refused(capsys):
    argv = ["plan", "--model", "llama-7b", "--mesh", "fsdp=8", "--quantize", "both"]
    assert cli.main([*argv, "--quantize-block", "6"]) == 2
    assert "--quantize-block 6" in capsys.readouterr().err


def test_deepspeed_sets_its_layout(tmp_path):
    out = tmp_path / "ds.json"
    assert (
        cli.main(["plan", "--model", "llama-7b", "--mesh", "8", "--deepspeed", "--json", str(out)])
        == 0
    )
    data = json.loads(out.read_text())
    cm = data["cost_model"]
    assert (cm["param_dtype"], cm["master_weights"], cm["prefetch"], cm["reduce_dtype"]) == (
        "fp16",
        True,
        0,
        "fp32",
    )
    assert len(data["units"]) == 291  # one unit per module, as DeepSpeed gathers them


# -- --units and --strategy --------------------------------------------------------------------


def test_one_strategy_prints_one_row(capsys):
    assert (
        cli.main(["plan", "--model", "mistral-7b", "--mesh", "8", "--strategy", "full_shard"]) == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("mistral-7b: 7,241,732,096 parameters")
    assert "\nfull_shard" in out
    assert "no_shard" not in out
    assert "\nauto" not in out


def test_strategy_auto_needs_a_budget(capsys):
    assert cli.main(["plan", "--model", "llama-7b", "--mesh", "8", "--strategy", "auto"]) == 2
    assert "--strategy auto needs --device-memory or --hardware" in capsys.readouterr().err


@pytest.mark.parametrize(("units", "count"), [("auto", None), ("layers/*,head", 34)])
def test_units_replace_the_presets(units, count, tmp_path):
    out = tmp_path / "u.json"
    argv = ["plan", "--model", "llama-3-8b", "--mesh", "8", "--units", units, "--json", str(out)]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["n_params"] == 8_030_261_248
    assert data["units"] == ("auto" if units == "auto" else units.split(","))


def test_a_model_is_required(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--mesh", "8"])
    assert "one of the arguments --model --hf-config is required" in capsys.readouterr().err


# -- JSON and the chart --------------------------------------------------------------------------


def test_json_carries_a_schema_version_and_the_usable_budget(tmp_path):
    out = tmp_path / "p.json"
    assert cli.main([*LLAMA_13B, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["schema_version"] == 2
    assert data["device_memory"] == 80 * 2**30
    assert data["usable_memory"] == 75 * 2**30  # the default reserve: 5% + 1 GiB
    assert data["auto"]["total"] <= data["usable_memory"]


def test_plot_without_matplotlib_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    png = tmp_path / "mem.png"
    assert cli.main(["plan", "--model", "llama-7b", "--mesh", "8", "--plot", str(png)]) == 2
    captured = capsys.readouterr()
    assert (
        captured.err
        == "funcshard plan: error: --plot needs matplotlib: pip install 'funcshard[plot]'\n"
    )
    assert captured.out == ""
    assert not png.exists()


def test_the_plot_of_llama_70b_marks_budget_reserve_and_auto(tmp_path, monkeypatch):
    """The docs' chart: llama-70b on dp=4,fsdp=8, h100, 80GiB; the axis breaks at 1.5 x 80 GiB."""
    import matplotlib.pyplot as plt

    from funcshard._src.cli import plot as plot_module

    drawn = {}
    real_savefig = plt.Figure.savefig

    def savefig(fig, *args, **kwargs):
        ax = fig.axes[0]
        drawn["lines"] = sorted(round(line.get_xdata()[0], 2) for line in ax.get_lines())
        drawn["texts"] = [t.get_text() for t in ax.texts]
        drawn["ticks"] = [t.get_text() for t in ax.get_yticklabels()]
        drawn["title"] = ax.get_title(loc="left")
        drawn["xmax"] = max(ax.get_xticks())
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", savefig)
    png = tmp_path / "mem.png"
    argv = ["plan", "--model", "llama-70b", "--mesh", "dp=4,fsdp=8", "--hardware", "h100-80gb"]
    argv += ["--device-memory", "80GiB", "--mixed-precision", "bf16", "--remat", "--plot", str(png)]
    assert cli.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn["lines"] == [75.0, 80.0]  # usable (the reserve below it) and device memory
    # no_shard, past the break: every unit's bf16 copy is kept from its forward to its backward
    assert "1.14 TiB  does not fit" in drawn["texts"]
    # no_shard, shard_grad_op, shard_optimizer and hybrid_shard run off
    assert drawn["texts"].count("//") == 4
    assert any(t.endswith("  fits") for t in drawn["texts"])
    assert drawn["ticks"][-1].startswith("auto plan\n")
    assert drawn["title"].startswith("Memory per rank: llama-70b (69.0B params) on dp=4 x fsdp=8")
    assert drawn["xmax"] <= 120
    assert plot_module.plot is cli.plot


def test_reserve_changes_what_fits(capsys):
    """llama-7b on 8 ranks in 80 GiB: the default reserve leaves 75 GiB; 50% leaves 40 GiB."""
    argv = ["plan", "--model", "llama-7b", "--mesh", "fsdp=8", "--device-memory", "80GiB"]
    assert cli.main([*argv, "--reserve", "0"]) == 0
    assert "80.00 GiB usable" not in capsys.readouterr().out  # nothing kept back
    assert cli.main([*argv, "--reserve", "50%"]) == 0
    assert "40.00 GiB usable" in capsys.readouterr().out
    assert cli.main([*argv, "--reserve", "lots"]) == 2
    assert "--reserve 'lots': write a percentage and/or a size" in capsys.readouterr().err


# -- the two tables, host RAM, refusals, --largest, and the printouts in docs/planner.md ----------

DOCS = pathlib.Path(__file__).parent.parent / "docs" / "planner.md"
BLOOM = "funcshard plan --model bloom-7b --mesh fsdp=8 --hardware a100-80gb --mixed-precision bf16 --remat --efficiency eager"
LLAMA = "funcshard plan --model llama-13b --mesh fsdp=8 --hardware a100-80gb --mixed-precision bf16 --remat --efficiency eager"
LARGEST = "funcshard plan --model llama-7b --mesh fsdp=8 --hardware a100-80gb --remat --batch-size 12 --largest"
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@functools.cache
def _run(command: str) -> tuple[str, dict]:
    """``command``'s printout and JSON, run once per session (planning a 7B model takes seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, buffer = pathlib.Path(tmp) / "p.json", io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert cli.main([*shlex.split(command)[1:], "--json", str(out)]) == 0
        return buffer.getvalue(), json.loads(out.read_text())


def _cells(line: str) -> list[float]:
    return [float(n) * _UNITS[u] for n, u in re.findall(r"([\d.]+) (B|KiB|MiB|GiB|TiB)\b", line)]


def test_the_memory_columns_add_up_to_the_total_and_the_reserve():
    """Every category the total counts is a column (logits and staging too), then the reserve."""
    text, data = _run(BLOOM)
    head = next(line for line in text.splitlines() if line.startswith("strategy  "))
    for column in ("logits", "staging", "total", "+ reserve", "fits"):
        assert column in head, column
    assert "(mixed prec, frozen, buffers: 0 B in every row)" in text
    row = next(line for line in text.splitlines() if line.startswith("full_shard "))
    *parts, total, with_reserve = _cells(row)
    assert sum(parts) == pytest.approx(total, abs=len(parts) * 0.005 * 2**30)
    assert with_reserve - total == pytest.approx(5 * 2**30, abs=0.01 * 2**30)
    assert total == pytest.approx(data["strategies"]["full_shard"]["total"], abs=0.005 * 2**30)


def test_time_table_gives_tokens_per_gpu_mfu_and_host_ram_beside_deepspeed():
    text, data = _run(BLOOM)
    assert "tokens/s per GPU  MFU" in text
    full = data["strategies"]["full_shard"]
    row = [line for line in text.splitlines() if line.startswith("full_shard ")][1]
    assert full["tokens_per_s_per_device"] == full["time"]["tokens_per_s"] / 8
    assert f"{full['tokens_per_s_per_device']:,.0f}" in row
    assert f"{full['time']['mfu']:.1%}" in row
    m = full["memory"]
    assert full["host_per_node"] == {
        "train": 0,  # without --async-checkpoint nothing of the model stays on the host
        "checkpoint": 8 * (m["params"] + m["frozen"] + m["optimizer"]),
    }
    # DeepSpeed's estimate_zero3_model_states_mem_needs, no offload: 4 * (largest | P) * 8 * 1.5
    assert data["deepspeed_host_per_node"] == {
        "zero_init=1": int(4 * 250880 * 4096 * 8 * 1.5),  # the embedding is the largest layer
        "zero_init=0": int(4 * 7_069_016_064 * 8 * 1.5),
    }
    assert "DeepSpeed's ZeRO-3 estimator, host RAM per node of 8 GPUs" in text


def test_async_checkpoint_keeps_its_pinned_buffers_on_the_host(tmp_path):
    out = tmp_path / "a.json"
    argv = ["plan", "--model", "llama-7b", "--mesh", "fsdp=8", "--strategy", "full_shard"]
    assert cli.main([*argv, "--async-checkpoint", "--json", str(out)]) == 0
    host = json.loads(out.read_text())["strategies"]["full_shard"]["host_per_node"]
    assert host["train"] == host["checkpoint"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--mesh", "fsdp=8", "--strategy", "hybrid_shard"],
            "--strategy hybrid_shard shards over the last mesh axis and replicates over the "
            "others, so it needs a mesh of two axes; on --mesh 'fsdp=8' it would be full_shard. "
            "Pass e.g. --mesh dp=2,fsdp=4, or --strategy full_shard",
        ),
        (
            ["--mesh", "16", "--strategy", "partial_reshard", "--hardware", "a100-80gb"],
            "Pass e.g. --mesh dp=2,fsdp=8, or --strategy full_shard",
        ),
        (
            ["--mesh", "dp=4,fsdp=6", "--hardware", "a100-80gb"],
            "--mesh dp=4,fsdp=6 on a100-80gb (8 devices per node): node boundaries cut its groups "
            "unevenly",
        ),
        (["--mesh", "dp=4,fsdp=6", "--hardware", "a100-80gb"], "e.g. --mesh dp=3,fsdp=8"),
        (["--mesh", "dp=5,fsdp=3", "--hardware", "a100-80gb"], "e.g. --mesh dp=2,fsdp=8"),
        (
            ["--mesh", "8", "--hardware", "a100-80gb", "--efficiency", "fast"],
            "--efficiency 'fast': give a profile (tuned = 0.5, eager = 0.24; default tuned) or a "
            "fraction of peak FLOP/s in (0, 1]",
        ),
        (["--mesh", "8", "--efficiency", "eager"], "--efficiency eager needs --hardware"),
        (["--mesh", "8", "--largest"], "--largest scales a preset: give --model and"),
    ],
)
def test_plans_the_mesh_cannot_express_are_refused_with_the_fix(argv, message, capsys):
    assert cli.main(["plan", "--model", "llama-7b", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_meshes_that_tile_nodes_are_accepted(capsys):
    for mesh in ("dp=2,fsdp=8", "fsdp=16", "dp=16,fsdp=4", "fsdp=3"):
        argv = ["plan", "--model", "llama-7b", "--mesh", mesh, "--hardware", "a100-80gb"]
        assert cli.main([*argv, "--strategy", "full_shard"]) == 0, mesh
    capsys.readouterr()


def test_a_fixed_strategy_that_does_not_fit_gets_the_advice_auto_gets(capsys):
    argv = ["plan", "--model", "llama-13b", "--mesh", "8", "--hardware", "a100-80gb"]
    assert cli.main([*argv, "--strategy", "no_shard"]) == 0
    out = capsys.readouterr().out
    assert "\nno_shard: no plan fits memory_budget 80.00 GiB (75.00 GiB usable) per rank" in out
    assert "\nauto: no plan fits" in out
    assert "Would fit: remat=True" in out


def test_largest_reproduces_ddp_2_to_3b_and_fsdp_over_10b_on_8_a100s():
    """The largest of LLaMA-7B's family per strategy, fp32 AdamW, 12 x 2048 tokens with remat."""
    _, data = _run(LARGEST)
    found = data["largest"]
    assert 2e9 <= found["no_shard"]["n_params"] <= 3e9
    assert found["full_shard"]["n_params"] > 10e9
    for f in found.values():
        assert f["total"] <= data["usable_memory"]


def test_the_docs_print_what_the_commands_print():
    """Each ``funcshard plan`` block in docs/planner.md followed by a text block is its output."""
    blocks = re.findall(
        r"```bash\n(funcshard plan [^`]*?)\n```\n\nprints\n\n```text\n(.*?)```",
        DOCS.read_text(),
        re.S,
    )
    commands = {" ".join(cmd.replace("\\\n", " ").split()) for cmd, _ in blocks}
    assert {BLOOM, LLAMA, LARGEST} <= commands
    for command, printed in blocks:
        text, _ = _run(" ".join(command.replace("\\\n", " ").split()))
        assert text.rstrip("\n") == printed.rstrip("\n"), command


# (run, command, metric, published low, published high): see "Calibration" in docs/planner.md
CALIBRATION = [
    ("BLOOM-7B", BLOOM, "tokens/s per GPU", 1000, 1000),
    ("LLaMA-13B", LLAMA, "tokens/s per GPU", 800, 800),
    (
        "Llama-3.1-8B",
        "funcshard plan --model llama-3-8b --mesh fsdp=8 --hardware h100-80gb --mixed-precision "
        "bf16 --remat --flash-attention --batch-size 2 --seq-len 8192 --strategy full_shard",
        "tokens/s per GPU",
        5762,
        5762,
    ),
    (
        "Llama-3.1-8B",
        "funcshard plan --model llama-3-8b --mesh fsdp=8 --hardware h100-80gb --mixed-precision "
        "bf16 --remat --flash-attention --batch-size 2 --seq-len 8192 --strategy full_shard",
        "MFU",
        0.33,
        0.39,
    ),
    (
        "GPT-175B",
        "funcshard plan --model gpt-175b --mesh fsdp=128 --hardware a100-80gb --mixed-precision "
        "bf16 --remat --strategy full_shard",
        "TFLOP/s per GPU",
        173,
        173,
    ),
]


@pytest.mark.parametrize(("run", "command", "metric", "low", "high"), CALIBRATION)
def test_calibration_reproduces_published_runs_within_25_percent(run, command, metric, low, high):
    """The prediction is the docs' table's, and within 25 % of the published figure (or range)."""
    _, data = _run(command)
    time = data["strategies"]["full_shard"]["time"]
    value, shown = {
        "tokens/s per GPU": (
            time["tokens_per_s"] / 8,
            f"{time['tokens_per_s'] / 8:,.0f} tokens/s per GPU",
        ),
        "MFU": (time["mfu"], f"{time['mfu']:.1%} MFU"),
        "TFLOP/s per GPU": (
            time["tflops_per_device"],
            f"{time['tflops_per_device']:.0f} TFLOP/s per GPU",
        ),
    }[metric]
    assert 0.75 * low <= value <= 1.25 * high, (run, metric, value)
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith(f"| {run},")]
    assert any(shown in row for row in rows), (run, shown, rows)


@pytest.mark.parametrize("command", [BLOOM, LLAMA])
def test_the_docs_host_ram_table_is_the_commands(command):
    """docs/planner.md's host-RAM row of each plan: funcshard's figures beside DeepSpeed's."""
    _, data = _run(command)
    host, ds = data["strategies"]["full_shard"]["host_per_node"], data["deepspeed_host_per_node"]
    figures = [host["train"], host["checkpoint"], host["checkpoint"], *ds.values()]
    row = f"| {data['model']} | " + " | ".join(format_bytes(n) for n in figures) + " |"
    assert row in DOCS.read_text().splitlines()
