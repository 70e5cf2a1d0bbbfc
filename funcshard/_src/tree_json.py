"""Tree structures as JSON: how plans and checkpoint manifests carry a params tree's shape.

A structure read from a file is untrusted: node types are named by
``module:qualname`` and looked up among the types this process registered
(``tree.register_namedtuple``, ``tree.register_dataclass``); a file can name a
type, never import one.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any

from funcshard._src.tree import (
    DATACLASS_FIELDS,
    NODE_TYPES,
    TreeDef,
    flatten,
    is_namedtuple,
    type_name,
)

__all__ = ["treedef_from_json", "treedef_to_json"]

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
                "factory": None if factory is None else type_name(factory),
            }
        if is_namedtuple(typ):
            NODE_TYPES.setdefault(type_name(typ), typ)  # written here: known when read back
            return {"namedtuple": type_name(typ), "children": list(children)}
        if typ in DATACLASS_FIELDS:
            return {"dataclass": type_name(typ), "meta": list(data), "children": list(children)}
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
        if not is_namedtuple(cls) or len(children) != len(cls._fields):  # pyright: ignore[reportAttributeAccessIssue]
            raise ValueError(
                f"malformed tree structure: {data['namedtuple']} with {len(children)} children"
            )
        return cls(*(_skeleton(c) for c in children))
    if "dataclass" in data:
        cls = _known(data["dataclass"])
        if cls not in DATACLASS_FIELDS:
            raise ValueError(
                f"{data['dataclass']} is not registered with funcshard.register_dataclass"
            )
        fields, meta = DATACLASS_FIELDS[cls]
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


def _known(name: Any) -> type:
    """The node type ``name`` (``module:qualname``) among those this process knows; never imports."""
    cls = NODE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        qualname = name.partition(":")[2] if isinstance(name, str) else ""
        raise ValueError(
            f"tree node type {_short(name)} is not known to funcshard, which never imports a "
            f"module that a file names. Import and register the type before loading: "
            f"fs.register_namedtuple({qualname or 'YourType'}) for a namedtuple, "
            f"fs.tree.register_dataclass for a dataclass"
        )
    return cls
