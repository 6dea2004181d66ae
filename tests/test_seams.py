"""The hand-offs between ringattn, paged and offload, as a researcher joining them writes them.

Each test is one seam that used to be a trap (issue 8): decode functions that disagreed on
where the queries sit, allocator copy plans that the cache could not take, results whose shape
depended on flags. Everything here uses public names only.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import paged
import ringattn
from tests._util import assert_close, make_test_mesh

N, K, H, C = 4, 2, 8, 4


def _pool_and_table(rng, lengths, M, num_pages):
    """A random pool with permuted page ids, NaN in every slot nobody may read."""
    B = len(lengths)
    k_pages = rng.standard_normal((K, num_pages, C, H)).astype(np.float32)
    v_pages = rng.standard_normal((K, num_pages, C, H)).astype(np.float32)
    ids = rng.permutation(np.arange(1, num_pages))[: B * M].reshape(B, M).astype(np.int32)
    table = np.zeros((B, M), np.int32)
    for b, n in enumerate(lengths):
        used = -(-n // C)
        table[b, :used] = ids[b, :used]
        for i in range(n, used * C):  # tail of the last page: garbage
            k_pages[:, table[b, i // C], i % C] = np.nan
            v_pages[:, table[b, i // C], i % C] = np.nan
    live = set(table[table > 0].tolist())
    for p in range(num_pages):
        if p not in live:  # free pages and the null page: garbage
            k_pages[:, p] = np.nan
            v_pages[:, p] = np.inf
    return jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(table)


def _contiguous(k_pages, table, S):
    """``[B, S, K, H]`` contiguous copy of the paged sequences (padding slots keep garbage)."""
    g = k_pages[:, table]  # [K, B, M, C, H]
    g = jnp.moveaxis(g, 0, 3).reshape(table.shape[0], -1, K, H)  # [B, M*C, K, H]
    return g[:, :S]


@pytest.mark.parametrize("T", [1, 3])
def test_every_decode_function_puts_queries_at_the_end_of_the_valid_cache(T):
    """Trap 1: no positions given, causal: every decode function must agree with paged's
    default (queries are the last T positions of the valid cache)."""
    rng = np.random.default_rng(T)
    lengths = np.array([13, 4, 16, 7], np.int32)
    B, M, n = len(lengths), 4, 4
    k_pages, v_pages, table = _pool_and_table(rng, lengths, M, num_pages=B * M + 1)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)).astype(np.float32))
    lengths_j = jnp.asarray(lengths)

    want = paged.paged_attention_reference(q, k_pages, v_pages, table, lengths_j, causal=True)
    got_paged = paged.paged_attention(q, k_pages, v_pages, table, lengths_j, causal=True)
    assert_close(got_paged.out, want.out, dtype=jnp.float32, what="paged_attention")

    S = M * C
    k = _contiguous(k_pages, table, S)
    v = _contiguous(v_pages, table, S)
    mesh = make_test_mesh((n,), ("seq",))
    got_sharded = ringattn.sharded_decode_attention(
        q, k, v, mesh=mesh, seq_axis="seq", lengths=lengths_j, causal=True
    )
    assert_close(got_sharded.out, want.out, dtype=jnp.float32, what="sharded_decode_attention")
    assert_close(got_sharded.lse, want.lse, dtype=jnp.float32, what="sharded_decode lse")

    # Per shard: each shard gets the number of valid keys in its own chunk.
    local = S // n
    local_lengths = jnp.clip(lengths_j[None, :] - local * jnp.arange(n)[:, None], 0, local)

    def body(q, k, v, local_lengths):
        return ringattn.decode_attention_per_shard(
            q, k, v, seq_axis="seq", lengths=local_lengths[0], causal=True
        )

    per_shard = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(None, "seq"), P(None, "seq"), P("seq")),
        out_specs=P(),
        check_vma=True,
    )(q, k, v, local_lengths)
    assert_close(per_shard.out, want.out, dtype=jnp.float32, what="decode_attention_per_shard")


def test_sharded_paged_decode_default_positions_match_paged():
    rng = np.random.default_rng(7)
    D, M_d, P_d = 2, 2, 5
    lengths = np.array([15, 3], np.int32)
    B = len(lengths)
    k_pages, v_pages, table = _pool_and_table(rng, lengths, D * M_d, num_pages=D * P_d)
    # Build a legal sharded layout: device d holds global slots d*M_d ... with local ids.
    k_local = np.full((K, D * P_d, C, H), np.nan, np.float32)
    v_local = np.full((K, D * P_d, C, H), np.nan, np.float32)
    table_local = np.zeros((B, D * M_d), np.int32)
    next_id = [1] * D
    for b in range(B):
        for j in range(D * M_d):
            pid = int(table[b, j])
            if pid == 0:
                continue
            d = j // M_d
            lid = next_id[d]
            next_id[d] += 1
            k_local[:, d * P_d + lid] = np.asarray(k_pages[:, pid])
            v_local[:, d * P_d + lid] = np.asarray(v_pages[:, pid])
            table_local[b, j] = lid
    q = jnp.asarray(rng.standard_normal((B, 2, N, H)).astype(np.float32))
    want = paged.paged_attention_reference(q, k_pages, v_pages, table, jnp.asarray(lengths))
    mesh = make_test_mesh((D,), ("seq",), axis_type=AxisType.Explicit)
    got = paged.sharded_paged_attention(
        q,
        jnp.asarray(k_local),
        jnp.asarray(v_local),
        jnp.asarray(table_local),
        jnp.asarray(lengths),
        mesh=mesh,
        seq_axis="seq",
    )
    assert_close(got.out, want.out, dtype=jnp.float32, what="sharded_paged_attention")


def test_allocator_outputs_feed_the_cache_directly():
    """Trap 2: page table, lengths and copy plans (empty ones included) go straight in."""
    alloc = paged.PageAllocator(16, C, max_pages_per_seq=4)
    cache = paged.init_paged_cache(1, K, 16, C, H, batch=2, max_pages_per_seq=4)
    alloc.admit("a", list(range(1, 7)))
    alloc.allocate("b", 3)
    cache = paged.with_page_table(cache, alloc.page_table(["a", "b"]), alloc.lengths(["a", "b"]))
    assert cache.page_table.shape == (2, 4) and cache.lengths.tolist() == [6, 3]
    alloc.commit("a")
    plan = alloc.extend("a", 7, token_ids=[7])  # room in the last page: nothing to copy
    assert isinstance(plan, paged.CopyPlan)
    assert plan.src.shape == plan.dst.shape == (0,)
    same = paged.copy_pages(cache, plan)
    np.testing.assert_array_equal(np.asarray(same.k_pages), np.asarray(cache.k_pages))
    plan = alloc.fork("a", "c")  # the partial last page is copied for the child
    assert plan.src.size == 1
    marked = cache.k_pages.at[:, :, plan.src].set(1.0)
    copied = jax.jit(paged.copy_pages)(cache._replace(k_pages=marked), plan)
    np.testing.assert_array_equal(np.asarray(copied.k_pages[:, :, plan.dst]), 1.0)
    cache = paged.with_page_table(copied, alloc.page_table(["a", "c"]), alloc.lengths(["a", "c"]))
    assert cache.lengths.tolist() == [7, 7]


def test_results_have_one_shape_whatever_the_flags():
    """Trap 5: one NamedTuple per function, None for what was not asked."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 8, N, H)).astype(np.float32))
    kv = jnp.asarray(rng.standard_normal((1, 8, K, H)).astype(np.float32))
    for fn in (ringattn.attention_reference, ringattn.blockwise_attention):
        res = fn(q, kv, kv, causal=True)
        assert isinstance(res, ringattn.AttentionOutput)
        assert res.out.shape == (1, 8, N, H) and res.lse.shape == (1, 8, N)
    lengths = np.array([9], np.int32)
    k_pages, v_pages, table = _pool_and_table(rng, lengths, 4, num_pages=6)
    qd = q[:, :1]
    plain = paged.paged_attention(qd, k_pages, v_pages, table, jnp.asarray(lengths))
    massed = paged.paged_attention(
        qd, k_pages, v_pages, table, jnp.asarray(lengths), return_page_mass=True
    )
    assert type(plain) is type(massed)
    assert plain.page_mass is None and massed.page_mass.shape == (1, N, 4)


def test_public_functions_jit_with_options_bound_by_partial():
    """Trap 6: the documented way to jit a function with options."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 8, N, H)).astype(np.float32))
    kv = jnp.asarray(rng.standard_normal((2, 8, K, H)).astype(np.float32))
    for fn in (ringattn.attention_reference, ringattn.blockwise_attention):
        eager = fn(q, kv, kv, causal=True, window=3)
        jitted = jax.jit(functools.partial(fn, causal=True, window=3))(q, kv, kv)
        assert_close(jitted.out, eager.out, dtype=jnp.float32, what=fn.__name__)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_vmap_over_sharded_attention_with_masks(strategy, axis_type):
    """Issue 9: vmap with causal + window used to crash inside the ring."""
    rng = np.random.default_rng(2)
    mesh = make_test_mesh((4,), ("seq",), axis_type=axis_type)
    q = jnp.asarray(rng.standard_normal((3, 1, 16, N, H)).astype(np.float32))
    kv = jnp.asarray(rng.standard_normal((3, 1, 16, N, H)).astype(np.float32))
    fn = functools.partial(
        ringattn.sharded_attention, mesh=mesh, seq_axis="seq", strategy=strategy,
        causal=True, window=5,
    )  # fmt: skip
    with jax.set_mesh(mesh):
        got = jax.jit(jax.vmap(lambda q, k, v: fn(q, k, v).out))(q, kv, kv)
    for i in range(3):
        want = ringattn.attention_reference(q[i], kv[i], kv[i], causal=True, window=5)
        assert_close(got[i], want.out, dtype=jnp.float32, what=f"vmap {strategy} [{i}]")


def test_sinks_join_the_softmax_once_across_ring_hops():
    rng = np.random.default_rng(3)
    mesh = make_test_mesh((4,), ("seq",))
    q = jnp.asarray(rng.standard_normal((1, 16, N, H)).astype(np.float32))
    kv = jnp.asarray(rng.standard_normal((1, 16, K, H)).astype(np.float32))
    sinks = jnp.asarray(rng.standard_normal(N).astype(np.float32))
    want = ringattn.attention_reference(q, kv, kv, causal=True, sinks=sinks)
    got = ringattn.sharded_attention(q, kv, kv, mesh=mesh, seq_axis="seq", causal=True, sinks=sinks)
    assert_close(got.out, want.out, dtype=jnp.float32, what="ring with sinks")
    assert_close(got.lse, want.lse, dtype=jnp.float32, what="ring lse with sinks")
