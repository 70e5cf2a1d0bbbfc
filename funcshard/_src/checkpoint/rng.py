"""Random number generator state of every rank, as one tensor a checkpoint can hold.

[Note: rng state v1]
One row of bytes per rank: ``FSRNG1\\0\\0``, then the torch CPU generator
(a u32 length and its bytes), Python's ``random`` (625 u32 words, a u8 flag
and an f64 for the cached Gaussian), numpy's legacy global generator (624 u32
words, a u32 position, a u32 flag and an f64), and the CUDA generators (a u32
count, then a u32 length and the bytes of each; one, the rank's own device's:
[Note: the local CUDA generator]). Little-endian. A row read
from a checkpoint is untrusted: every length and value is checked before any
generator is set, and a row of only torch's CPU state (funcshard 0.1's rows) is
still read.

[Note: rng states checked by value]
A state that every length check passes can still ruin a run: an MT19937 state
whose 19937 significant bits are all zero draws only zeros forever (``torch.rand``
returns 0), and a cached Gaussian that is NaN makes the next ``random.gauss`` or
``torch.randn`` NaN. So, per generator: torch's CPU state is exactly
:data:`TORCH_CPU_STATE` (``<QiiQ624Qdddi4xfB3x``, 5056 bytes: seed, ``left``,
``seeded`` 1, ``next``, 624 MT words below 2**32, the cached normal's three doubles and
its flag, the cached float normal and its flag), every double finite and every flag 0
or 1, and ``left``/``next`` a position torch's MT19937 can be in: ``left + next == 625``
(each in [1, 624]; the next draw reads word ``next``), or ``left`` 1 and ``next`` 0 just
after seeding. Any other pair makes torch read past its 624 words (``left=624,
next=624``). Python's and numpy's MT words and position are in range and their cached
Gaussian finite; no MT19937 state is degenerate; a CUDA state is the 16 bytes of a
Philox seed and offset, the offset a multiple of 4 (``torch.cuda.set_rng_state``
refuses any other, after the CPU generators would have been set). Anything else is a
:class:`CorruptCheckpointError` naming the generator and the field, and no generator
is changed.

[Note: the local CUDA generator]
Each rank saves the CUDA generator of its own device (``torch.cuda.current_device()``,
which ``fs.init`` sets to ``cuda:LOCAL_RANK``) and no other: the GPUs a rank
merely sees are other ranks' generators, and reading each would initialize a CUDA
context on every one of them. Its row then holds one CUDA state, which a load sets
on the loading rank's current device. A row that holds several (funcshard before
this rule saved every visible GPU's) sets only the current device's, from its
index.
"""

from __future__ import annotations

import base64
import math
import random
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from funcshard._src.checkpoint.errors import CorruptCheckpointError
from funcshard._src.comm import channel, runtime, settle

_MAGIC = b"FSRNG1\0\0"
_PY = struct.Struct("<625IBd")
_NP = struct.Struct("<624IIId")
_U32 = struct.Struct("<I")
_MAX_STATE = 1 << 20
TORCH_CPU_STATE = struct.Struct("<QiiQ624Qdddi4xfB3x")  # See [Note: rng states checked by value]
CUDA_STATE_BYTES = 16  # a Philox generator: seed and offset, u64 each
_MT_WORDS = 624


def rng_states() -> torch.Tensor:
    """Every rank's generator states (torch CPU and CUDA, Python, numpy), ``(world_size, n)`` uint8; collective.

    Example:
        >>> states = rng_states()
        >>> states.shape[0], states.dtype
        (1, torch.uint8)
    """
    if not runtime.is_distributed():
        return gather_rng_states()
    with settle.operation("fs.checkpoint.rng_states"):
        return gather_rng_states()


def gather_rng_states() -> torch.Tensor:
    """:func:`rng_states` without its own settling, for callers inside an operation."""
    mine = _pack()
    if not runtime.is_distributed():
        return torch.frombuffer(bytearray(mine), dtype=torch.uint8).unsqueeze(0)
    rows = channel.all_gather_json(base64.b64encode(mine).decode(), "fs.checkpoint.rng_states")
    raw = [base64.b64decode(row) for row in rows]
    width = max(len(r) for r in raw)  # CUDA states may differ in count across ranks
    out = torch.zeros(len(raw), width, dtype=torch.uint8)
    for i, r in enumerate(raw):
        out[i, : len(r)] = torch.frombuffer(bytearray(r), dtype=torch.uint8)
    return out


def set_rng_states(states: torch.Tensor, /) -> None:
    """Restores this rank's generators from :func:`rng_states`; mutates the global generators.

    On more ranks than saved, rank ``r`` takes row ``r % rows``.

    Raises:
        CorruptCheckpointError: a row that is not a state :func:`rng_states` wrote.

    Example:
        >>> saved = rng_states()
        >>> a = torch.rand(2), random.random()
        >>> set_rng_states(saved)
        >>> torch.equal(torch.rand(2), a[0]), random.random() == a[1]
        (True, True)
    """
    rng_setter(states)()


def rng_setter(states: torch.Tensor, /) -> Callable[[], None]:
    """Checks this rank's row of ``states`` now; the returned function sets the generators.

    Raises:
        CorruptCheckpointError: a row that is not a state :func:`rng_states` wrote.
    """
    if states.dtype != torch.uint8 or states.ndim != 2 or states.shape[0] == 0:
        raise CorruptCheckpointError(
            f"RNG states must be a (ranks, n) uint8 tensor from fs.checkpoint.rng_states(), got "
            f"{tuple(states.shape)} {states.dtype}"
        )
    row = runtime.rank() % states.shape[0]
    try:
        return _parse(bytes(states[row].numpy().tobytes()))
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"RNG states, row {row}: {e}") from None


def _pack() -> bytes:
    """This rank's row, laid out as [Note: rng state v1] says."""
    cpu = torch.get_rng_state().numpy().tobytes()
    version, words, gauss = random.getstate()
    assert version == 3
    assert len(words) == 625
    py = _PY.pack(*words, gauss is not None, 0.0 if gauss is None else gauss)
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert name == "MT19937"
    npy = _NP.pack(*(int(k) for k in keys), int(pos), int(has_gauss), float(cached))
    # this rank's own GPU alone: See [Note: the local CUDA generator]
    cuda = (
        [torch.cuda.get_rng_state(torch.cuda.current_device())]
        if torch.cuda.is_initialized()
        else []
    )
    parts = [_MAGIC, _U32.pack(len(cpu)), cpu, py, npy, _U32.pack(len(cuda))]
    for state in cuda:
        data = state.numpy().tobytes()
        parts += [_U32.pack(len(data)), data]
    return b"".join(parts)


def _parse(row: bytes) -> Callable[[], None]:
    """Checks all of ``row`` ([Note: rng state v1]); returns the function that sets the generators it holds."""
    if not row.startswith(_MAGIC):  # a row of torch's CPU state alone
        return _setter(_check_torch_cpu(row), None, None, [])
    at = len(_MAGIC)

    def take(n: int) -> bytes:
        nonlocal at
        if n < 0 or n > _MAX_STATE or at + n > len(row):
            raise CorruptCheckpointError("the saved RNG state is truncated or malformed")
        out, at = row[at : at + n], at + n
        return out

    cpu = take(_U32.unpack(take(4))[0])
    py = _PY.unpack(take(_PY.size))
    npy = _NP.unpack(take(_NP.size))
    cuda = [take(_U32.unpack(take(4))[0]) for _ in range(_U32.unpack(take(4))[0])]
    if any(row[at:]):  # only zero padding may follow (rows are padded to the longest)
        raise CorruptCheckpointError("the saved RNG state has trailing bytes")
    _check_torch_cpu(cpu)
    _check_mt("Python's random", py[:_MT_WORDS], py[_MT_WORDS], flag=py[625], gauss=py[626])
    _check_mt(
        "numpy's global generator", npy[:_MT_WORDS], npy[_MT_WORDS], flag=npy[625], gauss=npy[626]
    )
    for device, state in enumerate(cuda):
        if len(state) != CUDA_STATE_BYTES:
            raise CorruptCheckpointError(
                f"the saved RNG state of CUDA device {device} has {len(state)} bytes, not the "
                f"{CUDA_STATE_BYTES} of a Philox seed and offset"
            )
        offset = int.from_bytes(state[8:], "little")
        if offset % 4:  # torch's CUDAGeneratorImpl::set_philox_offset_per_thread refuses it
            raise CorruptCheckpointError(
                f"the saved RNG state of CUDA device {device}: its Philox offset {offset} is not "
                f"a multiple of 4, which torch.cuda.set_rng_state refuses"
            )
    return _setter(cpu, py, npy, cuda)


def _check_torch_cpu(state: bytes) -> bytes:
    """``state`` if it is a sound torch CPU generator state (See [Note: rng states checked by value])."""
    what = "the saved torch CPU RNG state"
    if len(state) != TORCH_CPU_STATE.size:
        raise CorruptCheckpointError(
            f"{what} has {len(state)} bytes, not the {TORCH_CPU_STATE.size} of a CPU generator"
        )
    fields = TORCH_CPU_STATE.unpack(state)
    left, seeded, next_ = fields[1], fields[2], fields[3]
    words = fields[4 : 4 + _MT_WORDS]
    normals, normal_valid, float_normal, float_valid = (
        fields[628:631],
        fields[631],
        fields[632],
        fields[633],
    )
    if seeded != 1 or not 1 <= left <= _MT_WORDS or not 0 <= next_ <= _MT_WORDS:
        raise CorruptCheckpointError(
            f"{what}: seeded={seeded}, left={left}, next={next_} is no MT19937 position"
        )
    if left + next_ != _MT_WORDS + 1 and (left, next_) != (1, 0):
        raise CorruptCheckpointError(
            f"{what}: left={left}, next={next_} is no position torch's MT19937 reaches (left + "
            f"next is 625, or 1 and 0 just after seeding); torch would read past its "
            f"{_MT_WORDS} words"
        )
    if any(w >= 1 << 32 for w in words):
        raise CorruptCheckpointError(f"{what}: an MT19937 word is not a 32-bit value")
    _check_not_degenerate(what, words)
    if not (0 <= normal_valid <= 1 and 0 <= float_valid <= 1):  # normal_valid is signed
        raise CorruptCheckpointError(f"{what}: a cached-normal flag is neither 0 nor 1")
    if not all(math.isfinite(x) for x in (*normals, float_normal)):
        raise CorruptCheckpointError(
            f"{what}: a cached normal sample is not finite ({[*normals, float_normal]}); "
            f"torch.randn would return NaN"
        )
    return state


def _check_mt(what: str, words: tuple[int, ...], pos: int, *, flag: int, gauss: float) -> None:
    if not 0 <= pos <= _MT_WORDS:
        raise CorruptCheckpointError(f"the saved {what} state: position {pos} is not in [0, 624]")
    _check_not_degenerate(f"the saved {what} state", words)
    if flag > 1:
        raise CorruptCheckpointError(f"the saved {what} state: its Gaussian flag is {flag}")
    if not math.isfinite(gauss):
        raise CorruptCheckpointError(
            f"the saved {what} state: its cached Gaussian is {gauss}; the next Gaussian drawn "
            f"would be NaN"
        )


def _check_not_degenerate(what: str, words: tuple[int, ...]) -> None:
    """MT19937 uses the top bit of the first word and all of the others: all zero draws zeros forever."""
    if not words[0] & 0x8000_0000 and not any(words[1:]):
        raise CorruptCheckpointError(
            f"{what}: its MT19937 state is all zero (degenerate: every number drawn would be 0)"
        )


def _setter(
    cpu: bytes, py: tuple[Any, ...] | None, npy: tuple[Any, ...] | None, cuda: list[bytes]
) -> Callable[[], None]:
    cpu_state = torch.frombuffer(bytearray(cpu), dtype=torch.uint8).clone()
    before = torch.get_rng_state()
    try:  # torch checks the state's size and content too
        torch.set_rng_state(cpu_state)
    except RuntimeError as e:
        raise CorruptCheckpointError(f"the saved torch RNG state is invalid: {e}") from None
    finally:
        torch.set_rng_state(before)

    def apply() -> None:
        torch.set_rng_state(cpu_state)
        if py is not None:
            random.setstate((3, tuple(py[:625]), py[626] if py[625] else None))
        if npy is not None:
            keys = np.array(npy[:624], dtype=np.uint32)
            np.random.set_state(("MT19937", keys, npy[624], npy[625], npy[626]))
        if cuda and torch.cuda.is_available():  # See [Note: the local CUDA generator]
            device = torch.cuda.current_device()
            state = cuda[0] if len(cuda) == 1 else cuda[device] if device < len(cuda) else None
            if state is not None:
                torch.cuda.set_rng_state(
                    torch.frombuffer(bytearray(state), dtype=torch.uint8), device
                )

    return apply
