"""Hardware topology, JSON descriptions, and the step time against published and measured runs.

References: Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
Parallel" (PVLDB 16(12)) for GPT-175B on 128 A100s; this machine's benchmark
(``bench/results/results.json``) with its calibration
(``bench/results/hardware-this-machine.json``). A failure names which figure moved.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

import funcshard as fs
from funcshard._src.plan.hardware import (
    HARDWARE,
    Hardware,
    get_hardware,
    link_bandwidth,
    ranks_per_node,
)
from funcshard._src.plan.model_config import ModelConfig
from funcshard._src.plan.presets import get_preset

RESULTS = Path(__file__).parent.parent / "bench" / "results"
A100 = get_hardware("a100-80gb")


# -- topology -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mesh", "axes", "local"),
    [
        ({"fsdp": 128}, ("fsdp",), 8),
        ({"fsdp": 4}, ("fsdp",), 4),
        ({"dp": 16, "fsdp": 8}, ("fsdp",), 8),
        ({"dp": 16, "fsdp": 8}, ("dp",), 1),
        ({"dp": 4, "fsdp": 4, "tp": 2}, ("fsdp",), 4),  # inner tp=2: 4 fsdp ranks per node
        ({"dp": 4, "fsdp": 4, "tp": 2}, ("dp",), 1),
        ({"a": 2, "b": 8, "c": 2}, ("a", "c"), 2),  # a spans nodes, c stays inside one
    ],
)
def test_ranks_of_a_group_in_one_node_follow_row_major_order(mesh, axes, local):
    assert ranks_per_node(mesh, axes, A100) == local


def test_a_ring_across_nodes_uses_every_nic_of_the_node():
    """NCCL runs one ring per NIC: 8 ranks of a node send through 8 NICs of 25 GB/s."""
    assert link_bandwidth({"fsdp": 128}, ("fsdp",), A100) == 200e9
    assert link_bandwidth({"dp": 16, "fsdp": 8}, ("dp",), A100) == 25e9  # one rank per node
    assert link_bandwidth({"fsdp": 8}, ("fsdp",), A100) == 300e9  # NVLink
    shared = Hardware("one-nic", 1e12, 2**30, 1e11, 300e9, 25e9, 8, node_bandwidth=25e9)
    assert link_bandwidth({"fsdp": 16}, ("fsdp",), shared) == pytest.approx(25e9)


def test_presets_describe_dgx_nodes():
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb"):
        hw = HARDWARE[name]
        assert hw.devices_per_node == 8
        assert hw.node_share * 8 == pytest.approx(8 * hw.inter_node_bandwidth)
    assert HARDWARE["h100-80gb"].inter_node_bandwidth == 50e9  # 400 Gb/s NDR per GPU


# -- JSON descriptions (untrusted input) --------------------------------------------------------


def test_a_description_round_trips_through_json(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(A100.to_json()))
    assert Hardware.from_json(path) == A100
    assert fs.cost.hardware(str(path)) == A100


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"peak_flops": "1e15"}, "peak_flops must be a number"),
        ({"peak_flops": True}, "peak_flops must be a number"),
        ({"overlap": 2}, "overlap is a fraction"),
        ({"latency": -1}, "latency must be >= 0"),
        ({"devices_per_node": 2.5}, "devices_per_node must be a whole number"),
        ({"name": {"__class__": "x"}}, "name must be a short string"),
        ({"exec": "import os"}, "unknown ['exec']"),
    ],
)
def test_a_bad_description_is_refused_with_the_field(change: dict[str, Any], message, tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({**A100.to_json(), **change}))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Hardware.from_json(path)


@pytest.mark.parametrize("text", ["[1, 2]", "{", '{"peak_flops": NaN}', '{"peak_flops": Infinity}'])
def test_json_that_is_not_an_object_of_numbers_is_refused(text, tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="hardware description"):
        Hardware.from_json(path)


def test_a_fifo_given_as_a_description_is_refused_without_waiting(tmp_path):
    """read_json opened it without O_NONBLOCK: the open waited forever for a writer."""
    os.mkfifo(tmp_path / "hw.json")
    with pytest.raises(ValueError, match=r"hw\.json: not a regular file \(a fifo\)"):
        Hardware.from_json(tmp_path / "hw.json")


# -- predicted against published ----------------------------------------------------------------


def test_gpt_175b_on_128_a100s_matches_the_fsdp_paper():
    """Zhao et al. 2023 (Sec. 6.3, Fig. 8): GPT-175B, full sharding, activation checkpointing,
    bf16, batch 1 x 2048 tokens per GPU on 16 DGX A100 nodes: about 173 TFLOPS per GPU.

    With the published links (NVLink 300 GB/s, one 25 GB/s NIC per GPU) and the assumed
    efficiency 0.5, the ring over 128 ranks runs at 8 NICs per node and hides under
    compute. A failure says the topology or the overlap changed (the old one-NIC model
    gave 52 TFLOPS).
    """
    gpt = get_preset("gpt-175b")
    cost = fs.cost.CostModel(
        mixed_precision=fs.MixedPrecision(torch.bfloat16, torch.bfloat16),
        workload=fs.cost.Workload(gpt.config, batch_size=1, seq_len=2048, remat=True),
        hardware=A100,
    )
    plan = fs.plan(gpt.params(), fs.Mesh({"fsdp": 128}), units=[gpt.unit_pattern])
    t = fs.cost.estimate(plan, cost).time
    assert t is not None
    assert t.tflops_per_device == pytest.approx(173, rel=0.25)
    assert t.exposed_comm_s < 0.1 * t.compute_s  # the gathers hide under compute
    assert 0.3 < t.mfu < 0.5  # 6 FLOPs per parameter and token over 312 TFLOP/s


# -- predicted against measured, on this machine ------------------------------------------------


def _bench_estimate(strategy: Literal["full_shard", "shard_grad_op"]) -> tuple[float, float]:
    from bench.model import Config, init_params

    cfg = Config()
    measured = json.loads((RESULTS / "results.json").read_text())
    assert measured["meta"]["config"] == cfg.to_json(), "the benchmark's model changed"
    hw = Hardware.from_json(RESULTS / "hardware-this-machine.json")
    shape = ModelConfig(
        "gpt",
        cfg.layers,
        cfg.width,
        4 * cfg.width,
        cfg.heads,
        cfg.heads,
        cfg.width // cfg.heads,
        cfg.vocab,
        cfg.seq,
    )
    cost = fs.cost.CostModel(
        workload=fs.cost.Workload(
            shape, batch_size=cfg.batch, seq_len=cfg.seq, flash_attention=True
        ),
        hardware=hw,
    )
    mesh = fs.Mesh({"fsdp": measured["meta"]["world_size"]})
    plan = fs.plan(init_params(cfg), mesh, units=["blocks/*"], strategy=strategy)
    t = fs.cost.estimate(plan, cost).time
    assert t is not None
    return t.step_s, _median_step(measured, f"funcshard/{strategy}", _calibrated_allocator(hw))


def _calibrated_allocator(hw: Hardware) -> str:
    """The allocator the calibration ran under: the benchmark's runs to compare with."""
    return "mmap" if "MALLOC_MMAP_THRESHOLD_': '65536'" in hw.source else "default"


def _median_step(measured: dict[str, Any], mode: str, malloc: str) -> float:
    """The median step of ``mode`` over the benchmark's runs under ``malloc`` (every rank, step)."""
    times = sorted(
        t
        for run in measured["runs"]
        if run["mode"] == mode and run.get("malloc", "mmap") == malloc
        for rank in run["ranks"]
        for t in rank["step_times_s"]
    )
    return times[len(times) // 2]


def test_the_calibration_and_the_bench_results_come_from_one_host_and_day():
    """A calibration describes one host: compared with runs of another, a failure below would
    blame the cost model for a change of machine."""
    meta = json.loads((RESULTS / "results.json").read_text())["meta"]
    source = Hardware.from_json(RESULTS / "hardware-this-machine.json").source
    match = re.match(r"measured by funcshard calibrate on (\S+ \S+) UTC: (\S+),", source)
    assert match, f"not a calibration's source: {source!r}"
    calibrated = datetime.strptime(match[1], "%Y-%m-%d %H:%M")
    benched = datetime.strptime(meta["date"], "%Y-%m-%d %H:%M:%S UTC")
    fix = (
        "run `funcshard calibrate --out bench/results/hardware-this-machine.json` beside the bench"
    )
    assert match[2] == meta["machine"]["platform"], (
        f"calibrated on {match[2]}, benched on {meta['machine']['platform']}: {fix}"
    )
    assert abs(calibrated - benched) < timedelta(days=1), (
        f"calibrated {calibrated}, benched {benched}: {fix}"
    )


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_the_bench_step_on_this_machine_is_predicted_within_25_percent(strategy):
    """The benchmark's GPT at W=2 on gloo (bench/results), from `funcshard calibrate` here.

    Compared with the benchmark's runs under the allocator the calibration ran with.
    """
    predicted, measured = _bench_estimate(strategy)
    assert predicted == pytest.approx(measured, rel=0.25), (predicted, measured)


# -- implausible numbers and malformed files (See [Note: plausible hardware] in ``plan/hardware.py``) ---------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"memory_bandwidth": 1e-308}, "memory_bandwidth is 1e-308"),
        ({"intra_node_bandwidth": 1e-308}, "intra_node_bandwidth is 1e-308"),
        ({"latency": 1e308}, "latency is 1e+308"),
        ({"peak_flops": 1e300}, "peak_flops is 1e+300"),
        ({"efficiency": 1e-300}, "efficiency is 1e-300"),
        ({"memory_bytes": 1e30}, "memory_bytes is 1e+30"),
        ({"devices_per_node": 10**9}, "devices_per_node is 1e+09"),
        ({"node_bandwidth": 5e-324}, "node_bandwidth is 4.94066e-324"),
    ],
)
def test_numbers_no_device_has_are_refused_with_the_field(change, field, tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({**A100.to_json(), **change}))
    with pytest.raises(
        ValueError, match=rf"hw.json: hardware 'a100-80gb': {re.escape(field)}, outside \["
    ):
        Hardware.from_json(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"latency": 1e400}', r"hw.json: latency is 1e400, not a finite number"),
        ('{"x": ' + "[" * 5000 + "]" * 5000 + "}", r"nested more than 64"),
        ('{"x": ' + '{"y": ' * 80 + "1" + "}" * 80 + "}", r"x.y.y.y... is nested more than 64"),
        ('{"latency": 1, "latency": 2}', r"the key 'latency' appears twice"),
    ],
)
def test_a_malformed_hardware_file_names_the_field(text, message, tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        Hardware.from_json(path)


def test_the_plan_command_refuses_them_and_writes_no_nan(tmp_path, capsys):
    from funcshard import cli

    path = tmp_path / "hw.json"
    out = tmp_path / "plan.json"
    argv = [
        "plan",
        "--model",
        "llama-7b",
        "--mesh",
        "8",
        "--device-memory",
        "80GiB",
        "--json",
        str(out),
    ]
    path.write_text(json.dumps({**A100.to_json(), "latency": 1e308}))
    assert cli.main([*argv, "--hardware", str(path)]) == 2
    captured = capsys.readouterr()
    assert "--hardware " in captured.err
    assert "latency is 1e+308, outside" in captured.err
    assert "nan" not in captured.out.lower()
    assert not out.exists()
    path.write_text(json.dumps(A100.to_json()))
    assert cli.main([*argv, "--hardware", str(path), "--strategy", "auto"]) == 0
    assert "nan" not in capsys.readouterr().out.lower()
    from funcshard._src.untrusted import loads_json

    loads_json(out.read_bytes(), what="plan.json")  # strict JSON: no NaN or Infinity
