"""Pytrees flattened exactly as ``jax.tree_util`` flattens them, and leaf paths.

funcshard trees are optree trees in the ``"funcshard"`` namespace with ``None``
as an empty node. Dict keys are sorted, ``OrderedDict`` keeps insertion order,
``defaultdict`` is sorted, namedtuples flatten by field and dataclasses
registered with :func:`register_dataclass` by their data fields: the leaf order
and structure of :func:`jax.tree_util.tree_flatten`.

A leaf's *path* is its keys joined by ``/``: dict keys as ``str(key)``, sequence
indices as numbers, namedtuple fields and dataclass attributes by name
(``blocks/3/attn/wq``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import optree

NAMESPACE = "funcshard"
SEPARATOR = "/"

PyTree = Any
TreeDef = optree.PyTreeSpec
_T = TypeVar("_T")

# Node types that structures written to files may name (see register_namedtuple and
# register_dataclass): tree_json.py looks them up by ``module:qualname``, never importing one.
DATACLASS_FIELDS: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}
NODE_TYPES: dict[str, type] = {}  # "module:qualname" -> a type structures may name


def flatten(tree: PyTree, /) -> tuple[list[Any], TreeDef]:
    """Returns the leaves of ``tree`` in ``jax.tree_util`` order and its structure.

    Example:
        >>> flatten({"b": 1, "a": (2, None)})[0]
        [2, 1]
    """
    return optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)


def flatten_with_paths(tree: PyTree, /) -> tuple[list[str], list[Any], TreeDef]:
    """Returns ``(paths, leaves, treedef)``; ``paths[i]`` names ``leaves[i]``.

    Raises:
        ValueError: a key's string form contains ``/``, which would make paths ambiguous.

    Example:
        >>> paths, leaves, _ = flatten_with_paths({"blocks": [{"w": 1}, {"w": 2}]})
        >>> paths
        ['blocks/0/w', 'blocks/1/w']
    """
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(
        tree, none_is_leaf=False, namespace=NAMESPACE
    )
    return [_path_of(accessor) for accessor in accessors], leaves, treedef


def unflatten(treedef: TreeDef, leaves: Sequence[Any], /) -> PyTree:
    """Builds the tree of structure ``treedef`` with ``leaves`` in order.

    Example:
        >>> leaves, treedef = flatten({"a": 1, "b": [2]})
        >>> unflatten(treedef, [10, 20])
        {'a': 10, 'b': [20]}
    """
    return optree.tree_unflatten(treedef, leaves)


def tree_map(fn: Callable[..., Any], tree: PyTree, /, *rest: PyTree) -> PyTree:
    """Applies ``fn`` to each leaf of ``tree`` (and the matching leaves of ``rest``).

    Example:
        >>> tree_map(lambda x: x * 2, {"a": 1, "b": (2, None)})
        {'a': 2, 'b': (4, None)}
    """
    return optree.tree_map(fn, tree, *rest, none_is_leaf=False, namespace=NAMESPACE)


def leaves(tree: PyTree, /) -> list[Any]:
    """The leaves of ``tree`` in ``jax.tree_util`` order.

    Example:
        >>> leaves({"b": 1, "a": [2, None]})
        [2, 1]
    """
    return flatten(tree)[0]


def leaf_paths(tree: PyTree, /) -> list[str]:
    """Returns the path of every leaf of ``tree``, in leaf order.

    Example:
        >>> leaf_paths({"head": {"w": 0, "b": 0}, "embed": 0})
        ['embed', 'head/b', 'head/w']
    """
    return flatten_with_paths(tree)[0]


def register_dataclass(
    cls: type[_T],
    /,
    data_fields: Sequence[str] | None = None,
    meta_fields: Sequence[str] = (),
) -> type[_T]:
    """Registers a dataclass as a funcshard pytree node, like ``jax.tree_util.register_dataclass``.

    ``data_fields`` are children (in the given order); ``meta_fields`` are static
    and become part of the structure. With ``data_fields=None`` every ``init``
    field not in ``meta_fields`` is a child, in declaration order. Paths name a
    child by its attribute.

    Args:
        cls: a class decorated with ``@dataclasses.dataclass``.
        data_fields: attribute names flattened as children.
        meta_fields: attribute names kept in the tree structure.

    Returns:
        ``cls`` itself, so this works as a decorator.

    Raises:
        TypeError: ``cls`` is not a dataclass, or the fields do not cover every ``init`` field.

    Example:
        >>> import dataclasses
        >>> @register_dataclass
        ... @dataclasses.dataclass
        ... class Linear:
        ...     w: int
        ...     b: int
        >>> leaf_paths({"fc": Linear(w=1, b=2)})
        ['fc/w', 'fc/b']
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"register_dataclass: {cls!r} is not a dataclass; decorate it first")
    init_fields = [f.name for f in dataclasses.fields(cls) if f.init]
    meta = tuple(meta_fields)
    data = (
        tuple(n for n in init_fields if n not in meta)
        if data_fields is None
        else tuple(data_fields)
    )
    missing = sorted(set(init_fields) - set(data) - set(meta))
    unknown = sorted((set(data) | set(meta)) - set(init_fields))
    if missing or unknown or set(data) & set(meta):
        raise TypeError(
            f"register_dataclass({cls.__name__}): data_fields and meta_fields must split the "
            f"init fields {init_fields} exactly; missing {missing}, unknown {unknown}, "
            f"in both {sorted(set(data) & set(meta))}"
        )

    def flatten_node(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        children = tuple(getattr(obj, name) for name in data)
        return children, tuple(getattr(obj, name) for name in meta), data

    def unflatten_node(metadata: tuple[Any, ...], children: tuple[Any, ...]) -> Any:
        return cls(**dict(zip(data, children)), **dict(zip(meta, metadata)))

    DATACLASS_FIELDS[cls] = (data, meta)
    NODE_TYPES[type_name(cls)] = cls
    optree.register_pytree_node(
        cls,  # pyright: ignore[reportArgumentType]
        flatten_node,
        unflatten_node,  # pyright: ignore[reportArgumentType]
        path_entry_type=optree.GetAttrEntry,
        namespace=NAMESPACE,
    )
    return cls


def _path_of(accessor: optree.PyTreeAccessor) -> str:
    parts: list[str] = []
    for entry in accessor:
        if isinstance(entry, (optree.NamedTupleEntry, optree.DataclassEntry)):
            part = str(entry.field)  # pyright: ignore[reportUnknownMemberType]
        elif isinstance(entry, optree.GetAttrEntry):
            part = str(entry.name)
        else:
            part = str(entry.entry)
        if SEPARATOR in part:
            raise ValueError(
                f"{SEPARATOR.join(parts) or '<root>'}: key {part!r} contains {SEPARATOR!r}, "
                f"which funcshard uses to join leaf paths; rename the key"
            )
        parts.append(part)
    return SEPARATOR.join(parts)


def register_namedtuple(cls: type[_T], /) -> type[_T]:
    """Lets tree structures that name the namedtuple ``cls`` be read back from JSON.

    A structure in a plan's JSON or a checkpoint's manifest names its node types
    as ``module:qualname``; funcshard never imports a module that a file names, so
    a namedtuple comes back only if this process knows it: it was registered here,
    or this process wrote a structure with it. Dataclasses are known once
    :func:`register_dataclass` registered them. funcshard's own states (optimizer
    states) are registered already.

    Returns:
        ``cls`` itself, so this works as a decorator.

    Raises:
        TypeError: ``cls`` is not a namedtuple class.

    Example:
        >>> from typing import NamedTuple
        >>> class State(NamedTuple):
        ...     mu: int
        >>> _ = register_namedtuple(State)
        >>> from funcshard._src.tree_json import treedef_from_json, treedef_to_json
        >>> treedef_from_json(treedef_to_json(flatten(State(1))[1])).num_leaves
        1
    """
    if not (isinstance(cls, type) and is_namedtuple(cls)):
        raise TypeError(f"register_namedtuple: {cls!r} is not a namedtuple class")
    NODE_TYPES[type_name(cls)] = cls
    return cls


def is_namedtuple(typ: type) -> bool:
    return issubclass(typ, tuple) and hasattr(typ, "_fields")


def type_name(typ: Any) -> str:
    return f"{typ.__module__}:{typ.__qualname__}"
