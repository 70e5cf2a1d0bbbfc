"""Pytrees: leaf order, paths, dataclasses, structure JSON (reference: jax.tree_util's rules)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from funcshard._src import tree, tree_json
from funcshard.tree import leaf_paths, register_dataclass
from tests.strategies import pytrees

Point = namedtuple("Point", ["y", "x"])


@register_dataclass
@dataclasses.dataclass
class Linear:
    w: object
    b: object


@dataclasses.dataclass
class Tagged:
    value: object
    tag: str


register_dataclass(Tagged, data_fields=["value"], meta_fields=["tag"])


def test_order_and_paths_follow_jax_rules():
    """Dicts sort, OrderedDict keeps insertion order, defaultdict sorts, None is empty."""
    t = {
        "b": [1, (2, None)],
        "a": Point(y=3, x=4),
        "c": OrderedDict([("z", 5), ("y", 6)]),
        "d": defaultdict(list, {"q": 7, "p": 8}),
        "e": [],
        "f": {},
        "g": Linear(w=9, b=10),
        "h": Tagged(11, "t"),
    }
    paths, leaves, _ = tree.flatten_with_paths(t)
    assert leaves == [3, 4, 1, 2, 5, 6, 8, 7, 9, 10, 11]
    assert paths == [
        "a/y",
        "a/x",
        "b/0",
        "b/1/0",
        "c/z",
        "c/y",
        "d/p",
        "d/q",
        "g/w",
        "g/b",
        "h/value",
    ]


def test_int_keys_and_single_leaf():
    assert leaf_paths({3: 1, 1: 2}) == ["1", "3"]
    assert leaf_paths(5) == [""]
    assert leaf_paths(None) == []


def test_key_with_separator_is_refused():
    with pytest.raises(ValueError, match=r"blocks: key 'a/b' contains '/'.*rename the key"):
        tree.flatten_with_paths({"blocks": {"a/b": 1}})


def test_register_dataclass_checks_fields():
    @dataclasses.dataclass
    class Two:
        a: int
        b: int

    with pytest.raises(TypeError, match=r"missing \['b'\]"):
        register_dataclass(Two, data_fields=["a"])
    with pytest.raises(TypeError, match="not a dataclass"):
        register_dataclass(int)


def test_dataclass_meta_fields_are_structure():
    one = tree.flatten(Tagged(1, "x"))[1]
    two = tree.flatten(Tagged(1, "y"))[1]
    assert one != two
    assert tree.unflatten(one, [5]) == Tagged(5, "x")


@given(pytrees(st.integers()))
def test_structure_json_round_trip(t):
    """treedef -> JSON -> treedef is the identity and rebuilds equal trees."""
    leaves, treedef = tree.flatten(t)
    back = tree_json.treedef_from_json(tree_json.treedef_to_json(treedef))
    assert back == treedef
    assert tree.unflatten(back, leaves) == t


def test_structure_json_with_dataclasses_and_defaultdict():
    t = {"g": Linear(w=1, b=Tagged(2, "t")), "d": defaultdict(list, {"k": 3}), 4: None}
    leaves, treedef = tree.flatten(t)
    back = tree_json.treedef_from_json(tree_json.treedef_to_json(treedef))
    assert tree.unflatten(back, leaves) == t


def test_structure_json_round_trips_types_this_process_wrote():
    Local = namedtuple("Local", ["a"])
    data = tree_json.treedef_to_json(tree.flatten(Local(1))[1])
    assert tree.unflatten(tree_json.treedef_from_json(data), [2]) == Local(2)


@pytest.mark.parametrize(
    "data",
    [
        {"namedtuple": "os:system", "children": [{"leaf": None}]},
        {"namedtuple": "tests.test_tree:NeverRegistered", "children": []},
        {"dataclass": "subprocess:Popen", "meta": [], "children": []},
        {"defaultdict": [], "factory": "os:system"},
    ],
    ids=["os.system", "unregistered", "dataclass", "defaultdict-factory"],
)
def test_structure_json_never_imports_what_it_names(data):
    """A file names a type; funcshard looks it up among the types it knows and never imports one."""
    with pytest.raises(
        ValueError, match=r"is not known to funcshard, which never imports a module"
    ):
        tree_json.treedef_from_json(data)


@pytest.mark.parametrize(
    "data",
    [
        {"list": 3},
        {"dict": [["a"]]},
        {"dict": [[{"int": True}, {"leaf": None}]]},
        {"tuple": [{"bogus": 1}]},
        {"namedtuple": "funcshard._src.optim.adamw:AdamWState", "children": []},
        [],
    ],
)
def test_malformed_structure_json_is_a_value_error(data):
    with pytest.raises(ValueError, match="malformed tree structure"):
        tree_json.treedef_from_json(data)


def test_deeply_nested_structure_json_is_a_value_error():
    data: object = {"leaf": None}
    for _ in range(100_000):
        data = {"list": [data]}
    with pytest.raises(ValueError, match="nested too deeply"):
        tree_json.treedef_from_json(data)
