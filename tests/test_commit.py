"""Commits, runs and rotation: no checkpoint is lost to ``keep``, a bad step, or a run saving alongside.

References: the directory listing after each save, and which checkpoint
``latest`` returns, against what ``docs/checkpoints.md`` ("Runs") promises. A
fresh process is simulated by forgetting the run this process adopted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import funcshard as fs
from funcshard._src.checkpoint import commit
from funcshard.checkpoint import CheckpointError


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Each test starts as a new process would: no run adopted, no run in the environment."""
    monkeypatch.setattr(commit, "_current_run", None)
    for name in commit.RUN_ENV:
        monkeypatch.delenv(name, raising=False)


def _save(directory: Path, step: int, **kw) -> Path:
    return fs.checkpoint.save(
        directory / f"step{step}", {"w": torch.full((2,), float(step))}, step=step, **kw
    )


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize(
    ("keep", "error", "message"),
    [
        (0, ValueError, r"keep=0 would delete the checkpoint just written; keep must be >= 1"),
        (-1, ValueError, r"keep=-1 would delete the checkpoint just written"),
        (True, TypeError, r"keep must be an integer >= 1 \(or None to keep all\), got True"),
        (1.5, TypeError, r"keep must be an integer >= 1"),
    ],
)
def test_keep_below_one_is_refused_before_anything_is_written(tmp_path, keep, error, message):
    _save(tmp_path, 1)
    with pytest.raises(error, match=message):
        _save(tmp_path, 2, keep=keep)
    assert _names(tmp_path) == ["step1"]


@pytest.mark.parametrize("step", ["3", 1.0, -1, True])
def test_steps_are_integers(tmp_path, step):
    with pytest.raises(TypeError, match=r"step must be an integer >= 0 \(or None\)"):
        fs.checkpoint.save(tmp_path / "x", {"n": 1}, step=step)
    assert _names(tmp_path) == []


def test_steps_order_numerically(tmp_path):
    for step in (9, 10, 2):
        _save(tmp_path, step)
    assert fs.checkpoint.latest(tmp_path) == tmp_path / "step10"


def test_keep_one_keeps_the_new_checkpoint_even_if_its_step_is_lowest(tmp_path):
    _save(tmp_path, 5)
    _save(tmp_path, 3, keep=1)
    assert _names(tmp_path) == ["step3"]


def test_two_runs_side_by_side_neither_prunes_nor_resumes_the_other(tmp_path, monkeypatch):
    """Runs a and b alternate saves into one directory with keep=2, each in its own process."""
    runs: dict[str, str] = {}
    for step in range(1, 5):
        for name, offset in (("a", 0), ("b", 100)):
            monkeypatch.setattr(commit, "_current_run", runs.get(name))  # that run's process
            _save(tmp_path, step + offset, keep=2)
            runs[name] = commit._current_run or ""
    assert _names(tmp_path) == ["step103", "step104", "step3", "step4"]
    monkeypatch.setattr(commit, "_current_run", None)  # a third, fresh process must not guess
    with pytest.raises(
        CheckpointError,
        match=r"holds checkpoints of 2 runs \(.*\); say which to resume: fs.checkpoint.latest\(dir, run=...\)",
    ):
        fs.checkpoint.latest(tmp_path)
    assert fs.checkpoint.latest(tmp_path, run=runs["a"]) == tmp_path / "step4"
    assert fs.checkpoint.latest(tmp_path, run=runs["b"]) == tmp_path / "step104"
    monkeypatch.setattr(commit, "_current_run", runs["b"])  # b's process after a restart
    assert fs.checkpoint.latest(tmp_path) == tmp_path / "step104"


def test_a_resumed_process_continues_the_run_it_loaded(tmp_path, monkeypatch):
    for step in (1, 2):
        _save(tmp_path, step, keep=2)
    run = commit._current_run
    monkeypatch.setattr(commit, "_current_run", None)  # restarted: a new process
    found = fs.checkpoint.latest(tmp_path)
    assert found is not None
    assert found == tmp_path / "step2"
    fs.checkpoint.load(found, like={"w": torch.zeros(2)})
    assert commit._current_run == run
    _save(tmp_path, 3, keep=2)  # prunes the run's own step1
    assert _names(tmp_path) == ["step2", "step3"]


def test_torchrun_restarts_share_a_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    _save(tmp_path, 1)
    monkeypatch.setattr(commit, "_current_run", None)  # the restarted attempt
    fs.checkpoint.save(tmp_path / "other", {"n": 1}, step=50, run="someone-else")
    monkeypatch.setattr(commit, "_current_run", None)
    assert fs.checkpoint.latest(tmp_path) == tmp_path / "step1"


def test_rotation_removes_only_its_own_interrupted_saves(tmp_path):
    mine = commit.staging_dir(tmp_path / "step9", "a", "d" * 32)
    theirs = commit.staging_dir(tmp_path / "step9", "b", "a" * 32)
    mine.mkdir()
    theirs.mkdir()
    fs.checkpoint.save(tmp_path / "step1", {"n": 1}, step=1, keep=1, run="a")
    assert not mine.exists()
    assert theirs.exists()


def test_a_bad_run_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"run must be a name of ASCII letters, digits"):
        fs.checkpoint.save(tmp_path / "x", {"n": 1}, run="../up")


def test_latest_refuses_a_damaged_manifest_instead_of_skipping_it(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / "step2" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"step2.*Move or delete .*step2 to go on"):
        fs.checkpoint.latest(tmp_path)
