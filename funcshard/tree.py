"""Pytrees flattened as ``jax.tree_util`` flattens them, and leaf paths: funcshard's ``jax.tree``.

Example:
    >>> import funcshard as fs
    >>> fs.tree.leaf_paths({"blocks": [{"w": 1}, {"w": 2}], "embed": 0})
    ['blocks/0/w', 'blocks/1/w', 'embed']
    >>> fs.tree.map(lambda x: x * 10, {"a": 1, "b": (2, None)})
    {'a': 10, 'b': (20, None)}
"""

from funcshard._src.tree import flatten as flatten
from funcshard._src.tree import flatten_with_paths as flatten_with_paths
from funcshard._src.tree import leaf_paths as leaf_paths
from funcshard._src.tree import leaves as leaves
from funcshard._src.tree import register_dataclass as register_dataclass
from funcshard._src.tree import register_namedtuple as register_namedtuple
from funcshard._src.tree import tree_map as map
from funcshard._src.tree import unflatten as unflatten

__all__ = [
    "flatten",
    "flatten_with_paths",
    "leaf_paths",
    "leaves",
    "map",
    "register_dataclass",
    "register_namedtuple",
    "unflatten",
]
