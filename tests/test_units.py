"""Units: subtrees named by patterns; root unit; errors for patterns matching nothing or overlapping."""

from __future__ import annotations

import re

import pytest

from funcshard._src.plan.units import ROOT, resolve_units

PATHS = [
    "embed",
    "blocks/0/attn/wq",
    "blocks/0/mlp/w1",
    "blocks/1/attn/wq",
    "blocks/1/mlp/w1",
    "head/w",
]


def test_each_match_is_one_unit_and_the_rest_is_the_root():
    assert resolve_units(PATHS, ["blocks/*"]) == [
        (ROOT, ("embed", "head/w")),
        ("blocks/0", ("blocks/0/attn/wq", "blocks/0/mlp/w1")),
        ("blocks/1", ("blocks/1/attn/wq", "blocks/1/mlp/w1")),
    ]


def test_leaf_units_and_no_root():
    units = resolve_units(PATHS, ["embed", "blocks", "head/w"])
    assert [name for name, _ in units] == ["embed", "blocks", "head/w"]


def test_nested_matches_of_one_pattern_join_the_outer_unit():
    units = resolve_units(PATHS, [re.compile(r"^blocks/\d")])
    assert [name for name, _ in units] == [ROOT, "blocks/0", "blocks/1"]


def test_pattern_matching_nothing():
    with pytest.raises(
        ValueError,
        match=r"units\[1\] 'layers/\*' matches no subtree of the params; subtree paths look like 'embed', 'blocks'",
    ):
        resolve_units(PATHS, ["blocks/*", "layers/*"])


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        (
            ["blocks/*", "**/attn"],
            r"units overlap: 'blocks/0/attn' \(from units\[1\] '\*\*/attn'\) lies inside 'blocks/0' \(from units\[0\] 'blocks/\*'\)",
        ),
        (
            ["**/attn", "blocks/*"],
            r"units overlap: 'blocks/0/attn' \(from units\[0\] '\*\*/attn'\) lies inside 'blocks/0' \(from units\[1\] 'blocks/\*'\)",
        ),
        (
            ["blocks/*", "blocks/0"],
            r"'blocks/0' \(from units\[1\] 'blocks/0'\) is the same subtree as 'blocks/0'",
        ),
    ],
)
def test_overlapping_units(patterns, message):
    with pytest.raises(ValueError, match=message):
        resolve_units(PATHS, patterns)
