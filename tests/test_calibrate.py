"""``funcshard calibrate``: two gloo ranks measure this machine and write a description the planner reads.

Reference: the description's own reader (``Hardware.from_json``) and the planner
(``funcshard plan --hardware``). A failure names the measurement or the field.
"""

from __future__ import annotations

import json

import pytest

from funcshard import cli
from funcshard._src.calibrate.calibrate import Settings, calibrate, describe, write_json
from funcshard._src.plan.hardware import Hardware

QUICK = Settings(world_size=2, comm_bytes=2**20, seconds=0.05, width=64, seq=32, batch=1)


def test_calibrate_measures_two_ranks_and_writes_json_the_planner_reads(tmp_path, capsys):
    hw = calibrate(QUICK, name="quick")
    assert hw.name == "quick"
    assert hw.source.startswith("measured by funcshard calibrate")
    assert hw.peak_flops > 1e8, "matmul rate"
    assert 0 < hw.efficiency <= 1, "block rate over matmul rate"
    assert hw.intra_node_bandwidth > 1e6, "gloo bandwidth"
    assert 0 <= hw.overlap <= 1
    path = tmp_path / "hw.json"
    write_json(hw, path)
    assert Hardware.from_json(path) == hw
    argv = ["plan", "--model", "llama-7b", "--mesh", "fsdp=2", "--hardware", str(path)]
    assert cli.main(argv) == 0
    assert "time on quick" in capsys.readouterr().out


def test_describe_takes_the_median_over_ranks_and_bounds_fractions():
    base = {
        "peak_flops": 1e10,
        "block_flops": 2e10,
        "memory_bandwidth": 1e9,
        "copy_bandwidth": 1e9,
        "bandwidth": 1e8,
        "latency": 1e-4,
        "overlap": -0.3,
        "memory_bytes": 2**30,
        "devices_per_node": 2,
    }
    hw = describe(
        [base, {**base, "peak_flops": 3e10}, {**base, "peak_flops": 2e10}], QUICK, name="x"
    )
    assert hw.peak_flops == 2e10
    assert hw.efficiency == 1.0  # a block cannot beat the matmul rate: measured noise
    assert hw.overlap == 0.0


def test_the_command_refuses_a_single_rank(tmp_path, capsys):
    assert cli.main(["calibrate", "--out", str(tmp_path / "x.json"), "--nproc", "1"]) == 2
    assert "--nproc >= 2" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["peak_flops", "intra_node_bandwidth"])
def test_a_written_description_with_a_tampered_field_is_refused(field, tmp_path):
    path = tmp_path / "hw.json"
    hw = Hardware("x", 1e10, 2**30, 1e9, 1e8, 1e8, 2, efficiency=0.8)
    write_json(hw, path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, field: "__import__('os')"}))
    with pytest.raises(ValueError, match=f"{field} must be a number"):
        Hardware.from_json(path)
