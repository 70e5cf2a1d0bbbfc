"""The checkpoint conformance matrix: every row that trains is saved and reloaded bit for bit.

Beside ``tests/test_conformance.py`` (which trains each row against its reference):
each row of the table that trains is trained one step at W=2 and at W=1, then saved
and loaded through every checkpoint path of ``tests/conformance/checkpoints.py``
(``fs.checkpoint.save``/``load``; ``save_dcp``/``load_dcp`` and FSDP2's ``dcp.load``
of what funcshard wrote; ``apply.state_dict``; ``save_pretrained``/``load_pretrained``).
Every parameter and persistent buffer must come back equal to the trained value, bit
for bit, under each of its names, or the path must refuse the row at save time with
the message the row's ``checkpoint_refused`` gives. A failure names the row, the world size,
the path and the tensors. CI runs ``IN_CI``; ``nox -s conformance`` runs them all.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.conformance.catalog import ROWS
from tests.conformance.checkpoints import PATHS, run_checkpoints

# One row through every path in CI: a plain stack with buffers (BatchNorm) and a row
# whose state-dict hook computes wq/wk/wv from a fused wqkv.
IN_CI = (("norm/BatchNorm", 2), ("state/fused-qkv-hook", 2))

CASES = [
    pytest.param(
        name,
        world,
        id=f"{name}-W{world}",
        marks=() if (name, world) in IN_CI else pytest.mark.matrix,
    )
    for name, row in ROWS.items()
    if row.refused is None
    for world in (2, 1)
]


@pytest.mark.parametrize(("name", "world"), CASES)
def test_row_round_trips_through_every_checkpoint_path(
    pools: Any, tmp_path: Any, name: str, world: int
):
    results = pools.run(world, run_checkpoints, name, str(tmp_path), timeout_s=300)
    for rank, result in enumerate(results):
        for path in PATHS:
            outcome = result[path]
            refused = next((r for p, r, _ in ROWS[name].checkpoint_refused if p == path), None)
            where = f"{name} W={world} rank {rank} {path}"
            if refused is not None:
                assert outcome["error"] is not None, f"{where}: saved; expected a refusal"
                assert re.search(refused, outcome["error"]), f"{where}: {outcome['error']}"
                continue
            assert outcome["error"] is None, f"{where}: {outcome['error']}"
            assert not outcome["missing"], f"{where}: not loaded: {outcome['missing']}"
            assert not outcome["differ"], f"{where}: not bit for bit: {outcome['differ']}"


def test_every_refusal_names_a_path():
    for name, row in ROWS.items():
        for path, _, _ in row.checkpoint_refused:
            assert path in PATHS, f"{name}: {path} is not a checkpoint path"
