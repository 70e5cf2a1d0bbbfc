"""A long training job with saves, for the soak test; run it under torchrun.

``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/soak_train.py DIR STEPS``
trains for STEPS steps, clipping and checking for non-finite gradients each
step, saving every 10 steps (keeping 2) and unsharding every 50; each rank
prints its resident memory, open file descriptors and threads after the first
20 steps and at the end, as ``soak rank R: rss_mib fds threads`` lines.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import funcshard as fs
from tests.models import Model

MODEL = Model(kind="transformer", width=16, hidden=32, layers=4, vocab=32, seq=8, batch=4)


def usage() -> tuple[float, int, int]:
    """(resident MiB, open file descriptors, threads) of this process, as the OS counts them.

    The OS's thread count includes gloo's threads, which ``threading`` does not see.
    """
    status = Path("/proc/self/status").read_text().splitlines()
    rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    threads = next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    return rss / 1024, len(os.listdir("/proc/self/fd")), threads


def main() -> None:
    directory, steps = Path(sys.argv[1]), int(sys.argv[2])
    fs.init(timeout_s=120)
    plan = fs.plan(MODEL.init(0), fs.Mesh({"fsdp": fs.world_size()}), units=MODEL.units)
    sparams = fs.shard(MODEL.init(0), plan)
    opt = fs.optim.skip_nonfinite(fs.optim.adamw(lr=1e-3))
    state = opt.init(sparams)
    step = fs.value_and_grad(MODEL.loss_fn, plan)
    for t in range(steps):
        _, grads = step(sparams, *MODEL.batch_for(100 * t + fs.rank()))
        grads, _ = fs.optim.clip_by_global_norm(grads, 1.0)
        sparams, state = opt.update_(grads, state, sparams)
        if (t + 1) % 10 == 0:
            fs.checkpoint.save(
                directory / f"step{t + 1:04d}",
                {"params": sparams, "opt": state, "step": t + 1},
                step=t + 1,
                keep=2,
            )
        if (t + 1) % 50 == 0:
            fs.unshard(sparams, rank0_only=True)
        if t + 1 in (20, steps):
            rss, fds, threads = usage()
            print(f"soak rank {fs.rank()} step {t + 1}: {rss:.1f} {fds} {threads}", flush=True)


if __name__ == "__main__":
    main()
