"""paged_attention / ragged_paged_attention against the public float32 oracles
(``paged.paged_attention_reference`` / ``ragged_paged_attention_reference``) and JAX's reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged import (
    PagedAttentionOutput,
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from tests._util import assert_close


def make_pool(rng, *, K, C, H, lengths, M, dtype, spare=3):
    """Random pools, a randomly permuted page table and NaN wherever nothing valid lives.

    Free pages, the null page, table padding and the tail of each last partial page hold NaN,
    so any read of them into a result shows up as a non-finite output.
    """
    lengths = np.asarray(lengths, np.int32)
    B = lengths.size
    used = [-(-int(n) // C) for n in lengths]
    P = 1 + sum(used) + spare
    ids = rng.permutation(np.arange(1, P))
    table = np.zeros((B, M), np.int32)
    start = 0
    for b, n in enumerate(used):
        table[b, :n] = ids[start : start + n]
        start += n
    k = rng.standard_normal((K, P, C, H)).astype(np.float32)
    v = rng.standard_normal((K, P, C, H)).astype(np.float32)
    valid = np.zeros((P, C), bool)
    for b in range(B):
        for i in range(lengths[b]):
            valid[table[b, i // C], i % C] = True
    k[:, ~valid] = np.nan
    v[:, ~valid] = np.nan
    return (
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(table),
        jnp.asarray(lengths),
    )


def reference(q, k_pages, v_pages, table, lengths, **options):
    """The public oracle, jitted (one compile per shape instead of one per eager op)."""
    return _jit_reference(q, k_pages, v_pages, table, lengths, **options)


@functools.partial(
    jax.jit, static_argnames=("mask", "causal", "window", "softcap", "scale", "return_page_mass")
)
def _jit_reference(q, k_pages, v_pages, table, lengths, **options):
    return paged_attention_reference(q, k_pages, v_pages, table, lengths, **options)


# (C, heads (N, K), dtype, window, softcap, T, pages_per_block, jit)
CASES = [
    (4, (4, 4), jnp.float32, None, None, 1, 1, False),
    (4, (4, 2), jnp.bfloat16, 3, None, 2, 2, True),
    (4, (4, 1), jnp.bfloat16, None, 5.0, 1, 8, True),
    (16, (4, 2), jnp.float32, None, None, 3, 2, True),
    (16, (4, 4), jnp.bfloat16, 5, None, 2, 3, True),
    (64, (4, 1), jnp.float32, 70, 4.0, 2, 1, True),
]


@pytest.mark.parametrize("C, heads, dtype, window, softcap, T, ppb, use_jit", CASES)
def test_paged_attention_matches_reference(C, heads, dtype, window, softcap, T, ppb, use_jit):
    rng = np.random.default_rng(C + T + ppb)
    N, K = heads
    H, M = 8, 3
    lengths = [0, 1, C, C + 1, M * C]
    k_pages, v_pages, table, lengths = make_pool(
        rng, K=K, C=C, H=H, lengths=lengths, M=M, dtype=dtype
    )
    q = jnp.asarray(rng.standard_normal((5, T, N, H)), dtype)

    def run(q, k_pages, v_pages, table, lengths):
        return paged_attention(
            q,
            k_pages,
            v_pages,
            table,
            lengths,
            window=window,
            softcap=softcap,
            pages_per_block=ppb,
            return_page_mass=True,
        )

    fn = jax.jit(run) if use_jit else run
    res = fn(q, k_pages, v_pages, table, lengths)
    assert isinstance(res, PagedAttentionOutput)
    out, lse, mass = res
    assert out.dtype == dtype and lse.dtype == jnp.float32 and mass.shape == (5, N, M)
    # The oracle's defaults are the kernel's: causal, queries at the last T positions.
    ref_out, ref_lse, ref_mass = reference(
        q, k_pages, v_pages, table, lengths, window=window, softcap=softcap, return_page_mass=True
    )
    assert_close(out, ref_out, dtype=dtype, what="out")
    seen = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
    assert_close(np.where(seen, lse, 0.0), np.where(seen, ref_lse, 0.0), dtype=dtype, what="lse")
    assert_close(mass, ref_mass, dtype=dtype, what="page_mass")
    # Each query that sees a key spreads exactly one unit of probability over the pages.
    np.testing.assert_allclose(
        np.asarray(mass).sum(-1), seen.sum(1), rtol=1e-3 if dtype == jnp.bfloat16 else 1e-5
    )


def test_explicit_positions_non_causal_and_scale():
    rng = np.random.default_rng(1)
    k_pages, v_pages, table, lengths = make_pool(
        rng, K=2, C=4, H=8, lengths=[9, 12], M=3, dtype=jnp.float32
    )
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 8)), jnp.float32)
    q_positions = jnp.array([[2, 5, 8], [0, 11, 30]], jnp.int32)
    for causal in (True, False):
        out, _, _ = paged_attention(
            q,
            k_pages,
            v_pages,
            table,
            lengths,
            q_positions=q_positions,
            causal=causal,
            scale=0.3,
        )
        ref, _, _ = reference(
            q, k_pages, v_pages, table, lengths, q_positions=q_positions, causal=causal, scale=0.3
        )
        assert_close(out, ref, dtype=jnp.float32, what=f"causal={causal}")


def test_bad_page_ids_are_masked_never_read():
    """Out-of-range (negative, >= P) and null ids inside a length read nothing."""
    rng = np.random.default_rng(2)
    k_pages, v_pages, table, lengths = make_pool(
        rng, K=1, C=4, H=8, lengths=[12, 12, 12], M=3, dtype=jnp.float32, spare=0
    )
    P = k_pages.shape[1]
    table = table.at[0, 1].set(P + 2).at[1, 0].set(-1).at[2, 2].set(0)
    q = jnp.asarray(rng.standard_normal((3, 1, 2, 8)), jnp.float32)
    # Traced (the documented masking); an eager call raises instead (tests/paged/test_checks.py).
    out = jax.jit(paged_attention)(q, k_pages, v_pages, table, lengths).out
    ref = reference(
        q, k_pages, v_pages, table, lengths, q_positions=lengths[:, None] - 1, causal=True
    ).out
    assert_close(out, ref, dtype=jnp.float32, what="masked bad ids")
    with pytest.raises(ValueError, match=r"paged_attention: page_table\[0, 1\]"):
        paged_attention(q, k_pages, v_pages, table, lengths)


def test_default_arguments_and_single_output():
    rng = np.random.default_rng(3)
    k_pages, v_pages, table, lengths = make_pool(
        rng, K=2, C=16, H=8, lengths=[40, 3], M=4, dtype=jnp.float32
    )
    q = jnp.asarray(rng.standard_normal((2, 1, 2, 8)), jnp.float32)
    res = paged_attention(q, k_pages, v_pages, table, lengths)
    assert isinstance(res, PagedAttentionOutput) and res.page_mass is None
    out = res.out
    ref = reference(
        q, k_pages, v_pages, table, lengths, q_positions=lengths[:, None] - 1, causal=True
    ).out
    assert_close(out, ref, dtype=jnp.float32, what="defaults")
    out2, lse2, mass = paged_attention(q, k_pages, v_pages, table, lengths, return_page_mass=True)
    assert mass.shape == (2, 2, 4)
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(res.lse))


def ragged_inputs(rng, C, K, N, H, dtype=jnp.float32):
    # Sequences: a chunk of 5 with 3 cached, one decode token, a whole prompt of 9 from 0,
    # a sequence with no queries, then a padding sequence beyond num_seqs.
    q_lens = [5, 1, 9, 0, 4]
    lengths = [8, 2 * C + 1, 9, 6, 7]
    M = 4
    k_pages, v_pages, table, lengths = make_pool(
        rng, K=K, C=C, H=H, lengths=lengths, M=M, dtype=dtype
    )
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    total = int(cu[4]) + 2  # two trailing rows owned by no real sequence
    q = jnp.asarray(rng.standard_normal((total, N, H)), dtype)
    return q, k_pages, v_pages, table, lengths, jnp.asarray(cu), q_lens


@pytest.mark.parametrize(
    "C, heads, window, softcap, qpb, dtype",
    [
        (4, (4, 2), None, None, 2, jnp.float32),
        (16, (4, 1), 6, 5.0, 16, jnp.bfloat16),
    ],
)
def test_ragged_matches_reference(C, heads, window, softcap, qpb, dtype):
    rng = np.random.default_rng(C + qpb)
    N, K = heads
    q, k_pages, v_pages, table, lengths, cu, q_lens = ragged_inputs(rng, C, K, N, 8, dtype)
    run = jax.jit(
        functools.partial(
            ragged_paged_attention,
            window=window,
            softcap=softcap,
            pages_per_block=2,
            queries_per_block=qpb,
        )
    )
    out, lse, mass = run(q, k_pages, v_pages, table, lengths, cu, jnp.int32(4))
    assert mass is None
    ref_out, ref_lse, _ = jax.jit(
        functools.partial(ragged_paged_attention_reference, window=window, softcap=softcap)
    )(q, k_pages, v_pages, table, lengths, cu, jnp.int32(4))
    ref_out, ref_lse = np.asarray(ref_out, np.float32), np.asarray(ref_lse)
    assert_close(out, ref_out, dtype=dtype, what="ragged out")
    seen = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
    assert_close(np.where(seen, lse, 0), np.where(seen, ref_lse, 0), dtype=dtype, what="lse")
    # Rows of padding sequences and unowned rows are zeros.
    np.testing.assert_array_equal(np.asarray(out[int(cu[4]) :], np.float32), 0.0)


def test_ragged_matches_jax_reference():
    kernel = pytest.importorskip(
        "jax.experimental.pallas.ops.tpu.ragged_paged_attention",
        reason="JAX's ragged paged attention reference is not importable on this JAX",
    )
    rng = np.random.default_rng(7)
    N, K, H, C = 4, 2, 8, 4
    # Its reference runs eagerly op by op (slow to compile): two sequences, a prefill chunk of
    # 3 on 4 cached tokens and one decode token.
    k_pages, v_pages, table, lengths = make_pool(
        rng, K=K, C=C, H=H, lengths=[7, 9], M=3, dtype=jnp.float32
    )
    cu = jnp.array([0, 3, 4], jnp.int32)
    q = jnp.asarray(rng.standard_normal((4, N, H)), jnp.float32)
    # JAX's reference reads whole pages, NaN tails included (its finite mask cannot hide
    # NaN), so hand it the same data with the invalid slots zeroed.
    kv = jnp.stack([jnp.nan_to_num(k_pages), jnp.nan_to_num(v_pages)], axis=3)  # [K,P,C,2,H]
    kv = kv.transpose(1, 2, 0, 3, 4).reshape(k_pages.shape[1], C, 2 * K, H)  # k0 v0 k1 v1 ...
    num_seqs = jnp.array([2], jnp.int32)
    # It cannot be jitted with traced metadata (it loops over num_seqs in Python), but with the
    # metadata closed over as concrete numpy arrays one compile replaces dozens of eager ones.
    meta = [np.asarray(x) for x in (lengths, table, cu, num_seqs)]
    expected = jax.jit(
        lambda q, kv: kernel.ref_ragged_paged_attention(
            q, kv, *meta, sm_scale=1 / np.sqrt(H), sliding_window=5, soft_cap=3.0
        )
    )(q, kv)
    out = ragged_paged_attention(
        q, k_pages, v_pages, table, lengths, cu, num_seqs, window=5, softcap=3.0
    ).out
    assert_close(out, expected, dtype=jnp.float32, what="vs ref_ragged_paged_attention")


def test_ragged_decode_batch_equals_paged_attention():
    rng = np.random.default_rng(4)
    k_pages, v_pages, table, lengths = make_pool(
        rng, K=1, C=4, H=8, lengths=[5, 12, 1], M=3, dtype=jnp.float32
    )
    q = jnp.asarray(rng.standard_normal((3, 1, 2, 8)), jnp.float32)
    a = paged_attention(q, k_pages, v_pages, table, lengths).out
    b = ragged_paged_attention(q[:, 0], k_pages, v_pages, table, lengths, jnp.arange(4), 3).out
    np.testing.assert_allclose(np.asarray(a[:, 0]), np.asarray(b), atol=1e-6)


def _small():
    k = jnp.zeros((2, 4, 4, 8))
    return jnp.zeros((1, 1, 4, 8)), k, k, jnp.ones((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=jnp.zeros((1, 4, 8))), "q: expected rank 4"),
        (dict(q=jnp.zeros((1, 1, 4, 8), jnp.int32)), "q: expected a floating point"),
        (dict(q=jnp.zeros((1, 0, 4, 8))), "q: expected at least one query"),
        (dict(q=jnp.zeros((1, 1, 3, 8))), "multiple of kv heads"),
        (dict(q=jnp.zeros((1, 1, 4, 4))), "q: expected head dim 8"),
        (dict(q=jnp.zeros((1, 1, 4, 8), jnp.bfloat16)), "q: expected dtype float32"),
        (dict(k=jnp.zeros((2, 4, 4, 8, 1))), "k_pages: expected rank 4"),
        (dict(v=jnp.zeros((2, 5, 4, 8))), "v_pages: expected the shape and dtype of k_pages"),
        (dict(t=jnp.ones((2, 2), jnp.int32)), "page_table: expected 1 rows"),
        (dict(t=jnp.ones((1, 2))), "page_table: expected an integer array"),
        (dict(lengths=jnp.ones((2,), jnp.int32)), r"lengths: expected shape \(1,\)"),
        (dict(pages_per_block=0), "pages_per_block: expected an int >= 1"),
        (dict(window=0), "window"),
        (dict(softcap=-1.0), "softcap"),
        (dict(q_positions=jnp.zeros((1, 2), jnp.int32)), "q_positions: expected shape"),
    ],
)
@pytest.mark.no_typecheck
def test_paged_attention_errors(change, match):
    q, k, v, t, lengths = _small()
    q = change.pop("q", q)
    k = change.pop("k", k)
    v = change.pop("v", v)
    t = change.pop("t", t)
    lengths = change.pop("lengths", lengths)
    with pytest.raises(ValueError, match=match):
        paged_attention(q, k, v, t, lengths, **change)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=jnp.zeros((1, 1, 4, 8))), "q: expected rank 3"),
        (dict(q=jnp.zeros((0, 4, 8))), "q: expected at least one token row"),
        (dict(cu=jnp.zeros((3,), jnp.int32)), "cu_q_lens: expected shape"),
        (dict(cu=jnp.zeros((2,))), "cu_q_lens: expected an integer array"),
        (dict(num_seqs=jnp.zeros((2,), jnp.int32)), "num_seqs: expected one integer"),
        (dict(queries_per_block=0), "queries_per_block: expected an int >= 1"),
        (dict(pages_per_block=1.5), "pages_per_block: expected an int >= 1"),
    ],
)
@pytest.mark.no_typecheck
def test_ragged_errors(change, match):
    q, k, v, t, lengths = _small()
    q = change.pop("q", q[0])
    cu = change.pop("cu", jnp.array([0, 1], jnp.int32))
    num_seqs = change.pop("num_seqs", 1)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(q, k, v, t, lengths, cu, num_seqs, **change)


def test_zero_based_tables_from_jax_convert_with_one_shift():
    """A JAX-style pool (page 0 an ordinary page, here holding real tokens) gives the same
    answer as JAX's reference after ``from_zero_based_table`` and one null page in front."""
    kernel = pytest.importorskip(
        "jax.experimental.pallas.ops.tpu.ragged_paged_attention",
        reason="JAX's ragged paged attention reference is not importable on this JAX",
    )
    from paged import from_zero_based_table

    rng = np.random.default_rng(11)
    N, K, H, C, P = 4, 2, 8, 4, 5
    kv = jnp.asarray(rng.standard_normal((P, C, 2 * K, H)), jnp.float32)  # JAX layout
    table = np.array([[0, 3, 1], [4, 2, 0]], np.int32)  # page 0 used by sequence 0
    lengths = np.array([10, 6], np.int32)
    cu = np.array([0, 2, 3], np.int32)
    num_seqs = np.array([2], np.int32)
    q = jnp.asarray(rng.standard_normal((3, N, H)), jnp.float32)
    expected = jax.jit(
        lambda q, kv: kernel.ref_ragged_paged_attention(
            q, kv, lengths, table, cu, num_seqs, sm_scale=1 / np.sqrt(H)
        )
    )(q, kv)
    # Ours: heads-major [K, P, C, H] pools, one null page in front, ids shifted by one.
    k_pages = kv[:, :, 0::2].transpose(2, 0, 1, 3)
    v_pages = kv[:, :, 1::2].transpose(2, 0, 1, 3)
    pad = ((0, 0), (1, 0), (0, 0), (0, 0))
    out = ragged_paged_attention(
        q,
        jnp.pad(k_pages, pad),
        jnp.pad(v_pages, pad),
        from_zero_based_table(table),
        lengths,
        cu,
        num_seqs,
    ).out
    assert_close(out, expected, dtype=jnp.float32, what="zero-based table converted")
