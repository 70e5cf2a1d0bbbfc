"""The funcshard source files one steady-state full_shard step runs through.

How it counts: a small transformer (embedding, two blocks and a head, each a
unit) is planned ``full_shard`` over ``{"fsdp": W}`` and stepped twice (the first
learns the call order, the second warms every buffer); over the third step
``sys.setprofile`` records the file of every Python function entered, from
``fs.value_and_grad``'s call to its return (the forward, the backward through
autograd's hooks, the reductions and the waits). The files under
``funcshard/`` are listed, relative to the repository. The model and the test
harness are not funcshard's and are left out.

    python -m tests.step_files          # W=1 here and W=2 in two gloo workers
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import funcshard as fs
from funcshard._src.plan.units import RequestedLayout
from tests.models import Model

ROOT = Path(fs.__file__).resolve().parent.parent
PACKAGE = str(Path(fs.__file__).resolve().parent)


def step_files(
    mesh: dict[str, int] | None = None,
    *,
    layout: RequestedLayout = "leaf",
    bucket_bytes: int | None = None,
) -> list[str]:
    """The funcshard files entered by one steady-state full_shard step, sorted; run on every rank.

    The shared-memory transport is loaded first, as it is in any process that ever used it:
    a step then settles through it (``transport.settle``) even at W=1, so the count does not
    depend on what ran earlier in the process.
    """
    from funcshard._src.comm import transport

    transport.shared_memory()
    model = Model(kind="transformer", vocab=64, width=16, hidden=32, layers=2, embed_unit=True)
    params = model.init(0)
    plan = fs.plan(
        params,
        fs.Mesh(mesh or {"fsdp": fs.world_size()}),
        units=model.units,
        strategy="full_shard",
        layout=layout,
    )
    sparams = fs.shard(params, plan)
    step = fs.value_and_grad(model.loss_fn, plan, bucket_bytes=bucket_bytes)
    batch = model.batch_for(fs.rank())
    for _ in range(2):
        step(sparams, *batch)
    seen: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        step(sparams, *batch)
    finally:
        sys.setprofile(None)
    return sorted(str(Path(f).resolve().relative_to(ROOT)) for f in seen if f.startswith(PACKAGE))


def main() -> None:
    from tests.pool import WorkerPool

    one = step_files({"fsdp": 1})
    pool = WorkerPool(2)
    try:
        two = pool.run(step_files)[0]
    finally:
        pool.close()
    for w, files in ((1, one), (2, two)):
        print(f"W={w}: {len(files)} files")
        for f in files:
            print(f"  {f}")


if __name__ == "__main__":
    main()
