"""Reading pickles and ``torch.save`` blobs that funcshard does not trust: bounded before they run.

[Note: pickles checked before they are unpickled]
An allowlist of classes (DCP's ``.metadata`` readers) or ``torch.load(weights_only=True)``
(chunk blobs) decides what a pickle may build, not how much work building it takes. A
few hundred bytes can build a tuple of 64 tuples of 64 tuples ... six deep, each level
reused through the memo (``BINGET``), and make it a dict key: unpickling hashes 64**6
tuples and never returns. :func:`check_pickle` runs first, over the opcodes alone
(``pickletools.genops``, nothing is built): it follows which object each opcode makes
from which, and refuses a pickle whose objects, unfolded as the tree that hashing,
comparing or copying them walks, hold more than :data:`EXPANSION` times as many nodes as
the pickle has opcodes (plus :data:`EXPANSION_FLOOR`), nest deeper than
:data:`MAX_PICKLE_DEPTH`, contain themselves, refer to a memo entry never stored, or
change a class (``BUILD`` on a global). Real pickles stay far below: DCP's metadata of
3500 tensors unfolds to 0.9 nodes per opcode and nests 12 deep.

Around ``torch.load`` (:func:`check_torch_blob`, :func:`check_plain_tensor`, both in
:func:`load_tensor`): the blob is a zip archive of stored records whose sizes add up to
at most the blob, and whose ``data.pkl`` passes :func:`check_pickle`; the result is a
plain dense CPU tensor (no subclass or ``Parameter``, not sparse, quantized, meta,
conjugated or requiring grad) of the declared dtype and shape, whose storage holds
exactly its bytes (strides that cover them once; no ``expand`` over one element).
"""

from __future__ import annotations

import io
import math
import pickletools
import warnings
import zipfile

import torch

EXPANSION = 16  # nodes an object may unfold to, per opcode of its pickle
EXPANSION_FLOOR = 1 << 16
MAX_PICKLE_DEPTH = 100  # objects inside objects; DCP's metadata: 12, a tensor's data.pkl: 5


def check_pickle(data: bytes, /, *, what: str, error: type[Exception] = ValueError) -> None:
    """Refuses a pickle whose unpickling would take more than linear work (see the Note above).

    Args:
        data: the pickle.
        what: the file (or record) it came from, for messages.
        error: the exception class raised.

    Raises:
        error: not a pickle, or one whose objects unfold to too many nodes, nest too
            deeply, contain themselves, read a memo entry never stored or change a class.

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
    """
    try:
        children, ops = _graph(data)
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


def check_torch_blob(blob: bytes, /, *, where: str, error: type[Exception] = ValueError) -> None:
    """Refuses a ``torch.save`` blob that would make ``torch.load`` allocate beyond it or hang.

    ``torch.load`` allocates every record of the archive at the size its central
    directory declares; a compressed record (a zip bomb) or a declared size beyond the
    blob would allocate what the file does not hold. Its pickles (``data.pkl``) must
    pass :func:`check_pickle`.

    Raises:
        error: not a zip archive, a compressed record, records larger than the blob, or
            a pickle that :func:`check_pickle` refuses.

    Example:
        >>> buffer = io.BytesIO(); torch.save(torch.zeros(3), buffer)
        >>> check_torch_blob(buffer.getvalue(), where="x")
        >>> check_torch_blob(b"junk", where="x")
        Traceback (most recent call last):
        ...
        ValueError: x: not a torch.save archive (File is not a zip file)
    """
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            records = archive.infolist()
            total = 0
            for record in records:
                if (
                    record.compress_type != zipfile.ZIP_STORED
                    or record.file_size != record.compress_size
                ):
                    raise error(
                        f"{where}: record {record.filename[:80]!r} is compressed; torch.save "
                        f"stores its records as they are"
                    )
                total += record.file_size
            if total > len(blob):
                raise error(
                    f"{where}: its records declare {total} bytes, more than the {len(blob)} it "
                    f"holds"
                )
            # torch finds data.pkl by a case-insensitive name: check every pickle it could read
            pickles = [(r.filename, archive.read(r)) for r in records if _is_pickle(r.filename)]
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
        if isinstance(e, error):
            raise
        raise error(f"{where}: not a torch.save archive ({e})") from None
    for name, data in pickles:
        check_pickle(data, what=f"{where}, record {name[:80]!r}", error=error)


def load_tensor(
    blob: bytes,
    /,
    *,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    where: str,
    declared_by: str,
    error: type[Exception] = ValueError,
) -> torch.Tensor:
    """The tensor of a ``torch.save`` blob, proven to be what ``declared_by`` declares.

    :func:`check_torch_blob` before ``torch.load(weights_only=True)``,
    :func:`check_plain_tensor` after it: nothing is allocated beyond the blob and the
    result is a plain dense CPU tensor of ``dtype`` and ``shape`` holding exactly its bytes.

    Args:
        blob: what ``torch.save`` wrote (or an attacker).
        dtype, shape: what the blob must hold.
        where: the file and entry, for messages.
        declared_by: what declares ``dtype`` and ``shape``, for messages ("the manifest").
        error: the exception class raised.

    Raises:
        error: the blob is refused, unreadable, or holds anything else.

    Example:
        >>> buffer = io.BytesIO(); torch.save(torch.ones(2), buffer)
        >>> load_tensor(buffer.getvalue(), dtype=torch.float32, shape=(2,), where="x", declared_by="y")
        tensor([1., 1.])
        >>> load_tensor(buffer.getvalue(), dtype=torch.float32, shape=(3,), where="x", declared_by="y")
        Traceback (most recent call last):
        ...
        ValueError: x: a torch.float32 tensor of shape (2,), not torch.float32 (3,); y says a plain torch.float32 tensor of shape (3,): the file is corrupted or was crafted
    """
    check_torch_blob(blob, where=where, error=error)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as e:  # whatever a damaged or crafted blob raises
        raise error(
            f"{where}: unreadable ({type(e).__name__}: {str(e)[:200]}); the file is corrupted or "
            f"was crafted"
        ) from None
    problem = _tensor_problem(value, dtype, shape)
    if problem is not None:
        raise error(
            f"{where}: {problem}; {declared_by} says a plain {dtype} tensor of shape {shape}: "
            f"the file is corrupted or was crafted"
        )
    assert isinstance(value, torch.Tensor)
    return value


def check_plain_tensor(
    value: object,
    /,
    *,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    where: str,
    error: type[Exception] = ValueError,
) -> torch.Tensor:
    """``value`` if it is a plain dense CPU tensor of ``dtype`` and ``shape`` holding exactly its bytes.

    Raises:
        error: anything else; the message says what ``value`` is instead.

    Example:
        >>> check_plain_tensor(torch.zeros(2, 3).T, dtype=torch.float32, shape=(3, 2), where="x").shape
        torch.Size([3, 2])
        >>> check_plain_tensor(torch.zeros(1).expand(4), dtype=torch.float32, shape=(4,), where="x")
        Traceback (most recent call last):
        ...
        ValueError: x: a tensor whose strides (0,) over storage of 4 bytes do not cover its 16 bytes once
    """
    problem = _tensor_problem(value, dtype, shape)
    if problem is not None:
        raise error(f"{where}: {problem}")
    assert isinstance(value, torch.Tensor)
    return value


# -- helpers ------------------------------------------------------------------------------


class _RefusedError(Exception):
    pass


def _graph(data: bytes) -> tuple[list[list[int]], int]:
    """Each object the pickle makes (0: every leaf) with the objects it holds, and the opcode count.

    Marks are kept apart from the stack, as the unpickler keeps them: no opcode but those
    that take a mark's slice reads below the last mark.
    """
    children: list[list[int]] = [[]]
    classes: set[int] = set()
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
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
            memo[arg] = stack[-1]  # pyright: ignore[reportArgumentType]
        elif action == _DUP:
            stack.append(stack[-1])
        else:
            for _ in range(single):
                popped.append(stack.pop())
            if action == _MUTATE:
                target = stack[-1]
                if target == 0 or target in classes:
                    raise _RefusedError(f"{op.name} fills or changes a leaf or a class")
                children[target] += popped
            elif action == _MAKE:
                children.append(popped)
                stack.append(len(children) - 1)
                if op.name in ("GLOBAL", "STACK_GLOBAL"):
                    classes.add(len(children) - 1)
    return children, ops


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


def _is_pickle(name: str) -> bool:
    return name.lower().endswith(".pkl")


def _tensor_problem(value: object, dtype: torch.dtype, shape: tuple[int, ...]) -> str | None:
    if type(value) is not torch.Tensor:
        return f"a {type(value).__name__}, not a plain tensor"
    t = value
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        return f"a {t.layout} tensor{' (quantized)' if t.is_quantized else ''}, not a dense one"
    if t.device.type != "cpu":
        return f"a tensor on {t.device}, not a CPU tensor with data"
    if t.requires_grad or t.grad_fn is not None or t.is_conj() or t.is_neg():
        return "a tensor that requires grad or carries a view flag; a saved tensor is plain data"
    if t.dtype != dtype or tuple(t.shape) != shape:
        return f"a {t.dtype} tensor of shape {tuple(t.shape)}, not {dtype} {shape}"
    nbytes = math.prod(shape) * dtype.itemsize
    storage = t.untyped_storage().nbytes()
    if storage != nbytes or t.storage_offset() != 0 or not _covers_once(shape, t.stride()):
        return (
            f"a tensor whose strides {t.stride()} over storage of {storage} bytes do not cover "
            f"its {nbytes} bytes once"
        )
    return None


def _covers_once(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether ``strides`` lay ``shape`` out densely: a permutation of the contiguous strides."""
    dims = sorted((s, n) for n, s in zip(shape, strides) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return False
        expected *= n
    return True


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


_ACTIONS = {op: _action(op) for op in pickletools.opcodes}  # genops yields these objects
