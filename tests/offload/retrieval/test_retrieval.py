"""Query-aware retrieval from pinned host: most pages demoted (their device copies scrubbed
with NaN), their bounds kept on the device; full budget equals paged_attention_reference,
a partial budget equals paged.retrieval_attention over the same pages all on the device, only
the selected host pages are fetched and the bytes are counted."""

import jax.numpy as jnp
import numpy as np
import pytest

import paged
from offload import OffloadStats, make_host_page_pool, page_out, wait
from offload.retrieval import fetch_selected_pages, retrieval_decode_attention, with_host_bounds
from tests.paged._retrieval_util import make_cache

N = 4


def demoted_setup(kind, seed=0, C=4, M=6):
    """A cache, its bounds, and the same pages with every live page but the first and the
    last two of each row moved to a host pool (device copies scrubbed)."""
    rng = np.random.default_rng(seed)
    cache = make_cache(kind, rng, C=C, M=M, lengths=[1, C + 1, 3 * C, M * C - 1, M * C, 4 * C + 2])
    bounds = paged.page_key_bounds(cache)
    table, lengths = np.asarray(cache.page_table), np.asarray(cache.lengths)
    host_table = np.full(table.shape, -1, np.int32)
    device_table = table.copy()
    ids = []
    for b in range(table.shape[0]):
        n = -(-lengths[b] // C)
        for j in range(1, n - 2):
            host_table[b, j] = len(ids)
            device_table[b, j] = 0
            ids.append(int(table[b, j]))
    assert len(ids) >= 8
    slots = np.arange(len(ids), dtype=np.int32)
    host = make_host_page_pool(cache.k_pages, cache.v_pages, len(ids) + 2)
    host = wait(page_out(cache.k_pages, cache.v_pages, ids, host, slots))
    host_bounds = with_host_bounds(bounds, ids, slots, num_slots=host.num_slots)
    k, v = cache.k_pages, cache.v_pages
    if kind == "float32":  # the device copies are gone: NaN where they were
        k, v = k.at[:, :, np.asarray(ids)].set(jnp.nan), v.at[:, :, np.asarray(ids)].set(jnp.nan)
    elif kind == "int8":
        scrub = lambda p: paged.QuantizedPages(p.data, p.scale.at[:, :, np.asarray(ids)].set(jnp.nan), p.format)  # fmt: skip
        k, v = scrub(k), scrub(v)
    q = jnp.asarray(rng.standard_normal((table.shape[0], 1, N, 8)), jnp.float32)
    return cache, bounds, k, v, jnp.asarray(device_table), host, host_bounds, host_table, q


@pytest.mark.parametrize("kind", ["float32", "int8", "int4", "kivi2"])
def test_full_budget_over_both_tiers_equals_the_reference(kind):
    cache, bounds, k, v, device_table, host, host_bounds, host_table, q = demoted_setup(kind)
    stats = OffloadStats()
    M = cache.page_table.shape[1]
    for layer in range(2):
        want = paged.paged_attention_reference(
            q, cache.k_pages[layer], cache.v_pages[layer], cache.page_table, cache.lengths
        )
        res = retrieval_decode_attention(
            q, k[layer], v[layer], bounds.layer(layer), device_table, host,
            host_bounds.layer(layer), jnp.asarray(host_table), cache.lengths,
            layer=layer, budget=M, stats=stats,
        )  # fmt: skip
        assert np.isfinite(np.asarray(res.out)).all(), "a scrubbed device copy was read"
        np.testing.assert_allclose(np.asarray(res.out), np.asarray(want.out), atol=1e-5)
        np.testing.assert_allclose(np.asarray(res.lse), np.asarray(want.lse), atol=1e-5)
        assert res.fetched_pages == int((host_table >= 0).sum())  # every host page
    totals = stats.transfers("host_to_device")
    assert totals.count == 2 and totals.in_flight == 0
    per_page = host.page_nbytes // 2  # one layer's keys and values
    assert totals.nbytes == 2 * 16 * per_page  # 1 + 12 pages padded to 16, per layer


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_partial_budget_fetches_only_the_selected_host_pages(kind):
    cache, bounds, k, v, device_table, host, host_bounds, host_table, q = demoted_setup(kind, 1)
    budget = 3
    for layer in range(2):
        want = paged.retrieval_attention(
            q, cache.k_pages[layer], cache.v_pages[layer], bounds.layer(layer), cache.page_table,
            cache.lengths, budget=budget,
        )  # fmt: skip
        sel = paged.select_pages_by_query(q, bounds.layer(layer), cache.page_table, cache.lengths,
                                          page_size=4, budget=budget)  # fmt: skip
        res = retrieval_decode_attention(
            q, k[layer], v[layer], bounds.layer(layer), device_table, host,
            host_bounds.layer(layer), jnp.asarray(host_table), cache.lengths,
            layer=layer, budget=budget,
        )  # fmt: skip
        np.testing.assert_allclose(np.asarray(res.out), np.asarray(want.out), atol=1e-5)
        np.testing.assert_array_equal(np.asarray(res.read_pages), np.asarray(sel.count))
        M = host_table.shape[1]
        slots = np.asarray(sel.slots)
        chosen = [host_table[b, s] for b in range(slots.shape[0]) for s in slots[b] if s < M]
        assert res.fetched_pages == len({s for s in chosen if s >= 0}) < (host_table >= 0).sum()


def test_fetch_stages_each_distinct_slot_once_and_checks():
    cache, _, _, _, _, host, _, _, _ = demoted_setup("float32", 2)
    staged = fetch_selected_pages(host, np.array([[5, -1, 2], [2, 7, -1]]), layer=1)
    assert staged.table.tolist() == [[2, 0, 1], [1, 3, 0]] and staged.num_pages == 3
    got = np.asarray(staged.k_pages)  # [K, 4, C, H]: dummy, slots 2, 5, 7
    want = np.asarray(host.k_pages[1])[:, [2, 5, 7]]
    np.testing.assert_array_equal(got[:, 1:], want)
    with pytest.raises(ValueError, match=r"host_table: expected host slots in \[-1, "):
        fetch_selected_pages(host, np.array([[host.num_slots]]), layer=0)
    with pytest.raises(ValueError, match="host_bounds: expected host_bounds or num_slots"):
        with_host_bounds(paged.page_key_bounds(cache), [1], [0])
    with pytest.raises(ValueError, match="host_slots: expected 1 slots"):
        with_host_bounds(paged.page_key_bounds(cache), [1], [0, 1], num_slots=4)


def test_a_policy_in_retrieve_mode_feeds_the_retrieval_decode():
    """select_keep(mode="retrieve") -> page out the retrieved pages with their bounds -> the
    decode reads the kept pages in place and any retrieved page its query selects."""
    from offload import RetentionPolicy, init_policy_state, select_keep

    rng = np.random.default_rng(4)
    C = 4
    cache = make_cache("float32", rng, C=C, M=6, lengths=[6 * C, 5 * C - 1, 3 * C + 2])
    bounds = paged.page_key_bounds(cache)
    policy = RetentionPolicy("recency", 0.3, page_size=C)
    sel = select_keep(init_policy_state(3, 6, policy=policy), cache.lengths, policy=policy,
                      page_table=cache.page_table, mode="retrieve")  # fmt: skip
    retrieve = np.asarray(sel.retrieve)
    assert retrieve.any() and not np.asarray(sel.demote | sel.drop).any()
    table = np.asarray(cache.page_table)
    ids = table[retrieve]
    slots = np.arange(ids.size, dtype=np.int32)
    host = make_host_page_pool(cache.k_pages, cache.v_pages, ids.size)
    host = wait(page_out(cache.k_pages, cache.v_pages, ids, host, slots))
    host_bounds = with_host_bounds(bounds, ids, slots, num_slots=ids.size)
    host_table = np.full(table.shape, -1, np.int32)
    host_table[retrieve] = slots
    device_table = jnp.asarray(np.where(retrieve, 0, table))
    k = cache.k_pages.at[:, :, ids].set(jnp.nan)  # the device copies are freed
    q = jnp.asarray(rng.standard_normal((3, 1, N, 8)), jnp.float32)
    for budget in (6, 2):
        res = retrieval_decode_attention(
            q, k[1], cache.v_pages[1], bounds.layer(1), device_table, host,
            host_bounds.layer(1), jnp.asarray(host_table), cache.lengths, layer=1, budget=budget,
        )  # fmt: skip
        want = paged.retrieval_attention(q, cache.k_pages[1], cache.v_pages[1], bounds.layer(1),
                                         cache.page_table, cache.lengths, budget=budget)  # fmt: skip
        np.testing.assert_allclose(np.asarray(res.out), np.asarray(want.out), atol=1e-5)


def _per_layer_host(cache, host, host_table):
    """A per-layer host pool (as a 0.3 cache's LayerPools make) holding the pages ``host``
    holds, at the same slots."""
    import jax

    table = np.asarray(cache.page_table)
    where = np.argwhere(host_table >= 0)
    slots = np.array([host_table[b, j] for b, j in where], np.int32)
    ids = np.array([table[b, j] for b, j in where], np.int32)
    L = cache.k_pages.shape[0]
    split = lambda x: paged.LayerPools([jax.tree.map(lambda a, i=i: a[i], x) for i in range(L)])  # fmt: skip
    kp, vp = split(cache.k_pages), split(cache.v_pages)
    out = wait(page_out(kp, vp, ids, make_host_page_pool(kp, vp, host.num_slots), slots))
    assert isinstance(out.k_pages, paged.LayerPools)
    return out


@pytest.mark.parametrize("kind", ["float32", "int8", "int4", "kivi2"])
@pytest.mark.parametrize("budget", [3, 6])
def test_in_program_retrieval_equals_the_host_orchestrated_one(kind, budget):
    """retrieval_decode_attention_jit under jax.jit (the selected host pages read by the
    program from the per-layer host pool) gives the outputs, log-sum-exps and pages read of
    retrieval_decode_attention (the fetch orchestrated from the host), never reads a scrubbed
    device copy, and counts one copied page per selected host entry."""
    import functools

    import jax

    from offload.retrieval import retrieval_decode_attention_jit

    cache, bounds, k, v, device_table, host, host_bounds, host_table, q = demoted_setup(kind, 2)
    layers = _per_layer_host(cache, host, host_table)  # the same pages, one buffer per layer
    step = jax.jit(functools.partial(retrieval_decode_attention_jit, budget=budget))
    per_page = host.page_nbytes // 2  # one layer's keys and values
    for layer in range(2):
        want = retrieval_decode_attention(
            q, k[layer], v[layer], bounds.layer(layer), device_table, host,
            host_bounds.layer(layer), jnp.asarray(host_table), cache.lengths,
            layer=layer, budget=budget,
        )  # fmt: skip
        got = step(
            q, k[layer], v[layer], bounds.layer(layer), device_table, layers.k_pages[layer],
            layers.v_pages[layer], host_bounds.layer(layer), jnp.asarray(host_table), cache.lengths,
        )  # fmt: skip
        assert np.isfinite(np.asarray(got.out)).all(), "a scrubbed device copy was read"
        np.testing.assert_allclose(np.asarray(got.out), np.asarray(want.out), atol=1e-6)
        np.testing.assert_allclose(np.asarray(got.lse), np.asarray(want.lse), atol=1e-6)
        np.testing.assert_array_equal(np.asarray(got.read_pages), np.asarray(want.read_pages))
        # Rows here select distinct host pages, so entries copied = distinct pages fetched.
        assert int(got.fetched_pages) == want.fetched_pages > 0
        assert int(got.fetched_bytes) == want.fetched_pages * per_page


@pytest.mark.no_typecheck
def test_in_program_retrieval_refuses_a_stacked_host_pool():
    from offload.retrieval import retrieval_decode_attention_jit

    cache, bounds, k, v, device_table, host, host_bounds, host_table, q = demoted_setup("float32")
    stacked = host.k_pages  # [L, K, P_host, C, H]
    with pytest.raises(ValueError, match=r"host_k_pages: expected one layer's host pool"):
        retrieval_decode_attention_jit(
            q, k[0], v[0], bounds.layer(0), device_table, stacked, stacked,
            host_bounds.layer(0), jnp.asarray(host_table), cache.lengths, budget=3,
        )  # fmt: skip
