"""The benchmark keeps working: a tiny configuration of every PyTorch-comparable mode, one round.

Numbers are not asserted here (timed tests are noise on a shared machine); only
that every mode runs, follows the same loss trajectory, and that funcshard's
bytes match the cost model. The real run is `nox -s bench`.
"""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("modes", ["funcshard/full_shard,funcshard/shard_grad_op,fsdp2,ddp,single"])
def test_tiny_benchmark_runs_every_mode(tmp_path, modes):
    from bench.__main__ import main

    summary = main(
        [
            "--tiny",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--steps",
            "2",
            "--modes",
            modes,
            "--timeout",  # a rank that hangs fails the test in a minute, not the suite
            "60",
            "--out",
            str(tmp_path),
        ]
    )
    assert set(summary["modes"]) == set(modes.split(","))
    for mode, s in summary["modes"].items():
        assert s["largest_loss_difference"] < 1e-4, mode
        if mode.startswith("funcshard/"):
            assert s["comm_bytes_per_step"] == s["expected_comm_bytes_per_step"], mode
    assert "funcshard/full_shard / fsdp2" in summary["ratios"]
    assert not (tmp_path / "bench").exists()
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["modes"].keys() == summary["modes"].keys()
    assert (tmp_path / "results.md").read_text().startswith("# Benchmark")


def test_a_tiny_run_without_out_never_replaces_the_measured_results(monkeypatch, tmp_path):
    """--tiny defaults to one round of two steps, written to a temporary directory, its ranks
    forked from a server that imported PyTorch's optimizer and FSDP modules once (bench/__main__.py)."""
    from bench import __main__ as bench

    seen = {}

    def report(runs, meta, out):
        seen.update(out=out, spec=meta["spec"], rounds=len(runs))
        return {}

    monkeypatch.setattr(bench, "write_report", report)
    monkeypatch.setattr(bench, "_run", lambda *a, **k: [{"step_times_s": [1.0]}])
    bench.main(["--tiny", "--modes", "single"])
    assert "funcshard-bench-" in str(seen["out"])
    assert seen["spec"]["steps"] == 2
    assert seen["rounds"] == 1
    assert seen["spec"]["preload"] == bench.TINY_PRELOAD
