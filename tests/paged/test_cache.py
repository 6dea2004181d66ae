"""PagedKVCache: writes land where the table says, drops are safe, validate is loud."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged import (
    PageAllocator,
    PagedKVCache,
    advance,
    append,
    copy_pages,
    gather_kv,
    init_paged_cache,
    paged_attention,
    validate,
    validate_page_table,
    write,
    write_layer,
)
from ringattn import attention_reference
from tests._util import assert_close

L, K, C, H, B, M = 2, 2, 4, 8, 3, 3


def permuted_cache(rng, num_pages=12):
    cache = init_paged_cache(L, K, num_pages, C, H, B, M)
    ids = rng.permutation(np.arange(1, num_pages))[: B * M].reshape(B, M)
    return cache._replace(page_table=jnp.asarray(ids, jnp.int32))


def test_init_shapes_and_pytree():
    cache = init_paged_cache(L, K, 10, C, H, B, M, jnp.bfloat16)
    assert cache.k_pages.shape == (L, K, 10, C, H) and cache.k_pages.dtype == jnp.bfloat16
    assert cache.page_table.shape == (B, M) and cache.lengths.shape == (B,)
    assert cache.page_size == C and cache.capacity == M * C
    assert len(jax.tree.leaves(cache)) == 4
    validate(cache)
    out = jax.jit(lambda c: advance(c, 2))(cache)
    assert isinstance(out, PagedKVCache) and out.lengths.tolist() == [2, 2, 2]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_pages=1), "num_pages"),
        (dict(page_size=0), "page_size"),
        (dict(head_dim=True), "head_dim"),
        (dict(dtype=jnp.int32), "dtype"),
    ],
)
def test_init_errors(kwargs, match):
    args = dict(
        num_layers=1,
        num_kv_heads=1,
        num_pages=4,
        page_size=4,
        head_dim=8,
        batch=1,
        max_pages_per_seq=2,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        init_paged_cache(**args)


def test_write_then_gather_round_trip():
    rng = np.random.default_rng(0)
    cache = permuted_cache(rng)
    T = 6
    k = jnp.asarray(rng.standard_normal((L, B, T, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((L, B, T, K, H)), jnp.float32)
    start = jnp.array([0, 3, 5])
    cache = jax.jit(write)(cache, k, v, start)
    assert cache.lengths.tolist() == [6, 9, 11]
    validate(cache)
    for layer in range(L):
        gk, gv = gather_kv(cache, layer)
        for b in range(B):
            s = int(start[b])
            np.testing.assert_array_equal(np.asarray(gk[b, s : s + T]), np.asarray(k[layer, b]))
            np.testing.assert_array_equal(np.asarray(gv[b, s : s + T]), np.asarray(v[layer, b]))
            np.testing.assert_array_equal(np.asarray(gk[b, s + T :]), 0.0)
    # The null page and pages outside every table were never touched.
    used = np.unique(np.asarray(cache.page_table))
    untouched = np.setdiff1d(np.arange(cache.k_pages.shape[2]), used)
    assert 0 in untouched
    np.testing.assert_array_equal(np.asarray(cache.k_pages[:, :, untouched]), 0.0)


def test_write_layer_matches_write_and_takes_traced_layer():
    rng = np.random.default_rng(1)
    cache = permuted_cache(rng)
    k = jnp.asarray(rng.standard_normal((B, 5, K, H)), jnp.float32)
    full = write(cache, jnp.stack([k * 0, k]), jnp.stack([k * 0, -k]), 2)
    one = jax.jit(write_layer)(cache, jnp.int32(1), k, -k, jnp.array([2, 2, 2]))
    np.testing.assert_array_equal(np.asarray(one.k_pages[1]), np.asarray(full.k_pages[1]))
    np.testing.assert_array_equal(np.asarray(one.v_pages[1]), np.asarray(full.v_pages[1]))
    assert one.lengths.tolist() == [0, 0, 0]  # write_layer leaves lengths to advance()
    # One token as [B, K, H]; an out-of-range layer is dropped.
    tok = write_layer(cache, 0, k[:, 0], k[:, 0], 1)
    np.testing.assert_array_equal(np.asarray(gather_kv(tok, 0)[0][:, 1]), 0.0)  # length 0
    np.testing.assert_array_equal(
        np.asarray(gather_kv(advance(tok, 2), 0)[0][:, 1]), np.asarray(k[:, 0])
    )
    dropped = jax.jit(write_layer)(cache, jnp.int32(L), k, k, 0)
    np.testing.assert_array_equal(np.asarray(dropped.k_pages), 0.0)


def test_unwritable_tokens_are_dropped():
    """Null slots, slots past the table and negative positions write nothing anywhere."""
    cache = init_paged_cache(1, 1, 6, C, H, 2, 2)
    cache = cache._replace(page_table=jnp.array([[3, 0], [-1, 9]], jnp.int32))
    k = jnp.ones((1, 2, 12, 1, H))
    out = write(cache, k, k, jnp.array([-2, 0]))
    written = np.asarray(out.k_pages[0, 0, :, :, 0])
    expected = np.zeros((6, C))
    expected[3, :] = 1.0  # only sequence 0's positions 0..3 land on a real page
    np.testing.assert_array_equal(written, expected)
    assert out.lengths.tolist() == [8, 8]  # capacity-clipped


def test_append_and_advance():
    rng = np.random.default_rng(2)
    cache = permuted_cache(rng)
    cache = advance(cache, jnp.array([3, 4, 0]))
    k = jnp.asarray(rng.standard_normal((L, B, K, H)), jnp.float32)
    cache = jax.jit(append)(cache, k, 2 * k)
    assert cache.lengths.tolist() == [4, 5, 1]
    gk, gv = gather_kv(cache, 1)
    for b, pos in enumerate([3, 4, 0]):
        np.testing.assert_array_equal(np.asarray(gk[b, pos]), np.asarray(k[1, b]))
        np.testing.assert_array_equal(np.asarray(gv[b, pos]), np.asarray(2 * k[1, b]))
    assert advance(cache, 100).lengths.tolist() == [M * C] * B
    assert advance(cache, -100).lengths.tolist() == [0] * B


def test_copy_pages_copies_and_drops():
    rng = np.random.default_rng(3)
    cache = init_paged_cache(L, K, 6, C, H, 1, 2)
    data = jnp.asarray(rng.standard_normal(cache.k_pages.shape), jnp.float32)
    cache = cache._replace(k_pages=data, v_pages=-data)
    out = copy_pages(cache, jnp.array([2, 4, 3, -1]), jnp.array([5, 0, 7, 1]))
    np.testing.assert_array_equal(np.asarray(out.k_pages[:, :, 5]), np.asarray(data[:, :, 2]))
    np.testing.assert_array_equal(np.asarray(out.v_pages[:, :, 5]), -np.asarray(data[:, :, 2]))
    np.testing.assert_array_equal(np.asarray(out.k_pages[:, :, 1]), 0.0)  # invalid src: zeros
    for page in (0, 2, 3, 4):  # dst null / out of range dropped; sources unchanged
        np.testing.assert_array_equal(
            np.asarray(out.k_pages[:, :, page]), np.asarray(data[:, :, page])
        )
    with pytest.raises(ValueError, match="src and dst must be 1-D int arrays"):
        copy_pages(cache, jnp.array([1, 2]), jnp.array([3]))


def test_prefill_then_decode_attention_matches_reference():
    """write a prompt, attend with paged_attention over the cache, compare with the oracle."""
    rng = np.random.default_rng(4)
    cache = permuted_cache(rng)
    T = 7
    k = jnp.asarray(rng.standard_normal((L, B, T, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((L, B, T, K, H)), jnp.float32)
    cache = write(cache, k, v, jnp.array([0, 2, 5]))
    q = jnp.asarray(rng.standard_normal((B, 1, 2 * K, H)), jnp.float32)
    layer = 1
    out = paged_attention(
        q, cache.k_pages[layer], cache.v_pages[layer], cache.page_table, cache.lengths
    )
    gk, gv = gather_kv(cache, layer)
    S = gk.shape[1]
    ref = jax.jit(functools.partial(attention_reference, causal=True))(
        q,
        gk,
        gv,
        q_positions=cache.lengths[:, None] - 1,
        kv_positions=jnp.broadcast_to(jnp.arange(S), (B, S)),
    )
    assert_close(out, ref, dtype=jnp.float32, what="cache attention")


def test_host_allocator_tables_drive_the_cache():
    """PageAllocator's page table and lengths are what the cache consumes."""
    alloc = PageAllocator(16, C, max_pages_per_seq=M)
    alloc.allocate("a", 5)
    alloc.allocate("b", 9)
    cache = init_paged_cache(1, K, 16, C, H, 2, M)
    cache = cache._replace(
        page_table=jnp.asarray(alloc.page_table(["a", "b"])),
        lengths=jnp.asarray(alloc.lengths(["a", "b"])),
    )
    validate(cache)


@pytest.mark.parametrize(
    "table, lengths, match",
    [
        ([[1, 12]], [5], r"page_table\[0, 1\] = 12 is out of range"),
        ([[1, -1]], [1], r"page_table\[0, 1\] = -1 is out of range"),
        ([[1, 2]], [9], r"lengths\[0\] = 9 is outside"),
        ([[1, 2]], [-1], r"lengths\[0\] = -1 is outside"),
        ([[1, 0]], [5], "slot 1 is the null page"),
        ([[3, 3]], [6], "uses page 3 twice"),
        ([[1, 2, 3]], [1, 2], "expected page_table"),
    ],
)
def test_validate_page_table_errors(table, lengths, match):
    with pytest.raises(ValueError, match=match):
        validate_page_table(np.array(table), np.array(lengths), num_pages=12, page_size=C)


def test_validate_accepts_shared_pages_and_checks_cache():
    validate_page_table(np.array([[1, 2], [1, 3]]), np.array([6, 5]), num_pages=4, page_size=C)
    cache = init_paged_cache(1, 1, 4, C, H, 1, 2)
    with pytest.raises(ValueError, match="lengths"):
        validate(cache._replace(lengths=jnp.array([100])))
    with pytest.raises(ValueError, match="expected a PagedKVCache"):
        validate((cache.k_pages, cache.v_pages))
    with pytest.raises(ValueError, match="must both be"):
        validate(cache._replace(v_pages=cache.v_pages[0]))
    with pytest.raises(ValueError, match="expected page_table"):
        validate(cache._replace(lengths=jnp.zeros((3,), jnp.int32)))


@pytest.mark.parametrize(
    "fn, args, match",
    [
        (
            write_layer,
            ("cache", 0, jnp.ones((3, 2, 2, 8)), jnp.ones((3, 2, 2, 9)), 0),
            "same shape",
        ),
        (write_layer, ("cache", 0, jnp.ones((3, 2, 3, 8)), jnp.ones((3, 2, 3, 8)), 0), "k/v must"),
        (write_layer, ("cache", 0, jnp.ones((3, 2, 8)), jnp.ones((3, 2, 8)), 0.5), "start must"),
        (write, ("cache", jnp.ones((3, 2, 8)), jnp.ones((3, 2, 8)), 0), "k/v must"),
        (append, ("cache", jnp.ones((2, 3, 2, 2, 8)), jnp.ones((2, 3, 2, 2, 8))), "one token"),
        (advance, ("cache", jnp.ones((2,), jnp.int32)), "start must"),
        (gather_kv, ("cache", 2), "layer must be an int"),
        (write_layer, ("cache", 0, "k", "v", 0), "k must be an array"),
    ],
)
def test_cache_errors(fn, args, match):
    cache = init_paged_cache(L, K, 6, C, H, B, M)
    with pytest.raises(ValueError, match=match):
        fn(cache, *args[1:])
