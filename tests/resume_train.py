"""A training job that resumes from its latest checkpoint, for the restart tests; run it under torchrun.

``python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1
tests/resume_train.py DIR STEPS [--kill-at K --kill-rank R --kill-point P]``
trains a small model for STEPS steps, saving a checkpoint every 2 steps
(keeping 2) under DIR/checkpoints and the final params in DIR/final. With
``--kill-at K``, rank R (``-1``: every rank) of the first attempt SIGKILLs
itself in step K at point P: ``after_update``, ``mid_forward`` (after the first
unit), ``mid_backward`` (inside autograd) or ``mid_save`` (after writing its
files, before the commit; K must be even), or inside a save at
``save:write`` (its data written, not yet reported), ``save:manifest`` (rank 0,
manifest written, not renamed), ``save:committed`` (renamed, not rotated) or
``save:rotating`` (one old checkpoint's manifest deleted). torchrun then
restarts every rank, which resume from the latest complete checkpoint.
``--keep 0`` keeps every checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import funcshard as fs
import funcshard._src.checkpoint.save as saving
from tests.models import Model

MODEL = Model(kind="transformer", width=6, hidden=10, layers=2)
POINTS = ("after_update", "mid_forward", "mid_backward", "mid_save")
SAVE_POINTS = ("save:write", "save:manifest", "save:committed", "save:rotating")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-point", choices=POINTS + SAVE_POINTS, default="after_update")
    parser.add_argument("--keep", type=int, default=2)
    args = parser.parse_args()
    fs.init(timeout_s=120)  # restarted ranks import torch again; allow for a loaded machine
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    victim = first_attempt and args.kill_rank in (fs.rank(), -1) and args.kill_at is not None
    now = {"step": 0}

    def die_at(point: str) -> None:
        if victim and now["step"] == args.kill_at and args.kill_point == point:
            os.kill(os.getpid(), signal.SIGKILL)

    plan = fs.plan(MODEL.init(0), fs.Mesh({"fsdp": fs.world_size()}), units=MODEL.units)
    sparams = fs.shard(MODEL.init(0), plan)
    opt = fs.optim.adamw(lr=0.05)
    state = opt.init(sparams)
    start = 0
    checkpoints = args.directory / "checkpoints"
    found = fs.checkpoint.latest(checkpoints)
    if found is not None:
        loaded = fs.checkpoint.load(found, like={"params": sparams, "opt": state, "step": 0})
        sparams, state, start = loaded["params"], loaded["opt"], loaded["step"]
        print(f"rank {fs.rank()} resumes from {found.name}", flush=True)

    def loss_fn(p: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = p["embed"]["tokens"][tokens]
        for i, blk in enumerate(p["blocks"]):
            h = fs.call(MODEL._block, blk, h)
            if i == 0:
                die_at("mid_forward")
                if h.requires_grad:
                    h.register_hook(lambda g: (die_at("mid_backward"), g)[1])
        logits = (h @ p["head"]["w"]) * p["head"]["temp"]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )

    write_mine = saving._write_mine

    def write_then_die(*a: Any) -> Any:
        report = write_mine(*a)
        die_at("mid_save")
        return report

    saving._write_mine = write_then_die
    _arm_save_points(die_at)
    step = fs.value_and_grad(loss_fn, plan)
    for t in range(start, args.steps):
        now["step"] = t + 1
        _, grads = step(sparams, *MODEL.batch_for(100 * t + fs.rank()))
        sparams, state = opt.update_(grads, state, sparams)
        if (t + 1) % 2 == 0:
            fs.checkpoint.save(
                checkpoints / f"step{t + 1:04d}",
                {"params": sparams, "opt": state, "step": t + 1},
                step=t + 1,
                keep=args.keep or None,
            )
        die_at("after_update")
    fs.checkpoint.save(args.directory / "final", {"params": sparams})


def _arm_save_points(die_at: Any) -> None:
    """Wraps the steps of a save so that ``die_at`` can kill the victim between them."""
    import funcshard._src.checkpoint.commit as commit

    def after(fn: Any, point: str) -> Any:
        def wrapped(*a: Any, **kw: Any) -> Any:
            out = fn(*a, **kw)
            die_at(point)
            return out

        return wrapped

    saving.write_chunks = after(saving.write_chunks, "save:write")
    saving.write_manifest = after(saving.write_manifest, "save:manifest")
    commit.rename_into_place = after(commit.rename_into_place, "save:committed")
    import funcshard._src.checkpoint.cleanup as cleanup

    unlink = cleanup._unlink_regular

    def unlink_then_die(fd: int, name: str) -> bool:
        done = unlink(fd, name)
        if name == cleanup.MANIFEST:
            die_at("save:rotating")  # the manifest is gone, its files not yet: a half-deleted one
        return done

    cleanup._unlink_regular = unlink_then_die


if __name__ == "__main__":
    main()
