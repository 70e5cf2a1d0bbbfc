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
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import optree

NAMESPACE = "funcshard"
SEPARATOR = "/"

PyTree = Any
TreeDef = optree.PyTreeSpec
_T = TypeVar("_T")


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

    _DATACLASS_FIELDS[cls] = (data, meta)
    _NODE_TYPES[_type_name(cls)] = cls
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
        >>> treedef_from_json(treedef_to_json(flatten(State(1))[1])).num_leaves
        1
    """
    if not (isinstance(cls, type) and _is_namedtuple(cls)):
        raise TypeError(f"register_namedtuple: {cls!r} is not a namedtuple class")
    _NODE_TYPES[_type_name(cls)] = cls
    return cls


# --- structure as JSON -------------------------------------------------------
# A tree structure travels in plans (``Plan.to_json``) and checkpoint manifests.
# Node types are named by ``module:qualname`` and looked up among the types this
# process knows (see register_namedtuple): a file can name a type, never import one.

_DATACLASS_FIELDS: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}
_NODE_TYPES: dict[str, type] = {}  # "module:qualname" -> a type structures may name
_FACTORIES: dict[str, type] = {
    _t.__name__: _t for _t in (list, dict, set, tuple, int, float, str, bool)
} | {f"builtins:{_t.__name__}": _t for _t in (list, dict, set, tuple, int, float, str, bool)}
_LEAF = 0  # placeholder leaf while rebuilding a structure


def treedef_to_json(treedef: TreeDef, /) -> Any:
    """Encodes a tree structure as JSON-ready data; :func:`treedef_from_json` inverts it.

    Raises:
        TypeError: a dict key that is not a str or int, or static dataclass data that
            JSON cannot hold.

    Example:
        >>> treedef_to_json(flatten({"a": [1, None]})[1])
        {'dict': [['a', {'list': [{'leaf': None}, None]}]]}
    """

    def node(typ: type, data: Any, children: tuple[Any, ...]) -> Any:
        if typ is type(None):
            return None
        if typ is list:
            return {"list": list(children)}
        if typ is tuple:
            return {"tuple": list(children)}
        if typ is dict:
            return {"dict": [[_key_to_json(k), c] for k, c in zip(data, children)]}
        if typ is OrderedDict:
            return {"ordereddict": [[_key_to_json(k), c] for k, c in zip(data, children)]}
        if typ is defaultdict:
            factory, keys = data
            return {
                "defaultdict": [[_key_to_json(k), c] for k, c in zip(keys, children)],
                "factory": None if factory is None else _type_name(factory),
            }
        if _is_namedtuple(typ):
            _NODE_TYPES.setdefault(_type_name(typ), typ)  # written here: known when read back
            return {"namedtuple": _type_name(typ), "children": list(children)}
        if typ in _DATACLASS_FIELDS:
            return {"dataclass": _type_name(typ), "meta": list(data), "children": list(children)}
        raise TypeError(f"cannot encode tree node of type {typ!r} as JSON")

    leaf = {"leaf": None}
    return treedef.walk([leaf] * treedef.num_leaves, node, None)


def treedef_from_json(data: Any, /) -> TreeDef:
    """Decodes :func:`treedef_to_json`'s output back into a tree structure; never imports anything.

    Raises:
        ValueError: a node type this process does not know (see
            :func:`register_namedtuple`), or malformed data.
    """
    try:
        return flatten(_skeleton(data))[1]
    except ValueError:
        raise
    except RecursionError:
        raise ValueError("malformed tree structure: nested too deeply") from None
    except (TypeError, KeyError, IndexError, AttributeError) as e:
        raise ValueError(f"malformed tree structure ({type(e).__name__}: {e})") from None


def _skeleton(data: Any) -> Any:
    if data is None:
        return None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"malformed tree structure entry {_short(data)}")
    if "leaf" in data:
        return _LEAF
    if "list" in data:
        return [_skeleton(c) for c in _children(data, "list")]
    if "tuple" in data:
        return tuple(_skeleton(c) for c in _children(data, "tuple"))
    for kind, mapping in (("dict", dict), ("ordereddict", OrderedDict)):
        if kind in data:
            return mapping(_items(data, kind))
    if "defaultdict" in data:
        name = data.get("factory")
        factory = None if name is None else _FACTORIES.get(name) if isinstance(name, str) else None
        if name is not None and factory is None:
            factory = _known(name)
        return defaultdict(factory, _items(data, "defaultdict"))
    if "namedtuple" in data:
        cls = _known(data["namedtuple"])
        children = _children(data, "children")
        if not _is_namedtuple(cls) or len(children) != len(cls._fields):  # pyright: ignore[reportAttributeAccessIssue]
            raise ValueError(
                f"malformed tree structure: {data['namedtuple']} with {len(children)} children"
            )
        return cls(*(_skeleton(c) for c in children))
    if "dataclass" in data:
        cls = _known(data["dataclass"])
        if cls not in _DATACLASS_FIELDS:
            raise ValueError(
                f"{data['dataclass']} is not registered with funcshard.register_dataclass"
            )
        fields, meta = _DATACLASS_FIELDS[cls]
        children = _children(data, "children")
        static = _children(data, "meta")
        if len(children) != len(fields) or len(static) != len(meta):
            raise ValueError(f"malformed tree structure: {data['dataclass']} has other fields")
        return cls(**dict(zip(fields, (_skeleton(c) for c in children))), **dict(zip(meta, static)))
    raise ValueError(f"malformed tree structure entry {_short(data)}")


def _children(data: dict[str, Any], key: str) -> list[Any]:
    value = data.get(key)
    if not isinstance(value, list):
        raise ValueError(f"malformed tree structure: {key!r} must hold a list, got {_short(value)}")
    return value


def _items(data: dict[str, Any], key: str) -> list[tuple[Any, Any]]:
    out: list[tuple[Any, Any]] = []
    for item in _children(data, key):
        if not isinstance(item, list) or len(item) != 2:
            raise ValueError(f"malformed tree structure: a {key} item must be [key, child]")
        out.append((_key_from_json(item[0]), _skeleton(item[1])))
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _key_to_json(key: Any) -> Any:
    if isinstance(key, str):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return {"int": key}
    raise TypeError(f"cannot encode dict key {key!r}: only str and int keys survive JSON")


def _key_from_json(key: Any) -> Any:
    if isinstance(key, str):
        return key
    if isinstance(key, dict) and set(key) == {"int"}:
        value = key["int"]
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ValueError(f"malformed tree structure: dict key {_short(key)}")


def _is_namedtuple(typ: type) -> bool:
    return issubclass(typ, tuple) and hasattr(typ, "_fields")


def _type_name(typ: Any) -> str:
    return f"{typ.__module__}:{typ.__qualname__}"


def _known(name: Any) -> type:
    """The node type ``name`` (``module:qualname``) among those this process knows; never imports."""
    cls = _NODE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        qualname = name.partition(":")[2] if isinstance(name, str) else ""
        raise ValueError(
            f"tree node type {_short(name)} is not known to funcshard, which never imports a "
            f"module that a file names. Import and register the type before loading: "
            f"fs.register_namedtuple({qualname or 'YourType'}) for a namedtuple, "
            f"fs.tree.register_dataclass for a dataclass"
        )
    return cls
