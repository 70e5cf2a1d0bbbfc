"""Path patterns and placement rules: ``[(pattern, P), ...]``, the first match wins.

A pattern is a glob over ``/``-separated path segments, where ``*`` matches
within one segment (``blocks/*/mlp/*``) and a ``**`` segment matches any number
of segments, none included (``**/bias``, ``**``); or a compiled ``re.Pattern``,
matched with ``re.search`` against the whole path.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from funcshard._src.spec.partition_spec import P

Pattern: TypeAlias = "str | re.Pattern[str]"


def matches(pattern: Pattern, path: str, /) -> bool:
    """Whether ``pattern`` matches the leaf or subtree ``path``.

    Example:
        >>> matches("blocks/*/mlp/*", "blocks/3/mlp/w1"), matches("**/b", "head/b")
        (True, True)
        >>> matches("blocks/*", "blocks/3/mlp/w1")
        False
    """
    if isinstance(pattern, re.Pattern):
        return pattern.search(path) is not None
    return _glob(
        tuple(pattern.split("/")) if pattern else (), tuple(path.split("/")) if path else ()
    )


def subtrees(path: str, /) -> list[str]:
    """``path`` and every subtree above it, the outermost first.

    Example:
        >>> subtrees("blocks/3/w")
        ['blocks', 'blocks/3', 'blocks/3/w']
    """
    parts = path.split("/") if path else [""]
    return ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]


def matches_within(pattern: Pattern, path: str, /) -> bool:
    """Whether ``pattern`` matches the leaf ``path`` or a subtree above it (``frozen=``, masks).

    Example:
        >>> matches_within("head", "head/w"), matches_within("blocks/*/w", "head/w")
        (True, False)
    """
    return any(matches(pattern, a) for a in subtrees(path))


def pattern_repr(pattern: Pattern, /) -> str:
    """A short readable form: ``'blocks/*'`` or ``re.compile('h\\\\d')``."""
    return repr(pattern) if isinstance(pattern, str) else f"re.compile({pattern.pattern!r})"


def check_pattern(pattern: object, /, *, what: str) -> Pattern:
    """Returns ``pattern`` if it is a glob string or compiled regex.

    Raises:
        TypeError: anything else; ``what`` names the argument in the message.
    """
    if isinstance(pattern, (str, re.Pattern)):
        return pattern  # pyright: ignore[reportUnknownVariableType]
    raise TypeError(
        f"{what}: pattern {pattern!r} must be a glob string or a re.compile(...) pattern"
    )


@dataclass(frozen=True)
class Rule:
    """One placement rule: leaves whose path ``pattern`` matches get ``spec``."""

    pattern: Pattern
    spec: P

    def __repr__(self) -> str:
        return f"({pattern_repr(self.pattern)}, {self.spec!r})"


def check_rules(rules: Sequence[object], /) -> tuple[Rule, ...]:
    """Validates ``[(pattern, P), ...]`` and returns them as :class:`Rule` s.

    Raises:
        TypeError: an entry that is not a ``(pattern, P)`` pair; the message gives its index.
    """
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(f"rules must be a list of (pattern, P) pairs, got {rules!r}")
    out: list[Rule] = []
    for i, rule in enumerate(rules):
        if isinstance(rule, Rule):
            out.append(rule)
            continue
        if not isinstance(rule, tuple) or len(rule) != 2:  # pyright: ignore[reportUnknownArgumentType]
            raise TypeError(f"rules[{i}] = {rule!r} must be a (pattern, P) pair")
        raw_pattern, spec = rule  # pyright: ignore[reportUnknownVariableType]
        pattern = check_pattern(raw_pattern, what=f"rules[{i}]")  # pyright: ignore[reportUnknownArgumentType]
        if not isinstance(spec, P):
            raise TypeError(
                f"rules[{i}] = {rule!r}: the spec must be a funcshard P, e.g. P('fsdp'); "
                f"got {type(spec).__name__}"  # pyright: ignore[reportUnknownArgumentType]
            )
        out.append(Rule(pattern, spec))
    return tuple(out)


def first_match(rules: Sequence[Rule], path: str, /) -> int | None:
    """Index of the first rule whose pattern matches ``path``, or ``None``."""
    for i, rule in enumerate(rules):
        if matches(rule.pattern, path):
            return i
    return None


def _glob(pattern: tuple[str, ...], path: tuple[str, ...]) -> bool:
    if not pattern:
        return not path
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_glob(rest, path[k:]) for k in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], head) and _glob(rest, path[1:])
