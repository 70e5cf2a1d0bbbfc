"""Every failure a user can cause at W=2 ends, on every rank, in a named error within the timeout + 5 s.

Each case breaks one thing on one rank (or both) the way a careless or
hostile user would: a rank that is late to a collective, catches an error and
carries on, skips a unit, runs another configuration, or loads a bad
checkpoint. Every rank reports what it raised and how long the failing call
took; none may hang, abort with a signal (the pool would report the exit
code), or return a wrong result. The pool restarts its workers after a case
that leaves them out of step.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.comm import channel
from tests import tampering
from tests.models import Model

TIMEOUT_S = 2.0
MODEL = Model(kind="mlp", width=6, layers=3)
Outcome = tuple[str, str, float]  # (exception name or "ok", message, seconds the failing call took)


def _setup(**step_options: Any) -> tuple[Any, Any, fs.Step]:
    """The cases below name the collective each unit's schedule fails at: units, not buckets."""
    params = MODEL.init(0)
    plan = fs.plan(params, fs.Mesh({"fsdp": 2}), units=MODEL.units)
    step_options.setdefault("bucket_bytes", 0)
    return plan, fs.shard(params, plan), fs.value_and_grad(MODEL.loss_fn, plan, **step_options)


def _late(seconds: float = TIMEOUT_S + 0.5) -> None:
    """Rank 1 is stuck in its own work for longer than the timeout (it does not wait for anyone)."""
    if fs.rank() == 1:
        time.sleep(seconds)


# -- class 3: hangs. Every synchronous collective honours the timeout --------------------


def _late_step() -> None:
    _, sparams, step = _setup()
    _late()
    step(sparams, *MODEL.batch_for(fs.rank()))


def _late_unshard(rank0_only: bool) -> None:
    _, sparams, _ = _setup()
    _late()
    fs.unshard(sparams, rank0_only=rank0_only)


def _late_clip() -> None:
    _, sparams, _ = _setup()
    _late()
    fs.optim.clip_by_global_norm(sparams, 1.0)


def _late_all_finite() -> None:
    _, sparams, _ = _setup()
    _late()
    fs.optim.all_finite(sparams)


def _late_shard() -> None:
    params = MODEL.init(0)
    plan = fs.plan(params, fs.Mesh({"fsdp": 2}), units=MODEL.units)
    fs.shard(params, plan)  # binds the mesh: both ranks are here
    _late()
    fs.shard(params, plan)


def _late_save(directory: str) -> None:
    _, sparams, _ = _setup()
    _late()
    fs.checkpoint.save(Path(directory) / "late", {"params": sparams})  # one target, one late rank


def _late_load(directory: str) -> None:
    _, sparams, _ = _setup()
    if fs.rank() == 0:
        fs.checkpoint.save(Path(directory) / "solo", {"params": sparams})  # rank 1 never comes
    else:
        _late()
        fs.checkpoint.load(Path(directory) / "solo", like={"params": sparams})


def _late_rng_states() -> None:
    _setup()
    _late()
    fs.checkpoint.rng_states()


# -- class 4: what made gloo abort the process ------------------------------------------


def _error_caught_and_carried_on() -> None:
    plan, sparams, _ = _setup()
    step = fs.value_and_grad(_loss_that_fails_in_block_1, plan, bucket_bytes=0)
    step(sparams, *MODEL.batch_for(fs.rank()), fail=False)  # the call order is known now
    if fs.rank() == 1:
        with contextlib.suppress(RuntimeError):  # the user catches it and carries on
            step(sparams, *MODEL.batch_for(1), fail=True)
    step(sparams, *MODEL.batch_for(fs.rank()), fail=False)


def _loss_that_fails_in_block_1(
    p: Any, tokens: torch.Tensor, targets: torch.Tensor, *, fail: bool
) -> Any:
    h = p["embed"]["tokens"][tokens]
    for i, blk in enumerate(p["blocks"]):
        if fail and i == 1:
            raise RuntimeError("rank 1 fails in a block")
        h = fs.call(MODEL._block, blk, h)
    return _head(p, h)


def _head(p: Any, h: torch.Tensor) -> torch.Tensor:
    return (h @ p["head"]["w"]).square().mean() * p["head"]["temp"]


def _skip_a_unit(steps_before: int, bucket_bytes: int | None = 0) -> None:
    _, sparams, step = _setup(bucket_bytes=bucket_bytes)
    for t in range(steps_before):
        step(sparams, *MODEL.batch_for(t))

    def loss_fn(p: Any, tokens: torch.Tensor, targets: torch.Tensor) -> Any:
        h = p["embed"]["tokens"][tokens]
        for i, blk in enumerate(p["blocks"]):
            if not (i == 1 and fs.rank() == 1):  # a data-dependent branch taken on rank 1 only
                h = fs.call(MODEL._block, blk, h)
        return _head(p, h)

    step.loss_fn = loss_fn
    step(sparams, *MODEL.batch_for(0))


def _stop_early() -> None:
    _, sparams, step = _setup()
    step(sparams, *MODEL.batch_for(0))

    def loss_fn(p: Any, tokens: torch.Tensor, targets: torch.Tensor) -> Any:
        h = p["embed"]["tokens"][tokens]
        for blk in p["blocks"][: 2 if fs.rank() == 1 else 3]:
            h = fs.call(MODEL._block, blk, h)
        return _head(p, h)

    step.loss_fn = loss_fn
    step(sparams, *MODEL.batch_for(0))


def _ignore_a_units_parameters() -> None:
    """Rank 1's loss uses block 1's output but not its parameters: its backward reduces less."""
    _, sparams, step = _setup()

    def loss_fn(p: Any, tokens: torch.Tensor, targets: torch.Tensor) -> Any:
        h = p["embed"]["tokens"][tokens]
        for i, blk in enumerate(p["blocks"]):
            block = _identity if i == 1 and fs.rank() == 1 else MODEL._block
            h = fs.call(block, blk, h)
        return _head(p, h)

    step.loss_fn = loss_fn
    step(sparams, *MODEL.batch_for(0))


def _identity(blk: Any, x: torch.Tensor) -> torch.Tensor:
    return x * 1.0


def _different_mixed_precision() -> None:
    precision = fs.MixedPrecision(param_dtype=torch.bfloat16) if fs.rank() == 1 else None
    _, sparams, step = _setup(mixed_precision=precision)
    step(sparams, *MODEL.batch_for(0))


def _different_prefetch() -> None:
    _, sparams, step = _setup(prefetch=fs.rank())
    step(sparams, *MODEL.batch_for(0))


def _different_plans() -> None:
    params = MODEL.init(0)
    units = MODEL.units if fs.rank() == 0 else ["blocks"]  # rank 1 diverged in its configuration
    plan = fs.plan(params, fs.Mesh({"fsdp": 2}), units=units)
    sparams = fs.shard(params, plan, verify=False)  # skip shard's check: the step's must catch it
    fs.value_and_grad(MODEL.loss_fn if fs.rank() == 0 else _whole_blocks, plan)(
        sparams, *MODEL.batch_for(0)
    )


def _whole_blocks(p: Any, tokens: torch.Tensor, targets: torch.Tensor) -> Any:
    h = fs.call(
        lambda blocks, x: MODEL._blocks(blocks, x), p["blocks"], p["embed"]["tokens"][tokens]
    )
    return _head(p, h)


def _different_collectives_in_debug_mode() -> None:
    from funcshard._src.comm import collectives, groups

    os.environ["FUNCSHARD_DEBUG"] = "1"
    try:
        bound = groups.bind(fs.Mesh({"fsdp": 2}))
        if fs.rank() == 0:
            collectives.all_gather(torch.ones(3), bound, ("fsdp",), tag="blocks/0").wait()
        else:
            collectives.reduce_scatter(torch.ones(2, 5), bound, ("fsdp",), tag="blocks/1").wait()
    finally:
        del os.environ["FUNCSHARD_DEBUG"]


def _change_a_setting_on_one_rank() -> None:
    """Rank 1 alone changes the all-gather algorithm between two steps (the ranks agreed once)."""
    _, sparams, step = _setup()
    step(sparams, *MODEL.batch_for(fs.rank()))
    if fs.rank() == 1:
        os.environ["FUNCSHARD_ALL_GATHER"] = "native"
    try:
        step(sparams, *MODEL.batch_for(fs.rank()))
    finally:
        os.environ.pop("FUNCSHARD_ALL_GATHER", None)


def _load_different_checkpoints(directory: str) -> None:
    _, sparams, _ = _setup()
    name = "good" if fs.rank() == 0 else "other"  # e.g. latest() on a directory that lags
    fs.checkpoint.load(Path(directory) / name, like={"params": sparams, "step": 0})


def _different_operations() -> None:
    _, sparams, _ = _setup()
    if fs.rank() == 0:
        fs.optim.clip_by_global_norm(sparams, 1.0)
    else:
        fs.unshard(sparams)


def _adafactor_beside_clipping() -> None:
    _, sparams, step = _setup()
    _, grads = step(sparams, *MODEL.batch_for(fs.rank()))
    if fs.rank() == 0:
        opt = fs.optim.adafactor(1e-2)
        opt.update_(grads, opt.init(sparams), sparams)
    else:
        fs.optim.clip_by_global_norm(grads, 1.0)


# -- classes 1, 2 and 5: checkpoints ------------------------------------------------------


def _save_reference(directory: str) -> None:
    _, sparams, _ = _setup()
    fs.checkpoint.save(Path(directory) / "good", {"params": sparams, "step": 4}, step=4, run="r")


def _load(directory: str) -> None:
    _, sparams, _ = _setup()
    loaded = fs.checkpoint.load(Path(directory) / "bad", like={"params": sparams, "step": 0})
    raise AssertionError(f"loaded a bad checkpoint: {loaded['step']}")


def _rank_1_cannot_write(directory: str) -> None:
    _, sparams, _ = _setup()
    if fs.rank() == 1:
        import funcshard._src.checkpoint.save as saving

        def full_disk(*_: Any) -> Any:
            raise OSError(28, "No space left on device")

        saving.write_chunks = full_disk  # this worker only; the pool restarts it after the case
    fs.checkpoint.save(
        Path(directory) / "step6", {"params": sparams, "step": 6}, step=6, keep=1, run="r"
    )


def _keep_zero(directory: str) -> None:
    _, sparams, _ = _setup()
    fs.checkpoint.save(Path(directory) / "step8", {"params": sparams}, step=8, keep=0)


# -- class 6: silent acceptance ----------------------------------------------------------


def _different_initial_params() -> None:
    params = MODEL.init(fs.rank())  # seeded with the rank: a classic mistake
    fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 2}), units=MODEL.units))


def _tie_as_a_view() -> None:
    params = MODEL.init(0)
    params["head"]["w"] = params["embed"]["tokens"].T
    fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 2}), units=MODEL.units))


# -- the harness -------------------------------------------------------------------------


def _attempt(name: str, *args: Any) -> tuple[Outcome, bool]:
    """Runs case ``name`` on this rank; returns what it raised and whether the rank is still in step."""
    fs.set_collective_timeout(TIMEOUT_S)
    start = time.monotonic()
    try:
        BODIES[name](*args)
        outcome: Outcome = ("ok", "", time.monotonic() - start)
    except BaseException as e:
        notes = "\n".join(getattr(e, "__notes__", []))
        outcome = (type(e).__name__, f"{e}\n{notes}", time.monotonic() - start)
    finally:
        fs.set_collective_timeout(None)
    ch = channel.channel()
    return outcome, ch is None or ch.out_of_step is None


BODIES: dict[str, Callable[..., None]] = {
    "late-step": _late_step,
    "late-unshard": lambda: _late_unshard(False),
    "late-unshard-rank0": lambda: _late_unshard(True),
    "late-clip": _late_clip,
    "late-all-finite": _late_all_finite,
    "late-shard": _late_shard,
    "late-rng-states": _late_rng_states,
    "late-save": _late_save,
    "late-load": _late_load,
    "error-caught-and-carried-on": _error_caught_and_carried_on,
    "skip-a-unit-first-step": lambda: _skip_a_unit(0),
    "skip-a-unit-later-step": lambda: _skip_a_unit(2),
    # the blocks share one bucket (the default on gloo): the ranks part at an agreement
    "skip-a-unit-in-a-bucket": lambda: _skip_a_unit(2, bucket_bytes=None),
    "stop-early": _stop_early,
    "ignore-a-units-parameters": _ignore_a_units_parameters,
    "different-mixed-precision": _different_mixed_precision,
    "different-prefetch": _different_prefetch,
    "different-operations": _different_operations,
    "adafactor-beside-clipping": _adafactor_beside_clipping,
    "different-plans": _different_plans,
    "change-a-transport-setting-on-one-rank": _change_a_setting_on_one_rank,
    "debug-mode": _different_collectives_in_debug_mode,
    "load-different-checkpoints": _load_different_checkpoints,
    "different-initial-params": _different_initial_params,
    "tie-as-a-view": _tie_as_a_view,
    "load": _load,
    "cannot-write": _rank_1_cannot_write,
    "keep-zero": _keep_zero,
}

LATE = ("CollectiveError", r"on rank 1|rank 0 gave up|a peer gave up")
EXPECTED: dict[str, list[tuple[str, str]]] = {  # per rank: (error, regex of its message)
    "late-step": [
        (
            "CollectiveError",
            r"the start of a step on rank 0: the other ranks did not reach it within 2 s",
        ),
        LATE,
    ],
    "late-unshard": [
        ("CollectiveError", r"fs.unshard on rank 0: the other ranks did not reach it"),
        LATE,
    ],
    "late-unshard-rank0": [("CollectiveError", r"fs.unshard on rank 0"), LATE],
    "late-clip": [("CollectiveError", r"clip_by_global_norm on rank 0"), LATE],
    "late-all-finite": [("CollectiveError", r"all_finite on rank 0"), LATE],
    "late-shard": [("CollectiveError", r"fs.shard on rank 0"), LATE],
    "late-rng-states": [("CollectiveError", r"rng_states on rank 0"), LATE],
    "error-caught-and-carried-on": [
        (
            "CollectiveError",
            r"on rank 0 failed: the other ranks did not join within 2 s.* The other ranks reported: rank 1 gave up during a step \(operation #\d+\): RuntimeError: rank 1 fails in a block",
        ),
        (
            "CollectiveError",
            r"the start of a step on rank 1 refused: an earlier operation left the ranks out of step",
        ),
    ],
    "skip-a-unit-first-step": [  # no call order yet: every call of the first step agrees
        (
            "DesyncError",
            r"ranks disagree at call #1 of the step: rank 1: unit called blocks/2 \(rank 0: blocks/1\)",
        ),
        ("DesyncError", r"call #1 of the step"),
    ],
    "skip-a-unit-later-step": [
        (
            "CollectiveError",
            r"all_gather of unit 'blocks/2' over mesh axes \['fsdp'\] on rank 0 failed",
        ),
        ("CollectiveError|DesyncError", r"call #1 of the step"),
    ],
    "skip-a-unit-in-a-bucket": [  # no unit's gather is issued alone: the agreements catch it
        ("DesyncError", r"ranks are at different operations .*rank 0 at the end of forward"),
        ("DesyncError", r"ranks are at different operations .*rank 1 at call #1 of the step"),
    ],
    "stop-early": [
        (
            "DesyncError",
            r"ranks disagree at the end of forward: rank 1: units called 2 calls, digest [0-9a-f]+ \(rank 0: 3 calls",
        ),
        ("DesyncError", r"ranks disagree at the end of forward"),
    ],
    "ignore-a-units-parameters": [
        (
            "CollectiveError|DesyncError",
            r"reduce_scatter of unit 'blocks/1'|the end of backward|rank 1",
        ),
        ("CollectiveError|DesyncError", r"the reduction of call #0 \(unit 'blocks/0'\)"),
    ],
    "different-mixed-precision": [
        (
            "DesyncError",
            r"the start of a step: rank 1: mixed precision MixedPrecision\(param_dtype=torch.bfloat16",
        ),
        ("DesyncError", r"mixed precision"),
    ],
    "different-prefetch": [
        ("DesyncError", r"rank 1: prefetch 1 \(rank 0: 0\)"),
        ("DesyncError", r"prefetch"),
    ],
    "different-operations": [
        ("DesyncError", r"ranks are at different operations"),
        ("DesyncError", r"ranks are at different operations"),
    ],
    "adafactor-beside-clipping": [  # both reduce over the mesh: the agreement names both
        ("DesyncError", r"adafactor.*clip_by_global_norm|clip_by_global_norm.*adafactor"),
        ("DesyncError", r"adafactor.*clip_by_global_norm|clip_by_global_norm.*adafactor"),
    ],
    "different-plans": [
        (
            "DesyncError",
            r"ranks disagree at the start of a step: rank 1: plan fingerprint [0-9a-f]{16} \(rank 0: [0-9a-f]{16}\)",
        ),
        ("DesyncError", r"Every rank must build the same plan"),
    ],
    "change-a-transport-setting-on-one-rank": [
        ("CollectiveError", r"all_gather of unit '<root>'.*failed"),
        ("CollectiveError", r"the transport settings before all_gather of unit '<root>'"),
    ],
    "debug-mode": [
        (
            "DesyncError",
            r"ranks issue different collectives at all_gather of unit 'blocks/0'.*rank 0: \('all_gather', 'blocks/0', \(3,\), 'torch.float32'\); rank 1: \('reduce_scatter', 'blocks/1', \(2, 5\), 'torch.float32'\)",
        ),
        ("DesyncError", r"ranks issue different collectives"),
    ],
    "different-initial-params": [
        (
            "DesyncError",
            r"fs.shard: ranks passed different plans or params: rank 1's values of \['blocks/0/b', 'blocks/0/w'",
        ),
        ("DesyncError", r"verify=False skips this check"),
    ],
    "tie-as-a-view": [
        ("ValueError", r"'head/w' shares memory with 'embed/tokens'"),
        ("ValueError", r"A tied weight is one leaf"),
    ],
}


def _check(results: list[tuple[Outcome, bool]], expected: list[tuple[str, str]]) -> None:
    for rank, ((name, message, seconds), _), (error, pattern) in zip(range(2), results, expected):
        assert re.fullmatch(error, name), f"rank {rank} raised {name}: {message}"
        assert re.search(pattern, message), f"rank {rank}: {message}"
        assert seconds <= TIMEOUT_S + 5, f"rank {rank} took {seconds:.1f} s"


def _run(pools: Any, name: str, *args: Any) -> list[tuple[Outcome, bool]]:
    results = pools.run(2, _attempt, name, *args, timeout_s=60)  # a hang ends here, as a failure
    if not all(in_step for _, in_step in results):
        pools.pool(2).close()  # out of step, as promised: the next case starts fresh
    return results


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_every_rank_fails_with_a_named_error_in_time(pools, case):
    _check(_run(pools, case), EXPECTED[case])


@pytest.mark.parametrize("which", ["late-save", "late-load"])
def test_a_late_rank_in_a_checkpoint_fails_in_time(pools, tmp_path, which):
    _check(
        _run(pools, which, str(tmp_path)),
        [("CollectiveError", r"fs.checkpoint.save on rank 0"), LATE],
    )
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == []
    )  # nothing committed, nothing half-written


# -- checkpoints at W=2: a bad one fails every rank, a failed save commits nothing --------

DAMAGE: dict[str, tuple[Callable[[Path], None], list[tuple[str, str]]]] = {}


def _damage(name: str, expected: list[tuple[str, str]]):
    def register(fn: Callable[[Path], None]) -> Callable[[Path], None]:
        DAMAGE[name] = (fn, expected)
        return fn

    return register


@_damage("malicious-pickle", [("UnsafeCheckpointError", r"refers to posix.system")] * 2)
def _malicious(bad: Path) -> None:
    tampering.replace_file(bad, "rank0/.metadata", pickle.dumps(_Run(bad.parent / "pwned")))


@_damage(
    "rank-1s-chunk-damaged",
    [
        (
            "CorruptCheckpointError",
            r"loading failed on rank 1: CorruptCheckpointError: .*rank1/__0_0.distcp",
        ),
        (
            "CorruptCheckpointError",
            r"rank1/__0_0.distcp, chunk .*: its contents differ from what was saved",
        ),
    ],
)
def _damage_rank1(bad: Path) -> None:
    data = bad / "rank1" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    first = MODEL.init(0)["blocks"][1]["w"][3:].numpy().tobytes()  # rank 1's shard of a leaf
    raw[raw.index(first[:16])] ^= 0xFF
    data.write_bytes(bytes(raw))


@_damage("offsets-crafted", [("CorruptCheckpointError", r"do not cover dim 0")] * 2)
def _shift_offsets(bad: Path) -> None:
    def shift(m: dict[str, Any]) -> None:
        entry = next(e for e in m["leaves"] if e["kind"] == "sharded" and len(e["chunks"]) == 2)
        entry["chunks"][1]["offsets"][0] += 1  # rows that would come back as zeros
        entry["chunks"][1]["key"] = (
            f"{entry['path']}@{','.join(map(str, entry['chunks'][1]['offsets']))}"
        )

    tampering.edit(bad, shift)


@_damage(
    "kind-flipped-to-value",
    [
        (
            "CheckpointMismatchError",
            r"params/blocks/0/b: saved a value \(int\), asked for a ShardedTensor",
        )
    ]
    * 2,
)
def _flip_kind(bad: Path) -> None:
    def flip(m: dict[str, Any]) -> None:
        i = next(i for i, e in enumerate(m["leaves"]) if e["path"] == "params/blocks/0/b")
        m["leaves"][i] = {"path": m["leaves"][i]["path"], "kind": "value", "value": 7}

    tampering.edit(bad, flip)


class _Run:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_bad_checkpoint_fails_every_rank_and_runs_nothing(pools, tmp_path, case):
    pools.run(2, _save_reference, str(tmp_path))
    shutil.copytree(tmp_path / "good", tmp_path / "bad")
    damage, expected = DAMAGE[case]
    damage(tmp_path / "bad")
    results = _run(pools, "load", str(tmp_path))
    _check(results, expected)
    assert not (tmp_path / "pwned").exists()
    assert all(in_step for _, in_step in results)  # a refused load leaves the ranks in step


def test_a_save_that_fails_on_one_rank_fails_on_all_and_loses_nothing(pools, tmp_path):
    pools.run(2, _save_reference, str(tmp_path))
    results = _run(pools, "cannot-write", str(tmp_path))
    pools.pool(2).close()  # rank 1's writer was replaced
    expected = (
        "CheckpointError",
        r"step6 failed, nothing was committed: rank 1: OSError: \[Errno 28\] No space left",
    )
    _check(results, [expected] * 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good"]
    assert fs.checkpoint.load_full(tmp_path / "good")["step"] == 4


def test_ranks_that_load_different_checkpoints_fail(pools, tmp_path):
    pools.run(2, _save_reference, str(tmp_path))
    shutil.copytree(tmp_path / "good", tmp_path / "other")
    tampering.edit(tmp_path / "other", lambda m: m.update(step=2))  # another sound checkpoint
    results = _run(pools, "load-different-checkpoints", str(tmp_path))
    _check(
        results,
        [
            (
                "CheckpointError",
                r"the ranks loaded different checkpoints \(rank 0: .*good; rank 1: .*other\)",
            )
        ]
        * 2,
    )


def test_keep_zero_is_refused_on_every_rank(pools, tmp_path):
    pools.run(2, _save_reference, str(tmp_path))
    results = _run(pools, "keep-zero", str(tmp_path))
    _check(results, [("ValueError", r"keep=0 would delete the checkpoint just written")] * 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good"]


def test_the_environment_timeout_survives_init(monkeypatch):
    from funcshard._src.comm import runtime

    monkeypatch.setenv("FUNCSHARD_COLLECTIVE_TIMEOUT_S", "7")
    monkeypatch.setattr(runtime, "_explicit_timeout_s", runtime._UNSET)
    monkeypatch.setattr(runtime, "_init_timeout_s", 600.0)  # what fs.init(timeout_s=600) leaves
    assert runtime.collective_timeout() == 7.0
    monkeypatch.setenv("FUNCSHARD_COLLECTIVE_TIMEOUT_S", "soon")
    with pytest.raises(
        ValueError, match=r"FUNCSHARD_COLLECTIVE_TIMEOUT_S='soon': give a positive number"
    ):
        runtime.collective_timeout()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0, -1, True, "3"])
def test_bad_timeouts_are_refused(bad):
    with pytest.raises(ValueError, match="a collective timeout must be"):
        fs.set_collective_timeout(bad)


def test_shard_onto_an_unusable_device():
    params = {"w": torch.ones(2)}
    plan = fs.plan(params, fs.Mesh({"x": 1}))
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for CPU-only torch builds")
    with pytest.raises(ValueError, match=r"device='cuda', but this torch .* sees no CUDA device"):
        fs.shard(params, plan, device="cuda")
    with pytest.raises(ValueError, match=r"device='gpu0' is not a device"):
        fs.shard(params, plan, device="gpu0")


def test_mixed_requires_grad_is_refused():
    params = {"w": torch.ones(2, requires_grad=True), "frozen": torch.ones(2)}
    with pytest.raises(
        ValueError, match=r"\['frozen'\] have requires_grad=False while other leaves require grad"
    ):
        fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
