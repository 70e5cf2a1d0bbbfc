"""A call's gradients on one rank ([Note: gradients without communication] in ``execute/gradients.py``).

No process group: what happens to gradients before and after their collectives.
"""

from __future__ import annotations

import torch

import funcshard as fs
from funcshard._src.execute.gradients import Gradients, take_donated
from funcshard._src.shard.sharded import flats_of


def _layout_and_params():
    params = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)}
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}))
    sparams = fs.shard(params, plan)
    (flat,) = {id(f): f for f in flats_of(sparams)}.values()
    return flat.layout, sparams, {"": [flat]}


def test_the_first_reduced_gradient_becomes_the_buffer_and_later_ones_add_into_it():
    layout, _, _ = _layout_and_params()
    g = Gradients(spares={})
    first = torch.ones(layout.numel)
    g.add(layout, first)
    assert g.sums[layout] is first
    g.add(layout, torch.full((layout.numel,), 2.0))
    assert torch.equal(g.sums[layout], torch.full((layout.numel,), 3.0))


def test_kept_rows_are_taken_once():
    layout, _, _ = _layout_and_params()
    g = Gradients(spares={})
    rows = torch.zeros(2, layout.numel)
    g.keep(layout, rows)
    assert g.keeps(layout)
    assert g.take_kept(layout) is rows
    assert g.take_kept(layout) is None
    assert not g.keeps(layout)


def test_a_donated_buffer_is_handed_out_once_and_only_in_its_dtype():
    layout, _, _ = _layout_and_params()
    buf = torch.empty(layout.numel)
    g = Gradients(spares={layout: buf})
    assert g.spare(layout, torch.float64) is None  # another dtype: not this buffer, and it is gone
    g = Gradients(spares={layout: buf})
    assert g.spare(layout, torch.float32) is buf
    assert g.spare(layout, torch.float32) is None


def test_the_tree_is_the_mean_over_micro_batches_and_its_buffers_can_be_donated():
    layout, sparams, by_unit = _layout_and_params()
    g = Gradients(spares={})
    g.add(layout, torch.full((layout.numel,), 4.0))
    grads = g.tree(sparams, by_unit, micro_batches=2)
    assert torch.equal(fs.unshard(grads)["w"], torch.full((2, 3), 2.0))
    donated = take_donated(flats_of(grads))
    assert list(donated) == [layout]
    try:
        fs.unshard(grads)
    except fs.DonatedError:
        pass
    else:
        raise AssertionError("a donated tree was read")
