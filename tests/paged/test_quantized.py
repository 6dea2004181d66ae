"""Quantized KV pages (int8, fp8, int4): formats, round trips, writes, attention over quantized
pools against the public oracles (on the decoded KV: tight; on the original KV: the format's
bound), garbage in unreadable slots and scales, jit / vmap, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType

import paged
from paged import (
    CopyPlan,
    KVFormat,
    QuantizedPages,
    append,
    copy_pages,
    gather_kv,
    init_paged_cache,
    paged_attention,
    paged_attention_reference,
    quantize_pages,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    sharded_paged_attention,
    with_page_table,
    write,
    write_layer,
)
from tests._util import assert_close, make_test_mesh
from tests.paged.test_attention import make_pool, ragged_inputs
from tests.paged.test_sharded import sharded_inputs

KINDS = ["int8", "fp8", "int4"]
# int4 of the shared round trip runs with the slow tests (its own round-trip test is fast).
KINDS_INT4_SLOW = ["int8", "fp8", pytest.param("int4", marks=pytest.mark.slow)]
TINY = 448 * 2.0**-126  # tokens whose scale would be subnormal store zeros
GROUP = 4  # int4's group in these tests: H = 8 has two groups per token
FORMATS = {"int8": KVFormat("int8"), "fp8": KVFormat("fp8"), "int4": KVFormat("int4", GROUP)}


@functools.partial(jax.jit, static_argnums=1)
def _round_trip(x, fmt):
    """``(quantize_pages(x, fmt), its dequantization)`` as one program: the hypothesis tests
    below draw a new shape per example, and one compile per shape costs a fraction of the
    eager ops' (each compiled on its own); eager calls are checked by the other tests."""
    pages = quantize_pages(x, fmt)
    return pages, pages.dequantize()


def group_absmax(x, kind, keepdims=False):
    """``absmax`` of each scale's values (a token, int4: a group), shaped like the scales."""
    x = np.asarray(x, np.float64)
    if kind == "int4":
        g = FORMATS[kind].group_size
        groups = np.abs(x).reshape(*x.shape[:-1], x.shape[-1] // g, g)
        out = np.max(groups, axis=-1)
        return np.repeat(out, g, axis=-1) if keepdims else out
    return np.max(np.abs(x), axis=-1, keepdims=keepdims)


def error_bound(x, kind):
    """The documented per-element bound of one round trip, ``x [..., H]`` float64."""
    absmax = group_absmax(x, kind, keepdims=True)
    if kind == "int8":
        bound = absmax / 254
    elif kind == "int4":
        bound = absmax / 14 * (1 + 2.0**-8)  # half a level of the bf16-rounded scale
    else:
        bound = np.abs(x) / 16 + absmax / 448 * 2.0**-10
    return bound + absmax * 2e-7 + TINY  # float32 rounding of the scale and the product


def quantized_pools(k, v, kind):
    fmt = FORMATS[kind]
    return quantize_pages(k, fmt), quantize_pages(v, fmt)


def levels(pages):
    """The stored levels ``[..., H]`` as float32 (int4 unpacked: low nibble first)."""
    if pages.format.kind != "int4":
        return np.asarray(pages.data, np.float32)
    data = np.asarray(pages.data).astype(np.int16)
    nibbles = np.stack([data & 0xF, data >> 4], axis=-1)
    return np.where(nibbles >= 8, nibbles - 16, nibbles).reshape(*data.shape[:-1], -1) * 1.0


def token_mask(mask, scale):
    """A ``[..., C]`` token mask broadcast onto ``scale`` (int4 scales carry a group axis)."""
    mask = np.asarray(mask)
    return mask[..., None] if scale.ndim > mask.ndim else mask


def attention_bound(q, k, v, kq, vq, table, lengths, *, scale=None):
    """A bound on |attention(k', v') - attention(k, v)| from the worst decoded errors of the
    visible keys and values: logits move by at most ``delta = scale * |q|_1 * max|k - k'|``,
    so each probability by a factor within ``exp(+-2 delta)``."""
    C = k.shape[2]
    valid = np.zeros(k.shape[1:3], bool)
    for b, n in enumerate(np.asarray(lengths)):
        for i in range(int(n)):
            valid[int(table[b, i // C]), i % C] = True
    k, v = np.asarray(k, np.float64)[:, valid], np.asarray(v, np.float64)[:, valid]
    kd = np.asarray(kq.dequantize(), np.float64)[:, valid]
    vd = np.asarray(vq.dequantize(), np.float64)[:, valid]
    H = q.shape[-1]
    scale = 1 / np.sqrt(H) if scale is None else scale
    delta = scale * np.max(np.sum(np.abs(np.asarray(q, np.float64)), -1)) * np.max(np.abs(k - kd))
    return np.max(np.abs(v - vd)) + (np.exp(2 * delta) - 1) * np.max(np.abs(vd)) + 1e-5


# --- formats -----------------------------------------------------------------------------


def test_format_is_a_hashable_validated_config():
    assert KVFormat("int8") == KVFormat("int8") and hash(KVFormat("fp8")) == hash(KVFormat("fp8"))
    assert KVFormat("int8").storage_dtype == jnp.int8 and KVFormat("int8").qmax == 127.0
    assert KVFormat("fp8").storage_dtype == jnp.float8_e4m3fn and KVFormat("fp8").qmax == 448.0
    # Bytes per token per kv head, data + one float32 scale: H = 128 -> 132 vs 256 (bf16).
    assert KVFormat("int8").bytes_per_token(128) == 132 == KVFormat("fp8").bytes_per_token(128)
    # int4: H / 2 + 2 * H / g with bfloat16 group scales: 72 of bf16's 256 at H = 128, g = 32.
    int4 = KVFormat("int4")
    assert int4.group_size == 32 and int4 == KVFormat("int4", group_size=32)
    assert int4.storage_dtype == jnp.uint8 and int4.scale_dtype == jnp.bfloat16
    assert int4.qmax == 7.0 and int4.tag == "int4-g32" and KVFormat("fp8").tag == "fp8"
    assert int4.bytes_per_token(128) == 72 and int4.bytes_per_token(128) / 256 == 0.28125
    assert int4.bytes_per_token(64) == 36 and int4.bytes_per_token(64) / 128 == 0.28125
    assert KVFormat("int4", group_size=64).bytes_per_token(128) == 68
    assert KVFormat("int4", 4) != int4 and hash(KVFormat("int4", 4)) == hash(KVFormat("int4", 4))
    assert int4.data_shape((3, 4, 64)) == (3, 4, 32) and int4.scale_shape((3, 4, 64)) == (3, 4, 2)
    assert int4.float_shape((3, 4, 32)) == (3, 4, 64)
    with pytest.raises(ValueError, match="KVFormat: kind: expected one of"):
        KVFormat("int9")
    for bad in (0, -2, 3):
        with pytest.raises(ValueError, match="KVFormat: group_size: expected a positive even"):
            KVFormat("int4", group_size=bad)
    with pytest.raises(ValueError, match="KVFormat: group_size: 'int8' has one scale per token"):
        KVFormat("int8", group_size=16)


# --- round trips -------------------------------------------------------------------------


@st.composite
def token_blocks(draw, multiple=1):
    """``[D, C, H]`` float32 blocks mixing random, all-zero, constant and outlier tokens
    (``H`` a multiple of ``multiple``)."""
    D, C = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    H = multiple * draw(st.integers(1, 16 // multiple))
    exponent = draw(st.integers(-30, 30))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((D, C, H)) * 10.0**exponent
    kinds = rng.integers(0, 4, size=(D, C))  # 0 random, 1 zero, 2 constant, 3 outlier
    x[kinds == 1] = 0.0
    x[kinds == 2] = draw(st.floats(-1e30, 1e30, allow_nan=False))
    outlier = rng.integers(0, H, size=(D, C))
    rows = np.argwhere(kinds == 3)
    x[rows[:, 0], rows[:, 1], outlier[kinds == 3]] = 1e6 * 10.0**exponent
    return np.clip(x, -3e38, 3e38).astype(np.float32)


@pytest.mark.parametrize("kind", KINDS_INT4_SLOW)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_is_within_the_format_bound(kind, data):
    fmt = FORMATS[kind]
    x = data.draw(token_blocks(fmt.group_size if kind == "int4" else 1))
    pages, back = _round_trip(jnp.asarray(x), fmt)
    assert pages.data.dtype == fmt.storage_dtype and pages.scale.dtype == fmt.scale_dtype
    assert pages.shape == x.shape and pages.scale.shape == fmt.scale_shape(x.shape)
    assert pages.data.shape == fmt.data_shape(x.shape)
    assert pages.nbytes == x.size // x.shape[-1] * fmt.bytes_per_token(x.shape[-1])
    back = np.asarray(back, np.float64)
    x64 = x.astype(np.float64)
    err = np.abs(back - x64)
    bound = error_bound(x64, kind)
    assert np.all(err <= bound), f"max excess {np.max(err - bound):.3g}"
    # All-zero tokens (groups): scale 0, exact zeros. Scales are absmax / qmax (int4: rounded
    # to bfloat16).
    scale = np.asarray(pages.scale, np.float64)
    zero = group_absmax(x64, kind) == 0
    np.testing.assert_array_equal(scale[zero], 0.0)
    zero_values = np.broadcast_to(group_absmax(x64, kind, keepdims=True) == 0, back.shape)
    np.testing.assert_array_equal(back[zero_values], 0.0)
    want = group_absmax(x64, kind) / fmt.qmax
    normal = want >= 2.0**-126  # smaller scales flush to zero (and the token stores zeros)
    rtol = 2.0**-8 if kind == "int4" else 1e-6
    np.testing.assert_allclose(scale[normal], want[normal], rtol=rtol)
    flushed = group_absmax(x64, kind, keepdims=True) / fmt.qmax < 2.0**-126
    np.testing.assert_array_equal(back[np.broadcast_to(flushed, back.shape)], 0.0)


@pytest.mark.parametrize("kind", KINDS)
def test_constant_and_extreme_tokens(kind):
    fmt = FORMATS[kind]
    rtol = 2.0**-8 if kind == "int4" else 1e-6  # int4: 7 * its bf16 scale is not 3.0
    x = jnp.array(
        [
            [3.0] * 4,  # constant: decodes to itself up to float32 rounding
            [-2.5e38, 1.0, 0.0, 2.5e38],  # near float32's max: no overflow
            [1e-40, 0.0, -1e-40, 0.0],  # subnormal absmax
            [0.0] * 4,
        ],
        jnp.float32,
    )[None]
    pages = quantize_pages(x, fmt)
    back = np.asarray(pages.dequantize())
    assert np.all(np.isfinite(back))
    np.testing.assert_allclose(back[0, 0], 3.0, rtol=rtol)
    np.testing.assert_allclose(back[0, 1, [0, 3]], [-2.5e38, 2.5e38], rtol=rtol)
    np.testing.assert_array_equal(back[0, 2], 0.0)  # its scale would be subnormal
    np.testing.assert_array_equal(back[0, 3], 0.0)
    assert int(np.max(np.abs(levels(pages)))) == int(fmt.qmax)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_token_decodes_to_nan_and_validate_rejects_it(kind, poison):
    x = jnp.ones((1, 3, 4)).at[0, 1, 2].set(poison)
    pages = quantize_pages(x, FORMATS[kind])  # H = 4: one int4 group
    back = np.asarray(pages.dequantize())
    assert np.all(np.isnan(back[0, 1])) and np.all(np.isnan(np.asarray(pages.scale[0, 1], float)))
    np.testing.assert_allclose(back[0, [0, 2]], 1.0, rtol=2.0**-8 if kind == "int4" else 1e-7)
    # Written into a cache, the token is caught by validate (readable slots only).
    cache = init_paged_cache(1, 1, 4, 2, 4, batch=1, max_pages_per_seq=2, kv_format=FORMATS[kind])
    cache = with_page_table(cache, jnp.array([[2, 3]]))
    token = jnp.ones((1, 1, 3, 1, 4)).at[0, 0, 2, 0, 1].set(poison)
    cache = write(cache, token, jnp.ones_like(token), 0)
    paged.validate(cache._replace(lengths=jnp.array([2])))  # the bad token is unreadable
    with pytest.raises(ValueError, match=r"validate: k_pages: expected finite values.*position 2"):
        paged.validate(cache)


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4", "kivi2"])
@pytest.mark.parametrize("shape", [(2, 12, 8, 32), (4, 16, 16, 64)])
def test_nan_in_a_large_pool_decodes_to_nan_and_validate_rejects_it(kind, shape):
    """Past about 4,096 values XLA:CPU's max / min reductions drop NaN: the NaN must reach the
    scale anyway (the whole token; int4 its group; kivi2 keys the channel over the page),
    eager and jitted, and ``paged.validate`` must flag it in a cache written at that size."""
    fmt = KVFormat(kind)  # int4: the default group 32
    x = np.random.default_rng(0).standard_normal(shape, np.float32)
    x[1, 5, 3, 7] = np.nan
    for role in ("keys", "values") if kind == "kivi2" else (None,):
        expected = np.zeros(shape, bool)
        if role == "keys":
            expected[1, 5, :, 7] = True
        elif kind == "int4":
            expected[1, 5, 3, :32] = True
        else:
            expected[1, 5, 3, :] = True
        encode = functools.partial(quantize_pages, kv_format=fmt, role=role)
        for f in (encode, jax.jit(encode)):
            back = np.asarray(f(jnp.asarray(x)).dequantize())
            np.testing.assert_array_equal(np.isnan(back), expected, err_msg=f"{kind} {role}")
    # Written into a cache at that size (k: 2 * 48 * 8 * 32 values), validate catches it.
    K, C, H, T = 8, 8, 32, 48
    cache = init_paged_cache(1, K, 13, C, H, batch=2, max_pages_per_seq=6, kv_format=fmt)
    table = np.random.default_rng(1).permutation(np.arange(1, 13)).reshape(2, 6)
    cache = with_page_table(cache, jnp.asarray(table, jnp.int32))
    k = np.random.default_rng(2).standard_normal((1, 2, T, K, H), np.float32)
    clean = write(cache, jnp.asarray(k), jnp.asarray(k), 0)
    paged.validate(clean)
    k[0, 1, 20, 3, 7] = np.nan
    cache = write(cache, jnp.asarray(k), jnp.asarray(k).at[0, 1, 20, 3, 7].set(0.0), 0)
    with pytest.raises(ValueError, match=r"validate: k_pages: expected finite.*sequence 1"):
        paged.validate(cache)


# --- the cache ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_cache_writes_quantize_and_gather_decodes(kind):
    fmt = FORMATS[kind]
    rng = np.random.default_rng(1)
    L, K, P, C, H, B, M = 2, 2, 9, 4, 8, 2, 3
    cache = init_paged_cache(L, K, P, C, H, batch=B, max_pages_per_seq=M, kv_format=fmt)
    assert isinstance(cache.k_pages[0], QuantizedPages) and cache.kv_format == fmt
    assert cache.k_pages.shape == (L, K, P, C, H) and cache.k_pages.dtype == fmt.storage_dtype
    assert cache.k_pages.scale.shape == fmt.scale_shape((L, K, P, C, H))
    assert cache.k_pages.data.shape == fmt.data_shape((L, K, P, C, H))
    assert cache.k_pages.nbytes == L * K * P * C * fmt.bytes_per_token(H)
    if kind != "int4":
        assert cache.k_pages.nbytes == L * K * P * C * (H * fmt.storage_dtype.itemsize + 4)
    paged.validate(cache)
    cache = with_page_table(cache, jnp.array([[5, 2, 7], [3, 4, 0]]))
    k = jnp.asarray(rng.standard_normal((L, B, 5, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((L, B, 5, K, H)), jnp.bfloat16)  # any float dtype
    cache = jax.jit(write)(cache, k, v, jnp.array([0, 0]))
    tok_k = jnp.asarray(rng.standard_normal((L, B, K, H)), jnp.float32)
    cache = jax.jit(append)(cache, tok_k, tok_k)
    layer_k = jnp.asarray(rng.standard_normal((B, 2, K, H)), jnp.float32)
    cache = jax.jit(write_layer)(cache, jnp.int32(1), layer_k, layer_k, jnp.array([6, 2]))
    np.testing.assert_array_equal(cache.lengths, [6, 6])
    paged.validate(cache)
    gk, gv = jax.jit(gather_kv, static_argnums=1)(cache, 1)
    assert gk.dtype == jnp.float32 and gk.shape == (B, M * C, K, H)
    want = np.zeros((B, M * C, K, H), np.float64)
    want[:, :5] = np.asarray(k[1], np.float64)
    want[:, 5] = np.asarray(tok_k[1], np.float64)
    want[1, 2:4] = np.asarray(layer_k[1], np.float64)  # sequence 0's went past its length
    gk64 = np.asarray(gk, np.float64)
    assert np.all(np.abs(gk64 - want) <= error_bound(want, kind))
    stored = np.asarray(cache.k_pages[1].dequantize()[:, 2, 2:4], np.float64)  # [K, 2, H]
    want_stored = np.asarray(layer_k[0], np.float64).transpose(1, 0, 2)
    assert np.all(np.abs(stored - want_stored) <= error_bound(want_stored, kind))
    # Writes store exactly what quantize_pages stores for the same vectors.
    direct = quantize_pages(k[1, 0, :4].transpose(1, 0, 2), fmt)  # page 5 of sequence 0
    np.testing.assert_array_equal(
        np.asarray(cache.k_pages.data[1, :, 5], np.float32), np.asarray(direct.data, np.float32)
    )
    np.testing.assert_array_equal(cache.k_pages.scale[1, :, 5], direct.scale)
    # Nothing reached the null page.
    np.testing.assert_array_equal(np.asarray(cache.k_pages.data[:, :, 0], np.float32), 0.0)
    np.testing.assert_array_equal(cache.k_pages.scale[:, :, 0], 0.0)
    # Copy-on-write copies stored values and scales exactly.
    copied = jax.jit(copy_pages)(cache, CopyPlan(np.array([5, 0]), np.array([8, 4])))
    for pool, new in ((cache.k_pages, copied.k_pages), (cache.v_pages, copied.v_pages)):
        np.testing.assert_array_equal(
            np.asarray(new.data[:, :, 8], np.float32), np.asarray(pool.data[:, :, 5], np.float32)
        )
        np.testing.assert_array_equal(new.scale[:, :, 8], pool.scale[:, :, 5])
        np.testing.assert_array_equal(new.scale[:, :, 4], 0.0)  # invalid src copies zeros
    # The call site of a float cache works unchanged: paged_attention(q, pools[layer], ...).
    q = jnp.asarray(rng.standard_normal((B, 1, 4, H)), jnp.float32)
    res = paged_attention(q, cache.k_pages[1], cache.v_pages[1], cache.page_table, cache.lengths)
    ref = paged_attention_reference(
        q, cache.k_pages[1].dequantize(), cache.v_pages[1].dequantize(), cache.page_table,
        cache.lengths,
    )  # fmt: skip
    assert_close(res.out, ref.out, dtype=jnp.float32, what=f"{kind} cache call site")


@pytest.mark.parametrize("kind", KINDS)
def test_writes_vmap_over_a_stack_of_quantized_caches(kind):
    fmt = FORMATS[kind]
    rng = np.random.default_rng(2)
    cache = init_paged_cache(1, 1, 5, 2, 4, batch=1, max_pages_per_seq=2, kv_format=fmt)
    cache = with_page_table(cache, jnp.array([[3, 1]]))
    stacked = jax.tree.map(lambda x: jnp.stack([x, x, x]), cache)  # 3 independent caches
    k = jnp.asarray(rng.standard_normal((3, 1, 3, 1, 4)), jnp.float32)  # [V, B, T, K, H]
    out = jax.jit(jax.vmap(write_layer, in_axes=(0, None, 0, 0, None)))(stacked, 0, k, k, 0)
    assert isinstance(out.k_pages[0], QuantizedPages) and out.k_pages[0].data.shape[0] == 3
    for i in range(3):
        one = write_layer(cache, 0, k[i], k[i], 0)
        np.testing.assert_array_equal(
            np.asarray(out.k_pages[0].data[i], np.float32),
            np.asarray(one.k_pages[0].data, np.float32),
        )
        np.testing.assert_array_equal(out.k_pages[0].scale[i], one.k_pages[0].scale)


def test_float_cache_is_unchanged_by_default():
    a = init_paged_cache(1, 2, 4, 2, 8, batch=1, max_pages_per_seq=2)
    b = init_paged_cache(1, 2, 4, 2, 8, batch=1, max_pages_per_seq=2, kv_format=None)
    assert a.kv_format is None and isinstance(a.k_pages[0], jax.Array)
    assert jax.tree.structure(a) == jax.tree.structure(b) and a.k_pages.dtype == jnp.float32


# --- attention ---------------------------------------------------------------------------

# (kind, C, heads (N, K), options, T, pages_per_block, q dtype)
ATTENTION_CASES = [
    ("int8", 4, (4, 2), {}, 1, 1, jnp.float32),
    ("int4", 4, (4, 2), {}, 1, 2, jnp.float32),
    ("int4", 4, (4, 1), {"window": 6, "softcap": 4.0, "sinks": True}, 2, 1, jnp.bfloat16),
    ("int4", 16, (4, 4), {"window": (3, None, 9, 5), "causal": False}, 2, 2, jnp.float32),
    ("fp8", 4, (4, 2), {"window": 3}, 2, 2, jnp.float32),
    ("int8", 4, (4, 1), {"softcap": 5.0}, 1, 8, jnp.bfloat16),
    ("fp8", 16, (4, 4), {"window": (3, None, 9, 5), "sinks": True}, 2, 2, jnp.float32),
    ("int8", 4, (4, 2), {"causal": False, "scale": 0.3}, 3, 2, jnp.float32),
    ("fp8", 4, (4, 1), {"window": 6, "softcap": 4.0, "sinks": True}, 2, 1, jnp.bfloat16),
]


def _options(rng, options, N):
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = jnp.asarray(rng.standard_normal(N), jnp.float32)
    return options


@pytest.mark.parametrize("kind, C, heads, options, T, ppb, dtype", ATTENTION_CASES)
def test_paged_attention_over_quantized_pages(kind, C, heads, options, T, ppb, dtype):
    rng = np.random.default_rng(C + T + ppb)
    N, K = heads
    H, M = 8, 3
    lengths = [0, 1, C, C + 1, M * C][: 5 if T == 1 else 4]
    lengths = [max(n, T) if n else 0 for n in lengths]
    k, v, table, lengths = make_pool(rng, K=K, C=C, H=H, lengths=lengths, M=M, dtype=jnp.float32)
    kq, vq = quantized_pools(k, v, kind)
    q = jnp.asarray(rng.standard_normal((table.shape[0], T, N, H)), dtype)
    options = _options(rng, options, N)
    run = jax.jit(
        functools.partial(paged_attention, pages_per_block=ppb, return_page_mass=True),
        static_argnames=("causal", "window", "softcap", "scale"),
    )
    out, lse, mass = run(q, kq, vq, table, lengths, **options)
    assert out.dtype == dtype
    decoded = paged_attention_reference(
        q.astype(jnp.float32), kq.dequantize(), vq.dequantize(), table, lengths,
        return_page_mass=True, **options,
    )  # fmt: skip
    direct = paged_attention_reference(
        q, kq, vq, table, lengths, return_page_mass=True, **options
    )  # the oracle takes quantized pools too
    tight = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
    assert_close(out, decoded.out, dtype=tight, what=f"{kind} vs decoded")
    assert_close(direct.out, decoded.out, dtype=tight, what="oracle on quantized pools")
    seen = np.isfinite(np.asarray(decoded.lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
    if dtype == jnp.float32:
        assert_close(np.where(seen, lse, 0), np.where(seen, decoded.lse, 0), dtype=jnp.float32)
        assert_close(mass, decoded.page_mass, dtype=jnp.float32, what="page mass")
    # Against the original float KV: within the bound the decoded errors imply.
    original = paged_attention_reference(q.astype(jnp.float32), k, v, table, lengths, **options)
    err = float(np.max(np.abs(np.asarray(out, np.float32) - np.asarray(original.out))))
    bound = attention_bound(q, k, v, kq, vq, table, lengths, scale=options.get("scale"))
    if dtype == jnp.bfloat16:
        bound += 2e-2
    assert err <= bound, f"{kind}: error {err:.3g} > bound {bound:.3g}"


@pytest.mark.parametrize("kind", KINDS)
def test_ragged_attention_over_quantized_pages(kind):
    rng = np.random.default_rng(7)
    N, K, C = 4, 2, 4
    q, k, v, table, lengths, cu, _ = ragged_inputs(rng, C, K, N, 8, jnp.float32)
    kq, vq = quantized_pools(k, v, kind)
    opts = dict(window=6, softcap=5.0, sinks=jnp.asarray(rng.standard_normal(N), jnp.float32))
    run = jax.jit(
        functools.partial(
            ragged_paged_attention,
            window=6,
            softcap=5.0,
            pages_per_block=2,
            queries_per_block=2,
            return_page_mass=True,
        )
    )
    out, lse, mass = run(q, kq, vq, table, lengths, cu, jnp.int32(4), sinks=opts["sinks"])
    ref = ragged_paged_attention_reference(
        q, kq.dequantize(), vq.dequantize(), table, lengths, cu, jnp.int32(4),
        return_page_mass=True, **opts,
    )  # fmt: skip
    assert_close(out, ref.out, dtype=jnp.float32, what=f"ragged {kind}")
    assert_close(mass, ref.page_mass, dtype=jnp.float32, what="ragged page mass")
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(np.asarray(ref.lse)))
    direct = ragged_paged_attention_reference(q, kq, vq, table, lengths, cu, jnp.int32(4), **opts)
    assert_close(direct.out, ref.out, dtype=jnp.float32, what="ragged oracle on quantized")


@pytest.mark.parametrize(
    "kind, D, axis_type",
    [("int8", 2, AxisType.Auto), ("fp8", 4, AxisType.Explicit), ("int4", 4, AxisType.Auto)],
)
def test_sharded_attention_over_quantized_pages(kind, D, axis_type):
    rng = np.random.default_rng(20 + D)
    q, k, v, local, lengths, global_table = sharded_inputs(rng, D, lengths=(45, 13, 0))
    kq, vq = quantized_pools(k, v, kind)
    mesh = make_test_mesh((D,), ("seq",), axis_type=axis_type)
    run = jax.jit(
        functools.partial(
            sharded_paged_attention, mesh=mesh, seq_axis="seq", window=9, return_page_mass=True
        )
    )
    res = run(q, kq, vq, local, lengths)
    single = paged_attention(q, kq, vq, global_table, lengths, window=9, return_page_mass=True)
    ref = paged_attention_reference(
        q, kq.dequantize(), vq.dequantize(), global_table, lengths, window=9
    )
    assert_close(res.out, single.out, dtype=jnp.float32, what=f"sharded {kind} D={D}")
    assert_close(res.out, ref.out, dtype=jnp.float32, what="sharded vs oracle")
    assert_close(res.page_mass, single.page_mass, dtype=jnp.float32, what="sharded mass")


@pytest.mark.parametrize("kind", KINDS_INT4_SLOW)
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_garbage_in_unreadable_slots_and_scales_has_no_effect(kind, poison):
    rng = np.random.default_rng(3)
    C, K, N, H, M = 4, 2, 4, 8, 3
    k, v, table, lengths = make_pool(
        rng, K=K, C=C, H=H, lengths=[0, 1, C, C + 1, 2 * C + 3], M=M, dtype=jnp.float32
    )
    kq, vq = quantized_pools(k, v, kind)
    # make_pool put NaN in every unreadable slot (null page, free pages, past lengths):
    # quantized, those tokens carry NaN scales. Poison them further.
    scale0 = np.isnan(np.asarray(kq.scale[0], np.float32))  # [P, C] (int4: [P, C, H / g])
    unreadable = scale0.all(-1) if kind == "int4" else scale0  # [P, C]
    assert unreadable[0].all() and unreadable.sum() > C
    on_scale = token_mask(unreadable[None], kq.scale)  # [1, P, C] (int4: [1, P, C, 1])

    def poisoned(pages):
        scale = jnp.where(on_scale, poison, pages.scale).astype(pages.scale.dtype)
        data = pages.data
        if kind == "fp8":  # fp8 can store NaN itself
            data = jnp.where(unreadable[None, :, :, None], jnp.nan, data.astype(jnp.float32))
            data = data.astype(pages.data.dtype)
        elif kind == "int4":  # 0x88: the -8 nibbles, never written
            data = jnp.where(unreadable[None, :, :, None], 0x88, data).astype(jnp.uint8)
        else:
            data = jnp.where(unreadable[None, :, :, None], 127, data).astype(jnp.int8)
        return QuantizedPages(data, scale, pages.format)

    def clean(pages):
        scale = jnp.where(on_scale, 0.0, pages.scale).astype(pages.scale.dtype)
        return QuantizedPages(pages.data, scale, pages.format)

    clean_k, clean_v = clean(kq), clean(vq)
    q = jnp.asarray(rng.standard_normal((table.shape[0], 2, N, H)), jnp.float32)
    table = table.at[1, 2].set(99).at[2, 2].set(-1)  # bad ids past the lengths too
    sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
    for window in (None, 3):
        got = paged_attention(
            q, poisoned(kq), poisoned(vq), table, lengths, window=window, sinks=sinks,
            pages_per_block=2, return_page_mass=True,
        )  # fmt: skip
        want = paged_attention(
            q, clean_k, clean_v, table, lengths, window=window, sinks=sinks,
            pages_per_block=2, return_page_mass=True,
        )  # fmt: skip
        for name, a, b in zip(("out", "lse", "mass"), got, want, strict=True):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.all(np.isfinite(a)), f"{kind} {name}: garbage reached the result"
            np.testing.assert_array_equal(a, b)
    gk, _ = gather_kv(paged.PagedKVCache(poisoned(kq)[None], poisoned(vq)[None], table, lengths), 0)
    assert np.all(np.isfinite(np.asarray(gk)))


@pytest.mark.parametrize("kind", KINDS)
def test_vmap_and_jit_over_quantized_pools(kind):
    rng = np.random.default_rng(5)
    C, K, N, H, M, V = 4, 2, 4, 8, 3, 3
    k1, v1, table, lengths = make_pool(rng, K=K, C=C, H=H, lengths=[5, 9], M=M, dtype=jnp.float32)
    k = jnp.stack([k1 * (i + 1) for i in range(V)])  # one table, NaN in the same free slots
    v = jnp.stack([v1 - i for i in range(V)])
    kq, vq = quantized_pools(k, v, kind)  # [V, K, P, C, H] data
    q = jnp.asarray(rng.standard_normal((V, 2, 1, N, H)), jnp.float32)

    def one(q, kq, vq):
        return paged_attention(q, kq, vq, table, lengths, window=4).out

    got = jax.jit(jax.vmap(one))(q, kq, vq)
    for i in range(V):
        ref = paged_attention_reference(
            q[i], kq[i].dequantize(), vq[i].dequantize(), table, lengths, window=4
        )
        assert_close(got[i], ref.out, dtype=jnp.float32, what=f"vmap {i}")
    # quantize_pages under jit and vmap agrees with the eager result.
    eager = quantize_pages(k, FORMATS[kind])
    mapped = jax.jit(jax.vmap(functools.partial(quantize_pages, kv_format=FORMATS[kind])))(k)
    np.testing.assert_array_equal(
        np.asarray(mapped.data, np.float32), np.asarray(eager.data, np.float32)
    )
    np.testing.assert_array_equal(  # NaN scales (free slots) included; bf16 via float32
        np.asarray(mapped.scale, np.float32), np.asarray(eager.scale, np.float32)
    )


# --- errors ------------------------------------------------------------------------------


@pytest.mark.no_typecheck
def test_errors_name_the_argument():
    rng = np.random.default_rng(0)
    k, v, table, lengths = make_pool(rng, K=1, C=4, H=8, lengths=[3], M=2, dtype=jnp.float32)
    kq, vq = quantized_pools(k, v, "int8")
    _, v8 = quantized_pools(k, v, "fp8")
    q = jnp.ones((1, 1, 2, 8))
    with pytest.raises(ValueError, match="KVFormat: kind: expected one of"):
        KVFormat(8)
    for bad in (2.0, True, "32", None):
        with pytest.raises(ValueError, match="KVFormat: group_size: expected a positive even"):
            KVFormat("int4", group_size=bad)
    with pytest.raises(ValueError, match="paged_attention: v_pages: expected a pool of the same"):
        paged_attention(q, kq, v, table, lengths)
    with pytest.raises(ValueError, match="paged_attention: k_pages: expected a pool of the same"):
        paged_attention(q, k, vq, table, lengths)
    with pytest.raises(ValueError, match="v_pages: expected the shape and format of k_pages"):
        paged_attention(q, kq, v8, table, lengths)
    bad_scale = QuantizedPages(kq.data, kq.scale.astype(jnp.bfloat16), kq.format)
    with pytest.raises(ValueError, match=r"k_pages.scale: expected float32 scales of shape"):
        paged_attention(q, bad_scale, vq, table, lengths)
    bad_data = QuantizedPages(kq.data.astype(jnp.float32), kq.scale, kq.format)
    with pytest.raises(ValueError, match=r"k_pages.data: expected dtype int8"):
        ragged_paged_attention(q[0], bad_data, vq, table, lengths, jnp.array([0, 1]), 1)
    with pytest.raises(ValueError, match="paged_attention_reference: v_pages: expected a pool"):
        paged_attention_reference(q, kq, v, table, lengths)
    with pytest.raises(ValueError, match="init_paged_cache: kv_format: expected None or a"):
        init_paged_cache(1, 1, 4, 2, 8, batch=1, max_pages_per_seq=2, kv_format="int8")
    with pytest.raises(ValueError, match=r"quantize_pages: kv_format: expected a paged.KVFormat"):
        quantize_pages(k, "int8")
    with pytest.raises(ValueError, match="quantize_pages: x: expected a float array"):
        quantize_pages(jnp.ones((4,)), KVFormat("int8"))
    with pytest.raises(IndexError, match="QuantizedPages: index: expected indices of the axes"):
        kq[0, 0, 0]
    with pytest.raises(IndexError, match="QuantizedPages: index"):
        kq[..., 0]
    cache = init_paged_cache(1, 1, 4, 2, 8, batch=1, max_pages_per_seq=2, kv_format=KVFormat("fp8"))
    mixed = cache._replace(v_pages=jnp.zeros(cache.v_pages.shape))
    with pytest.raises(ValueError, match="validate: v_pages: expected the kind of k_pages"):
        paged.validate(mixed)
    with pytest.raises(ValueError, match="validate: v_pages: expected the kind of k_pages"):
        other = init_paged_cache(
            1, 1, 4, 2, 8, batch=1, max_pages_per_seq=2, kv_format=KVFormat("int8")
        )
        paged.validate(cache._replace(v_pages=other.v_pages))
    k4, v4 = quantized_pools(k, v, "int4")
    bad_scale = QuantizedPages(k4.data, k4.scale.astype(jnp.float32), k4.format)
    with pytest.raises(ValueError, match=r"k_pages.scale: expected bfloat16 scales of shape"):
        paged_attention(q, bad_scale, v4, table, lengths)
    other_group = QuantizedPages(v4.data, v4.scale[..., :1], KVFormat("int4", group_size=8))
    with pytest.raises(ValueError, match="v_pages: expected the shape and format of k_pages"):
        paged_attention(q, k4, other_group, table, lengths)
    with pytest.raises(ValueError, match="paged_attention: v_pages: expected a pool of the same"):
        paged_attention(q, k4, v, table, lengths)


# --- int4 --------------------------------------------------------------------------------


def test_int4_packs_two_levels_per_byte_and_round_trips_representable_values_exactly():
    rng = np.random.default_rng(11)
    fmt = KVFormat("int4", group_size=8)
    q = rng.integers(-7, 8, size=(3, 5, 16))  # [D, C, H] levels
    q[..., 0], q[..., 9] = 7, -7  # each group reaches +-7: absmax = 7 * step
    step = 2.0 ** rng.integers(-20, 20, size=(3, 5, 2))  # bf16-exact steps, one per group
    x = q * np.repeat(step, 8, axis=-1)
    pages = quantize_pages(jnp.asarray(x, jnp.float32), fmt)
    np.testing.assert_array_equal(np.asarray(pages.dequantize(), np.float64), x)
    np.testing.assert_array_equal(np.asarray(pages.scale, np.float64), step)
    # Value 2i in the low nibble of byte i, 2i + 1 in the high one, two's complement.
    data = np.asarray(pages.data)
    np.testing.assert_array_equal(data, (q[..., 0::2] & 0xF) | ((q[..., 1::2] & 0xF) << 4))
    np.testing.assert_array_equal(levels(pages), q)
    # Every byte decodes (garbage included): the nibble 8 is -8 levels, never written.
    every = QuantizedPages(
        jnp.arange(256, dtype=jnp.uint8).reshape(1, 256), jnp.ones((1, 64), jnp.bfloat16),
        KVFormat("int4", group_size=8),
    )  # fmt: skip
    decoded = np.asarray(every.dequantize()).reshape(256, 2)
    nibble = np.arange(256)
    signed = lambda n: np.where(n >= 8, n - 16, n)
    np.testing.assert_array_equal(decoded[:, 0], signed(nibble & 0xF))
    np.testing.assert_array_equal(decoded[:, 1], signed(nibble >> 4))
    assert np.min(levels(quantize_pages(-jnp.abs(jnp.asarray(x, jnp.float32)), fmt))) == -7


@st.composite
def grouped_blocks(draw):
    """``[C, H]`` float32 tokens, ``H = n * g``, and the group with an outlier (or None)."""
    g = draw(st.sampled_from([2, 4, 8]))
    n, C = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    x = rng.standard_normal((C, n * g)) * 10.0 ** draw(st.integers(-20, 20))
    pattern = draw(st.sampled_from(["random", "zero", "constant", "outlier"]))
    if pattern == "zero":
        x[:] = 0.0
    elif pattern == "constant":
        x[:] = draw(st.floats(-1e30, 1e30, allow_nan=False))
    outlier = None
    if pattern == "outlier" or draw(st.booleans()):
        outlier = draw(st.integers(0, n - 1))
        x[:, outlier * g + draw(st.integers(0, g - 1))] = draw(st.sampled_from([1e30, -3e38]))
    return g, np.clip(x, -3e38, 3e38).astype(np.float32), outlier


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block=grouped_blocks())
def test_int4_round_trip_bound_and_groups_are_independent(block):
    g, x, outlier = block
    fmt = KVFormat("int4", group_size=g)
    back = np.asarray(_round_trip(jnp.asarray(x), fmt)[1], np.float64)
    x64 = x.astype(np.float64)
    groups = np.abs(x64).reshape(*x.shape[:-1], -1, g)
    absmax = np.repeat(np.max(groups, axis=-1), g, axis=-1)
    bound = absmax / 14 * (1 + 2.0**-8) + absmax * 2e-7 + 7 * 2.0**-126
    err = np.abs(back - x64)
    assert np.all(err <= bound), f"max excess {np.max(err - bound):.3g}"
    np.testing.assert_array_equal(back[absmax == 0], 0.0)
    # Each group is quantized on its own: a huge outlier leaves the other groups exactly as
    # they would be without it (its own group alone loses precision).
    for j in range(x.shape[-1] // g):
        alone = _round_trip(jnp.asarray(x[..., j * g : (j + 1) * g]), fmt)[1]
        np.testing.assert_array_equal(back[..., j * g : (j + 1) * g], alone)
    if outlier is not None and x.shape[-1] > g:
        other = (outlier + 1) % (x.shape[-1] // g)
        part = x64[..., other * g : (other + 1) * g]
        got = back[..., other * g : (other + 1) * g]
        assert np.all(np.abs(got - part) <= np.max(np.abs(part), -1, keepdims=True) / 13.9)


def test_int4_odd_shapes_and_group_sizes():
    rng = np.random.default_rng(12)
    for shape, g in [((1, 2), 2), ((1, 1, 6), 2), ((2, 1, 3, 1, 12), 6), ((3, 64), 64)]:
        x = rng.standard_normal(shape).astype(np.float32)
        fmt = KVFormat("int4", group_size=g)
        pages = jax.jit(quantize_pages, static_argnums=1)(jnp.asarray(x), fmt)
        assert pages.shape == shape and pages.ndim == len(shape)
        assert pages.data.shape == (*shape[:-1], shape[-1] // 2)
        assert pages.scale.shape == (*shape[:-1], shape[-1] // g)
        back = np.asarray(pages.dequantize(), np.float64)
        assert np.all(np.abs(back - x) <= error_bound_int4(x, g)), shape
    # A head dim that the group does not divide (H < group_size included) is an error.
    with pytest.raises(ValueError, match=r"quantize_pages: x: expected a head dim H divisible"):
        quantize_pages(jnp.ones((2, 48)), KVFormat("int4"))
    with pytest.raises(ValueError, match=r"quantize_pages: x: .*group_size 32, got H=16"):
        quantize_pages(jnp.ones((2, 16)), KVFormat("int4"))
    with pytest.raises(ValueError, match=r"init_paged_cache: head_dim: .*group_size 4, got H=6"):
        init_paged_cache(1, 1, 4, 2, 6, batch=1, max_pages_per_seq=2, kv_format=FORMATS["int4"])


def error_bound_int4(x, g):
    x = np.asarray(x, np.float64)
    absmax = np.repeat(np.max(np.abs(x).reshape(*x.shape[:-1], -1, g), -1), g, -1)
    return absmax / 14 * (1 + 2.0**-8) + absmax * 2e-7


def test_int4_default_group_cache_attention_at_head_dim_64():
    """The default format (group 32) end to end: writes, gather, attention vs both oracles."""
    rng = np.random.default_rng(13)
    fmt = KVFormat("int4")
    L, K, P, C, H, B, M, N = 1, 2, 7, 4, 64, 2, 3, 4
    cache = init_paged_cache(L, K, P, C, H, batch=B, max_pages_per_seq=M, kv_format=fmt)
    assert cache.k_pages.nbytes == L * K * P * C * 36  # 32 data bytes + 2 bf16 scales
    cache = with_page_table(cache, jnp.array([[4, 1, 6], [2, 5, 0]]))
    k = jnp.asarray(rng.standard_normal((L, B, 7, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((L, B, 7, K, H)), jnp.float32)
    cache = jax.jit(write)(cache, k, v, jnp.array([0, 0]))
    paged.validate(cache)
    gk, gv = gather_kv(cache, 0)
    assert np.all(np.abs(np.asarray(gk[:, :7]) - np.asarray(k[0])) <= error_bound_int4(k[0], 32))
    q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.float32)
    res = jax.jit(paged_attention)(q, cache.k_pages[0], cache.v_pages[0], cache.page_table,
                                   cache.lengths)  # fmt: skip
    decoded = paged_attention_reference(
        q, cache.k_pages[0].dequantize(), cache.v_pages[0].dequantize(), cache.page_table,
        cache.lengths,
    )  # fmt: skip
    assert_close(res.out, decoded.out, dtype=jnp.float32, what="int4 g32 vs decoded")
    # Against the original KV, with the pools' float layout rebuilt from k and v.
    fk = np.full((K, P, C, H), np.nan, np.float32)
    fv = np.full((K, P, C, H), np.nan, np.float32)
    table = np.asarray(cache.page_table)
    for b in range(B):
        for t in range(7):
            fk[:, table[b, t // C], t % C] = np.asarray(k[0, b, t])
            fv[:, table[b, t // C], t % C] = np.asarray(v[0, b, t])
    fk, fv = jnp.asarray(fk), jnp.asarray(fv)
    original = paged_attention_reference(q, fk, fv, cache.page_table, cache.lengths)
    err = float(np.max(np.abs(np.asarray(res.out) - np.asarray(original.out))))
    bound = attention_bound(q, fk, fv, cache.k_pages[0], cache.v_pages[0], table, cache.lengths)
    assert err <= bound, f"int4 g32: error {err:.3g} > bound {bound:.3g}"
