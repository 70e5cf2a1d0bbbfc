"""Plans: default and rule specs, units, strategies, JSON round trip, fingerprint, explain, errors."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import funcshard as fs
from funcshard import Mesh, P, Plan, SpecError, plan
from tests.strategies import Pair, meshes, rules_for, tensor_trees, units_for


def gpt_params():
    def block():
        return {
            "attn": {"wq": torch.zeros(8, 8), "wo": torch.zeros(8, 8)},
            "mlp": {"w1": torch.zeros(8, 32), "b1": torch.zeros(32)},
        }

    return {
        "embed": torch.zeros(64, 8),
        "blocks": [block(), block()],
        "head": {"w": torch.zeros(8, 64), "scale": torch.tensor(1.0)},
    }


def test_default_shards_dim_0_over_every_axis_unless_another_dim_pads_less():
    p = plan(gpt_params(), Mesh({"dp": 2, "fsdp": 2}))
    assert p.leaf("embed").spec == P(("dp", "fsdp"))
    assert p.leaf("blocks/0/mlp/w1").spec == P(("dp", "fsdp"))
    assert p.leaf("head/scale").spec == P()
    assert p.leaf("blocks/0/attn/wq").spec == P(("dp", "fsdp"))
    odd = plan(
        {"w": torch.zeros(3, 8), "v": torch.zeros(3, 5), "b": torch.zeros(2)}, Mesh({"fsdp": 4})
    )
    assert odd.leaf("w").spec == P(None, "fsdp")  # dim 0 would pad a row of 8
    assert odd.leaf("v").spec == P("fsdp")  # dim 0 pads 5 elements, dim 1 pads 9
    assert odd.leaf("b").spec == P("fsdp")  # padded: no other dim


def test_default_largest_dim_shards_the_largest_dim():
    p = plan(gpt_params(), Mesh({"dp": 2, "fsdp": 2}), default="largest_dim")
    assert p.leaf("embed").spec == P(("dp", "fsdp"))
    assert p.leaf("blocks/0/mlp/w1").spec == P(None, ("dp", "fsdp"))
    assert p.leaf("head/scale").spec == P()
    assert p.leaf("blocks/0/attn/wq").spec == P(("dp", "fsdp"))  # tie: first dim


def test_strategies_choose_their_shard_axes():
    mesh = Mesh({"dp": 2, "fsdp": 2})
    assert plan(gpt_params(), mesh, strategy="hybrid_shard").leaf("embed").spec == P("fsdp")
    assert plan(gpt_params(), mesh, strategy="no_shard").leaf("embed").spec == P()
    assert plan(gpt_params(), mesh, strategy="shard_grad_op").leaf("embed").spec == P(
        ("dp", "fsdp")
    )


def test_first_matching_rule_wins_and_units_group_subtrees():
    p = plan(
        gpt_params(),
        Mesh({"dp": 1, "fsdp": 2}),
        rules=[
            ("**/b1", P("fsdp")),
            ("blocks/*/mlp/*", P(None, "fsdp")),
            ("**/wq", P("dp")),
            ("head/scale", P()),
            ("**", P("fsdp")),
        ],
        units=["blocks/*"],
    )
    assert p.leaf("blocks/1/mlp/b1").spec == P("fsdp")
    assert p.leaf("blocks/1/mlp/w1").spec == P(None, "fsdp")
    assert p.leaf("blocks/1/attn/wq").spec == P("dp")
    assert p.leaf("embed").spec == P("fsdp")
    assert [u.name for u in p.units] == ["<root>", "blocks/0", "blocks/1"]
    assert p.unit("blocks/0").paths == (
        "blocks/0/attn/wo",
        "blocks/0/attn/wq",
        "blocks/0/mlp/b1",
        "blocks/0/mlp/w1",
    )
    assert p.leaf("head/w").unit == "<root>"
    assert p.notes == ()


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        (
            [("blocks/*/attn/*", P(None, "fsdp")), ("**/bias", P())],
            r"rules\[1\] \('\*\*/bias', P\(\)\) matches no leaf of the params \(leaf paths look like 'blocks/0/attn/wo', .*fix the pattern, or drop the rule",
        ),
        (
            [("blocks/**", P()), ("**/wq", P())],
            r"rules\[1\] \('\*\*/wq', P\(\)\) places no leaf: every leaf it matches is placed by an earlier rule \(rules\[0\]\), since the first match wins",
        ),
    ],
    ids=["typo", "shadowed"],
)
def test_a_rule_that_places_no_leaf_is_an_error(rules, message):
    with pytest.raises(ValueError, match=message):
        plan(gpt_params(), Mesh({"fsdp": 2}), rules=rules)


def test_specs_tree_has_the_params_structure():
    params = {"a": (torch.zeros(4), None), "b": Pair(torch.zeros(2, 2), [torch.zeros(())])}
    p = plan(params, Mesh({"x": 2}))
    assert p.specs == {"a": (P("x"), None), "b": Pair(P("x"), [P()])}


def test_regex_rules():
    p = plan(gpt_params(), Mesh({"fsdp": 2}), rules=[(re.compile(r"attn/w[qo]$"), P(None, "fsdp"))])
    assert p.leaf("blocks/0/attn/wo").spec == P(None, "fsdp")


def test_plans_need_no_memory():
    """A 70B-sized leaf on the meta device plans instantly."""
    p = plan({"w": torch.empty(80 * 8192, 28672, device="meta")}, Mesh({"fsdp": 64}))
    assert "w" in p.explain()


def test_explain_shows_leaves_units_and_totals():
    text = plan(gpt_params(), Mesh({"fsdp": 3}), units=["blocks/*"]).explain()
    assert text.startswith("Plan on Mesh({'fsdp': 3}) (3 ranks), strategy full_shard")
    assert re.search(
        r"blocks/0/mlp/b1\s+\(32,\)\s+float32\s+P\('fsdp'\)\s+\(11,\)\*\s+blocks/0", text
    )
    assert "* uneven: every rank stores the shard padded" in text
    assert re.search(r"blocks/0\s+full_shard\s+4\s+", text)
    assert "parameters per rank" in text
    assert "fingerprint" in text
    assert "full_shard: ZeRO-3: gathered for forward, freed" in text
    assert "shard_optimizer:" not in text  # only the strategies the plan uses are explained


def test_explain_says_what_shard_optimizer_does():
    text = plan(
        gpt_params(), Mesh({"fsdp": 2}), units=["blocks/*"], strategy="shard_optimizer"
    ).explain()
    assert re.search(r"blocks/0\s+shard_optimizer\s+4\s+", text)
    assert "shard_optimizer: ZeRO-1: gathered once per step and kept for every micro-batch" in text


@st.composite
def planned(draw):
    params = draw(tensor_trees())
    mesh = draw(meshes())
    return plan(
        params,
        mesh,
        rules=draw(rules_for(params, mesh)),
        units=draw(units_for(params)),
        layout=draw(st.sampled_from(["leaf", "flat"])),
    )


@given(planned())
def test_json_round_trip_is_the_identity(p):
    text = json.dumps(p.to_json())
    back = Plan.from_json(text)
    assert back == p
    assert back.specs == p.specs
    assert back.fingerprint() == p.fingerprint()


@given(planned())
def test_fingerprint_follows_the_placement(p):
    """Rebuilding gives the same fingerprint; changing one leaf's spec changes it."""
    assert Plan.from_json(p.to_json()).fingerprint() == p.fingerprint()
    first = p.leaves[0]
    other = P() if first.spec != P() else P(p.mesh.axis_names[0]) if first.shape else None
    if other is not None:  # a scalar has no other spec
        changed = dataclasses.replace(
            p, leaves=(dataclasses.replace(first, spec=other), *p.leaves[1:])
        )
        assert changed.fingerprint() != p.fingerprint()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"rules": [("embed", P("tp"))]},
            SpecError,
            r"embed: P\('tp'\) names mesh axis 'tp', which is not in the mesh",
        ),
        (
            {"rules": [("embed", P("fsdp", "fsdp"))]},
            SpecError,
            r"embed: P\('fsdp', 'fsdp'\) uses mesh axis 'fsdp' twice",
        ),
        (
            {"rules": [("**/b1", P(None, "fsdp"))]},
            SpecError,
            r"blocks/0/mlp/b1 \(from rules\[0\] \('\*\*/b1', P\(None, 'fsdp'\)\)\): P\(None, 'fsdp'\) has 2 entries but the leaf has 1 dim; give at most one entry per dim",
        ),
        (
            {"rules": [("embed", P())], "default": None},
            ValueError,
            r"blocks/0/attn/wo: no rule matches this leaf and default=None; add a rule for it, e.g. \('blocks/0/attn/wo', P\(...\)\), or a catch-all \('\*\*', P\('fsdp'\)\)",
        ),
        ({"units": ["layers/*"]}, ValueError, r"units\[0\] 'layers/\*' matches no subtree"),
        ({"units": ["blocks/*", "**/mlp"]}, ValueError, r"units overlap: 'blocks/0/mlp'"),
        (
            {"units": "blocks/*"},
            TypeError,
            r"units must be a list of patterns, e.g. \['blocks/\*'\]",
        ),
        (
            {"strategy": "zero3"},
            ValueError,
            r"unknown strategy 'zero3'; choose one of \['full_shard'",
        ),
        (
            {"strategy": "no_shard", "rules": [("embed", P("fsdp"))]},
            ValueError,
            r"embed: rules\[0\] \('embed', P\('fsdp'\)\) shards over mesh axis 'fsdp', but strategy 'no_shard' shards only over \[\]",
        ),
        ({"default": "first"}, TypeError, r"default must be 'dim_0', 'largest_dim', a P or None"),
        (
            {"layout": "ragged"},
            ValueError,
            r"layout must be one of \['leaf', 'flat', 'auto'\]; got 'ragged'",
        ),
        (
            {"strict": True},
            SpecError,
            r"blocks/0/attn/wo: P\('fsdp'\) cuts dim 0 of shape \(8, 8\) into 3 shards, which do not divide 8; pad the dim or pass strict=False",
        ),
    ],
)
def test_bad_input_names_the_leaf_and_the_fix(kwargs, error, message):
    with pytest.raises(error, match=message):
        plan(gpt_params(), Mesh({"fsdp": 3}), **kwargs)


def test_non_tensor_leaf():
    with pytest.raises(
        TypeError,
        match=r"head/scale: leaf is a float, not a torch.Tensor; params must be a pytree of tensors",
    ):
        plan({"head": {"scale": 1.0}}, Mesh({"fsdp": 2}))


def test_mesh_must_be_a_mesh():
    with pytest.raises(TypeError, match="mesh must be a funcshard Mesh"):
        plan(gpt_params(), {"fsdp": 2})  # pyright: ignore[reportArgumentType]


def test_hybrid_rule_may_not_shard_over_the_replica_axis():
    with pytest.raises(
        ValueError,
        match=r"shards over mesh axis 'dp', but strategy 'hybrid_shard' shards only over \['fsdp'\]",
    ):
        plan(
            gpt_params(),
            Mesh({"dp": 2, "fsdp": 2}),
            strategy="hybrid_shard",
            rules=[("embed", P("dp"))],
        )


def test_from_json_refuses_other_data():
    with pytest.raises(ValueError, match="not a funcshard plan of version 1"):
        Plan.from_json({"version": 99})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d.update(treedef={"namedtuple": "os:system", "children": []}),
            r"tree node type 'os:system' is not known to funcshard",
        ),
        (
            lambda d: d.update(mesh=[["fsdp", "2"]]),
            r"a mesh axis size must be an integer >= 0, got '2'",
        ),
        (
            lambda d: d["leaves"][0].update(shape=[8, -1]),
            r"leaves\[0\].shape must be an integer >= 0, got -1",
        ),
        (lambda d: d["leaves"][0].update(dtype="load"), r"dtype is 'load': unknown dtype"),
        (lambda d: d["leaves"][0].update(spec=["nope"]), r"nope"),
        (
            lambda d: d["leaves"][0].update(unit="blocks/9"),
            r"names unit 'blocks/9', which does not list it",
        ),
        (lambda d: d["units"].pop(), r"does not list it|every leaf exactly once"),
        (lambda d: d["leaves"].pop(), r"the tree structure has \d+ leaves, the plan lists"),
        (lambda d: d["units"][0].update(strategy="zero9"), r"unknown strategy 'zero9'"),
        (lambda d: d.update(leaves=5), r"leaves must be a list"),
        (lambda d: d.pop("mesh"), r"malformed \(KeyError"),
        (
            lambda d: d["units"][1].update(layout="ragged"),
            r"units\[1\].layout is 'ragged', not one of \['leaf', 'flat'\]",
        ),
        # explain() raised a bare OverflowError; estimate() priced PB-scale nonsense
        (lambda d: d["leaves"][0].update(shape=[10**400, 4]), r"leaves\[0\].shape is 1000"),
        (lambda d: d["leaves"][0].update(shape=[2**25, 2**26]), r"leaves\[0\].shape \[33554432"),
        (lambda d: d.update(memory_budget=10**400), r"memory_budget is 1000.* more than"),
        (lambda d: d.update(mesh=[["fsdp", 2**40]]), r"a mesh axis size is 1099511627776"),
        # no leaf has these; they were priced at one byte per element
        (lambda d: d["leaves"][0].update(dtype="uint1"), r"leaves\[0\].dtype is 'uint1'"),
        (lambda d: d["leaves"][0].update(dtype="quint4x2"), r"leaves\[0\].dtype is 'quint4x2'"),
        (lambda d: d["leaves"][0].update(dtype="bits8"), r"leaves\[0\].dtype is 'bits8'"),
        (lambda d: d["leaves"][0].update(dtype="float4_e2m1fn_x2"), r"dtype is 'float4_e2m1fn_x2'"),
    ],
)
def test_plan_json_is_untrusted_input(change, message):
    data = json.loads(
        json.dumps(plan(gpt_params(), Mesh({"fsdp": 2}), units=["blocks/*"]).to_json())
    )
    change(data)
    with pytest.raises(ValueError, match=message):
        Plan.from_json(data)


def test_frozen_patterns_mark_leaves_and_subtrees_and_round_trip_through_json():
    params = {"base": {"w": torch.zeros(4, 2), "b": torch.zeros(2)}, "lora": torch.zeros(2, 2)}
    plan = fs.plan(params, fs.Mesh({"fsdp": 2}), frozen=["base"])
    assert [(leaf.path, leaf.frozen) for leaf in plan.leaves] == [
        ("base/b", True),
        ("base/w", True),
        ("lora", False),
    ]
    again = fs.Plan.from_json(json.dumps(plan.to_json()))
    assert again == plan
    assert again.fingerprint() == plan.fingerprint()
    assert plan.fingerprint() != fs.plan(params, fs.Mesh({"fsdp": 2})).fingerprint()
    with pytest.raises(ValueError, match=r"frozen\[0\] 'bsae' matches no leaf or subtree"):
        fs.plan(params, fs.Mesh({"fsdp": 2}), frozen=["bsae"])
    with pytest.raises(TypeError, match=r"frozen must be a list of patterns"):
        fs.plan(params, fs.Mesh({"fsdp": 2}), frozen="base")
    data = plan.to_json()
    data["leaves"][0]["frozen"] = "yes"
    with pytest.raises(ValueError, match=r"leaves\[0\]\.frozen must be true or false"):
        fs.Plan.from_json(data)


def test_the_flat_layout_round_trips_explains_itself_and_costs_one_range_per_rank():
    params = {"blocks": [{"w": torch.zeros(5, 3), "b": torch.zeros(3)}] * 2, "head": torch.zeros(7)}
    flat = fs.plan(params, fs.Mesh({"fsdp": 4}), units=["blocks/*"], layout="flat")
    assert {u.layout for u in flat.units} == {"flat"}
    again = fs.Plan.from_json(json.dumps(flat.to_json()))
    assert again == flat
    leafwise = fs.plan(params, fs.Mesh({"fsdp": 4}), units=["blocks/*"])
    assert again.fingerprint() == flat.fingerprint() != leafwise.fingerprint()
    assert "layout" not in json.dumps(leafwise.to_json())  # older plans read as they were
    # per rank: ceil(18 / 4) = 5 elements a block, ceil(7 / 4) = 2 of the head
    assert fs.cost.estimate(flat).memory.params == (5 + 5 + 2) * 4
    text = flat.explain()
    assert "full_shard (flat)" in text
    assert "flat" in text.split("blocks/0/w")[1].splitlines()[0]


def test_auto_layout_is_flat_for_units_of_several_leaves_and_says_so():
    params = {
        "embed": torch.zeros(16, 8),
        "blocks": [{"w": torch.zeros(5, 3), "b": torch.zeros(3)} for _ in range(3)],
        "norm": {"g": torch.zeros(8)},
    }
    mesh = fs.Mesh({"fsdp": 2})
    auto = fs.plan(params, mesh, units=["blocks/*", "norm"], layout="auto")
    layouts = {u.name: u.layout for u in auto.units}
    # several leaves: flat; one leaf (the root's embed here, norm/g): leaf, a placement JAX uses
    assert layouts == {
        "<root>": "leaf",
        "blocks/0": "flat",
        "blocks/1": "flat",
        "blocks/2": "flat",
        "norm": "leaf",
    }
    assert "layout='auto': flat for 3 unit(s)" in auto.explain()
    assert fs.Plan.from_json(json.dumps(auto.to_json())) == auto
    # a rule asks for a placement, which the flat layout would ignore: that unit keeps "leaf"
    ruled = fs.plan(
        params,
        mesh,
        units=["blocks/*", "norm"],
        layout="auto",
        rules=[("blocks/1/w", P(None, "fsdp"))],
    )
    assert {u.name: u.layout for u in ruled.units}["blocks/1"] == "leaf"
    assert {u.name: u.layout for u in ruled.units}["blocks/0"] == "flat"
    # never more bytes a rank than the leaf layout: flat pads only a unit's end
    leaf = fs.plan(params, mesh, units=["blocks/*", "norm"])
    assert fs.cost.estimate(auto).memory.params <= fs.cost.estimate(leaf).memory.params


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"version": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
            r"plan JSON: nested more than 256",
        ),
        (
            '{"version": 1, "x": ' + "[" * 300 + "]" * 300 + "}",
            r"plan JSON: x\[0\]\[0\]\[0\]... is nested",
        ),
        (
            '{"version": 1, "memory_budget": NaN}',
            r"plan JSON: memory_budget is NaN, not a finite number",
        ),
        ('{"version": 1, "memory_budget": 1e400}', r"plan JSON: memory_budget is 1e400"),
        (
            '{"version": 1, "version": 2}',
            r"plan JSON: not valid JSON \(the key 'version' appears twice",
        ),
    ],
)
def test_plan_json_text_is_read_strictly(text, message):
    with pytest.raises(ValueError, match=message):
        Plan.from_json(text)


def test_a_deeply_nested_plan_mapping_is_a_value_error():
    data = json.loads(json.dumps(plan(gpt_params(), Mesh({"fsdp": 2})).to_json()))
    node: Any = {"leaf": None}
    for _ in range(5000):
        node = {"list": [node]}
    data["treedef"] = node
    with pytest.raises(ValueError, match=r"plan JSON"):
        Plan.from_json(data)


def test_leaves_that_do_not_require_grad_among_ones_that_do_are_frozen_or_refused():
    """Reference: what the plan trains. Without ``frozen=`` such a leaf would be trained
    silently on every path that does not pass values through fs.shard (fs.materialize)."""
    params = {
        "w": torch.empty(4, 2, device="meta", requires_grad=True),
        "b": torch.empty(4, device="meta"),
        "step": torch.zeros((), dtype=torch.int64),  # not floating: never trained, never asked
    }
    with pytest.raises(
        ValueError,
        match=r"\['b'\] have requires_grad=False while other leaves require grad: .*fs.plan\(\.\.\., frozen=\['b'\]\)",
    ):
        fs.plan(params, fs.Mesh({"fsdp": 2}))
    frozen = fs.plan(params, fs.Mesh({"fsdp": 2}), frozen=["b"])
    assert [(leaf.path, leaf.frozen) for leaf in frozen.leaves] == [
        ("b", True),
        ("step", False),
        ("w", False),
    ]
    alike = {"w": torch.zeros(4, 2), "b": torch.zeros(4)}  # a plain tree: nothing requires grad
    assert not any(leaf.frozen for leaf in fs.plan(alike, fs.Mesh({"fsdp": 2})).leaves)
