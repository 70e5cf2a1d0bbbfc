"""A call's gradients on one rank ([Note: gradients without communication] in ``execute/gradients.py``).

No process group: what happens to gradients before and after their collectives.
"""

from __future__ import annotations

import torch

import funcshard as fs
from funcshard._src.execute.gradients import Gradients, take_donated
from funcshard._src.shard.layout import FlatLayout
from funcshard._src.shard.sharded import flats_of


class Part:
    """A part as gradients see it: kept by identity, with its layout."""

    def __init__(self, layout: FlatLayout) -> None:
        self.layout = layout


def _layout_and_params():
    params = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)}
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}))
    sparams = fs.shard(params, plan)
    (flat,) = {id(f): f for f in flats_of(sparams)}.values()
    part = Part(flat.layout)
    return part, sparams, [(part, flat)]


def test_the_first_reduced_gradient_becomes_the_buffer_and_later_ones_add_into_it():
    part, _, _ = _layout_and_params()
    layout = part.layout
    g = Gradients(spares={})
    first = torch.ones(layout.numel)
    g.add(part, first)
    assert g.sums[part] is first
    g.add(part, torch.full((layout.numel,), 2.0))
    assert torch.equal(g.sums[part], torch.full((layout.numel,), 3.0))


def test_kept_rows_are_taken_once():
    part, _, _ = _layout_and_params()
    layout = part.layout
    g = Gradients(spares={})
    rows = torch.zeros(2, layout.numel)
    g.keep(part, rows)
    assert g.keeps(part)
    assert g.take_kept(part) is rows
    assert g.take_kept(part) is None
    assert not g.keeps(part)


def test_a_donated_buffer_is_handed_out_once_and_only_in_its_dtype():
    part, _, _ = _layout_and_params()
    layout = part.layout
    buf = torch.empty(layout.numel)
    g = Gradients(spares={part: buf})
    assert g.spare(part, torch.float64) is None  # another dtype: not this buffer, and it is gone
    g = Gradients(spares={part: buf})
    assert g.spare(part, torch.float32) is buf
    assert g.spare(part, torch.float32) is None


def test_the_tree_is_the_mean_over_micro_batches_and_its_buffers_can_be_donated():
    part, sparams, shards = _layout_and_params()
    layout = part.layout
    g = Gradients(spares={})
    g.add(part, torch.full((layout.numel,), 4.0))
    grads = g.tree(sparams, shards, micro_batches=2)
    assert torch.equal(fs.unshard(grads)["w"], torch.full((2, 3), 2.0))
    donated = take_donated(g.returned)
    assert list(donated) == [part]
    try:
        fs.unshard(grads)
    except fs.DonatedError:
        pass
    else:
        raise AssertionError("a donated tree was read")
