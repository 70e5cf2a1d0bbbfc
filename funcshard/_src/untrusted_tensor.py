"""Reading ``torch.save`` blobs that funcshard does not trust: bounded before ``torch.load``, proven after.

Around ``torch.load`` (:func:`check_torch_blob`, :func:`check_plain_tensor`, both in
:func:`load_tensor`): the blob is a zip archive of stored records whose sizes add up to
at most the blob, and whose ``data.pkl`` passes ``check_pickle`` (see [Note: pickles
checked before they are unpickled] in ``untrusted_pickle.py``); the result is a plain
dense CPU tensor (no subclass or ``Parameter``, not sparse, quantized, meta, conjugated
or requiring grad) of the declared dtype and shape, whose storage holds exactly its
bytes (strides that cover them once; no ``expand`` over one element).
"""

from __future__ import annotations

import io
import math
import warnings
import zipfile

import torch

from funcshard._src.untrusted_pickle import check_pickle


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
