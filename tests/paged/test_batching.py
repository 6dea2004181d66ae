"""Serving-loop helpers: ragged query offsets with empty rows, the pages a loop reserves, and
batches whose rows are not all admitted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import paged
from tests._util import assert_close

C, M = 4, 4


def test_make_cu_q_lens_with_empty_rows_feeds_ragged_attention():
    counts = np.array([2, 0, 3, 0], np.int32)  # rows 1 and 3 have no query this step
    cu = paged.make_cu_q_lens(counts)
    assert cu.tolist() == [0, 2, 2, 5, 5] and cu.dtype == jnp.int32
    assert jax.jit(paged.make_cu_q_lens)(jnp.asarray(counts)).tolist() == cu.tolist()
    K, N, H, P = 1, 2, 8, 12
    kk, kv, kq = jax.random.split(jax.random.key(0), 3)
    k_pages = jax.random.normal(kk, (K, P, C, H))
    v_pages = jax.random.normal(kv, (K, P, C, H))
    table = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, P))[:8].reshape(4, 2))
    lengths = jnp.asarray([6, 5, 7, 0], jnp.int32)
    q = jax.random.normal(kq, (5, N, H))
    got = paged.ragged_paged_attention(q, k_pages, v_pages, table, lengths, cu, 4)
    want = paged.ragged_paged_attention_reference(q, k_pages, v_pages, table, lengths, cu, 4)
    assert_close(got.out, want.out, dtype=jnp.float32, what="empty rows")
    # The same as each row alone: row 0's queries, row 2's queries.
    for b, rows in ((0, slice(0, 2)), (2, slice(2, 5))):
        alone = paged.paged_attention_reference(
            q[None, rows], k_pages, v_pages, table[b : b + 1], lengths[b : b + 1]
        )
        assert_close(got.out[rows], alone.out[0], dtype=jnp.float32, what=f"row {b}")


@pytest.mark.no_typecheck
def test_make_cu_q_lens_errors():
    with pytest.raises(ValueError, match="make_cu_q_lens: counts: expected queries per row >= 0"):
        paged.make_cu_q_lens(np.array([1, -1]))
    with pytest.raises(ValueError, match="make_cu_q_lens: counts: expected rank 1"):
        paged.make_cu_q_lens(np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="make_cu_q_lens: counts: expected an integer"):
        paged.make_cu_q_lens(np.zeros(2))


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, M * C), min_size=3, max_size=3),
    tokens=st.lists(st.integers(0, 6), min_size=3, max_size=3),
)
def test_pages_to_reserve_is_what_ensure_next_page_pops(lengths, tokens):
    """With the count reserved every row writes all its tokens; with one page fewer, not."""
    B = 3
    lengths = np.array(lengths)
    tokens = np.minimum(np.array(tokens), M * C - lengths)  # capacity
    need = paged.pages_to_reserve(lengths, tokens, page_size=C, max_pages_per_seq=M)

    def run(num_free):
        alloc = paged.PageAllocator(B * M + 2, C, max_pages_per_seq=M)
        seqs = [alloc.allocate(b, int(n)) is not None and b for b, n in enumerate(lengths)]
        cache = paged.init_paged_cache(1, 1, B * M + 2, C, 2, batch=B, max_pages_per_seq=M)
        cache = paged.with_page_table(cache, alloc.page_table(seqs), alloc.lengths(seqs))
        stack = paged.make_free_stack(alloc.reserve(num_free), capacity=B * M + 2)
        all_ok = True
        for step in range(int(tokens.max(initial=0))):
            active = jnp.asarray(step < tokens)
            cache, stack, ok = paged.ensure_next_page(cache, stack, active=active)
            all_ok &= bool((np.asarray(ok) == np.asarray(active)).all())
            cache = paged.advance(cache, ok.astype(jnp.int32))
        return all_ok

    assert run(need)
    if need:
        assert not run(need - 1)


@pytest.mark.no_typecheck
def test_pages_to_reserve_errors_and_scalar_counts():
    assert paged.pages_to_reserve([0, 3], 2, page_size=2) == 1 + 1
    assert paged.pages_to_reserve([6], [9], page_size=4, max_pages_per_seq=3) == 1
    fn = "pages_to_reserve"
    with pytest.raises(ValueError, match=f"{fn}: num_tokens: expected shape"):
        paged.pages_to_reserve([1, 2], [1], page_size=2)
    with pytest.raises(ValueError, match=f"{fn}: lengths: expected ints >= 0"):
        paged.pages_to_reserve([-1], [1], page_size=2)
    with pytest.raises(ValueError, match=f"{fn}: page_size: expected an int >= 1"):
        paged.pages_to_reserve([1], [1], page_size=0)


def test_batch_with_empty_rows():
    alloc = paged.PageAllocator(8, 2, max_pages_per_seq=3)
    alloc.allocate("x", 3)
    seqs = [None, "x", None]
    table = alloc.page_table(seqs)
    assert table.tolist() == [[0, 0, 0], [1, 2, 0], [0, 0, 0]]
    assert alloc.lengths(seqs).tolist() == [0, 3, 0]
    stack = alloc.reserve(1)
    table[1, 2] = stack[0]  # what a loop does for row "x"; the empty rows get nothing
    alloc.settle(seqs, table, [0, 5, 0])
    assert alloc.sequence_pages("x").tolist() == [1, 2, int(stack[0])]
    alloc.validate()
    with pytest.raises(ValueError, match="settle: page_table\\[0\\]: expected an empty row"):
        alloc.settle(seqs, table, [1, 5, 0])
    with pytest.raises(ValueError, match="allocate: seq: expected an id other than None"):
        alloc.allocate(None, 1)
