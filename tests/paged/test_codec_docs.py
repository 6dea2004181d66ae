"""Every documented KV encoding rule, written again in numpy from the documented words, equals
what the library stores, bit for bit: int8, fp8, int4, kivi2 pages (the docs' "Quantized KV" page,
``ringattn._formats`` / ``paged._kivi`` docstrings) and the int8 / fp8 ring hops
(``ringattn._hop_format``; the same codec, ``KVFormat.encode``). Each rule runs on > 100k values: random tokens over six decades,
tokens whose values sit exactly on rounding ties, at the absmax and at the clip, all-zero
tokens and tokens holding NaN / inf."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import paged
import ringattn

F32 = np.float32
TINY = F32(2.0**-126)  # float32's smallest normal


def recip(q):
    """The documented factor: ``float32(1 / q)``, correctly rounded."""
    return F32(1.0) / F32(q)


def round_half_even(y):
    return np.round(y)  # numpy rounds half to even


def inputs(H, ties, rng, n_tokens=2048, rows=64):
    """``[n_tokens, rows, H]`` float32 (> 100k values): random tokens, tie tokens, edge tokens."""
    mag = F32(10.0) ** rng.uniform(-3, 3, size=(n_tokens, rows, 1)).astype(F32)
    x = (rng.standard_normal((n_tokens, rows, H)) * mag).astype(F32)
    t = ties(rng, (n_tokens // 4, rows, H))  # a quarter of the tokens sit on ties
    x[: len(t)] = t
    x[-1, 0] = 0.0  # an all-zero token
    x[-1, 1, 3] = np.nan
    x[-1, 2, 5] = np.inf
    x[-1, 3, 0] = -np.inf
    # absmax 2**-121 .. 2**-113 (values normal): scales on both sides of float32's smallest
    # normal, the ones below stored as 0
    tiny = rng.uniform(0.5, 1.0, size=(9, H)) * np.where(rng.random((9, H)) < 0.5, -1, 1)
    tiny[:, 0] = 1.0
    x[-2, :9] = (tiny * 2.0 ** np.arange(-121, -112)[:, None]).astype(F32)
    return x


def int_ties(qmax):
    """Tokens ``2**k * (j + 0.5)`` with one element at ``+-qmax * 2**k``: the scale is exactly
    ``2**k`` (``qmax * float32(1 / qmax) == 1`` in float32), so ``x * (1 / scale)`` lands on
    ``j + 0.5`` exactly (and on ``qmax``, the clip)."""

    def make(rng, shape):
        k = rng.integers(-20, 20, size=(*shape[:-1], 1))
        j = rng.integers(-qmax, qmax, size=shape)
        x = (j + 0.5) * 2.0**k
        x[..., :1] = np.where(rng.random((*shape[:-1], 1)) < 0.5, qmax, -qmax) * 2.0**k
        return x.astype(F32)

    return make


def fp8_ties(rng, shape):
    """Midpoints of adjacent float8_e4m3fn values (and 448 itself) times ``2**k``."""
    grid = np.arange(0, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)
    grid = np.sort(grid[np.isfinite(grid)])  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    k = rng.integers(-20, 20, size=(*shape[:-1], 1))
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    x = sign * rng.choice(np.concatenate([mids, grid]), size=shape) * 2.0**k
    x[..., :1] = 448.0 * 2.0**k
    return x.astype(F32)


# ------------------------------------------------------------------ the documented rules


def doc_per_token(x, qmax, storage):
    """int8 / fp8 pages: docs/concepts/quantized.md, "Scales and rounding"; the
    ``ringattn._formats`` docstring."""
    absmax = np.max(np.abs(x), axis=-1)
    bad = ~np.all(np.isfinite(x), axis=-1)
    scale = np.where(bad, np.nan, absmax * recip(qmax)).astype(F32)
    keep = ~bad & (scale >= TINY)
    scale = np.where(~bad & ~keep, F32(0.0), scale)
    inverse = F32(1.0) / np.where(keep, scale, F32(1.0))
    y = np.clip(x * inverse[..., None], -qmax, qmax)
    if storage == np.int8:
        y = round_half_even(y)
    y = np.where(keep[..., None], y, F32(0.0))
    return y.astype(storage), scale


def doc_int4(x, g):
    """int4 pages: per group of ``g``."""
    *lead, H = x.shape
    groups = x.reshape(*lead, H // g, g)
    absmax = np.max(np.abs(groups), axis=-1)
    bad = ~np.all(np.isfinite(groups), axis=-1)
    s32 = (absmax * recip(7)).astype(F32)
    keep = ~bad & (s32 >= TINY)
    scale = np.where(bad, np.nan, np.where(keep, s32, 0.0)).astype(ml_dtypes.bfloat16)
    inverse = F32(1.0) / np.where(keep, scale.astype(F32), F32(1.0))
    levels = np.clip(round_half_even(groups * inverse[..., None]), -7, 7)
    levels = np.where(keep[..., None], levels, 0).astype(np.int8).reshape(*lead, H)
    nibbles = levels.view(np.uint8) & 0xF
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8), scale


def doc_kivi2(x, axis):
    """kivi2 pages (``paged._kivi`` docstring): ``axis`` -2 keys (per channel), -1 values."""
    lo, hi = np.min(x, axis=axis), np.max(x, axis=axis)
    bad = ~np.all(np.isfinite(x), axis=axis)
    zero = lo.astype(ml_dtypes.bfloat16)
    scale = ((hi - lo) * recip(3)).astype(F32).astype(ml_dtypes.bfloat16)
    z = np.expand_dims(zero.astype(F32), axis)
    s = np.expand_dims(scale.astype(F32), axis)
    with np.errstate(invalid="ignore"):
        positive = s > 0
        q = round_half_even((x - z) * (F32(1.0) / np.where(positive, s, F32(1.0))))
        q = np.where(positive, np.clip(q, 0, 3), 0)
    q = np.where(np.expand_dims(bad, axis), 0, q).astype(np.uint8)
    q = q.reshape(*q.shape[:-1], q.shape[-1] // 4, 4)
    data = (q[..., 0] | q[..., 1] << 2 | q[..., 2] << 4 | q[..., 3] << 6).astype(np.uint8)
    scale = np.where(bad, np.nan, scale.astype(F32)).astype(ml_dtypes.bfloat16)
    zero = np.where(bad, np.nan, zero.astype(F32)).astype(ml_dtypes.bfloat16)
    return data, scale, zero


def doc_hop(x, hop_format):
    """Ring hops (``ringattn._hop_format`` docstring)."""
    top, storage = {"int8": (127, np.int8), "fp8": (448, ml_dtypes.float8_e4m3fn)}[hop_format]
    bad = ~np.all(np.isfinite(x), axis=-1)
    scale = np.where(bad, np.nan, np.max(np.abs(x), axis=-1) * recip(top)).astype(F32)
    scale = np.where(scale < TINY, F32(0.0), scale)
    with np.errstate(invalid="ignore"):
        positive = scale > 0
    y = x * (F32(1.0) / np.where(positive, scale, F32(1.0)))[..., None]
    y = np.where(positive[..., None], y, F32(0.0))
    if hop_format == "int8":
        y = round_half_even(y)
    return np.clip(y, -top, top).astype(storage), scale


def same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))


# ------------------------------------------------------------------ the checks


@pytest.mark.parametrize(
    "kind, qmax, storage, ties",
    [
        ("int8", 127, np.int8, int_ties(127)),
        ("fp8", 448, ml_dtypes.float8_e4m3fn, fp8_ties),
    ],
)
def test_int8_fp8_pages_follow_the_documented_rule(kind, qmax, storage, ties):
    x = inputs(64, ties, np.random.default_rng(0))
    pages = paged.quantize_pages(jnp.asarray(x), paged.KVFormat(kind))
    data, scale = doc_per_token(x, qmax, storage)
    same_bits(pages.scale, scale)
    same_bits(pages.data, data)


def test_int8_old_documented_rule_x_over_scale_is_not_what_runs():
    """The rule the README stated before (``round(x / scale)`` with ``scale = absmax / 127``,
    divisions correctly rounded) differs from what runs: the docs now state the reciprocal."""
    x = inputs(64, int_ties(127), np.random.default_rng(0))[:-1]
    scale = (np.max(np.abs(x), axis=-1) / F32(127)).astype(F32)
    old = np.clip(round_half_even(x / np.where(scale > 0, scale, 1)[..., None]), -127, 127)
    got = paged.quantize_pages(jnp.asarray(x), paged.KVFormat("int8"))
    assert not np.array_equal(np.asarray(got.scale), scale)
    assert not np.array_equal(np.asarray(got.data), old.astype(np.int8))


@pytest.mark.parametrize("g", [32, 8])
def test_int4_pages_follow_the_documented_rule(g):
    x = inputs(64, int_ties(7), np.random.default_rng(1))
    pages = paged.quantize_pages(jnp.asarray(x), paged.KVFormat("int4", group_size=g))
    data, scale = doc_int4(x, g)
    same_bits(pages.scale, scale)
    same_bits(pages.data, data)


def kivi_ties(grouping):
    """Groups with min ``0`` and max ``3 * 2**k``: scale exactly ``2**k`` (``3 * float32(1 /
    3) == 1``), zero 0, values ``(j + 0.5) * 2**k`` on the ties (and ``3 * 2**k``)."""

    def make(rng, shape):
        k = rng.integers(-20, 20, size=(shape[0], 1, 1))
        x = (rng.integers(0, 3, size=shape) + 0.5) * 2.0**k
        if grouping == "channel":  # groups along axis -2 (the page's tokens)
            x[:, 0, :], x[:, 1, :] = 0.0, 3.0 * 2.0 ** k[:, 0]
        else:
            x[..., 0], x[..., 1] = 0.0, 3.0 * 2.0 ** k[..., 0]
        return x.astype(F32)

    return make


@pytest.mark.parametrize("role, grouping, axis", [("keys", "channel", -2), ("values", "token", -1)])
def test_kivi2_pages_follow_the_documented_rule(role, grouping, axis):
    x = inputs(64, kivi_ties(grouping), np.random.default_rng(2))  # [P, C, H] pages
    x[-2] = x[0]  # kivi2 states no rule below float32's smallest normal (the backend's own)
    pages = paged.quantize_pages(jnp.asarray(x), paged.KVFormat("kivi2"), role=role)
    data, scale, zero = doc_kivi2(x, axis)
    same_bits(pages.zero, zero)
    same_bits(pages.scale, scale)
    same_bits(pages.data, data)


@pytest.mark.parametrize(
    "hop_format, ties", [("int8", int_ties(127)), ("fp8", fp8_ties)], ids=["int8", "fp8"]
)
def test_ring_hops_follow_the_documented_rule(hop_format, ties):
    x = inputs(64, ties, np.random.default_rng(3))
    hop = ringattn.quantize_hop(jnp.asarray(x), hop_format=hop_format)
    data, scale = doc_hop(x, hop_format)
    same_bits(hop.scale, scale)
    same_bits(hop.data, data)
