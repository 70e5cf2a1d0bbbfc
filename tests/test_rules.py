"""Path patterns and rules: glob segments, ** and regexes; malformed rules are TypeErrors."""

from __future__ import annotations

import re

import pytest

from funcshard import P
from funcshard._src.plan.rules import check_rules, first_match, matches


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("blocks/*/mlp/*", "blocks/3/mlp/w1", True),
        ("blocks/*/mlp/*", "blocks/3/attn/wq", False),
        ("blocks/*", "blocks/3", True),
        ("blocks/*", "blocks/3/mlp/w1", False),
        ("**", "a/b/c", True),
        ("**", "", True),
        ("**/b", "b", True),
        ("**/b", "head/b", True),
        ("**/b", "head/bias", False),
        ("a/**/w", "a/w", True),
        ("a/**/w", "a/x/y/w", True),
        ("head/w*", "head/wq", True),
        ("head/w?", "head/wq", True),
        ("head", "head/w", False),
        (re.compile(r"mlp/w\d"), "blocks/0/mlp/w1", True),
        (re.compile(r"^mlp"), "blocks/0/mlp/w1", False),
    ],
)
def test_matches(pattern, path, expected):
    assert matches(pattern, path) is expected


def test_first_match_wins():
    rules = check_rules([("**/b", P()), ("**", P("fsdp"))])
    assert first_match(rules, "head/b") == 0
    assert first_match(rules, "head/w") == 1
    assert first_match(check_rules([("x", P())]), "y") is None


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ("**", r"rules must be a list of \(pattern, P\) pairs"),
        ([("**",)], r"rules\[0\] = \('\*\*',\) must be a \(pattern, P\) pair"),
        (
            [("**", ("fsdp",))],
            r"rules\[0\].*the spec must be a funcshard P, e.g. P\('fsdp'\); got tuple",
        ),
        ([(3, P())], r"rules\[0\]: pattern 3 must be a glob string or a re.compile"),
    ],
)
def test_malformed_rules(rules, message):
    with pytest.raises(TypeError, match=message):
        check_rules(rules)
