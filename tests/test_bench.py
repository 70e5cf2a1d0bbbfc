"""The benchmark keeps working: tiny configurations of the PyTorch-comparable modes, one round.

Numbers are not asserted here (timed tests are noise on a shared machine); only
that every mode runs under each allocator, follows the same loss trajectory,
that funcshard's bytes match the cost model and its state is the ideal split,
and that the report has its pieces: a section per size, the floor multiples,
the allocator of each memory row, the per-unit overhead. The real run is
`nox -s bench`.
"""

from __future__ import annotations

import json

import pytest


def _tiny(tmp_path, *args):
    from bench.__main__ import main

    return main(
        [
            "--tiny",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--steps",
            "2",
            "--timeout",  # a rank that hangs fails the test in a minute, not the suite
            "60",
            "--out",
            str(tmp_path),
            *args,
        ]
    )


@pytest.mark.parametrize(
    "modes", ["funcshard/full_shard,funcshard/shard_grad_op,fsdp2,ddp,single,floor"]
)
def test_tiny_benchmark_runs_every_mode(tmp_path, monkeypatch, modes):
    """Both allocators at W=2; a failure in the memory rows or `malloc_set_by` localises to
    bench/allocator.py (the variable leaked into a default run, or mallopt failed)."""
    # a default-allocator rank that inherits this fails (bench/allocator.py: apply)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    summary = _tiny(tmp_path, "--modes", modes, "--size", "34m", "--malloc", "both")
    assert list(summary["sizes"]) == ["34m"]
    size = summary["sizes"]["34m"]
    assert set(size["modes"]) == set(modes.split(","))
    for mode, s in size["modes"].items():
        assert s["largest_loss_difference"] < 1e-4, mode
        assert s["allocator"] == "default", mode
        if mode.startswith("funcshard/"):
            assert s["comm_bytes_per_step"] == s["expected_comm_bytes_per_step"], mode
            assert s["state_vs_ideal"] == pytest.approx(1.0), mode
        # a spawned mode (ddp) runs under the first allocator only with --tiny
        want = {"default"} if mode == "ddp" else {"default", "mmap"}
        assert set(s["memory"]) == want, mode
    assert size["modes"]["floor"]["floor_multiple"] == 1.0
    assert size["modes"]["single"]["loss_reference"] == "single"
    assert size["modes"]["floor"]["loss_reference"] == "floor"  # one rank's batch only
    assert {"funcshard/full_shard / fsdp2", "funcshard/full_shard / floor"} <= set(size["ratios"])
    assert not (tmp_path / "bench").exists()
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["sizes"]["34m"]["modes"].keys() == size["modes"].keys()
    for run in written["runs"]:
        for rank in run["ranks"]:
            assert rank["malloc"] == run["malloc"]
            assert rank["malloc_set_by"] == (None if run["malloc"] == "default" else "mallopt")
    md = (tmp_path / "results.md").read_text()
    assert md.startswith("# Benchmark")
    assert "## 34m: GPT" in md
    assert "`floor` is one rank's work alone" in md
    assert "| funcshard/full_shard | mmap |" in md
    assert "| funcshard/full_shard | default |" in md
    assert "| floor | 0." in md
    assert "1.00x floor |" in md
    assert "- funcshard/full_shard / floor: step time" in md


def test_tiny_deep_at_one_rank_gives_the_per_unit_overhead(tmp_path):
    """--world-size 1: funcshard and FSDP2 on a 1-rank process group against plain torch;
    a failure localises to bench/summary.py's _per_unit or the W=1 path of bench/worker.py."""
    summary = _tiny(
        tmp_path,
        "--size",
        "deep",
        "--world-size",
        "1",
        "--malloc",
        "mmap",
        "--modes",
        "funcshard/full_shard,fsdp2,plain",
    )
    deep = summary["sizes"]["deep"]
    units = deep["config"]["layers"] + 1  # every block, and the root
    assert deep["per_unit_us"]["reference"] == "plain"
    assert deep["per_unit_us"]["units"] == {"funcshard/full_shard": units, "fsdp2": units}
    for mode, s in deep["modes"].items():
        assert s["allocator"] == "mmap", mode
        assert s["largest_loss_difference"] < 1e-4, mode
        assert "floor_multiple" not in s  # no floor ran
    md = (tmp_path / "results.md").read_text()
    assert "## deep: GPT" in md
    assert "per-unit overhead over plain torch at W=1" in md
    assert f"µs/unit ({units} units)" in md


def test_a_tiny_run_without_out_never_replaces_the_measured_results(monkeypatch, tmp_path):
    """--tiny defaults to one round of two steps, at 34m and deep (shrunk), under glibc's
    default allocator, written to a temporary directory, its ranks forked from a server that
    imported PyTorch's optimizer and FSDP modules once (bench/__main__.py)."""
    from bench import __main__ as bench

    seen = {}

    def report(runs, meta, out):
        seen.update(out=out, spec=meta["spec"], runs=runs, meta=meta)
        return {}

    monkeypatch.setattr(bench, "write_report", report)
    monkeypatch.setattr(bench, "_run", lambda *a, **k: [{"step_times_s": [1.0]}])
    bench.main(["--tiny", "--modes", "single"])
    assert "funcshard-bench-" in str(seen["out"])
    assert seen["spec"]["steps"] == 2
    assert {r["round"] for r in seen["runs"]} == {0}
    assert [(r["size"], r["malloc"]) for r in seen["runs"]] == [
        ("34m", "default"),
        ("deep", "default"),
    ]
    assert seen["meta"]["malloc"] == ["default"]
    seen.clear()
    bench.main(["--tiny", "--modes", "single", "--size", "34m", "--malloc", "both"])
    assert [r["malloc"] for r in seen["runs"]] == ["default", "mmap"]
    assert seen["spec"]["preload"] == bench.TINY_PRELOAD


def test_sizes_and_overrides():
    """--size takes a comma list or repeats; --width and the like apply on top of each size."""
    from bench import __main__ as bench
    from bench import model as gpt

    assert bench._sizes(["8m,deep", "126m", "8m"]) == ["8m", "deep", "126m"]
    with pytest.raises(SystemExit, match="unknown size"):
        bench._sizes(["35m"])
    assert gpt.param_count(gpt.SIZES["34m"]) == 33_719_296
    assert 120e6 < gpt.param_count(gpt.SIZES["126m"]) < 130e6
    assert (gpt.SIZES["deep"].layers, gpt.SIZES["deep"].width) == (96, 128)
    assert bench._modes(None, "deep", 2) == bench.DEFAULT_MODES_DEEP
    with pytest.raises(SystemExit, match="unknown mode"):
        bench._modes("fsdp3", "34m", 2)


def test_the_allocator_environment_is_set_and_removed(monkeypatch):
    import os

    from bench import allocator

    monkeypatch.setenv(allocator.ENV, "123")
    with allocator.environment("default"):
        assert allocator.ENV not in os.environ
        assert allocator.apply("default") is None
    with allocator.environment("mmap"):
        assert os.environ[allocator.ENV] == "65536"
        assert allocator.apply("mmap") == "environment"
    assert os.environ[allocator.ENV] == "123"
    with pytest.raises(RuntimeError, match="inherited"):
        allocator.apply("default")


def test_a_tiny_paired_run_alternates_two_modes_in_the_same_processes(tmp_path):
    """bench.paired: both modes' step times, the median paired ratio, and funcshard's per-unit
    difference over plain torch; a smoke run writes nothing under --out."""
    from bench import paired

    summary = paired.main(
        [
            "--tiny",
            "--size",
            "deep",
            "--world-size",
            "1",
            "--modes",
            "funcshard/full_shard,plain",
            "--warmup",
            "1",
            "--steps",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    assert summary["modes"] == ["funcshard/full_shard", "plain"]
    assert all(len(summary["times"][m]) == 3 for m in summary["modes"])
    assert summary["median_ratio"] > 0
    assert set(summary["per_unit_us"]) == {"funcshard/full_shard"}
    assert summary["units"]["funcshard/full_shard"] == summary["config"]["layers"] + 1
    assert not list(tmp_path.iterdir())
    assert "median of the paired step ratios" in paired.markdown(summary)
    with pytest.raises(SystemExit, match="needs two of"):
        paired.main(["--modes", "plain"])


def test_tiny_benchmark_runs_the_per_step_levers(tmp_path):
    """Two micro-batches a step: shard_optimizer (ZeRO-1) trains like the one-process
    reference, sends what the cost model says, and sends less than shard_grad_op does over
    the same micro-batches (one all-gather and one reduce-scatter a step, not two each)."""
    modes = "funcshard/shard_optimizer,funcshard/shard_grad_op/2mb,single"
    summary = _tiny(tmp_path, "--modes", modes, "--size", "34m")
    rows = summary["sizes"]["34m"]["modes"]
    for mode in ("funcshard/shard_optimizer", "funcshard/shard_grad_op/2mb"):
        assert rows[mode]["largest_loss_difference"] < 1e-4, mode
        assert rows[mode]["comm_bytes_per_step"] == rows[mode]["expected_comm_bytes_per_step"]
    zero1 = rows["funcshard/shard_optimizer"]["comm_bytes_per_step"]
    assert zero1 < rows["funcshard/shard_grad_op/2mb"]["comm_bytes_per_step"]


def test_tiny_benchmark_runs_the_partial_copies(tmp_path):
    """partial_reshard on {node: 2, local: 1} and hybrid_shard_optimizer on {dp: 2, fsdp: 1}
    ([Note: partial copies] in ``plan/strategy.py``) train like the one-process reference and send what the cost
    model says; hybrid_shard_optimizer holds half of hybrid_shard's optimizer state."""
    modes = "funcshard/partial_reshard,funcshard/hybrid_shard_optimizer,funcshard/hybrid_shard/2mb,single"
    summary = _tiny(tmp_path, "--modes", modes, "--size", "34m")
    rows = summary["sizes"]["34m"]["modes"]
    for mode in modes.split(",")[:3]:
        assert rows[mode]["largest_loss_difference"] < 1e-4, mode
        assert rows[mode]["comm_bytes_per_step"] == rows[mode]["expected_comm_bytes_per_step"]
        assert any("sent per step and rank" in n for n in rows[mode]["notes"]), mode
    hfsdp = rows["funcshard/hybrid_shard_optimizer"]["state_bytes_per_rank"]["optimizer"]
    hybrid = rows["funcshard/hybrid_shard/2mb"]["state_bytes_per_rank"]["optimizer"]
    assert 2 * hfsdp <= hybrid + 64


def test_tiny_benchmark_runs_the_quantized_collectives(tmp_path):
    """fs.Quantized() on full_shard, and its int4 and fp8 modes: bytes sent equal the cost
    model and are under a third of the exact step's (blocks of 256 on tiny units pad), int4
    reductions send less than int8's, the loss stays close, and the report carries each
    convergence check."""
    quantized = ("funcshard/quantized", "funcshard/quantized_int4", "funcshard/quantized_fp8")
    modes = ",".join(("funcshard/full_shard", *quantized))
    summary = _tiny(tmp_path, "--modes", modes, "--size", "34m")
    rows = summary["sizes"]["34m"]["modes"]
    exact = rows["funcshard/full_shard"]
    for mode in quantized:
        quant = rows[mode]
        assert quant["comm_bytes_per_step"] == quant["expected_comm_bytes_per_step"], mode
        assert quant["comm_bytes_per_step"] < exact["comm_bytes_per_step"] / 3, mode
        assert quant["largest_relative_loss_difference"] < 5e-2, mode
        assert "converges" in quant, mode
    int4, int8 = rows["funcshard/quantized_int4"], rows["funcshard/quantized"]
    assert int4["comm_bytes_per_step"] < int8["comm_bytes_per_step"]
    assert (tmp_path / "results.md").read_text().count("convergence check") == 3


def test_the_one_gpu_check_falls_back_to_gloo_on_the_cpu(tmp_path, capsys):
    """python -m bench.gpu without CUDA: every check runs at a tiny size on gloo; every line
    starts with 'gpu '; the sync check counts host reads instead of raising."""
    from bench import gpu

    report = gpu.main(["--out", str(tmp_path)])
    lines = (tmp_path / "gpu.txt").read_text().splitlines()
    assert lines == report.lines
    assert all(line.startswith("gpu ") for line in capsys.readouterr().out.splitlines())
    assert report.data["equality"]["ok"]
    assert report.data["checkpoint"]["ok"]
    assert set(report.data["throughput"]["runs"]) == {"funcshard/full_shard", "fsdp2"}
    assert all(len(runs) == 2 for runs in report.data["throughput"]["runs"].values())
    assert any(line.startswith("gpu sync: ") for line in lines)
    assert report.data["streams"]["ok"] is None  # a fake W=2 step ran; no streams on the CPU
    assert report.data["ok"]


def test_the_fake_process_group_bench_times_funcshard_and_fsdp2_per_unit(tmp_path, capsys):
    """python -m bench.fake_pg --tiny: both libraries' W=8 steps in one process, per unit."""
    from bench import fake_pg

    result = fake_pg.main(["--tiny", "--out", str(tmp_path)])
    assert set(result["median_step_s"]) == set(fake_pg.MODES)
    assert "fsdp2" in result["median_step_s"]
    assert result["units"] == 9
    assert result["ratio_per_unit"] > 0
    assert all(line.startswith("fake_pg ") for line in capsys.readouterr().out.splitlines())
    assert (tmp_path / "fake_pg.json").exists()
    # the run flushes denormals (the CPU's FTZ/DAZ, which Python's floats obey) only while it runs
    assert float("5e-324") * 1.0 > 0
