"""Commits, runs and rotation: no checkpoint is lost to ``keep``, a bad step, or a run saving alongside.

Also: ``keep`` deletes exactly the files a save wrote (see [Note: what cleanup deletes] in ``checkpoint/cleanup.py``),
never follows a symlink, never touches anything outside the directory, and a save either
committed and returns or raises and committed nothing.

References: the directory listing after each save, and which checkpoint
``latest`` returns, against what ``docs/checkpoints.md`` ("Runs") promises. A
fresh process is simulated by forgetting the run this process adopted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.checkpoint import commit
from funcshard.checkpoint import CheckpointError, CheckpointWarning, UnsafeCheckpointError
from tests import tampering


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


# -- nothing deleted that a save did not write; nothing outside the directory touched ------


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every file and link under ``root`` (links as their targets), to compare before and after."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = f"-> {os.readlink(p)}"
        elif p.is_file():
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


HOSTILE_RUNS = [
    "x/../../victim/*",
    "*",
    "../victim",
    "/",
    ".hidden",
    "a b",
    "é",
    "a" * 129,
    "job@x",
    "job\n",
    "",
    "x/" + "a" * 10,
    ".",
]


@pytest.mark.parametrize("run", HOSTILE_RUNS)
def test_a_crafted_run_never_reaches_a_path(tmp_path, run):
    """A checkpoint whose manifest names a run that is no run name (digest recomputed) is refused
    on load, so no later save adopts it; a victim directory beside the parent stays untouched."""
    victim = tmp_path / "victim"
    (victim / "data").mkdir(parents=True)
    (victim / "data" / "keep.txt").write_text("mine")
    ckpts = tmp_path / "a" / "b"
    ckpts.mkdir(parents=True)
    _save(ckpts, 1, run="good")
    tampering.edit(ckpts / "step1", lambda m: m.update(run=run))
    before = _tree(victim)
    with pytest.raises(UnsafeCheckpointError, match=r"manifest.json: run .* is not a run name"):
        fs.checkpoint.load(ckpts / "step1", like={"w": torch.zeros(2)})
    assert commit._current_run == "good"  # the saving run, not the crafted one
    with pytest.raises(UnsafeCheckpointError, match=r"is not a run name"):
        fs.checkpoint.latest(ckpts)
    with pytest.warns(CheckpointWarning, match=r"could not delete everything"):  # rotation refuses
        _save(ckpts, 2, keep=1, run="good")
    assert _tree(victim) == before
    assert _names(ckpts) == ["step1", "step2"]


@pytest.mark.parametrize("other", ["job-2", "x.tmp-job", "job-" + "f" * 32, "jo", "job.", "JOB"])
def test_a_run_deletes_only_its_own_interrupted_saves(tmp_path, other):
    mine = commit.staging_dir(tmp_path / "step9", "job", "d" * 32)
    theirs = commit.staging_dir(tmp_path / "step9", other, "a" * 32)
    for d in (mine, theirs):
        (d / "rank0").mkdir(parents=True)
        (d / "rank0" / "__0_0.distcp").write_bytes(b"x")
    _save(tmp_path, 1, keep=1, run="job")
    assert not mine.exists()
    assert (
        theirs / "rank0" / "__0_0.distcp"
    ).read_bytes() == b"x"  # another run's save in progress


def test_keep_never_follows_a_symlink(tmp_path):
    """A ``latest`` link to a checkpoint, and a link to a checkpoint outside: neither is counted
    or deleted, and what they point to keeps its manifest."""
    ckpts, outside = tmp_path / "ckpts", tmp_path / "outside"
    ckpts.mkdir()
    _save(outside, 0, run="r")  # the same run, outside the directory
    _save(ckpts, 1, run="r")
    _save(ckpts, 2, run="r")
    (ckpts / "latest").symlink_to(ckpts / "step2", target_is_directory=True)
    (ckpts / "external").symlink_to(outside / "step0", target_is_directory=True)
    outside_before = _tree(outside)
    _save(ckpts, 3, keep=2, run="r")
    assert _names(ckpts) == ["external", "latest", "step2", "step3"]
    assert (ckpts / "latest").is_symlink()
    assert fs.checkpoint.load_full(ckpts / "step2")["w"].tolist() == [2.0, 2.0]
    assert _tree(outside) == outside_before
    assert fs.checkpoint.latest(ckpts) == ckpts / "step3"


def test_keep_deletes_only_the_files_a_save_wrote(tmp_path):
    _save(tmp_path, 1)
    (tmp_path / "step1" / "NOTES.txt").write_text("why this run diverged")
    (tmp_path / "step1" / "rank0" / "extra.bin").write_bytes(b"\0")
    (tmp_path / "step1" / "plots").mkdir()
    _save(tmp_path, 2, keep=1)
    # the folder stays with the user's files only: no manifest, so no checkpoint any more
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "step1").rglob("*")) == [
        "step1/NOTES.txt",
        "step1/plots",
        "step1/rank0",
        "step1/rank0/extra.bin",
    ]
    assert fs.checkpoint.latest(tmp_path) == tmp_path / "step2"
    _save(tmp_path, 3, keep=1)
    assert (tmp_path / "step1" / "NOTES.txt").read_text() == "why this run diverged"
    assert not (tmp_path / "step2").exists()


def test_a_save_whose_cleanup_fails_after_the_commit_returns_committed(tmp_path, monkeypatch):
    _save(tmp_path, 1)

    def refuse(*_: Any) -> list[str]:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(commit, "remove_saved", refuse)
    with pytest.warns(CheckpointWarning, match=r"step2 was saved, but keep=1 could not delete"):
        assert _save(tmp_path, 2, keep=1) == tmp_path / "step2"
    assert fs.checkpoint.load_full(tmp_path / "step2")["w"].tolist() == [2.0, 2.0]
    assert fs.checkpoint.latest(tmp_path) == tmp_path / "step2"


def test_a_save_whose_rename_fails_commits_nothing(tmp_path, monkeypatch):
    _save(tmp_path, 1)

    rename = os.rename

    def refuse(source: Any, target: Any) -> None:
        if Path(target).name == "step2":  # the commit's rename; DCP's own renames go through
            raise OSError(18, "Invalid cross-device link")
        rename(source, target)

    with monkeypatch.context() as patched:  # undoes this patch only, not the fixture's
        patched.setattr(commit.os, "rename", refuse)
        with pytest.raises(CheckpointError, match=r"step2 failed on rank 0: OSError: .*cross-dev"):
            _save(tmp_path, 2, keep=1)
    assert not (tmp_path / "step2").exists()
    assert fs.checkpoint.latest(tmp_path) == tmp_path / "step1"  # keep=1 deleted nothing
