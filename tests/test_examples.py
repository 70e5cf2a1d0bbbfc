"""The examples run, at tiny size, on two ranks of the worker pool (what `nox -s demo` runs at full size)."""

from __future__ import annotations

import math
import re
import sys

import pytest


def _train_gpt(argv: list[str]) -> list[float]:
    from examples import train_gpt

    return train_gpt.main(argv)


def _shard_demo() -> None:
    from examples import shard_demo

    shard_demo.main()


def test_train_gpt_learns_and_plots_its_loss_curve(pools, tmp_path):
    png = tmp_path / "loss.png"
    argv = [
        "--steps",
        "12",
        "--layers",
        "2",
        "--width",
        "32",
        "--seq",
        "16",
        "--batch",
        "4",
        "--lr",
        "1e-2",
        "--plot",
        str(png),
    ]
    for losses in pools.run(2, _train_gpt, argv):
        assert len(losses) == 12
        assert all(math.isfinite(x) for x in losses)
        assert sum(losses[-3:]) < sum(losses[:3])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # written by rank 0


def test_train_gpt_without_matplotlib_says_what_to_install(monkeypatch, capsys, tmp_path):
    """--plot is checked before training starts: one line, exit status 2, no traceback."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit) as exit_:
        _train_gpt(["--plot", str(tmp_path / "loss.png")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == "train_gpt.py: --plot needs matplotlib: pip install matplotlib\n"
    assert not (tmp_path / "loss.png").exists()


@pytest.mark.parametrize("strategy", ["hybrid_shard", "partial_reshard", "hybrid_shard_optimizer"])
def test_train_gpt_bf16_on_two_axes(pools, strategy):
    argv = [
        "--steps",
        "3",
        "--layers",
        "1",
        "--width",
        "16",
        "--seq",
        "8",
        "--batch",
        "2",
        "--bf16",
        "--strategy",
        strategy,
    ]
    four = pools.run(4, _train_gpt, [*argv, "--mesh", "dp=2,fsdp=2"])
    assert all(len(losses) == 3 for losses in four)


def _refused(argv: list[str]) -> str:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        _train_gpt(argv)
    return err.getvalue()


def test_train_gpt_refuses_hybrid_shard_on_one_axis_and_a_mesh_of_other_ranks(pools):
    for message in pools.run(2, _refused, ["--strategy", "hybrid_shard"]):
        assert "hybrid_shard shards over the last mesh axis" in message
        assert "--mesh dp=2,fsdp=1" in message
    for message in pools.run(2, _refused, ["--strategy", "partial_reshard"]):
        assert "partial_reshard keeps a copy sharded over the last mesh axis" in message
    for message in pools.run(2, _refused, ["--mesh", "dp=2,fsdp=2"]):
        assert "--mesh 'dp=2,fsdp=2' has 4 ranks, the run has 2" in message


def test_shard_demo(pools):
    pools.run(2, _shard_demo)


def test_train_gpt_explains_the_precision_and_bytes_it_runs_with(capsys):
    """``--explain --bf16`` reports bf16 compute and the gathered bytes of bf16 units, not fp32's."""
    tiny = ["--steps", "1", "--layers", "1", "--width", "16", "--seq", "8", "--batch", "2"]
    gathered = {}
    for flags in ([], ["--bf16"]):
        _train_gpt([*tiny, *flags, "--explain"])
        out = capsys.readouterr().out
        found = re.search(r"^gathered +\S+ \S+ +([\d,]+)", out, re.M)
        assert found is not None, out
        gathered[bool(flags)] = int(found[1].replace(",", ""))
        if flags:
            assert "mixed precision: compute bfloat16, reduce float32" in out
        else:
            assert "mixed precision: none" in out
    assert gathered[True] != gathered[False]  # bf16 copies, where fp32 leaves were aliased
