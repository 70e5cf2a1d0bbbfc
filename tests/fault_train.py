"""A training job for the fault test, run under torchrun: resumes from its latest checkpoint.

``python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1
tests/fault_train.py DIR STEPS [--kill-at K]``: trains a small model for STEPS
steps, saving a checkpoint every 2 steps (keeping 2) under DIR, and the final
params in DIR/final. With ``--kill-at K``, rank 1 of the first attempt SIGKILLs
itself after step K; torchrun restarts every rank, which resume from the
latest complete checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import funcshard as fs
from tests.models import Model

MODEL = Model(kind="transformer", width=6, hidden=10, layers=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    fs.init(timeout_s=120)  # restarted ranks import torch again; allow for a loaded machine
    plan = fs.plan(MODEL.init(0), fs.Mesh({"fsdp": fs.world_size()}), units=MODEL.units)
    sparams = fs.shard(MODEL.init(0), plan)
    opt = fs.optim.adamw(lr=0.05)
    state = opt.init(sparams)
    start = 0
    found = fs.checkpoint.latest(Path(args.directory) / "checkpoints")
    if found is not None:
        loaded = fs.checkpoint.load(found, like={"params": sparams, "opt": state, "step": 0})
        sparams, state, start = loaded["params"], loaded["opt"], loaded["step"]
    step = fs.value_and_grad(MODEL.loss_fn, plan)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for t in range(start, args.steps):
        _, grads = step(sparams, *MODEL.batch_for(100 * t + fs.rank()))
        sparams, state = opt.update(grads, state, sparams)
        if (t + 1) % 2 == 0:
            fs.checkpoint.save(
                Path(args.directory) / "checkpoints" / f"step{t + 1:04d}",
                {"params": sparams, "opt": state, "step": t + 1},
                step=t + 1,
                keep=2,
            )
        if args.kill_at == t + 1 and first_attempt and fs.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    fs.checkpoint.save(Path(args.directory) / "final", {"params": sparams})


if __name__ == "__main__":
    main()
