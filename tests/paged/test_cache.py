"""PagedKVCache: writes land where the table says, drops are safe, validate is loud."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged import (
    CopyPlan,
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
    with_page_table,
    write,
    write_layer,
)
from ringattn import Positions, attention_reference
from tests._util import assert_close

L, K, C, H, B, M = 2, 2, 4, 8, 3, 3


def permuted_cache(rng, num_pages=12):
    cache = init_paged_cache(L, K, num_pages, C, H, B, M)
    ids = rng.permutation(np.arange(1, num_pages))[: B * M].reshape(B, M)
    return with_page_table(cache, ids.astype(np.int32))


def test_init_shapes_and_pytree():
    cache = init_paged_cache(L, K, 10, C, H, B, M, jnp.bfloat16)
    assert cache.k_pages.shape == (L, K, 10, C, H) and cache.k_pages.dtype == jnp.bfloat16
    assert cache.page_table.shape == (B, M) and cache.lengths.shape == (B,)
    assert cache.page_size == C and cache.capacity == M * C
    assert len(jax.tree.leaves(cache)) == 2 * L + 2  # one buffer per layer, keys and values
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
    cache = with_page_table(cache, jnp.array([[3, 0], [-1, 9]], jnp.int32))
    k = jnp.ones((1, 2, 12, 1, H))
    out = jax.jit(write)(cache, k, k, jnp.array([-2, 0]))  # traced: dropped, never raised
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
    # Under jit the documented clipping stays; an eager call says what is wrong.
    assert jax.jit(advance)(cache, 100).lengths.tolist() == [M * C] * B
    assert jax.jit(advance)(cache, -100).lengths.tolist() == [0] * B
    with pytest.raises(ValueError, match=r"advance: lengths \+ n\[0\]: expected a length in"):
        advance(cache, 100)
    with pytest.raises(ValueError, match=r"lengths \+ n\[0\]: .* got -96"):
        advance(cache, -100)


def test_copy_pages_copies_and_drops():
    rng = np.random.default_rng(3)
    cache = init_paged_cache(L, K, 6, C, H, 1, 2)
    data = jnp.asarray(rng.standard_normal(cache.k_pages.shape), jnp.float32)
    cache = cache._replace(k_pages=data, v_pages=-data)
    out = copy_pages(cache, CopyPlan(jnp.array([2, 4, 3, -1]), jnp.array([5, 0, 7, 1])))
    np.testing.assert_array_equal(np.asarray(out.k_pages[:, :, 5]), np.asarray(data[:, :, 2]))
    np.testing.assert_array_equal(np.asarray(out.v_pages[:, :, 5]), -np.asarray(data[:, :, 2]))
    np.testing.assert_array_equal(np.asarray(out.k_pages[:, :, 1]), 0.0)  # invalid src: zeros
    for page in (0, 2, 3, 4):  # dst null / out of range dropped; sources unchanged
        np.testing.assert_array_equal(
            np.asarray(out.k_pages[:, :, page]), np.asarray(data[:, :, page])
        )
    with pytest.raises(ValueError, match="src and dst 1-D int arrays of one length"):
        copy_pages(cache, CopyPlan(jnp.array([1, 2]), jnp.array([3])))


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
    ).out
    gk, gv = gather_kv(cache, layer)
    S = gk.shape[1]
    ref, _ = jax.jit(functools.partial(attention_reference, causal=True))(
        q,
        gk,
        gv,
        positions=Positions(cache.lengths[:, None] - 1, jnp.broadcast_to(jnp.arange(S), (B, S))),
    )
    assert_close(out, ref, dtype=jnp.float32, what="cache attention")


def test_host_allocator_tables_drive_the_cache():
    """PageAllocator's page table and lengths are what the cache consumes."""
    alloc = PageAllocator(16, C, max_pages_per_seq=M)
    alloc.allocate("a", 5)
    alloc.allocate("b", 9)
    cache = init_paged_cache(1, K, 16, C, H, 2, M)
    cache = with_page_table(cache, alloc.page_table(["a", "b"]), alloc.lengths(["a", "b"]))
    validate(cache)
    assert cache.page_table.dtype == cache.lengths.dtype == jnp.int32
    assert cache.lengths.tolist() == [5, 9]


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
@pytest.mark.no_typecheck
def test_validate_page_table_errors(table, lengths, match):
    with pytest.raises(ValueError, match=match):
        validate_page_table(np.array(table), np.array(lengths), num_pages=12, page_size=C)


@pytest.mark.no_typecheck
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
            "v: expected the shape of k",
        ),
        (
            write_layer,
            ("cache", 0, jnp.ones((3, 2, 3, 8)), jnp.ones((3, 2, 3, 8)), 0),
            "k: expected",
        ),
        (
            write_layer,
            ("cache", 0, jnp.ones((3, 2, 8)), jnp.ones((3, 2, 8)), 0.5),
            "start: expected",
        ),
        (write, ("cache", jnp.ones((3, 2, 8)), jnp.ones((3, 2, 8)), 0), "k: expected shape"),
        (append, ("cache", jnp.ones((2, 3, 2, 2, 8)), jnp.ones((2, 3, 2, 2, 8))), "one token"),
        (advance, ("cache", jnp.ones((2,), jnp.int32)), "n: expected"),
        (gather_kv, ("cache", 2), r"layer: expected an int in \[0, 2\)"),
        (write_layer, ("cache", 0, "k", "v", 0), "k: expected an array"),
    ],
)
@pytest.mark.no_typecheck
def test_cache_errors(fn, args, match):
    cache = init_paged_cache(L, K, 6, C, H, B, M)
    with pytest.raises(ValueError, match=match):
        fn(cache, *args[1:])


# ------------------------------------------------------------------ hand-offs from the allocator


@pytest.mark.parametrize("use_jit", [False, True])
def test_copy_pages_takes_allocator_plans_directly_empty_included(use_jit):
    alloc = PageAllocator(12, C, max_pages_per_seq=M)
    alloc.allocate("a", C + 1)  # a partial last page
    cache = init_paged_cache(L, K, 12, C, H, 2, M)
    data = jnp.asarray(np.random.default_rng(5).standard_normal(cache.k_pages.shape), jnp.float32)
    cache = cache._replace(k_pages=data, v_pages=-data)
    run = jax.jit(copy_pages) if use_jit else copy_pages
    empty = alloc.extend("a", C + 1)  # no growth: the empty plan most extends return
    assert empty.src.shape == (0,)
    same = run(cache, empty)
    np.testing.assert_array_equal(np.asarray(same.k_pages), np.asarray(data))
    plan = alloc.fork("a", "b")  # copies a's partial page
    ((src, dst),) = plan.pairs()
    out = run(cache, plan)
    np.testing.assert_array_equal(np.asarray(out.k_pages[:, :, dst]), np.asarray(data[:, :, src]))
    np.testing.assert_array_equal(np.asarray(out.v_pages[:, :, dst]), -np.asarray(data[:, :, src]))
    both = CopyPlan.concatenate([empty, plan, CopyPlan.empty()])
    assert both.pairs() == plan.pairs()
    np.testing.assert_array_equal(np.asarray(run(cache, both).k_pages), np.asarray(out.k_pages))


def test_copy_pages_pads_plans_to_a_power_of_two():
    cache = init_paged_cache(1, 1, 12, C, H, 1, M)
    from paged._copy import _copy_pages_impl

    start = _copy_pages_impl._cache_size()
    for n in (0, 1):
        copy_pages(cache, CopyPlan(np.arange(1, n + 1), np.arange(5, n + 5)))
    assert _copy_pages_impl._cache_size() - start <= 1  # 0 and 1 pairs share bucket 1
    mid = _copy_pages_impl._cache_size()
    for n in (3, 4):
        copy_pages(cache, CopyPlan(np.arange(1, n + 1), np.arange(5, n + 5)))
    assert _copy_pages_impl._cache_size() - mid <= 1  # 3 and 4 share bucket 4


def test_copy_pages_is_vmappable_over_plans():
    cache = init_paged_cache(1, 1, 6, C, H, 1, 2)
    cache = cache._replace(k_pages=cache.k_pages.at[:, :, 1].set(3.0))
    plans = CopyPlan(jnp.array([[1], [1]]), jnp.array([[2], [4]]))
    out = jax.vmap(copy_pages, in_axes=(None, 0))(cache, plans)
    layer0 = out.k_pages[0]  # [V, K, P, C, H]: the plans' axis leads each layer's buffer
    assert float(layer0[0, 0, 2, 0, 0]) == 3.0 and float(layer0[1, 0, 4, 0, 0]) == 3.0
    assert float(out.k_pages[0, 0, 0, 4, 0, 0]) == 0.0


@pytest.mark.no_typecheck
def test_copy_pages_rejects_anything_but_a_plan():
    cache = init_paged_cache(1, 1, 6, C, H, 1, 2)
    # A list of pairs [(2, 3), (4, 5)] would be ambiguous as (src, dst): refused.
    for bad in ([(2, 3), (4, 5)], (jnp.array([1]), jnp.array([2])), None):
        with pytest.raises(ValueError, match=r"copy_pages: plan: expected a paged.CopyPlan"):
            copy_pages(cache, bad)
    with pytest.raises(ValueError, match="copy_pages: plan: expected src and dst"):
        copy_pages(cache, CopyPlan(jnp.array([1.0]), jnp.array([2])))


def test_with_page_table_is_the_hand_off_and_is_jittable():
    alloc = PageAllocator(8, C, max_pages_per_seq=M)
    alloc.allocate("a", 5)
    cache = init_paged_cache(1, 1, 8, C, H, 1, M)
    cache = jax.jit(with_page_table)(cache, alloc.page_table(["a"]), alloc.lengths(["a"]))
    assert cache.page_table.tolist() == [[1, 2, 0]] and cache.lengths.tolist() == [5]
    alloc.extend("a", 9)
    kept = with_page_table(cache, alloc.page_table(["a"]))  # lengths kept from the cache
    assert kept.page_table.tolist() == [[1, 2, 3]] and kept.lengths.tolist() == [5]


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    "table, lengths, match",
    [
        (np.zeros((1, 3), np.int32), None, r"page_table: expected the cache's shape"),
        (np.zeros((2, 3), np.float32), None, "page_table: expected an integer array"),
        (np.zeros((2, 3), np.int32), np.zeros((3,), np.int32), r"lengths: expected shape \(2,\)"),
        (np.zeros((2, 3), np.int32), [1, 2], "lengths: expected a rank-1 integer array"),
    ],
)
def test_with_page_table_errors(table, lengths, match):
    cache = init_paged_cache(1, 1, 8, C, H, 2, M)
    with pytest.raises(ValueError, match=f"with_page_table: {match}"):
        with_page_table(cache, table, lengths)


@pytest.mark.no_typecheck
@pytest.mark.parametrize("layer", [1.0, np.float32(1.0), jnp.float32(1.0), True, "1", -1])
def test_float_layer_index_is_an_error_never_truncated(layer):
    cache = init_paged_cache(L, K, 6, C, H, B, M)
    kv = jnp.ones((B, 1, K, H))
    with pytest.raises(ValueError, match="write_layer: layer: expected"):
        write_layer(cache, layer, kv, kv, 0)
    with pytest.raises(ValueError, match="gather_kv: layer: expected"):
        gather_kv(cache, layer)


def test_numpy_scalars_are_accepted_by_the_cache_functions():
    cache = init_paged_cache(np.int32(L), np.int64(K), np.int32(12), np.int8(C), np.int32(H), B, M)
    cache = with_page_table(cache, np.arange(1, 10, dtype=np.int32).reshape(B, M))
    kv = jnp.ones((B, 2, K, H))
    cache = write_layer(cache, np.int64(1), kv, kv, np.int32(0))
    cache = advance(cache, np.int32(2))
    k, _ = gather_kv(cache, np.int32(1))
    np.testing.assert_array_equal(np.asarray(k[:, :2]), 1.0)
    assert cache.lengths.tolist() == [2, 2, 2]


def test_from_zero_based_table_shifts_ids_for_a_pool_with_a_null_page():
    from paged import from_zero_based_table

    zero_based = np.array([[0, 2], [1, 0]])
    ours = from_zero_based_table(zero_based)
    assert ours.dtype == jnp.int32 and ours.tolist() == [[1, 3], [2, 1]]
    pages = jnp.arange(3 * C * H, dtype=jnp.float32).reshape(1, 3, C, H)  # [K, P, C, H]
    padded = jnp.pad(pages, ((0, 0), (1, 0), (0, 0), (0, 0)))
    # Page i of the zero-based pool is page i + 1 of ours.
    np.testing.assert_array_equal(np.asarray(padded[:, ours]), np.asarray(pages[:, zero_based]))
    assert jax.jit(from_zero_based_table)(jnp.asarray(zero_based)).tolist() == ours.tolist()


def test_constructor_and_gather_under_jit_with_static_arguments():
    make = jax.jit(init_paged_cache, static_argnums=range(7), static_argnames=("dtype",))
    cache = make(L, K, 12, C, H, B, M, dtype=jnp.bfloat16)
    assert cache.k_pages.dtype == jnp.bfloat16 and cache.k_pages.shape == (L, K, 12, C, H)
    cache = permuted_cache(np.random.default_rng(9))
    kv = jnp.ones((L, B, 2, K, H))
    cache = write(cache, kv, -kv, 0)
    k, v = jax.jit(gather_kv, static_argnums=1)(cache, 1)
    np.testing.assert_array_equal(np.asarray(k[:, :2]), 1.0)
    np.testing.assert_array_equal(np.asarray(v[:, 2:]), 0.0)


def test_cache_functions_under_vmap_and_attention_under_remat():
    cache = init_paged_cache(1, 1, 6, 2, 4, batch=2, max_pages_per_seq=2)
    caches = jax.tree.map(lambda x: jnp.stack([x, x]), cache)
    tables = jnp.asarray([[[1, 2], [3, 4]], [[5, 1], [2, 3]]], jnp.int32)
    caches = jax.vmap(with_page_table)(caches, tables, jnp.zeros((2, 2), jnp.int32))
    kv = jnp.arange(2 * 2 * 4, dtype=jnp.float32).reshape(2, 1, 2, 1, 4)  # [V, L, B, K, H]
    out = jax.jit(jax.vmap(append))(caches, kv, kv)
    out = jax.vmap(advance, in_axes=(0, None))(out, 1)
    for i in range(2):
        one = advance(append(jax.tree.map(lambda x, i=i: x[i], caches), kv[i], kv[i]), 1)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(one), strict=True):
            np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(b))
    layer = jax.vmap(write_layer, in_axes=(0, None, 0, 0, None))(caches, 0, kv[:, 0], kv[:, 0], 0)
    assert layer.k_pages.shape == caches.k_pages.shape
    # Forward remat of the attention (it is forward-only, but composes with checkpoint).
    c = out.k_pages[0, 0]
    res = jax.checkpoint(functools.partial(paged_attention, window=2))(
        jnp.ones((2, 1, 1, 4)), c, c, out.page_table[0], out.lengths[0]
    )
    plain = paged_attention(
        jnp.ones((2, 1, 1, 4)), c, c, out.page_table[0], out.lengths[0], window=2
    )
    np.testing.assert_allclose(np.asarray(res.out), np.asarray(plain.out), atol=1e-6)


@pytest.mark.no_typecheck
def test_from_zero_based_table_errors():
    from paged import from_zero_based_table

    with pytest.raises(ValueError, match="from_zero_based_table: page_table: expected rank 2"):
        from_zero_based_table(np.zeros((3,), np.int32))
    with pytest.raises(ValueError, match="from_zero_based_table: page_table: expected an integer"):
        from_zero_based_table(np.zeros((1, 3), np.float32))
