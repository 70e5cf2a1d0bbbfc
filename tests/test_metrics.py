"""``fs.mean_over_ranks``: every rank gets the same mean of a per-rank metric, or a named error."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import funcshard as fs


def _means() -> Any:
    r = fs.rank()
    metrics = {f"m{i}": float(r * 10 + i) for i in range(6)}  # more than one agreement carries
    return fs.mean_over_ranks(
        {"loss": torch.tensor(1.0 + r, dtype=torch.bfloat16), "count": r, **metrics}
    )


def test_every_rank_gets_the_mean_of_every_leaf(pools):
    results = pools.run(2, _means)
    assert results[0] == results[1]
    got = results[0]
    assert got["loss"].dtype == torch.bfloat16
    assert float(got["loss"]) == 1.5
    assert got["count"] == 0.5
    assert [got[f"m{i}"] for i in range(6)] == [5.0 + i for i in range(6)]


def _different_trees() -> str:
    tree = {"loss": 1.0} if fs.rank() == 0 else {"loss": 1.0, "acc": 0.5}
    try:
        fs.mean_over_ranks(tree)
    except fs.DesyncError as e:
        return str(e)
    return "no error"


def test_ranks_with_different_metrics_get_a_desync_error(pools):
    for message in pools.run(2, _different_trees):
        assert "ranks run different operations where they sum over every rank" in message


def test_one_process_gives_the_value_and_bad_leaves_are_named():
    assert fs.mean_over_ranks(3) == 3.0
    assert fs.mean_over_ranks([]) == []
    assert torch.equal(fs.mean_over_ranks(torch.tensor([2])), torch.tensor(2.0))
    with pytest.raises(ValueError, match=r"mean_over_ranks: b is a tensor of shape \[2\]; pass"):
        fs.mean_over_ranks({"a": 1.0, "b": torch.ones(2)})
    with pytest.raises(ValueError, match=r"mean_over_ranks: <root> is a str"):
        fs.mean_over_ranks("1.0")


def _logged(path: str) -> Any:
    seen: list[tuple[int, dict[str, float]]] = []
    logger = fs.MetricLogger(lambda step, m: seen.append((step, m)), every=2, jsonl=path)
    out = [
        logger.log(step, {"loss": torch.tensor(float(step + 10 * fs.rank()))})
        for step in range(1, 6)
    ]
    out.append(logger.flush(5))  # the window's last step
    return out, seen


def test_the_logger_averages_over_steps_and_ranks_and_emits_on_rank_0(pools, tmp_path):
    path = tmp_path / "metrics.jsonl"
    (out0, seen0), (out1, seen1) = pools.run(2, _logged, str(path))
    # steps 1, 2 -> (1.5 + 11.5) / 2; steps 3, 4 -> 8.5; step 5 alone -> 10
    assert out0 == out1 == [None, {"loss": 6.5}, None, {"loss": 8.5}, None, {"loss": 10.0}]
    assert seen0 == [(2, {"loss": 6.5}), (4, {"loss": 8.5}), (5, {"loss": 10.0})]
    assert seen1 == []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"step": 2, "loss": 6.5}, {"step": 4, "loss": 8.5}, {"step": 5, "loss": 10.0}]


def test_bad_logger_arguments():
    with pytest.raises(ValueError, match=r"every must be an integer >= 1, got 0"):
        fs.MetricLogger(every=0)
    with pytest.raises(TypeError, match=r"callback 0 is a str"):
        fs.MetricLogger("print")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"metric 'loss' is a tensor of shape \[2\]"):
        fs.MetricLogger().log(1, {"loss": torch.ones(2)})
