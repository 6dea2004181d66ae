"""KIVI-style 2-bit pages (``KVFormat("kivi2")``): codes and their bound, the residual page
(exact until the page fills, then stored whole), writes in any chunking agreeing, attention
over a kivi2 cache against the oracles (on the decoded KV: tight; on the original KV: the
format's bound), garbage in unreadable slots, validate, and the paths that refuse kivi2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import paged
from paged import (
    CopyPlan,
    KVFormat,
    advance,
    append,
    copy_pages,
    gather_kv,
    init_paged_cache,
    paged_attention,
    paged_attention_reference,
    quantize_pages,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    with_page_table,
    write,
    write_layer,
)
from tests._util import assert_close, make_test_mesh

FMT = KVFormat("kivi2")
WINDOW = KVFormat("kivi2", residual=6)  # page size 4: a window of ceil(6 / 4) + 1 = 3 pages


def kivi_bound(x, axis):
    """The documented per-element bound over groups along ``axis`` of ``x`` (float64)."""
    lo = np.min(x, axis=axis, keepdims=True)
    hi = np.max(x, axis=axis, keepdims=True)
    return (hi - lo) / 6 + (np.abs(lo) + np.abs(hi)) * 2.0**-8 + 1e-30


@st.composite
def pages_of(draw):
    """``[D, C, H]`` float32 pages mixing random, zero, constant and outlier-channel data."""
    # Few distinct shapes (each one compiles): sizes that cover one token, one channel group
    # and a ragged page.
    D, C, H = draw(st.sampled_from([(1, 1, 4), (2, 4, 8), (1, 7, 16), (3, 16, 4)]))
    exponent = draw(st.integers(-20, 20))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    x = rng.standard_normal((D, C, H)) * 10.0**exponent
    kind = draw(st.sampled_from(["random", "zero", "constant", "outlier_channel", "outlier"]))
    if kind == "zero":
        x[:] = 0.0
    elif kind == "constant":
        x[:] = draw(st.floats(-1e20, 1e20, allow_nan=False))
    elif kind == "outlier_channel":
        x[..., rng.integers(0, H)] *= 1e3
    elif kind == "outlier":
        x[rng.integers(0, D), rng.integers(0, C), rng.integers(0, H)] = 1e6 * 10.0**exponent
    return x.astype(np.float32)


# One jitted program per drawn shape (the eager ops compile one by one, several times slower);
# eager calls are checked by the tests below.
_jit_quantize = jax.jit(quantize_pages, static_argnums=1, static_argnames="role")


@pytest.mark.parametrize("role", ["keys", "values"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=pages_of())
def test_round_trip_is_within_the_bound(role, x):
    pages = _jit_quantize(jnp.asarray(x), FMT, role=role)
    D, C, H = x.shape
    assert pages.shape == x.shape and pages.data.shape == (D, C, H // 4)
    assert pages.data.dtype == jnp.uint8 and pages.scale.dtype == jnp.bfloat16
    stats = (D, H) if role == "keys" else (D, C)
    assert pages.scale.shape == stats == pages.zero.shape
    back = np.asarray(pages.dequantize(), np.float64)
    x64 = x.astype(np.float64)
    bound = kivi_bound(x64, -2 if role == "keys" else -1)
    err = np.abs(back - x64)
    assert np.all(err <= bound), f"max excess {np.max(err - bound):.3g}"
    if np.all(x == 0):
        np.testing.assert_array_equal(back, 0.0)


def test_codes_pack_four_to_a_byte_and_decode_exactly_on_the_grid():
    # Per-token values on the grid zero + q * scale with q in 0..3 decode exactly.
    q = np.array([[[0, 1, 2, 3, 3, 2, 1, 0]]], np.float32)  # [1, 1, 8]
    pages = quantize_pages(jnp.asarray(0.5 + 0.25 * q), FMT, role="values")
    assert pages.data.shape == (1, 1, 2)
    assert pages.data[0, 0, 0] == 0 | 1 << 2 | 2 << 4 | 3 << 6
    np.testing.assert_array_equal(np.asarray(pages.dequantize()), 0.5 + 0.25 * q)


def test_outlier_channel_only_costs_its_own_channel_for_keys():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, 8)).astype(np.float32)
    x[..., 3] *= 1000.0  # the outlier channels KIVI quantizes keys per channel for
    keys = np.asarray(quantize_pages(jnp.asarray(x), FMT, role="keys").dequantize())
    tokens = np.asarray(quantize_pages(jnp.asarray(x), FMT, role="values").dequantize())
    others = [c for c in range(8) if c != 3]
    err_keys = np.abs(keys - x)[..., others].max()
    err_tokens = np.abs(tokens - x)[..., others].max()
    assert err_keys < 1.0 and err_tokens > 4 * err_keys  # per token, the outlier sets the step


def test_bytes_per_token_meet_the_target_with_bf16_stats():
    # H = 128: keys 32 + 4 * 128 / C, values 32 + 4 bytes, against bf16's 256 each.
    for C, want in ((16, 100.0), (32, 84.0), (64, 76.0)):
        assert FMT.bytes_per_token(128, page_size=C) * 2 == want
    cache = init_paged_cache(1, 1, 9, 64, 128, batch=1, max_pages_per_seq=8, kv_format=FMT)
    per_token = (cache.k_pages.nbytes + cache.v_pages.nbytes) / (9 * 64)
    assert per_token == 76.0 and per_token / (2 * 128 * 2) <= 0.16
    assert cache.k_pages.residual.shape == (1, 1, 1, 64, 128)
    with pytest.raises(ValueError, match="needs page_size"):
        FMT.bytes_per_token(128)


# --- the cache: residual, chunking ---------------------------------------------------------


def _cache(L=2, K=2, P=20, C=4, H=8, B=3, M=6, fmt=FMT):
    rng = np.random.default_rng(1)
    table = np.zeros((B, M), np.int32)
    ids = rng.permutation(np.arange(1, P))[: B * M].reshape(B, M)
    table[:] = ids
    cache = init_paged_cache(L, K, P, C, H, batch=B, max_pages_per_seq=M, kv_format=fmt)
    return with_page_table(cache, jnp.asarray(table))


def _kv(rng, L, B, T, K, H):
    return (
        jnp.asarray(rng.standard_normal((L, B, T, K, H)), jnp.float32),
        jnp.asarray(rng.standard_normal((L, B, T, K, H)), jnp.float32),
    )


def test_residual_is_exact_and_full_pages_are_stored_whole():
    cache = _cache()
    L, K, P, C, H = cache.k_pages.shape
    B = cache.page_table.shape[0]
    rng = np.random.default_rng(2)
    T = 10  # pages 0, 1 full, page 2 holds 2 tokens in the residual
    k, v = _kv(rng, L, B, T, K, H)
    cache = write(cache, k, v, 0)
    np.testing.assert_array_equal(cache.lengths, [T] * B)
    for layer in range(L):
        kg, vg = gather_kv(cache, layer)
        for got, x, role in ((kg, k, "keys"), (vg, v, "values")):
            x = np.asarray(x[layer])  # [B, T, K, H]
            got = np.asarray(got)
            np.testing.assert_array_equal(got[:, 8:T], x[:, 8:T])  # the residual: exact
            np.testing.assert_array_equal(got[:, T:], 0.0)
            # Full pages equal quantize_pages of the same page (keys over its 4 tokens).
            pages = x[:, :8].reshape(B, 2, C, K, H).transpose(0, 1, 3, 2, 4)
            want = np.asarray(quantize_pages(jnp.asarray(pages), FMT, role=role).dequantize())
            want = want.transpose(0, 1, 3, 2, 4).reshape(B, 8, K, H)
            np.testing.assert_array_equal(got[:, :8], want)


@pytest.mark.parametrize(
    "chunks",
    [
        [13],
        [1] * 13,
        [3, 1, 5, 4],
        pytest.param([4, 4, 4, 1], marks=pytest.mark.slow),
        pytest.param([2, 11], marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("fmt", [FMT, WINDOW], ids=["open-page", "window"])
def test_any_chunking_of_appends_gives_the_same_cache(chunks, fmt):
    base = _cache(fmt=fmt)
    L, K, P, C, H = base.k_pages.shape
    B = base.page_table.shape[0]
    rng = np.random.default_rng(3)
    k, v = _kv(rng, L, B, sum(chunks), K, H)
    whole = write(base, k, v, 0)
    cache, start = base, 0
    for n in chunks:
        if n == 1:
            cache = append(cache, k[:, :, start], v[:, :, start])
        else:
            cache = write(cache, k[:, :, start : start + n], v[:, :, start : start + n], start)
        start += n
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_write_layer_then_advance_equals_write():
    base = _cache()
    L, K, P, C, H = base.k_pages.shape
    B = base.page_table.shape[0]
    rng = np.random.default_rng(4)
    k, v = _kv(rng, L, B, 6, K, H)
    whole = write(write(base, k[:, :, :5], v[:, :, :5], 0), k[:, :, 5:], v[:, :, 5:], 5)
    cache = write(base, k[:, :, :5], v[:, :, :5], 0)
    step = jax.jit(write_layer)
    for layer in range(L):
        cache = step(cache, layer, k[layer, :, 5:], v[layer, :, 5:], cache.lengths)
    cache = advance(cache, 1)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # An out-of-range layer drops its tokens.
    same = step(whole, jnp.int32(L), k[0, :, 5:], v[0, :, 5:], whole.lengths)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(same), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_ragged_lengths_and_writes_past_capacity():
    cache = _cache(M=3)  # capacity 12
    L, K, P, C, H = cache.k_pages.shape
    B = cache.page_table.shape[0]
    rng = np.random.default_rng(5)
    k, v = _kv(rng, L, B, 5, K, H)
    start = jnp.array([0, 3, 9])  # the last sequence runs past capacity (dropped)
    with pytest.raises(ValueError, match=r"write: start\[2\]: expected the 5 token\(s\)"):
        write(cache, k, v, start)  # eager: an error; traced: the documented drop
    cache = jax.jit(write)(cache, k, v, start)
    np.testing.assert_array_equal(cache.lengths, [5, 8, 12])
    kg, _ = gather_kv(cache, 1)
    kg, x = np.asarray(kg), np.asarray(k[1])
    np.testing.assert_array_equal(kg[0, 4], x[0, 4])  # residual of sequence 0
    np.testing.assert_array_equal(kg[0, 5:], 0.0)
    # Positions 0..2 were never written (zeros) but share page 0 with position 3, which is
    # stored whole once full: they decode within the page's bound, not exactly.
    want = np.concatenate([np.zeros_like(x[1, :3]), x[1]])
    assert np.abs(kg[1, :8] - want).max() < 3.0
    assert np.abs(kg[2, 9:12] - x[2, :3]).max() < 3.0  # page 2 filled: stored whole


# --- attention ---------------------------------------------------------------------------


def _filled(rng, T=23, N=4, **kw):
    cache = _cache(**kw)
    L, K, P, C, H = cache.k_pages.shape
    B = cache.page_table.shape[0]
    k, v = _kv(rng, L, B, T, K, H)
    cache = write(cache, k, v, 0)
    lengths = jnp.array([T, 13, 0][:B])  # row 1 cut back into a stored page: re-seated
    return with_page_table(cache, cache.page_table, lengths), k, v


@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True}, {"window": 5}, {"softcap": 2.0}, {"causal": True, "window": 3}],
)
@pytest.mark.parametrize("T", [1, 3])
def test_paged_attention_over_a_kivi2_cache(options, T):
    rng = np.random.default_rng(6)
    cache, k, v = _filled(rng)
    N, H = 4, cache.k_pages.shape[-1]
    B = cache.page_table.shape[0]
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    for layer in range(cache.k_pages.shape[0]):
        kp, vp = cache.k_pages[layer], cache.v_pages[layer]
        args = (q, kp, vp, cache.page_table, cache.lengths)
        got = paged_attention(*args, pages_per_block=2, return_page_mass=True, **options)
        ref = paged_attention_reference(*args, return_page_mass=True, **options)
        assert_close(got.out, ref.out, dtype=jnp.float32)
        assert_close(got.page_mass, ref.page_mass, dtype=jnp.float32)
        # Against the original KV: within the bound the decoded errors imply (logits move
        # by at most delta = scale * |q|_1 * max|k - k'|, probabilities by exp(+-2 delta)).
        float_cache = init_paged_cache(1, *cache.k_pages.shape[1:], batch=B, max_pages_per_seq=6)
        float_cache = with_page_table(float_cache, cache.page_table)
        float_cache = write(float_cache, k[layer : layer + 1], v[layer : layer + 1], 0)
        float_cache = float_cache._replace(lengths=cache.lengths)
        fk, fv = float_cache.k_pages[0], float_cache.v_pages[0]
        exact = paged_attention_reference(q, fk, fv, cache.page_table, cache.lengths, **options)
        kd, vd = (np.asarray(x, np.float64) for x in gather_kv(cache, layer))
        ko, vo = (np.asarray(x, np.float64) for x in gather_kv(float_cache, 0))
        delta = np.max(np.sum(np.abs(np.asarray(q, np.float64)), -1)) * np.max(np.abs(kd - ko))
        delta /= np.sqrt(H)
        if "softcap" in options:
            delta = min(delta, 2 * options["softcap"])
        bound = np.max(np.abs(vd - vo)) + (np.exp(2 * delta) - 1) * np.max(np.abs(vd)) + 1e-5
        err = np.abs(np.asarray(got.out) - np.asarray(exact.out))
        assert np.max(err) <= bound


def test_ragged_attention_over_a_kivi2_cache():
    rng = np.random.default_rng(7)
    cache, _, _ = _filled(rng)
    N, H = 4, cache.k_pages.shape[-1]
    q_lens = np.array([3, 1, 0])
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((int(q_lens.sum()), N, H)), jnp.float32)
    args = (q, cache.k_pages[0], cache.v_pages[0], cache.page_table, cache.lengths, cu, 3)
    got = ragged_paged_attention(*args, causal=True, queries_per_block=2)
    ref = ragged_paged_attention_reference(*args, causal=True)
    assert_close(got.out, ref.out, dtype=jnp.float32)


def test_garbage_in_unreadable_slots_has_no_effect():
    rng = np.random.default_rng(8)
    cache, _, _ = _filled(rng)
    B, N, H = 3, 4, cache.k_pages.shape[-1]
    q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.float32)
    clean = paged_attention(q, cache.k_pages[0], cache.v_pages[0], cache.page_table, cache.lengths)
    C = cache.page_size
    kp, vp = cache.k_pages.stacked(), cache.v_pages.stacked()
    # NaN in the residual past each row's written length, in pages no table row reaches, and
    # in the stored page under each open residual page.
    np.testing.assert_array_equal(kp.residual_len[0, 0], cache.lengths)
    res_k = np.array(kp.residual)
    for b, n in enumerate(np.asarray(cache.lengths)):
        res_k[:, :, b, n % C :] = np.nan
    table = np.asarray(cache.page_table)
    unused = np.setdiff1d(np.arange(1, kp.shape[2]), table)
    scale = np.array(kp.scale.astype(jnp.float32))
    scale[:, :, unused] = np.nan
    for b, n in enumerate(np.asarray(cache.lengths)):
        if n % C:
            scale[:, :, table[b, n // C]] = np.nan
    import dataclasses

    kp = dataclasses.replace(
        kp, residual=jnp.asarray(res_k), scale=jnp.asarray(scale, jnp.bfloat16)
    )
    dirty = paged_attention(q, kp[0], vp[0], cache.page_table, cache.lengths)
    np.testing.assert_array_equal(np.asarray(dirty.out), np.asarray(clean.out))


def test_jit_and_vmap_over_kivi2_caches():
    rng = np.random.default_rng(9)
    caches = [_filled(np.random.default_rng(s))[0] for s in (10, 11)]
    stack = jax.tree.map(lambda *x: jnp.stack(x), *caches)
    N, H = 4, caches[0].k_pages.shape[-1]
    q = jnp.asarray(rng.standard_normal((2, 3, 1, N, H)), jnp.float32)

    def attend(q, c):
        return paged_attention(q, c.k_pages[0], c.v_pages[0], c.page_table, c.lengths).out

    got = jax.jit(jax.vmap(attend))(q, stack)
    for i, c in enumerate(caches):
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(attend(q[i], c)), atol=1e-6)


# --- validate, copies and the paths that refuse kivi2 -----------------------------------


def test_validate_rejects_nan_written_into_a_stored_page_or_the_residual():
    for position in (1, 9):  # a stored page (0..7) and the residual (8, 9)
        cache = _cache()
        L, K, P, C, H = cache.k_pages.shape
        B = cache.page_table.shape[0]
        k, v = _kv(np.random.default_rng(12), L, B, 10, K, H)
        k = k.at[1, 2, position, 0, 3].set(jnp.nan)
        cache = write(cache, k, v, 0)
        with pytest.raises(ValueError, match="validate: k_pages: expected finite values"):
            paged.validate(cache)
    paged.validate(write(_cache(), *_kv(np.random.default_rng(12), 2, 3, 10, 2, 8), 0))


def test_copy_pages_copies_stored_pages_and_keeps_the_residual():
    rng = np.random.default_rng(13)
    cache, _, _ = _filled(rng)
    src = int(cache.page_table[0, 0])
    free = np.setdiff1d(np.arange(1, cache.k_pages.shape[2]), np.asarray(cache.page_table))
    dst = int(free[0])
    out = copy_pages(cache, CopyPlan.from_pairs([(src, dst)]))
    for a, b in ((out.k_pages, cache.k_pages), (out.v_pages, cache.v_pages)):
        np.testing.assert_array_equal(
            np.asarray(a.dequantize()[:, :, dst]), np.asarray(b.dequantize()[:, :, src])
        )
        np.testing.assert_array_equal(np.asarray(a.residual), np.asarray(b.residual))


@pytest.mark.no_typecheck
def test_errors_name_the_argument():
    x = jnp.ones((2, 4, 8))
    with pytest.raises(ValueError, match="quantize_pages: role: kivi2 needs"):
        quantize_pages(x, FMT)
    with pytest.raises(ValueError, match="quantize_pages: role: only kivi2"):
        quantize_pages(x, KVFormat("int8"), role="keys")
    with pytest.raises(ValueError, match="quantize_pages: x: kivi2 packs 4 codes a byte"):
        quantize_pages(jnp.ones((2, 4, 6)), FMT, role="keys")
    with pytest.raises(ValueError, match="write: count: expected an int or shape"):
        write(_cache(), *_kv(np.random.default_rng(0), 2, 3, 2, 2, 8), 0, count=jnp.ones(2, int))
    with pytest.raises(ValueError, match="init_paged_cache: head_dim: kivi2"):
        init_paged_cache(1, 1, 4, 4, 6, batch=1, max_pages_per_seq=2, kv_format=FMT)
    cache = _cache()
    q = jnp.ones((2, 1, 4, 8))
    with pytest.raises(ValueError, match=r"paged_attention: k_pages\.residual: expected one"):
        paged_attention(
            q, cache.k_pages[0], cache.v_pages[0], cache.page_table[:2], cache.lengths[:2]
        )


# --- padded chunks, re-seating rows, select_rows ------------------------------------------


@pytest.mark.parametrize("kind", [None, "int8", "kivi2"])
def test_count_drops_the_padding_of_a_chunk(kind):
    fmt = None if kind is None else KVFormat(kind)
    base = init_paged_cache(2, 2, 20, 4, 8, batch=3, max_pages_per_seq=6, kv_format=fmt)
    base = with_page_table(base, _cache().page_table)
    rng = np.random.default_rng(14)
    k, v = _kv(rng, 2, 3, 7, 2, 8)
    count = jnp.array([7, 3, 0])
    padded = write(base, k, v, jnp.array([0, 2, 5]), count=count)
    np.testing.assert_array_equal(padded.lengths, [7, 5, 0])
    for b, (s, n) in enumerate(((0, 7), (2, 3))):
        one = write(
            with_page_table(base, base.page_table), k[:, :, :n], v[:, :, :n], s,
            count=jnp.array([n if r == b else 0 for r in range(3)]),
        )  # fmt: skip
        kg, vg = gather_kv(padded, 1)
        ko, vo = gather_kv(one, 1)
        np.testing.assert_array_equal(np.asarray(kg[b]), np.asarray(ko[b]))
        np.testing.assert_array_equal(np.asarray(vg[b]), np.asarray(vo[b]))
    kg, _ = gather_kv(padded, 0)
    np.testing.assert_array_equal(np.asarray(kg[2]), 0.0)  # count 0: nothing written
    # write_layer takes count alike; a bad count is a ValueError.
    one = write_layer(base, 0, k[0], v[0], 0, count=jnp.array([2, 0, 1]))
    kg, _ = gather_kv(one._replace(lengths=jnp.array([7, 7, 7])), 0)
    assert np.all(np.asarray(kg[0, 2:]) == 0) and np.all(np.asarray(kg[1]) == 0)


def test_writes_follow_the_pool_not_the_cache_lengths():
    # The residual tracks what was written (residual_len), so attention lengths and
    # cache.lengths may be anything: a chunk written with the cache's lengths left behind
    # equals one written with them kept up to date.
    base = _cache()
    rng = np.random.default_rng(15)
    k, v = _kv(rng, 2, 3, 9, 2, 8)
    a = write(write(base, k[:, :, :5], v[:, :, :5], 0), k[:, :, 5:], v[:, :, 5:], 5)
    stale = base
    for layer in range(2):
        stale = write_layer(stale, layer, k[layer, :, :5], v[layer, :, :5], 0)
    for layer in range(2):
        stale = write_layer(stale, layer, k[layer, :, 5:], v[layer, :, 5:], 5)
    np.testing.assert_array_equal(stale.lengths, 0)
    for x, y in zip(
        jax.tree.leaves((a.k_pages, a.v_pages)),
        jax.tree.leaves((stale.k_pages, stale.v_pages)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_with_page_table_reseats_the_rows():
    cache = _cache()
    rng = np.random.default_rng(16)
    k, v = _kv(rng, 2, 3, 14, 2, 8)
    cache = write(cache, k, v, 0)  # 14 tokens: pages 0..2 stored, 12, 13 in the residual
    before = [np.asarray(x) for x in gather_kv(cache, 0)]
    # Cut row 0 to 13 (same open page), row 1 to 8 (page-aligned), row 2 to 6 (into a
    # stored page: its residual comes from the stored page's decoded tokens).
    cut = with_page_table(cache, cache.page_table, jnp.array([13, 8, 6]))
    np.testing.assert_array_equal(cut.k_pages.residual_len[0, 0], [13, 8, 6])
    after = [np.asarray(x) for x in gather_kv(cut, 0)]
    for got, want in zip(after, before, strict=True):
        np.testing.assert_array_equal(got[0, :13], want[0, :13])
        np.testing.assert_array_equal(got[1, :8], want[1, :8])
        np.testing.assert_array_equal(got[2, :6], want[2, :6])
    # Appending after the cut continues from there: row 2's page 1 is stored again from
    # its decoded tokens plus the new ones.
    more = write(cut, k[:, :, :2], v[:, :, :2], cut.lengths)
    kg = np.asarray(gather_kv(more, 0)[0])
    np.testing.assert_array_equal(kg[0, 13:15], np.asarray(k[0, 0, :2]))  # open page 3
    assert np.abs(kg[2, 6:8] - np.asarray(k[0, 2, :2])).max() < 3.0
    # Without lengths the residual is untouched.
    same = with_page_table(cache, cache.page_table)
    np.testing.assert_array_equal(same.k_pages.residual, cache.k_pages.residual)


def test_select_rows_lets_any_table_order_read_the_residual():
    rng = np.random.default_rng(17)
    cache, _, _ = _filled(rng)
    N, H = 4, cache.k_pages.shape[-1]
    rows = jnp.array([1, 0, 1, 0])
    q = jnp.asarray(rng.standard_normal((4, 1, N, H)), jnp.float32)
    table, lengths = cache.page_table[rows], cache.lengths[rows]
    kp, vp = paged.select_rows(cache.k_pages[0], rows), paged.select_rows(cache.v_pages[0], rows)
    got = paged_attention(q, kp, vp, table, lengths)
    for i, r in enumerate(np.asarray(rows)):
        want = paged_attention(
            q[i : i + 1].repeat(3, 0), cache.k_pages[0], cache.v_pages[0],
            cache.page_table, cache.lengths,
        ).out[r]  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got.out[i]), np.asarray(want))
    float_pool = jnp.zeros((2, 4, 4, 8))
    assert paged.select_rows(float_pool, rows) is float_pool
    with pytest.raises(ValueError, match="select_rows: rows"):
        paged.select_rows(float_pool, jnp.ones((2, 2), jnp.int32))


@pytest.mark.parametrize(
    ("D", "axis_type", "fmt"),
    [
        (2, jax.sharding.AxisType.Explicit, FMT),
        (4, jax.sharding.AxisType.Explicit, WINDOW),
        pytest.param(2, jax.sharding.AxisType.Auto, FMT, marks=pytest.mark.slow),
        pytest.param(2, jax.sharding.AxisType.Auto, WINDOW, marks=pytest.mark.slow),
        pytest.param(4, jax.sharding.AxisType.Auto, FMT, marks=pytest.mark.slow),
        pytest.param(4, jax.sharding.AxisType.Explicit, FMT, marks=pytest.mark.slow),
    ],
)
def test_sharded_decode_over_a_kivi2_cache(D, axis_type, fmt):
    # Pages split over the devices; each row's residual page (replicated) is read by the
    # device whose token range holds it. Lengths put the residual on several devices; with a
    # window of 3 pages, row 2's (positions 8..16) and, on 4 devices, row 0's (20..29)
    # straddle two devices.
    rng = np.random.default_rng(18)
    L, K, C, H, B, M = 1, 2, 4, 8, 3, 8
    Md = M // D
    Pd = 1 + Md * B  # pages per device, its local null page 0 included
    P = D * Pd
    # The sharded decode reads local ids (device d holds pages [d * Pd, (d + 1) * Pd) and
    # table slots [d * Md, (d + 1) * Md)); the cache is written through the global ids.
    local = np.zeros((B, M), np.int32)
    for i in range(M):
        local[:, i] = 1 + (i % Md) * B + np.arange(B)
    global_table = local + (np.arange(M) // Md)[None] * Pd
    cache = init_paged_cache(L, K, P, C, H, batch=B, max_pages_per_seq=M, kv_format=fmt)
    cache = with_page_table(cache, jnp.asarray(global_table))
    k, v = _kv(rng, L, B, 30, K, H)
    lengths = jnp.array([30, 7, 17])  # residual pages on different devices
    cache = write(cache, k, v, 0, count=lengths)  # each window holds exact tokens
    np.testing.assert_array_equal(cache.lengths, lengths)
    q = jnp.asarray(rng.standard_normal((B, 2, 4, H)), jnp.float32)
    mesh = make_test_mesh((D,), ("seq",), axis_type=axis_type)
    got = paged.sharded_paged_attention(
        q, cache.k_pages[0], cache.v_pages[0], jnp.asarray(local), lengths, mesh=mesh,
        seq_axis="seq", causal=True, return_page_mass=True,
    )  # fmt: skip
    ref = paged_attention_reference(
        q, cache.k_pages[0], cache.v_pages[0], cache.page_table, lengths, causal=True,
        return_page_mass=True,
    )  # fmt: skip
    assert_close(got.out, ref.out, dtype=jnp.float32)
    assert_close(got.page_mass, ref.page_mass, dtype=jnp.float32)


# --- the residual window (KVFormat("kivi2", residual=R)) ---------------------------------


def _expected_kv(x, n, C, W, role):
    """The independent oracle of a kivi2 window: ``x [B, T, K, H]`` exact tokens, ``n [B]``
    lengths: positions in the last ``W`` pages (``C * (n // C - W + 1) .. n - 1``) exact, every
    older page as ``quantize_pages`` stores it, the rest zero. Returns ``[B, M * C, K, H]``
    for a capacity of ``x.shape[1]`` tokens."""
    B, T, K, H = x.shape
    out = np.zeros_like(x)
    for b in range(B):
        base = max(0, (n[b] // C - W + 1) * C)
        for page in range(base // C):
            tokens = x[b, page * C : (page + 1) * C].transpose(1, 0, 2)  # [K, C, H]
            q = quantize_pages(jnp.asarray(tokens), FMT, role=role).dequantize()
            out[b, page * C : (page + 1) * C] = np.asarray(q).transpose(1, 0, 2)
        out[b, base : n[b]] = x[b, base : n[b]]
    return out


def test_window_formats_and_their_shapes():
    assert WINDOW.residual_pages(4) == 3 and FMT.residual_pages(4) == 1
    assert KVFormat("kivi2", residual=8).residual_pages(4) == 3
    assert KVFormat("int8").residual_pages(4) == 0
    assert WINDOW.tag == "kivi2-r6" and WINDOW != FMT and hash(WINDOW) != hash(FMT)
    cache = _cache(fmt=WINDOW)
    assert cache.k_pages.residual.shape == (2, 2, 3, 12, 8)  # [L, K, B, W * C, H]
    assert cache.v_pages.residual.shape == (2, 2, 3, 12, 8)


@pytest.mark.no_typecheck
def test_window_option_errors():
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="KVFormat: residual: expected a non-negative int"):
            KVFormat("kivi2", residual=bad)
    with pytest.raises(ValueError, match="KVFormat: residual: only kivi2"):
        KVFormat("int8", residual=4)
    cache = _cache(fmt=WINDOW)
    narrow = init_paged_cache(2, 2, 20, 4, 8, batch=3, max_pages_per_seq=6, kv_format=FMT)
    import dataclasses

    wrong = dataclasses.replace(cache.k_pages.stacked(), residual=narrow.k_pages.residual)
    q = jnp.ones((3, 1, 4, 8))
    with pytest.raises(ValueError, match=r"paged_attention: k_pages\.residual: expected float32"):
        paged_attention(q, wrong[0], cache.v_pages[0], cache.page_table, cache.lengths)


@pytest.mark.parametrize(
    "residual",
    [pytest.param(4, marks=pytest.mark.slow), 6, pytest.param(9, marks=pytest.mark.slow)],
)
def test_window_keeps_the_recent_pages_exact_in_any_chunking(residual):
    fmt = KVFormat("kivi2", residual=residual)
    base = _cache(fmt=fmt)
    L, K, P, C, H = base.k_pages.shape
    B = base.page_table.shape[0]
    W = fmt.residual_pages(C)
    rng = np.random.default_rng(30 + residual)
    k, v = _kv(rng, L, B, 24, K, H)
    cache, start = base, 0
    for n in (3, 1, 1, 6, 2, 5, 1, 4):  # random chunking of 23 tokens
        cache = write(cache, k[:, :, start : start + n], v[:, :, start : start + n], start)
        start += n
        lengths = np.full(B, start)
        for layer in (0, L - 1):
            kg, vg = (np.asarray(x) for x in gather_kv(cache, layer))
            for got, x, role in ((kg, k, "keys"), (vg, v, "values")):
                want = _expected_kv(np.asarray(x[layer]), lengths, C, W, role)
                np.testing.assert_array_equal(got, want)
    # Every full page is stored whole the moment it fills, inside the window or not.
    table = np.asarray(cache.page_table)
    for pool, x, role in ((cache.k_pages, k, "keys"), (cache.v_pages, v, "values")):
        stored = np.asarray(pool.dequantize())  # [L, K, P, C, H]
        for b in range(B):
            for page in range(start // C):
                tokens = np.asarray(x[1, b, page * C : (page + 1) * C]).transpose(1, 0, 2)
                q = quantize_pages(jnp.asarray(tokens), FMT, role=role).dequantize()
                np.testing.assert_array_equal(stored[1, :, table[b, page]], np.asarray(q))


@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True, "window": 5}, pytest.param({"softcap": 2.0}, marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("T", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_paged_attention_reads_the_window_exactly(options, T):
    # Oracle: attention over a float cache holding _expected_kv (exact window, stored pages
    # below it), against paged_attention over the kivi2 window cache.
    rng = np.random.default_rng(40)
    cache, k, v = _filled(rng, fmt=WINDOW)  # lengths 23, 13 (re-seated), 0
    L, K, P, C, H = cache.k_pages.shape
    B, M = cache.page_table.shape
    N = 4
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    for layer in range(L):
        got = paged_attention(
            q, cache.k_pages[layer], cache.v_pages[layer], cache.page_table, cache.lengths,
            pages_per_block=2, return_page_mass=True, **options,
        )  # fmt: skip
        float_cache = init_paged_cache(1, K, P, C, H, batch=B, max_pages_per_seq=M)
        float_cache = with_page_table(float_cache, cache.page_table)
        want_k = np.zeros((B, M * C, K, H), np.float32)
        want_v = np.zeros_like(want_k)
        lengths = np.asarray(cache.lengths)
        for b, n in enumerate(lengths):
            xs = (np.asarray(k[layer, b : b + 1, :23]), np.asarray(v[layer, b : b + 1, :23]))
            if b == 1:  # cut from 23 to 13: pages 1, 2 keep their exact window tokens; page 3
                # (9..12 before the cut, 12 now the open page) too: same ids, same pages
                n_old = np.array([23])
                kk = _expected_kv(xs[0], n_old, C, 3, "keys")
                vv = _expected_kv(xs[1], n_old, C, 3, "values")
                # The old window (pages 3..5) holds page 3 exactly; pages 1, 2 are re-read
                # from their stored (decoded) pages.
                kk[:, n:], vv[:, n:] = 0.0, 0.0
            else:
                kk = _expected_kv(xs[0], np.array([n]), C, 3, "keys")
                vv = _expected_kv(xs[1], np.array([n]), C, 3, "values")
            want_k[b, :23], want_v[b, :23] = kk[0], vv[0]
        float_cache = write(
            float_cache, jnp.asarray(want_k)[None], jnp.asarray(want_v)[None], 0
        )._replace(lengths=cache.lengths)
        ref = paged_attention_reference(
            q, float_cache.k_pages[0], float_cache.v_pages[0], cache.page_table, cache.lengths,
            return_page_mass=True, **options,
        )  # fmt: skip
        assert_close(got.out, ref.out, dtype=jnp.float32)
        assert_close(got.page_mass, ref.page_mass, dtype=jnp.float32)


def test_reseat_keeps_window_pages_held_on_the_same_ids():
    cache = _cache(fmt=WINDOW)
    L, K, P, C, H = cache.k_pages.shape
    rng = np.random.default_rng(41)
    k, v = _kv(rng, L, 3, 22, K, H)
    cache = write(cache, k, v, 0)  # 22 tokens: window = pages 3, 4, 5 (12..21) exact
    x = np.asarray(k[0])
    kg0 = np.asarray(gather_kv(cache, 0)[0])
    table = np.asarray(cache.page_table).copy()
    moved = table.copy()
    moved[2, 3:] = np.setdiff1d(np.arange(1, P), table)[:3]  # row 2: pages 3.. elsewhere
    cut = with_page_table(cache, jnp.asarray(moved), jnp.array([22, 15, 15]))
    kg = np.asarray(gather_kv(cut, 0)[0])
    np.testing.assert_array_equal(kg[0, :22], kg0[0, :22])  # nothing changed
    # Row 1 cut to 15: window pages 1..3; pages 3 (12..14) were in the old window on the same
    # id: exact; pages 1, 2 come from their stored pages (as they read before the cut).
    np.testing.assert_array_equal(kg[1, 12:15], x[1, 12:15])
    np.testing.assert_array_equal(kg[1, 4:12], kg0[1, 4:12])
    np.testing.assert_array_equal(kg[1, 15:], 0.0)
    # Row 2: page 3 now lives on a different id: its tokens come from that page (never
    # written: zeros), not from the old window.
    np.testing.assert_array_equal(kg[2, 12:15], 0.0)
    np.testing.assert_array_equal(kg[2, 4:12], kg0[2, 4:12])
    # Appends continue the window from there, exactly.
    more = write(cut, k[:, :, :2], v[:, :, :2], cut.lengths)
    kg = np.asarray(gather_kv(more, 0)[0])
    np.testing.assert_array_equal(kg[1, 12:17], np.concatenate([x[1, 12:15], x[1, :2]]))


def test_garbage_outside_the_window_has_no_effect():
    rng = np.random.default_rng(42)
    cache, _, _ = _filled(rng, fmt=WINDOW)
    B, N, H = 3, 4, cache.k_pages.shape[-1]
    C = cache.page_size
    q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.float32)
    clean = paged_attention(q, cache.k_pages[0], cache.v_pages[0], cache.page_table, cache.lengths)
    kp = cache.k_pages.stacked()
    res = np.array(kp.residual)  # [L, K, B, 3 * C, H]
    scale = np.array(kp.scale.astype(jnp.float32))
    table = np.asarray(cache.page_table)
    for b, n in enumerate(np.asarray(cache.lengths)):
        held = {(p // C) % 3 * C + p % C for p in range(max(0, (n // C - 2) * C), n)}
        for slot in range(3 * C):
            if slot not in held:
                res[:, :, b, slot] = np.nan  # window slots no position reads
        for page in range(max(0, n // C - 2), -(-n // C)):
            scale[:, :, table[b, page]] = np.nan  # stored pages under the window
    import dataclasses

    kp = dataclasses.replace(kp, residual=jnp.asarray(res), scale=jnp.asarray(scale, jnp.bfloat16))
    dirty = paged_attention(q, kp[0], cache.v_pages[0], cache.page_table, cache.lengths)
    np.testing.assert_array_equal(np.asarray(dirty.out), np.asarray(clean.out))
    # validate reads what attention reads: the window, not the pages under it.
    paged.validate(cache._replace(k_pages=kp))
