"""Reading pickles that funcshard does not trust: bounded before they are unpickled.

[Note: pickles checked before they are unpickled]
An allowlist of classes (DCP's ``.metadata`` readers) or ``torch.load(weights_only=True)``
(chunk blobs, ``untrusted_tensor.py``) decides what a pickle may build, not how much work
building it takes. A few hundred bytes can build a tuple of 64 tuples of 64 tuples ...
six deep, each level reused through the memo (``BINGET``), and make it a dict key:
unpickling hashes 64**6 tuples and never returns. :func:`check_pickle` runs first, over
the opcodes alone (``pickletools.genops``, nothing is built): it follows which object
each opcode makes from which, and refuses a pickle whose objects, unfolded as the tree
that hashing, comparing or copying them walks, hold more than :data:`EXPANSION` times as
many nodes as the pickle has opcodes (plus :data:`EXPANSION_FLOOR`), nest deeper than
:data:`MAX_PICKLE_DEPTH`, contain themselves, refer to a memo entry never stored, or
change a class (``BUILD`` on a global). Real pickles stay far below: DCP's metadata of
3500 tensors unfolds to 0.9 nodes per opcode and nests 12 deep.

Two more refusals bound the work linear in the file. A dict key or set member must be a
string (its hash is keyed per process, so a file cannot choose keys that collide) or an
instance of a class the caller names (DCP's ``MetadataIndex``, which the readers rebuild
with a keyed hash): integers ``k * (2**61 - 1) + 7``, or tuples of them, all hash alike,
and a dict of N of them takes N**2 comparisons to build. That holds for the opcodes that
fill a dict or set, and for a set or dict constructor a loader allows (``torch.load``'s
``weights_only`` allows ``set``, ``OrderedDict`` and ``Counter``): called with members, it
would hash them unseen, so it is refused unless called with none. And a memo index (``PUT``)
must be below the count of opcodes read so far: the unpickler grows its memo to twice
the largest index, so ``PUT 2**31`` in an 11-byte file would allocate 32 GiB.
"""

from __future__ import annotations

import pickletools
from collections.abc import Collection

EXPANSION = 16  # nodes an object may unfold to, per opcode of its pickle
EXPANSION_FLOOR = 1 << 16
MAX_PICKLE_DEPTH = 100  # objects inside objects; DCP's metadata: 12, a tensor's data.pkl: 5


def check_pickle(
    data: bytes,
    /,
    *,
    what: str,
    error: type[Exception] = ValueError,
    key_classes: Collection[str] = (),
) -> None:
    """Refuses a pickle whose unpickling would take more than linear work (see the Note above).

    Args:
        data: the pickle.
        what: the file (or record) it came from, for messages.
        error: the exception class raised.
        key_classes: classes (``"module.Name"``) whose instances may be dict keys or set
            members besides strings; the caller makes their hash one a file cannot steer.

    Raises:
        error: not a pickle, or one whose objects unfold to too many nodes, nest too
            deeply, contain themselves, read a memo entry never stored, store one past
            the opcodes read, change a class, or key a dict or set by anything else
            than strings and ``key_classes``.

    Example:
        >>> import pickle
        >>> check_pickle(pickle.dumps({"a": (1, 2)}), what="x.pkl")
        >>> t = (0,) * 64
        >>> for _ in range(3):
        ...     t = (t,) * 64  # 64**4 nodes in 4 objects: unpickled as a dict key, hashed in full
        >>> check_pickle(pickle.dumps([t]), what="x.pkl")
        Traceback (most recent call last):
        ...
        ValueError: x.pkl: a pickle of 271 opcodes whose objects unfold to more than 69872 nodes (a memo reused to build exponentially large objects, which unpickling would hash for hours); the file was crafted
        >>> check_pickle(pickle.dumps({7: None}), what="x.pkl")
        Traceback (most recent call last):
        ...
        ValueError: x.pkl: it keys a dict or set by a number (real files key them by strings only; keys of one hash would make unpickling quadratic); the file is damaged or was crafted
    """
    try:
        children, ops, bad_key = _graph(data, frozenset(key_classes))
    except _RefusedError as e:
        raise error(f"{what}: {e}; the file is damaged or was crafted") from None
    except Exception as e:  # genops' errors on truncated or unknown opcodes; a stack underflow
        raise error(
            f"{what}: not a pickle ({type(e).__name__}: {str(e)[:200]}); the file is damaged "
            f"or was crafted"
        ) from None
    limit = EXPANSION * ops + EXPANSION_FLOOR
    problem = _unfolded(children, limit)
    if problem == "size":
        raise error(
            f"{what}: a pickle of {ops} opcodes whose objects unfold to more than {limit} nodes "
            f"(a memo reused to build exponentially large objects, which unpickling would hash "
            f"for hours); the file was crafted"
        )
    if problem is not None:
        raise error(f"{what}: a pickle whose objects {problem}; the file was crafted")
    if bad_key is not None:  # after the checks above, whose messages say more
        raise error(f"{what}: {bad_key}; the file is damaged or was crafted")


# -- helpers ------------------------------------------------------------------------------


class _RefusedError(Exception):
    pass


def _graph(data: bytes, key_classes: frozenset[str]) -> tuple[list[list[int]], int, str | None]:
    """Each object the pickle makes (0: every leaf but strings) with the objects it holds, and the opcode count.

    Marks are kept apart from the stack, as the unpickler keeps them: no opcode but those
    that take a mark's slice reads below the last mark. Strings get nodes of their own
    (their values in ``strings``) so that dict keys and class names can be told apart.
    """
    children: list[list[int]] = [[]]
    strings: dict[int, str] = {}
    classes: dict[int, str] = {}  # GLOBAL's node -> "module.Name"
    instances: dict[int, str] = {}  # node -> its class, for REDUCE, NEWOBJ, OBJ and INST
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    bad_key: str | None = None
    ops = 0
    for op, arg, _ in pickletools.genops(data):
        ops += 1
        action, single, sliced = _ACTIONS[op]
        if action == _GET:
            if arg not in memo:
                raise _RefusedError(f"it reads memo entry {arg}, which it never stored")
            stack.append(memo[arg])
            continue
        if action == _PUSH_LEAF:
            if op.name in _STRINGS:
                children.append([])
                strings[len(children) - 1] = str(arg)
                stack.append(len(children) - 1)
            else:
                stack.append(0)
            continue
        if action == _MARK:
            marks.append(len(stack))
            continue
        if action == _SKIP:
            continue
        if action == _DROP and op.name == "POP" and marks and len(stack) == marks[-1]:
            marks.pop()  # POP at a mark drops the mark, as the unpickler does
            continue
        popped: list[int] = []
        if sliced:
            if not marks:
                raise _RefusedError(f"{op.name} finds no mark")
            popped = stack[marks[-1] :]
            del stack[marks.pop() :]
        fence = marks[-1] if marks else 0
        reach = single + (action in (_MUTATE, _PUT, _MEMOIZE, _DUP))
        if len(stack) - reach < fence:
            raise _RefusedError(f"{op.name} reads below the stack's bottom or its last mark")
        if action == _MEMOIZE:
            memo[len(memo)] = stack[-1]
        elif action == _PUT:
            if not isinstance(arg, int) or arg >= ops:  # the unpickler allocates 2 * arg slots
                raise _RefusedError(f"it stores memo entry {arg} after only {ops} opcodes")
            memo[arg] = stack[-1]
        elif action == _DUP:
            stack.append(stack[-1])
        else:
            for _ in range(single):
                popped.append(stack.pop())
            if op.name in _KEYED and bad_key is None:
                bad_key = _bad_key(op.name, popped, strings, instances, key_classes)
            if action == _MUTATE:
                target = stack[-1]
                if target == 0 or target in strings or target in classes:
                    raise _RefusedError(f"{op.name} fills or changes a leaf or a class")
                children[target] += popped
            elif action == _MAKE:
                children.append(popped)
                node = len(children) - 1
                stack.append(node)
                if op.name in ("GLOBAL", "STACK_GLOBAL", "INST"):
                    parts = (
                        str(arg).split(" ")
                        if op.name != "STACK_GLOBAL"
                        else [
                            strings.get(popped[1], "?"),
                            strings.get(popped[0], "?"),
                        ]
                    )
                    name = ".".join(parts)
                    if op.name == "INST":
                        instances[node] = name
                        if name in _HASHING and popped and bad_key is None:
                            bad_key = _called_with_members(name)
                    else:
                        classes[node] = name
                elif op.name in _INSTANCE:
                    cls = popped[0] if op.name == "OBJ" else popped[-1]
                    instances[node] = classes.get(cls, "?")
                    if instances[node] in _HASHING and bad_key is None:
                        # the arguments: OBJ's after its class; REDUCE's and NEWOBJ's tuple
                        # (NEWOBJ_EX's and its keywords), which are its children
                        given = popped[1:] if op.name == "OBJ" else popped[:-1]
                        if any(n == 0 or children[n] for n in given):
                            bad_key = _called_with_members(instances[node])
    return children, ops, bad_key


def _bad_key(
    name: str,
    popped: list[int],
    strings: dict[int, str],
    instances: dict[int, str],
    key_classes: frozenset[str],
) -> str | None:
    """What is wrong with keys (or set members) that are neither strings nor instances of ``key_classes``."""
    if name == "SETITEM":
        keys = popped[1:]  # popped: [value, key]
    elif name in ("SETITEMS", "DICT"):
        keys = popped[0::2]
    else:
        keys = popped
    for key in keys:
        if key in strings or instances.get(key) in key_classes:
            continue
        kind = (
            "a number"
            if key == 0
            else f"a {instances[key]} object"
            if key in instances
            else "a tuple or other object"
        )
        allowed = " and ".join(["strings", *sorted(key_classes)])
        return (
            f"it keys a dict or set by {kind} (real files key them by {allowed} only; keys of "
            f"one hash would make unpickling quadratic)"
        )
    return None


def _called_with_members(name: str) -> str:
    """Why a call of a set or dict constructor with arguments is refused."""
    return (
        f"it builds a set or dict by calling {name} with members (funcshard's files and "
        f"torch's tensors build them empty and fill them with strings; members of one hash "
        f"would make unpickling quadratic)"
    )


def _unfolded(children: list[list[int]], limit: int) -> str | None:
    """``"size"`` if an object unfolds to more than ``limit`` nodes, another problem, or ``None``."""
    n = len(children)
    size = [1] * n
    depth = [1] * n
    state = bytearray(n)  # 0 unseen, 1 on the path, 2 done
    for root in range(1, n):
        if state[root]:
            continue
        todo = [root]
        while todo:
            v = todo[-1]
            if state[v] == 0:
                state[v] = 1
                for c in children[v]:
                    if state[c] == 1:
                        return "contain themselves"
                    if state[c] == 0:
                        todo.append(c)
                continue
            todo.pop()
            if state[v] == 2:
                continue
            state[v] = 2
            kids = children[v]
            if kids:
                size[v] = min(limit + 1, 1 + sum(size[c] for c in kids))
                depth[v] = 1 + max(depth[c] for c in kids)
                if size[v] > limit:
                    return "size"
                if depth[v] > MAX_PICKLE_DEPTH:
                    return f"nest more than {MAX_PICKLE_DEPTH} deep"
    return None


# What each opcode does to the stack, by name: (action, items popped besides a mark slice)
_PUSH_LEAF, _MAKE, _MUTATE, _DROP, _MARK, _PUT, _MEMOIZE, _GET, _DUP, _SKIP = range(10)
_MUTATORS = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}
_FRESH = {"EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "EMPTY_TUPLE", "GLOBAL", "PERSID", "EXT1"}
_FRESH |= {"EXT2", "EXT4", "NEXT_BUFFER"}  # objects that later opcodes may fill or share


def _action(op: pickletools.OpcodeInfo) -> tuple[int, int, bool]:
    """(what ``op`` does, how many single items it pops, whether it pops a mark slice first)."""
    names = [s.name for s in op.stack_before]
    sliced = bool(names) and names[-1] == "stackslice"
    single = names.index("mark") if sliced else len(names)  # OBJ's class is inside its slice
    special = {
        "MARK": _MARK,
        "PUT": _PUT,
        "BINPUT": _PUT,
        "LONG_BINPUT": _PUT,
        "MEMOIZE": _MEMOIZE,
        "GET": _GET,
        "BINGET": _GET,
        "LONG_BINGET": _GET,
        "DUP": _DUP,
    }
    if op.name in special:
        return special[op.name], 0, False
    if op.name in ("PROTO", "FRAME", "STOP", "READONLY_BUFFER"):
        return _SKIP, 0, False
    if op.name in _MUTATORS:
        return _MUTATE, single - 1, sliced  # the container stays on the stack
    if not op.stack_after:
        return _DROP, single, sliced
    if single == 0 and not sliced and op.name not in _FRESH:
        return _PUSH_LEAF, 0, False
    return _MAKE, single, sliced


_STRINGS = {"UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_KEYED = {"SETITEM", "SETITEMS", "ADDITEMS", "DICT", "FROZENSET"}  # ops that hash keys
_INSTANCE = {"REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ"}
# constructors that hash what they are called with: a pickle calls them (REDUCE, NEWOBJ)
# with no members, and fills the result with the keyed opcodes above (torch.save's
# OrderedDict); called with members, they would hash keys no check saw
_HASHING = {
    f"{module}.{name}"
    for module in ("builtins", "__builtin__")
    for name in ("set", "frozenset", "dict")
} | {f"collections.{name}" for name in ("OrderedDict", "Counter", "defaultdict", "ChainMap")}
_ACTIONS = {op: _action(op) for op in pickletools.opcodes}  # genops yields these objects
