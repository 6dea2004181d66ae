"""The device free-page stack: pops in order, exhaustion is safe, hand-over with the host."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged import (
    PageAllocator,
    advance,
    ensure_next_page,
    gather_kv,
    init_paged_cache,
    make_free_stack,
    pop_pages,
    push_pages,
    taken_pages,
    validate,
    with_page_table,
    write,
    write_layer,
)


def test_pop_grants_in_batch_order_until_exhausted():
    stack = make_free_stack([4, 9, 2])
    stack, ids, granted = pop_pages(stack, jnp.array([True, False, True, True, True]))
    assert ids.tolist() == [2, 0, 9, 4, 0]
    assert granted.tolist() == [True, False, True, True, False]
    assert int(stack.top) == 0
    stack, ids, granted = pop_pages(stack, jnp.array([True]))
    assert ids.tolist() == [0] and granted.tolist() == [False] and int(stack.top) == 0


def test_push_returns_pages_and_drops_overflow():
    stack = make_free_stack([5], capacity=3)
    stack = push_pages(stack, jnp.array([7, 0, 8, 6]), jnp.array([True, True, True, True]))
    assert int(stack.top) == 3 and stack.pages.tolist() == [5, 7, 8]  # 0 ignored, 6 overflows
    stack, ids, _ = pop_pages(stack, jnp.array([True, True]))
    assert ids.tolist() == [8, 7]


@settings(max_examples=25, deadline=None)
@given(
    free=st.lists(st.integers(1, 40), unique=True, max_size=8),
    ops=st.lists(
        st.tuples(st.booleans(), st.lists(st.booleans(), min_size=4, max_size=4)), max_size=6
    ),
)
def test_stack_never_duplicates_or_loses_pages(free, ops):
    """Model check against a Python list: pops hand out distinct held pages; pushes return them."""
    stack = make_free_stack(free, capacity=8)  # fixed shapes: one compile per function
    model = list(free)
    held = []
    for is_pop, mask in ops:
        mask_arr = jnp.asarray(mask)
        if is_pop:
            stack, ids, granted = pop_pages(stack, mask_arr)
            expect = []
            for want in mask:
                expect.append(model.pop() if want and model else 0)
            assert ids.tolist() == expect
            assert granted.tolist() == [e != 0 for e in expect]
            held += [e for e in expect if e]
        else:
            back = [held.pop() if want and held else 0 for want in mask]
            stack = push_pages(stack, jnp.asarray(back, jnp.int32), mask_arr)
            model += [p for p in back if p]
        assert int(stack.top) == len(model)
        assert np.asarray(stack.pages)[: len(model)].tolist() == model
        assert sorted(model + held) == sorted(free)


@pytest.mark.parametrize(
    "ids, kwargs, match",
    [
        ([[1, 2]], {}, "free_ids must be 1-D ints"),
        ([1.5], {}, "free_ids must be 1-D ints"),
        ([0, 3], {}, "real pages"),
        ([3, 3], {}, "distinct"),
        ([1, 2], dict(capacity=1), "capacity: expected an int >= 2"),
        ([1, 2], dict(capacity=3.0), "capacity: expected an int >= 2"),
    ],
)
@pytest.mark.no_typecheck
def test_make_free_stack_errors(ids, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_free_stack(ids, **kwargs)


def test_taken_pages_error():
    with pytest.raises(ValueError, match="exceeds initial_top"):
        taken_pages(make_free_stack([1, 2, 3]), 2)


L, K, C, H = 2, 1, 4, 2


def decode_loop(cache, stack, steps):
    """A jitted multi-step decode: take pages on device, write each layer, advance if ok."""

    def step(i, carry):
        cache, stack, grew = carry
        cache, stack, ok = ensure_next_page(cache, stack)
        B = cache.lengths.shape[0]
        # Token value encodes (sequence, position) so the result can be checked exactly.
        value = (jnp.arange(B) * 1000 + cache.lengths).astype(jnp.float32)
        kv = jnp.broadcast_to(value[:, None, None], (B, K, H))
        for layer in range(L):
            cache = write_layer(cache, layer, kv * (layer + 1), -kv, cache.lengths)
        cache = advance(cache, ok.astype(jnp.int32))
        return cache, stack, grew + ok.astype(jnp.int32)

    grew = jnp.zeros(cache.lengths.shape, jnp.int32)
    return jax.lax.fori_loop(0, steps, step, (cache, stack, grew))


def test_jitted_decode_loop_takes_pages_and_stops_safely_when_exhausted():
    B, M, P = 3, 4, 9
    cache = init_paged_cache(L, K, P, C, H, B, M)
    # Sequence 0 holds 3 tokens on page 5, sequence 1 holds 4 (full page 6), sequence 2 holds
    # 13 tokens and its table is full after 16.
    table = np.zeros((B, M), np.int32)
    table[0, 0], table[1, 0], table[2, :4] = 5, 6, [1, 2, 3, 4]
    cache = with_page_table(cache, table, jnp.array([3, 4, 13], jnp.int32))
    # Pre-fill existing tokens with the same encoding the loop uses (one write of up to 13
    # tokens, count= keeping each row to its length: the loop writes the rest).
    value = jnp.arange(B)[:, None] * 1000.0 + jnp.arange(13)[None]  # [B, 13]
    kv = jnp.broadcast_to(value[None, :, :, None, None], (L, B, 13, K, H))
    scale = jnp.arange(1, L + 1, dtype=jnp.float32)[:, None, None, None, None]
    cache = write(cache, kv * scale, -kv, 0, count=cache.lengths)
    stack = make_free_stack([7, 8])
    cache, stack, grew = jax.jit(decode_loop, static_argnums=2)(cache, stack, 10)
    # Step 0: seq 1 (full page) takes page 8; step 1: seq 0 reaches position 4 and takes 7.
    # Then the stack is empty: seqs 0 and 1 stop at 8 tokens; seq 2 fills its table (16).
    assert cache.lengths.tolist() == [8, 8, 16]
    assert grew.tolist() == [5, 4, 3]
    assert cache.page_table.tolist() == [[5, 7, 0, 0], [6, 8, 0, 0], [1, 2, 3, 4]]
    assert int(stack.top) == 0
    validate(cache)
    for layer in range(L):
        k, v = gather_kv(cache, layer)
        for b in range(B):
            n = int(cache.lengths[b])
            expected = (b * 1000 + np.arange(n)) * (layer + 1)
            np.testing.assert_array_equal(np.asarray(k[b, :n, 0, 0]), expected)
            np.testing.assert_array_equal(np.asarray(v[b, :n, 0, 0]), -expected / (layer + 1))
    # Dropped writes never reached the null page.
    np.testing.assert_array_equal(np.asarray(cache.k_pages[:, :, 0]), 0.0)


def test_hand_over_with_host_allocator():
    """reserve -> device stack -> jitted loop -> taken_pages -> settle, and the host agrees."""
    alloc = PageAllocator(12, C, max_pages_per_seq=4)
    alloc.allocate("a", 3)
    alloc.allocate("b", 8)
    seqs = ["a", "b"]
    reserved = alloc.reserve(3)
    stack = make_free_stack(reserved)
    cache = init_paged_cache(L, K, 12, C, H, 2, 4)
    cache = with_page_table(cache, alloc.page_table(seqs), alloc.lengths(seqs))
    cache, stack, _ = jax.jit(decode_loop, static_argnums=2)(cache, stack, 3)
    taken, unused = taken_pages(stack, len(reserved))
    assert cache.lengths.tolist() == [6, 11]
    assert sorted(taken.tolist() + unused.tolist()) == sorted(reserved.tolist())
    alloc.settle(seqs, np.asarray(cache.page_table), np.asarray(cache.lengths), unused=unused)
    alloc.validate()
    assert alloc.page_table(seqs).tolist() == np.asarray(cache.page_table).tolist()
    assert alloc.lengths(seqs).tolist() == [6, 11]
