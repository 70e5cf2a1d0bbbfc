"""Initializers: the counter RNG's contract, each law's statistics, torch's fans, keys and errors.

References: a pure-Python transcription of [Note: counter rng v1] in ``shard/counter_rng.py`` (the contract
the vectorized numpy code must keep bit for bit), pinned values (a change of
scheme fails here first), ``torch.nn.init`` (fans, gains, the laws of
``xavier_*``/``kaiming_*``/``orthogonal_``) and closed-form moments.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import funcshard as fs
from funcshard._src.shard import counter_rng, fill
from tests.strategies import shapes

inits = fs.initializers
Key = inits.Key
M64 = (1 << 64) - 1
LARGE = (512, 1024)  # 2**19 elements: standard errors near 0.1 % of the std


def _reference_bits(seed: int, path: str, stream: int, i: int) -> int:
    """[Note: counter rng v1] in ``shard/counter_rng.py`` step by step, in Python ints."""
    digest = hashlib.sha256(
        b"funcshard.counter_rng.v1\x00"
        + seed.to_bytes(8, "little")
        + stream.to_bytes(4, "little")
        + path.encode()
    ).digest()
    k0, k1 = int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:16], "little")

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    return mix(mix((k0 + (i + 1) * 0x9E3779B97F4A7C15) & M64) ^ k1)


@given(
    seed=st.integers(0, M64),
    path=st.text(max_size=12),
    stream=st.integers(0, 2**32 - 1),
    index=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=8),
)
def test_bits_follow_the_documented_scheme(seed, path, stream, index):
    key = counter_rng.stream_key(seed, path, stream)
    got = counter_rng.bits(key, np.array(index, dtype=np.int64)).tolist()
    assert got == [_reference_bits(seed, path, stream, i) for i in index]
    u = counter_rng.uniform(key, torch.tensor(index, dtype=torch.int64)).tolist()
    assert u == [((b >> 12) + 0.5) * 2.0**-52 for b in got]


def test_pinned_values_never_change():
    """The values a seed gives are a contract: checkpoints are not needed to reproduce a model."""
    key = counter_rng.stream_key(0, "blocks/0/w")
    got = counter_rng.bits(key, np.array([0, 1, 2**40, 2**63 - 1], dtype=np.int64))
    assert [hex(b) for b in got.tolist()] == [
        "0x2084698b26029984",
        "0x80ff96e5573cb71b",
        "0x7d9a4e20bcabbf41",
        "0x60c45322c3328ecb",
    ]
    got = counter_rng.bits(counter_rng.stream_key(M64, "", 7), np.array([0, 5], dtype=np.int64))
    assert [hex(b) for b in got.tolist()] == ["0x1bddea415b89e902", "0xddaf34ffaff152c8"]
    assert counter_rng.uniform(key, torch.arange(3)).tolist() == [
        0.1270204510419809,
        0.503899985305213,
        0.565183065237492,
    ]
    normal = inits.normal()(Key(0, "blocks/0/w"), (3,), torch.float64)
    expected = [-1.1405892278073089, 0.009775969148659214, 0.1641235670799715]
    assert torch.allclose(normal, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)


def test_uniforms_stay_inside_the_open_interval(monkeypatch):
    """The extreme bit patterns give 2**-53 and 1 - 2**-53, and the normal stays finite there."""
    monkeypatch.setattr(counter_rng, "bits", lambda key, index: np.array([0, M64], dtype=np.uint64))
    u = counter_rng.uniform((0, 0), torch.arange(2))
    assert u.tolist() == [2.0**-53, 1 - 2.0**-53]
    z = Key(0).normal(torch.arange(2))
    assert torch.isfinite(z).all()
    assert z[0] == -z[1]
    assert 8 < z[1] < 9


@pytest.mark.parametrize(
    ("init", "mean", "std"),
    [
        (inits.normal(std=0.02, mean=0.5), 0.5, 0.02),
        (inits.normal(), 0.0, 1.0),
        (inits.uniform(-3.0, 1.0), -1.0, 4 / math.sqrt(12)),
        (inits.xavier_normal(gain=2.0), 0.0, 2.0 * math.sqrt(2 / (512 + 1024))),
        (inits.xavier_uniform(), 0.0, math.sqrt(2 / (512 + 1024))),
        (inits.kaiming_normal(), 0.0, math.sqrt(2 / 1024)),
        (inits.kaiming_uniform(a=0.2, mode="fan_out"), 0.0, math.sqrt(2 / 1.04 / 512)),
        (inits.kaiming_normal(nonlinearity="tanh"), 0.0, 5 / 3 / math.sqrt(1024)),
        (inits.lecun_normal(), 0.0, math.sqrt(1 / 1024)),
    ],
    ids=repr,
)
def test_statistics_on_a_large_leaf(init, mean, std):
    x = init(Key(1, "w"), LARGE, torch.float64)
    n = x.numel()
    assert abs(x.mean().item() - mean) < 6 * std / math.sqrt(n)
    assert abs(x.std().item() / std - 1) < 6 / math.sqrt(2 * n)


def _truncated_moments(lower: float, upper: float) -> tuple[float, float]:
    pdf = [math.exp(-(t**2) / 2) / math.sqrt(2 * math.pi) for t in (lower, upper)]
    z = 0.5 * (math.erf(upper / math.sqrt(2)) - math.erf(lower / math.sqrt(2)))
    mean = (pdf[0] - pdf[1]) / z
    var = 1 + (lower * pdf[0] - upper * pdf[1]) / z - mean**2
    return mean, math.sqrt(var)


@pytest.mark.parametrize(("lower", "upper"), [(-2.0, 2.0), (-1.0, 3.0), (0.5, 1.0)])
def test_truncated_normal_keeps_its_bounds_and_moments(lower, upper):
    x = inits.truncated_normal(std=0.5, lower=lower, upper=upper)(Key(0, "t"), LARGE, torch.float64)
    assert x.min() >= 0.5 * lower
    assert x.max() <= 0.5 * upper
    mean, std = _truncated_moments(lower, upper)
    assert abs(x.mean().item() - 0.5 * mean) < 6 * 0.5 * std / math.sqrt(x.numel())
    assert abs(x.std().item() / (0.5 * std) - 1) < 0.01


def test_lecun_normal_is_jax_truncated_normal_of_variance_one_over_fan_in():
    x = inits.lecun_normal()(Key(0, "w"), (256, 64, 2), torch.float64)  # fan_in = 64 * 2
    bound = 2 * math.sqrt(1 / 128) / 0.87962566103423978
    assert x.abs().max() <= bound
    assert abs(x.std().item() / math.sqrt(1 / 128) - 1) < 0.01


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (
            inits.xavier_uniform(gain=0.5),
            lambda t, g: torch.nn.init.xavier_uniform_(t, gain=0.5, generator=g),
        ),
        (inits.kaiming_uniform(), lambda t, g: torch.nn.init.kaiming_uniform_(t, generator=g)),
        (
            inits.kaiming_uniform(a=1.0, mode="fan_out", nonlinearity="leaky_relu"),
            lambda t, g: torch.nn.init.kaiming_uniform_(t, a=1.0, mode="fan_out", generator=g),
        ),
    ],
    ids=repr,
)
def test_uniform_bounds_equal_torch_init(ours, theirs):
    """torch's bound is reached within 0.1 %: the same law, scaled the same way."""
    shape = (64, 32, 3, 3)
    x = ours(Key(0, "w"), shape, torch.float64)
    y = theirs(torch.empty(shape, dtype=torch.float64), torch.Generator().manual_seed(0))
    for t in (x, y):
        assert t.abs().max().item() == pytest.approx(y.abs().max().item(), rel=1e-3)


@pytest.mark.parametrize("shape", [(8, 20), (20, 8), (6, 4, 3), (5, 2, 2, 2)])
@pytest.mark.parametrize("gain", [1.0, 2.5])
def test_orthogonal_is_orthogonal_as_torch_makes_it(shape, gain):
    q = inits.orthogonal(gain=gain)(Key(0, "w"), shape, torch.float64).reshape(shape[0], -1)
    small = min(q.shape)
    gram = q @ q.T if q.shape[0] == small else q.T @ q
    assert torch.allclose(gram, gain**2 * torch.eye(small, dtype=torch.float64), atol=1e-12)
    assert torch.equal(
        inits.orthogonal(gain=gain)(Key(0, "w"), shape, torch.float32),
        inits.orthogonal(gain=gain)(Key(0, "w"), shape, torch.float64).float(),
    )


@given(shapes(min_ndim=1, max_ndim=4, max_side=6).filter(lambda s: 0 not in s))
def test_fans_equal_torch(shape):
    t = torch.empty(shape)
    if len(shape) < 2:
        with pytest.raises(ValueError, match="fewer than 2 dimensions"):
            torch.nn.init._calculate_fan_in_and_fan_out(t)
        with pytest.raises(ValueError, match="at least 2 dims"):
            inits.fan_in_and_fan_out(shape)
        return
    assert inits.fan_in_and_fan_out(shape) == torch.nn.init._calculate_fan_in_and_fan_out(t)


ALL = [
    inits.zeros,
    inits.ones,
    inits.constant(0.5),
    inits.normal(0.02),
    inits.uniform(-1.0, 2.0),
    inits.truncated_normal(),
    inits.xavier_uniform(),
    inits.xavier_normal(),
    inits.kaiming_uniform(),
    inits.kaiming_normal(mode="fan_out"),
    inits.lecun_normal(),
    inits.orthogonal(),
    inits.elementwise(lambda u, index, shape: u * index),
]
RANDOM = [init for init in ALL if init not in (inits.zeros, inits.ones, inits.constant(0.5))]


@pytest.mark.parametrize("init", ALL, ids=repr)
def test_same_key_same_bits_other_key_other_values(init):
    shape = (6, 5)
    x = init(Key(3, "blocks/0/w"), shape, torch.float32)
    assert torch.equal(x, init(Key(3, "blocks/0/w"), shape, torch.float32))
    if init in RANDOM:
        assert not torch.equal(x, init(Key(4, "blocks/0/w"), shape, torch.float32))
        assert not torch.equal(x, init(Key(3, "blocks/1/w"), shape, torch.float32))
    assert torch.equal(init(0, shape), init(Key(0, ""), shape))


@pytest.mark.parametrize("init", ALL, ids=repr)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_values_are_float64_cast_to_the_dtype(init, dtype):
    x = init(Key(0, "w"), (7, 9), dtype)
    assert x.dtype == dtype
    assert torch.equal(x, init(Key(0, "w"), (7, 9), torch.float64).to(dtype))


@pytest.mark.parametrize("init", ALL, ids=repr)
@pytest.mark.parametrize("block", [1, 5, 64])
def test_values_do_not_depend_on_the_block_size(init, block, monkeypatch):
    whole = init(Key(0, "w"), (9, 11, 3), torch.float64)
    monkeypatch.setattr(fill, "BLOCK_NUMEL", block)
    assert torch.equal(init(Key(0, "w"), (9, 11, 3), torch.float64), whole)


@given(
    shape=shapes(min_ndim=1, max_ndim=3, max_side=7),
    data=st.data(),
    init=st.sampled_from([i for i in ALL if i not in (inits.orthogonal(),)]),
)
def test_any_box_holds_the_values_the_whole_leaf_has_there(shape, data, init):
    """What one rank fills of its shard is the whole leaf's box: the basis of mesh independence."""
    if len(shape) < 2 and init in (ALL[6:11]):
        shape = (*shape, 2)
    starts = [data.draw(st.integers(0, n)) for n in shape]
    box = [data.draw(st.integers(0, n - s)) for s, n in zip(starts, shape)]
    whole = init(Key(0, "w"), shape, torch.float64)
    out = torch.full(box, float("nan"), dtype=torch.float64)
    init.fill_(out, Key(0, "w"), tuple(shape), starts)
    assert torch.equal(out, whole[tuple(slice(s, s + n) for s, n in zip(starts, box))])


def test_elementwise_gets_uniforms_flat_indices_and_the_shape():
    seen = []

    def fn(u, index, shape):
        seen.append((u.dtype, index.dtype, shape))
        assert ((u > 0) & (u < 1)).all()
        return index.double() * 10

    x = inits.elementwise(fn)(Key(0, "w"), (2, 3), torch.int64)
    assert torch.equal(x, torch.arange(6).reshape(2, 3) * 10)
    assert seen == [(torch.float64, torch.int64, (2, 3))]
    u = inits.elementwise(lambda u, index, shape: u)(Key(0, "w"), (4,), torch.float64)
    assert torch.equal(u, inits.uniform()(Key(0, "w"), (4,), torch.float64))


def test_constants_fill_any_dtype_exactly():
    assert torch.equal(inits.constant(2**60 + 1)(0, (2,), torch.int64), torch.full((2,), 2**60 + 1))
    assert inits.ones(0, (2,), torch.bool).all()
    assert torch.equal(inits.zeros(0, (), torch.bfloat16), torch.zeros((), dtype=torch.bfloat16))


def test_initializers_are_immutable_values_with_a_readable_repr():
    assert [repr(i) for i in ALL[:12]] == [
        "zeros",
        "ones",
        "constant(0.5)",
        "normal(std=0.02)",
        "uniform(low=-1.0, high=2.0)",
        "truncated_normal()",
        "xavier_uniform()",
        "xavier_normal()",
        "kaiming_uniform()",
        "kaiming_normal(mode='fan_out')",
        "lecun_normal()",
        "orthogonal()",
    ]
    assert repr(inits.elementwise(_named_fn)) == "elementwise(_named_fn)"
    assert inits.normal(0.02) == inits.normal(std=0.02)
    assert hash(inits.normal(0.02)) == hash(inits.normal(0.02))
    with pytest.raises(dataclasses.FrozenInstanceError):
        inits.normal(0.02).std = 1.0  # type: ignore[misc]
    assert isinstance(inits.zeros, inits.Initializer)


def _named_fn(u, index, shape):
    return u


@pytest.mark.parametrize("init", RANDOM[:-1], ids=repr)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool])
def test_random_initializers_refuse_integer_leaves(init, dtype):
    with pytest.raises(TypeError, match=r"^head/w: .* draws random values but the leaf is torch\."):
        init(Key(0, "head/w"), (3, 4), dtype)


@pytest.mark.parametrize("init", ALL[6:12], ids=repr)
def test_fan_initializers_refuse_leaves_of_one_dim(init):
    with pytest.raises(
        ValueError, match=r"^b: .* shape \(4,\).*e\.g\. a rule \('b', fs\.initializers\.zeros\)"
    ):
        init(Key(0, "b"), (4,))
    assert init(Key(0, "b"), (0,)).shape == (0,)  # an empty leaf is left empty, as torch does


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: inits.uniform(1.0, 1.0), ValueError, r"uniform: low=1.0 must be below high=1.0"),
        (lambda: inits.normal(-1.0), ValueError, r"normal: std=-1.0 must be a non-negative"),
        (lambda: inits.normal("0.02"), TypeError, r"normal: std must be a number, got str"),  # pyright: ignore[reportArgumentType]
        (
            lambda: inits.truncated_normal(lower=2.0, upper=1.0),
            ValueError,
            r"lower=2.0 must be below",
        ),
        (
            lambda: inits.kaiming_uniform(mode="fan"),  # pyright: ignore[reportArgumentType]
            ValueError,
            r"mode must be 'fan_in' or 'fan_out'",
        ),
        (lambda: inits.kaiming_normal(nonlinearity="gelu"), ValueError, r"kaiming_normal: .*gelu"),
        (
            lambda: inits.xavier_uniform(gain=float("nan")),
            TypeError,
            r"gain must be a finite number",
        ),
        (lambda: inits.constant(torch.tensor(1.0)), TypeError, r"a Python number, got Tensor"),  # pyright: ignore[reportArgumentType]
        (lambda: inits.elementwise(3), TypeError, r"fn must be callable"),  # pyright: ignore[reportArgumentType]
        (lambda: Key(-1, "w"), ValueError, r"seed must be in \[0, 2\*\*64\), got -1"),
        (lambda: Key(True, "w"), TypeError, r"seed must be an int"),
        (lambda: Key(0, 3), TypeError, r"path must be a str"),  # pyright: ignore[reportArgumentType]
        (
            lambda: inits.normal()("w", (2,)),  # pyright: ignore[reportArgumentType]
            TypeError,
            r"Key\(seed, path\) or an int seed, got str",
        ),
        (
            lambda: inits.normal()(0, (2, -1)),
            TypeError,
            r"shape must be a tuple of non-negative ints",
        ),
        (
            lambda: inits.elementwise(lambda u, i, s: u[:1])(Key(0, "w"), (3,)),
            ValueError,
            r"w: elementwise\(.*\) returned \(1,\) for a block of 3 elements",
        ),
    ],
)
def test_bad_arguments_say_what_to_pass(make, error, message):
    with pytest.raises(error, match=message):
        make()
