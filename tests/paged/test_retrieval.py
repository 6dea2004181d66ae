"""Query-aware page retrieval: the logit bound holds for every key (seeded fuzz), the selection
matches a numpy oracle and keeps sink and recent pages, a full budget equals
paged_attention_reference on every format and page size (garbage in unread slots), a partial
budget equals attention over exactly the selected pages, jit / vmap, and the errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged import (
    PageKeyBounds,
    PageSelection,
    page_key_bounds,
    page_logit_bounds,
    paged_attention,
    paged_attention_reference,
    retrieval_attention,
    retrieval_pool,
    retrieval_table,
    select_pages_by_query,
)
from tests.paged._retrieval_util import (
    FORMATS,
    attention_oracle,
    make_cache,
    read_keys,
    selection_oracle,
)

N = 4  # query heads over K = 2 kv heads (GQA, G = 2)


def queries(rng, B, T=1, H=8):
    return jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)


@pytest.mark.parametrize("seed", range(6))
def test_the_bound_is_above_every_logit_of_the_page(seed):
    rng = np.random.default_rng(seed)
    kind = list(FORMATS)[seed % len(FORMATS)]
    C = (2, 4, 3)[seed % 3]
    cache = make_cache(kind, rng, C=C)
    bounds = page_key_bounds(cache)
    table, lengths = np.asarray(cache.page_table), np.asarray(cache.lengths)
    q = queries(rng, table.shape[0], T=2) * (10.0 ** rng.uniform(-2, 2))
    for layer in range(2):
        ub = np.asarray(page_logit_bounds(q, bounds.layer(layer), cache.page_table))  # [B, K, M]
        k = read_keys(cache, layer)
        qn = np.asarray(q, np.float64)
        for b in range(table.shape[0]):
            for i in range(lengths[b]):
                j = i // C
                for h in range(N):
                    logit = qn[b, :, h] @ k[b, i, h // 2]  # [T]
                    slack = 1e-5 * (np.abs(qn[b, :, h]) @ np.abs(k[b, i, h // 2]) + 1e-30)
                    assert (logit <= ub[b, h // 2, j] + slack).all(), (kind, b, i, h)


@pytest.mark.parametrize("kind", ["float32", "int4", "kivi2_window"])
@pytest.mark.parametrize(("budget", "sink", "recent"), [(3, 1, 1), (2, 0, 2), (4, 2, 1), (9, 1, 1)])
def test_selection_matches_the_oracle_and_keeps_sink_and_recent(kind, budget, sink, recent):
    rng = np.random.default_rng(budget * 10 + sink)
    C = 4
    cache = make_cache(kind, rng, C=C)
    bounds = page_key_bounds(cache)
    q = queries(rng, cache.page_table.shape[0], T=2)
    lengths = np.asarray(cache.lengths)
    sel = jax.jit(
        functools.partial(
            select_pages_by_query, page_size=C, budget=budget, sink_pages=sink, recent_pages=recent
        )
    )(q, bounds.layer(1), cache.page_table, cache.lengths)
    b1 = bounds.layer(1)
    sets, scores = selection_oracle(q, np.asarray(b1.k_min), np.asarray(b1.k_max),
                                    np.asarray(cache.page_table), lengths, C, budget, sink, recent)  # fmt: skip
    got_scores = np.asarray(sel.scores, np.float64)
    fin = np.isfinite(scores)
    np.testing.assert_allclose(got_scores[fin], scores[fin], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.isneginf(got_scores), np.isneginf(scores))
    slots = np.asarray(sel.slots)
    M = cache.page_table.shape[1]
    for b, want in enumerate(sets):
        got = [int(s) for s in slots[b] if s < M]
        assert got == sorted(got) and list(slots[b, len(got) :]) == [M] * (budget - len(got))
        assert got == want, (b, got, want)
        assert int(sel.count[b]) == len(want) == min(budget, -(-lengths[b] // C))
        n = -(-lengths[b] // C)
        must = set(range(min(sink, n))) | set(range(max(n - recent, 0), n))
        assert must <= set(got)


@pytest.mark.parametrize("kind", list(FORMATS))
@pytest.mark.parametrize("C", [2, 4])
def test_full_budget_equals_the_reference(kind, C):
    rng = np.random.default_rng(C + len(kind))
    cache = make_cache(kind, rng, C=C)
    bounds = page_key_bounds(cache)
    B, M = cache.page_table.shape
    q = queries(rng, B)
    for layer in range(2):
        kp, vp = cache.k_pages[layer], cache.v_pages[layer]
        want = paged_attention_reference(q, kp, vp, cache.page_table, cache.lengths)
        for budget in (M, M + 3):
            got = retrieval_attention(q, kp, vp, bounds.layer(layer), cache.page_table,
                                      cache.lengths, budget=budget)  # fmt: skip
            assert np.isfinite(np.asarray(got.out)).all(), "garbage reached the output"
            np.testing.assert_allclose(np.asarray(got.out), np.asarray(want.out), atol=1e-5)
            np.testing.assert_allclose(np.asarray(got.lse), np.asarray(want.lse), atol=1e-5)


@pytest.mark.parametrize("kind", ["float32", "int8", "fp8", "kivi2", "kivi2_window"])
@pytest.mark.parametrize("T", [1, 2])
def test_partial_budget_equals_attention_over_exactly_the_selected_pages(kind, T):
    rng = np.random.default_rng(11 + T)
    C = 2
    cache = make_cache(kind, rng, C=C, M=8)
    bounds = page_key_bounds(cache)
    B, M = cache.page_table.shape
    q = queries(rng, B, T=T)
    fmt = FORMATS[kind]
    recent = 2 if T == 2 else 1  # the queries' own pages (T = 2 may straddle a page edge)
    if fmt is not None and fmt.kind == "kivi2":
        recent = max(recent, fmt.residual_pages(C))
    budget = 1 + recent + 1
    sel = select_pages_by_query(q, bounds.layer(0), cache.page_table, cache.lengths,
                                page_size=C, budget=budget, recent_pages=recent)  # fmt: skip
    got = jax.jit(functools.partial(retrieval_attention, budget=budget, recent_pages=recent))(
        q, cache.k_pages[0], cache.v_pages[0], bounds.layer(0), cache.page_table, cache.lengths
    )
    rows = [[int(s) for s in r if s < M] for r in np.asarray(sel.slots)]
    assert any(len(r) < -(-int(n) // C) for r, n in zip(rows, np.asarray(cache.lengths), strict=True))  # fmt: skip
    want = attention_oracle(q, cache, 0, np.asarray(cache.lengths), rows)
    np.testing.assert_allclose(np.asarray(got.out, np.float64), want, atol=2e-5)
    # the same through the public pieces
    rt = retrieval_table(sel, cache.page_table, cache.lengths, page_size=C)
    kp, vp = (
        retrieval_pool(cache.k_pages[0], rt.offset),
        retrieval_pool(cache.v_pages[0], rt.offset),
    )
    qpos = cache.lengths[:, None] - T + jnp.arange(T) - rt.offset[:, None]
    res = jax.jit(paged_attention)(q, kp, vp, rt.page_table, rt.lengths, q_positions=qpos)
    np.testing.assert_allclose(np.asarray(res.out, np.float64), want, atol=2e-5)
    assert (np.asarray(rt.lengths) <= budget * C).all()


def test_table_compacts_in_position_order_with_the_open_page_last():
    table = jnp.array([[5, 9, 2, 7, 3], [4, 6, 0, 0, 0]])
    sel = PageSelection(jnp.array([[0, 3, 4], [0, 1, 5]]), jnp.array([3, 2]), jnp.zeros((2, 5)))
    rt = retrieval_table(sel, table, jnp.array([9, 3]), page_size=2)
    assert rt.page_table.tolist() == [[5, 7, 3], [4, 6, 0]]
    assert rt.lengths.tolist() == [5, 3] and rt.offset.tolist() == [4, 0]


def test_unsummarised_live_pages_are_read_and_garbage_bounds_are_harmless():
    rng = np.random.default_rng(3)
    cache = make_cache("float32", rng, C=4)
    bounds = page_key_bounds(cache)
    table = np.asarray(cache.page_table)
    stale = int(table[3, 2])  # a live middle page whose bounds were never computed
    b0 = bounds.layer(0)
    b0 = PageKeyBounds(b0.k_min.at[:, stale].set(jnp.inf), b0.k_max.at[:, stale].set(-jnp.inf))
    nan_page = int(table[4, 1])
    b0 = PageKeyBounds(b0.k_min.at[:, nan_page].set(jnp.nan), b0.k_max)
    # NaN / inf bounds of pages past the lengths never make them live
    b0 = PageKeyBounds(b0.k_min.at[:, 0].set(-jnp.inf), b0.k_max.at[:, 0].set(jnp.inf))
    q = queries(rng, table.shape[0])
    sel = select_pages_by_query(q, b0, cache.page_table, cache.lengths, page_size=4, budget=3)
    assert 2 in np.asarray(sel.slots[3]).tolist() and 1 in np.asarray(sel.slots[4]).tolist()
    assert np.isposinf(np.asarray(sel.scores)[3, 2])
    scores = np.asarray(sel.scores)
    lengths = np.asarray(cache.lengths)
    for b in range(table.shape[0]):
        assert np.isneginf(scores[b, -(-lengths[b] // 4) :]).all()


def test_vmap_over_requests_and_jit():
    rng = np.random.default_rng(5)
    cache = make_cache("int8", rng, C=4)
    bounds = page_key_bounds(cache).layer(0)
    B = cache.page_table.shape[0]
    q = jnp.stack([queries(rng, B), queries(rng, B)])  # [V, B, 1, N, H]
    fn = functools.partial(select_pages_by_query, page_size=4, budget=3)
    got = jax.vmap(fn, in_axes=(0, None, None, None))(q, bounds, cache.page_table, cache.lengths)
    for i in range(2):
        one = fn(q[i], bounds, cache.page_table, cache.lengths)
        np.testing.assert_array_equal(np.asarray(got.slots[i]), np.asarray(one.slots))
    att = jax.vmap(functools.partial(retrieval_attention, budget=3), in_axes=(0,) + (None,) * 5)
    out = att(q, cache.k_pages[0], cache.v_pages[0], bounds, cache.page_table, cache.lengths)
    single = retrieval_attention(q[1], cache.k_pages[0], cache.v_pages[0], bounds,
                                 cache.page_table, cache.lengths, budget=3)  # fmt: skip
    np.testing.assert_allclose(np.asarray(out.out[1]), np.asarray(single.out), atol=1e-6)


def test_errors_name_the_argument():
    rng = np.random.default_rng(0)
    cache = make_cache("float32", rng, C=4)
    bounds = page_key_bounds(cache)
    q = queries(rng, cache.page_table.shape[0])
    args = (q, bounds.layer(0), cache.page_table, cache.lengths)
    with pytest.raises(ValueError, match="budget: expected at least sink_pages"):
        select_pages_by_query(*args, page_size=4, budget=1)
    with pytest.raises(ValueError, match="budget: expected an int >= 1"):
        select_pages_by_query(*args, page_size=4, budget=0)
    with pytest.raises(ValueError, match="page_size: expected an int >= 1"):
        select_pages_by_query(*args, page_size=0, budget=2)
    with pytest.raises(ValueError, match=r"bounds: expected one layer's \[K, P, H\]"):
        select_pages_by_query(q, bounds, cache.page_table, cache.lengths, page_size=4, budget=2)
    with pytest.raises(ValueError, match="q: expected head dim H=8"):
        select_pages_by_query(q[..., :4], *args[1:], page_size=4, budget=2)
    kivi = make_cache("kivi2_window", rng, C=2)  # a window of 3 pages, always read
    with pytest.raises(ValueError, match="budget: expected at least sink_pages"):
        retrieval_attention(q, kivi.k_pages[0], kivi.v_pages[0], page_key_bounds(kivi).layer(0),
                            kivi.page_table, kivi.lengths, budget=3)  # fmt: skip
    with pytest.raises(ValueError, match=r"bounds: expected \[K, P, H\] = \(2, 10, 8\)"):
        small = cache.k_pages[0][:, :10]
        retrieval_attention(q, small, small, bounds.layer(0), cache.page_table, cache.lengths,
                            budget=2)  # fmt: skip


def test_an_empty_sequence_reads_nothing_and_gets_zeros():
    rng = np.random.default_rng(9)
    cache = make_cache("float32", rng, C=4, lengths=[0, 5])
    bounds = page_key_bounds(cache).layer(0)
    q = queries(rng, 2)
    sel = select_pages_by_query(q, bounds, cache.page_table, cache.lengths, page_size=4, budget=2)
    assert sel.count.tolist() == [0, 2] and np.isneginf(np.asarray(sel.scores[0])).all()
    rt = retrieval_table(sel, cache.page_table, cache.lengths, page_size=4)
    assert rt.lengths.tolist() == [0, 5] and rt.page_table[0].tolist() == [0, 0]
    res = retrieval_attention(q, cache.k_pages[0], cache.v_pages[0], bounds, cache.page_table,
                              cache.lengths, budget=2)  # fmt: skip
    want = paged_attention_reference(q, cache.k_pages[0], cache.v_pages[0], cache.page_table,
                                     cache.lengths)  # fmt: skip
    assert (np.asarray(res.out[0]) == 0).all() and np.isneginf(np.asarray(res.lse[0])).all()
    np.testing.assert_allclose(np.asarray(res.out), np.asarray(want.out), atol=1e-5)


@pytest.mark.parametrize("kind", ["float32", "int8", "kivi2_window"])
def test_per_kv_head_selection_reads_each_heads_own_pages(kind):
    rng = np.random.default_rng(21)
    C = 2
    cache = make_cache(kind, rng, C=C, M=8)
    bounds = page_key_bounds(cache)
    B, M = cache.page_table.shape
    q = queries(rng, B)
    fmt = FORMATS[kind]
    recent = fmt.residual_pages(C) if fmt is not None and fmt.kind == "kivi2" else 1
    lengths = np.asarray(cache.lengths)
    sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
    full = retrieval_attention(q, cache.k_pages[0], cache.v_pages[0], bounds.layer(0),
                               cache.page_table, cache.lengths, budget=M, per_kv_head=True,
                               sinks=sinks)  # fmt: skip
    want = paged_attention_reference(q, cache.k_pages[0], cache.v_pages[0], cache.page_table,
                                     cache.lengths, sinks=sinks)  # fmt: skip
    np.testing.assert_allclose(np.asarray(full.out), np.asarray(want.out), atol=1e-5)
    np.testing.assert_allclose(np.asarray(full.lse), np.asarray(want.lse), atol=1e-5)
    budget = 1 + recent + 1
    got = jax.jit(functools.partial(retrieval_attention, budget=budget, per_kv_head=True))(
        q, cache.k_pages[0], cache.v_pages[0], bounds.layer(0), cache.page_table, cache.lengths
    )
    b0 = bounds.layer(0)
    K, G = 2, N // 2
    sets_by_head = []
    for k in range(K):
        heads = slice(k * G, (k + 1) * G)
        sets, _ = selection_oracle(q[:, :, heads], np.asarray(b0.k_min[k : k + 1]),
                                   np.asarray(b0.k_max[k : k + 1]), np.asarray(cache.page_table),
                                   lengths, C, budget, 1, recent)  # fmt: skip
        sets_by_head.append(sets)
        want_k = attention_oracle(q, cache, 0, lengths, sets)[:, :, heads]
        np.testing.assert_allclose(np.asarray(got.out[:, :, heads], np.float64), want_k, atol=2e-5)
    differ = any(a != b for a, b in zip(*sets_by_head, strict=True))
    assert differ, "the two kv heads chose the same pages everywhere: the test shows nothing"
