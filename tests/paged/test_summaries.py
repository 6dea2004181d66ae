"""Page key bounds: from scratch against a numpy oracle on every format (garbage in unread
slots never reaching them), refreshed after writes equal to from scratch, copied with
copy_pages, jit / vmap, and the errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
from paged import PageKeyBounds, copy_key_bounds, page_key_bounds, refresh_key_bounds
from tests.paged._retrieval_util import FORMATS, bounds_oracle, make_cache


def assert_bounds(got: PageKeyBounds, lo, hi, *, tol=0.0):
    for name, a, b in (("k_min", got.k_min, lo), ("k_max", got.k_max, hi)):
        a = np.asarray(a, np.float64)
        assert a.shape == b.shape and got.k_min.dtype == jnp.float32
        same_inf = np.isinf(a) == np.isinf(b)
        assert same_inf.all(), f"{name}: empty pages differ at {np.argwhere(~same_inf)[:4]}"
        fin = np.isfinite(b)
        assert not np.isnan(a).any(), f"{name}: NaN (garbage) reached the bounds"
        np.testing.assert_allclose(a[fin], b[fin], atol=tol, rtol=0, err_msg=name)
        np.testing.assert_array_equal(a[~fin], b[~fin])


@pytest.mark.parametrize("kind", list(FORMATS))
@pytest.mark.parametrize("C", [2, 4])
def test_bounds_from_scratch_match_the_oracle_on_every_format(kind, C):
    cache = make_cache(kind, np.random.default_rng(C), C=C)
    got = page_key_bounds(cache)
    lo, hi = bounds_oracle(cache)
    assert_bounds(got, lo, hi)
    assert np.isposinf(np.asarray(got.k_min[:, :, 0])).all()  # the null page is empty
    # pages holding tokens are finite; the spare pages past the lengths are empty
    table, lengths = np.asarray(cache.page_table), np.asarray(cache.lengths)
    for b in range(table.shape[0]):
        n = -(-lengths[b] // C)
        assert np.isfinite(np.asarray(got.k_min[:, :, table[b, :n]])).all()
        for p in table[b, n:]:
            if p and p not in table[:, :n][table[:, :n] > 0]:
                assert np.isposinf(np.asarray(got.k_min[:, :, p])).all()


def test_bounds_with_shorter_lengths_ignore_the_tokens_past_them():
    cache = make_cache("float32", np.random.default_rng(0))
    shorter = jnp.maximum(cache.lengths - 3, 0)
    got = jax.jit(page_key_bounds)(cache, shorter)
    lo, hi = bounds_oracle(cache, shorter)
    assert_bounds(got, lo, hi)


def test_shared_pages_get_the_union_of_their_rows():
    rng = np.random.default_rng(1)
    cache = make_cache("float32", rng, lengths=[8, 8], C=4, M=3)
    table = np.asarray(cache.page_table).copy()
    table[1, 0] = table[0, 0]  # a shared prefix page, read to 4 tokens by both rows
    cache = cache._replace(page_table=jnp.asarray(table), lengths=jnp.array([8, 2]))
    lo, hi = bounds_oracle(cache)
    assert_bounds(page_key_bounds(cache), lo, hi)


@pytest.mark.parametrize("kind", ["float32", "int8", "int4", "kivi2", "kivi2_window"])
def test_refresh_after_prefill_chunks_and_appends_equals_from_scratch(kind):
    rng = np.random.default_rng(7)
    L, K, C, H, M, P, B = 2, 2, 4, 8, 6, 20, 2
    fmt = FORMATS[kind]
    cache = paged.init_paged_cache(L, K, P, C, H, B, M, kv_format=fmt)
    table = np.stack([rng.permutation(np.arange(1, P))[:M] for _ in range(B)]).astype(np.int32)
    table[1] = np.setdiff1d(np.arange(1, P), table[0])[:M]
    cache = paged.with_page_table(cache, jnp.asarray(table), jnp.zeros(B, jnp.int32))
    bounds = page_key_bounds(cache)
    refresh = jax.jit(refresh_key_bounds, static_argnums=3)

    def write_layerwise(cache, bounds, T, count):
        start = cache.lengths
        for layer in range(L):
            k = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32)
            cache = paged.write_layer(cache, layer, k, k * 0.5, start, count=count)
            bounds = refresh(bounds, cache, start, T, layer=jnp.int32(layer), lengths=start + count)
        return paged.advance(cache, count), bounds

    cache, bounds = write_layerwise(cache, bounds, 7, jnp.array([7, 5]))  # a prefill chunk
    for _ in range(9):  # decode steps, crossing page edges and sliding kivi2's window
        cache, bounds = write_layerwise(cache, bounds, 1, jnp.array([1, 1]))
        scratch = page_key_bounds(cache)
        if kind.startswith("kivi2"):  # refreshed bounds hold the exact window copy as well
            assert (np.asarray(bounds.k_min) <= np.asarray(scratch.k_min)).all()
            assert (np.asarray(bounds.k_max) >= np.asarray(scratch.k_max)).all()
            lo, hi = bounds_oracle(cache)
            assert (np.asarray(bounds.k_min) <= lo).all() and (np.asarray(bounds.k_max) >= hi).all()  # fmt: skip
        else:
            assert_bounds(bounds, np.asarray(scratch.k_min), np.asarray(scratch.k_max))


def test_refresh_with_a_traced_out_of_range_layer_changes_nothing():
    cache = make_cache("float32", np.random.default_rng(2))
    bounds = page_key_bounds(cache)
    junk = PageKeyBounds(bounds.k_min + 1.0, bounds.k_max)
    got = jax.jit(refresh_key_bounds, static_argnums=3)(
        junk, cache, 0, 4, layer=jnp.int32(7), lengths=cache.lengths
    )
    np.testing.assert_array_equal(np.asarray(got.k_min), np.asarray(junk.k_min))


def test_copy_follows_copy_pages():
    cache = make_cache("int8", np.random.default_rng(3))
    bounds = page_key_bounds(cache)
    src = np.asarray(cache.page_table)[3, :2]
    dst = np.setdiff1d(np.arange(1, 48), np.asarray(cache.page_table))[:2]
    copied = paged.copy_pages(cache, paged.CopyPlan(src, dst))
    table = np.asarray(copied.page_table).copy()
    table[0, :2] = dst  # row 0 now reads the copies
    copied = copied._replace(page_table=jnp.asarray(table), lengths=copied.lengths.at[0].set(8))
    got = copy_key_bounds(bounds, src, dst)
    lo, hi = bounds_oracle(copied)
    np.testing.assert_array_equal(np.asarray(got.k_min[:, :, dst]), lo[:, :, dst])
    np.testing.assert_array_equal(np.asarray(got.k_max[:, :, dst]), hi[:, :, dst])
    jitted = jax.jit(copy_key_bounds)(bounds, jnp.asarray(src), jnp.asarray(dst))
    np.testing.assert_array_equal(np.asarray(jitted.k_min), np.asarray(got.k_min))


def test_vmap_over_a_stack_of_caches():
    base = make_cache("float32", np.random.default_rng(4))  # one table, NaN in one place
    caches = [base, base._replace(k_pages=base.k_pages * -2.0, lengths=base.lengths // 2)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *caches)
    got = jax.vmap(page_key_bounds)(stacked)
    for i, c in enumerate(caches):
        want = page_key_bounds(c)
        np.testing.assert_array_equal(np.asarray(got.k_min[i]), np.asarray(want.k_min))
    per_layer = got.layer(1)
    assert per_layer.k_min.shape == (2, 2, 48, 8) and per_layer.nbytes == 2 * 4 * 2 * 2 * 48 * 8


def test_errors_name_the_argument():
    cache = make_cache("float32", np.random.default_rng(0))
    bounds = page_key_bounds(cache)
    with pytest.raises(ValueError, match=r"lengths: expected shape \(6,\)"):
        page_key_bounds(cache, jnp.zeros(3, jnp.int32))
    refresh = functools.partial(refresh_key_bounds, layer=0, lengths=cache.lengths)
    with pytest.raises(ValueError, match="num_tokens: expected an int >= 1"):
        refresh(bounds, cache, 0, 0)
    with pytest.raises(ValueError, match=r"bounds.k_min: expected float32 \[L, K, P, H\]"):
        refresh(bounds.layer(0), cache, 0, 1)
    with pytest.raises(ValueError, match="layer: expected an int"):
        refresh_key_bounds(bounds, cache, 0, 1, layer=2, lengths=cache.lengths)
    with pytest.raises(ValueError, match="start: expected positions >= 0"):
        refresh(bounds, cache, -1, 1)
    with pytest.raises(ValueError, match=r"expected page ids in \[0, 48\)"):
        copy_key_bounds(bounds, jnp.array([1]), jnp.array([48]))
