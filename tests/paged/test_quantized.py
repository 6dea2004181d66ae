"""Quantized KV pages (int8, fp8): formats, round trips, writes, attention over quantized
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

KINDS = ["int8", "fp8"]
TINY = 448 * 2.0**-126  # tokens whose scale would be subnormal store zeros


def error_bound(x, kind):
    """The documented per-element bound of one round trip, ``x [..., H]`` float64."""
    absmax = np.max(np.abs(x), axis=-1, keepdims=True)
    if kind == "int8":
        bound = absmax / 254
    else:
        bound = np.abs(x) / 16 + absmax / 448 * 2.0**-10
    return bound + absmax * 2e-7 + TINY  # float32 rounding of the scale and the product


def quantized_pools(k, v, kind):
    fmt = KVFormat(kind)
    return quantize_pages(k, fmt), quantize_pages(v, fmt)


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
    with pytest.raises(ValueError, match="KVFormat: kind: expected one of"):
        KVFormat("int9")
    for planned in ("int4",):
        with pytest.raises(NotImplementedError, match=r"KVFormat: kind: .* not yet supported"):
            KVFormat(planned)


# --- round trips -------------------------------------------------------------------------


@st.composite
def token_blocks(draw):
    """``[D, C, H]`` float32 blocks mixing random, all-zero, constant and outlier tokens."""
    D, C, H = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 16))
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


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=token_blocks())
def test_round_trip_is_within_the_format_bound(kind, x):
    pages = quantize_pages(jnp.asarray(x), KVFormat(kind))
    assert pages.data.dtype == KVFormat(kind).storage_dtype and pages.scale.dtype == jnp.float32
    assert pages.shape == x.shape and pages.scale.shape == x.shape[:-1]
    back = np.asarray(pages.dequantize(), np.float64)
    x64 = x.astype(np.float64)
    err = np.abs(back - x64)
    bound = error_bound(x64, kind)
    assert np.all(err <= bound), f"max excess {np.max(err - bound):.3g}"
    # All-zero tokens: scale 0, exact zeros. Scales are absmax / qmax.
    zero = np.all(x == 0, axis=-1)
    np.testing.assert_array_equal(np.asarray(pages.scale)[zero], 0.0)
    np.testing.assert_array_equal(back[zero], 0.0)
    want = np.max(np.abs(x64), axis=-1) / KVFormat(kind).qmax
    normal = want >= 2.0**-126  # smaller scales flush to zero (and the token stores zeros)
    np.testing.assert_allclose(np.asarray(pages.scale)[normal], want[normal], rtol=1e-6)
    np.testing.assert_array_equal(back[~normal], 0.0)


@pytest.mark.parametrize("kind", KINDS)
def test_constant_and_extreme_tokens(kind):
    fmt = KVFormat(kind)
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
    np.testing.assert_allclose(back[0, 0], 3.0, rtol=1e-6)
    np.testing.assert_allclose(back[0, 1, [0, 3]], [-2.5e38, 2.5e38], rtol=1e-6)
    np.testing.assert_array_equal(back[0, 2], 0.0)  # its scale would be subnormal
    np.testing.assert_array_equal(back[0, 3], 0.0)
    assert int(jnp.max(jnp.abs(pages.data.astype(jnp.float32)))) == int(fmt.qmax)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_token_decodes_to_nan_and_validate_rejects_it(kind, poison):
    x = jnp.ones((1, 3, 4)).at[0, 1, 2].set(poison)
    pages = quantize_pages(x, KVFormat(kind))
    back = np.asarray(pages.dequantize())
    assert np.all(np.isnan(back[0, 1])) and np.isnan(float(pages.scale[0, 1]))
    np.testing.assert_allclose(back[0, [0, 2]], 1.0)
    # Written into a cache, the token is caught by validate (readable slots only).
    cache = init_paged_cache(1, 1, 4, 2, 4, batch=1, max_pages_per_seq=2, kv_format=KVFormat(kind))
    cache = with_page_table(cache, jnp.array([[2, 3]]))
    token = jnp.ones((1, 1, 3, 1, 4)).at[0, 0, 2, 0, 1].set(poison)
    cache = write(cache, token, jnp.ones_like(token), 0)
    paged.validate(cache._replace(lengths=jnp.array([2])))  # the bad token is unreadable
    with pytest.raises(ValueError, match=r"validate: k_pages: expected finite values.*position 2"):
        paged.validate(cache)


# --- the cache ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_cache_writes_quantize_and_gather_decodes(kind):
    fmt = KVFormat(kind)
    rng = np.random.default_rng(1)
    L, K, P, C, H, B, M = 2, 2, 9, 4, 8, 2, 3
    cache = init_paged_cache(L, K, P, C, H, batch=B, max_pages_per_seq=M, kv_format=fmt)
    assert isinstance(cache.k_pages, QuantizedPages) and cache.kv_format == fmt
    assert cache.k_pages.shape == (L, K, P, C, H) and cache.k_pages.dtype == fmt.storage_dtype
    assert cache.k_pages.scale.shape == (L, K, P, C)
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
    fmt = KVFormat(kind)
    rng = np.random.default_rng(2)
    cache = init_paged_cache(1, 1, 5, 2, 4, batch=1, max_pages_per_seq=2, kv_format=fmt)
    cache = with_page_table(cache, jnp.array([[3, 1]]))
    stacked = jax.tree.map(lambda x: jnp.stack([x, x, x]), cache)  # 3 independent caches
    k = jnp.asarray(rng.standard_normal((3, 1, 3, 1, 4)), jnp.float32)  # [V, B, T, K, H]
    out = jax.jit(jax.vmap(write_layer, in_axes=(0, None, 0, 0, None)))(stacked, 0, k, k, 0)
    assert isinstance(out.k_pages, QuantizedPages) and out.k_pages.data.shape[0] == 3
    for i in range(3):
        one = write_layer(cache, 0, k[i], k[i], 0)
        np.testing.assert_array_equal(
            np.asarray(out.k_pages.data[i], np.float32), np.asarray(one.k_pages.data, np.float32)
        )
        np.testing.assert_array_equal(out.k_pages.scale[i], one.k_pages.scale)


def test_float_cache_is_unchanged_by_default():
    a = init_paged_cache(1, 2, 4, 2, 8, batch=1, max_pages_per_seq=2)
    b = init_paged_cache(1, 2, 4, 2, 8, batch=1, max_pages_per_seq=2, kv_format=None)
    assert a.kv_format is None and isinstance(a.k_pages, jax.Array)
    assert jax.tree.structure(a) == jax.tree.structure(b) and a.k_pages.dtype == jnp.float32


# --- attention ---------------------------------------------------------------------------

# (kind, C, heads (N, K), options, T, pages_per_block, q dtype)
ATTENTION_CASES = [
    ("int8", 4, (4, 2), {}, 1, 1, jnp.float32),
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
    "kind, D, axis_type", [("int8", 2, AxisType.Auto), ("fp8", 4, AxisType.Explicit)]
)
def test_sharded_attention_over_quantized_pages(kind, D, axis_type):
    rng = np.random.default_rng(20 + D)
    q, k, v, local, lengths, global_table = sharded_inputs(
        rng, D, slots_per_device=12 // D, pages_per_device=12 // D + 2, lengths=(45, 13, 0)
    )
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


@pytest.mark.parametrize("kind", KINDS)
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
    unreadable = np.isnan(np.asarray(kq.scale[0]))  # [P, C]
    assert unreadable[0].all() and unreadable.sum() > C

    def poisoned(pages):
        scale = jnp.where(unreadable[None], poison, pages.scale)
        data = pages.data
        if kind == "fp8":  # fp8 can store NaN itself
            data = jnp.where(unreadable[None, :, :, None], jnp.nan, data.astype(jnp.float32))
            data = data.astype(pages.data.dtype)
        else:
            data = jnp.where(unreadable[None, :, :, None], 127, data).astype(jnp.int8)
        return QuantizedPages(data, scale, pages.format)

    clean_k = QuantizedPages(kq.data, jnp.where(unreadable[None], 0.0, kq.scale), kq.format)
    clean_v = QuantizedPages(vq.data, jnp.where(unreadable[None], 0.0, vq.scale), vq.format)
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
    eager = quantize_pages(k, KVFormat(kind))
    mapped = jax.jit(jax.vmap(functools.partial(quantize_pages, kv_format=KVFormat(kind))))(k)
    np.testing.assert_array_equal(
        np.asarray(mapped.data, np.float32), np.asarray(eager.data, np.float32)
    )
    np.testing.assert_array_equal(mapped.scale, eager.scale)


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
