"""Retention over pages shared between rows (prefix cache): a page kept by one row stays
readable for every row that holds it, whatever the other rows' policies evict."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import paged
from offload import (
    POLICY_KINDS,
    OffloadManager,
    RetentionPolicy,
    init_policy_state,
    keep_shared_pages,
    make_host_page_pool,
    make_staging_pool,
    mixed_residency_attention,
    select_keep,
    select_keep_reference,
    split_residency,
    staging_table,
    update_policy_state,
)
from tests._util import assert_close

C, K, N, H = 4, 1, 2, 8
LEN_A, LEN_B = 20, 32  # 5 and 8 pages; the first 4 are shared through the prefix cache

POLICIES = {
    "recency": RetentionPolicy("recency", 0.5, page_size=C),
    "streaming": RetentionPolicy("streaming", 0.5, page_size=C, sink=1),
    "h2o": RetentionPolicy("h2o", 0.5, page_size=C),
    "snapkv": RetentionPolicy("snapkv", 0.5, page_size=C, recent=1),
    "tova": RetentionPolicy("tova", 0.5, page_size=C),
    "scissorhands": RetentionPolicy("scissorhands", 0.5, page_size=C),
}
assert set(POLICIES) == set(POLICY_KINDS)


def _shared_batch():
    """Two rows admitted through a PageAllocator: row b hits row a's cached 16-token prefix."""
    alloc = paged.PageAllocator(32, C, max_pages_per_seq=8)
    prompt_a = np.arange(LEN_A) + 100
    prompt_b = np.concatenate([prompt_a[:16], np.arange(LEN_B - 16) + 500])
    alloc.admit("a", prompt_a)
    alloc.commit("a")
    assert alloc.admit("b", prompt_b).num_cached_tokens == 16
    table = alloc.page_table(["a", "b"])
    assert (table[0, :4] == table[1, :4]).all() and (table[0, :4] > 0).all()
    return alloc, table


def _state(policy, B, M):
    # Row a's attention is on the shared pages 0-3, row b's on its own pages 4-7: the scored
    # kinds then disagree about the shared pages, like the score-free ones (row a's recent
    # window covers shared pages, row b's does not).
    mass = np.zeros((B, N, M), np.float32)
    mass[0, :, :5] = [5.0, 4.0, 3.0, 2.0, 0.5]
    mass[1, :, :8] = [0.1, 0.2, 0.1, 0.2, 3.0, 4.0, 5.0, 6.0]
    return update_policy_state(init_policy_state(B, M, policy=policy), jnp.asarray(mass),
                               policy=policy)  # fmt: skip


def _evicted(sel):
    return np.asarray(sel.demote | sel.drop)


@pytest.mark.parametrize("mode", ["drop", "demote"])
@pytest.mark.parametrize("kind", POLICY_KINDS)
def test_shared_prefix_rows_read_only_clean_kept_pages(kind, mode):
    policy = POLICIES[kind]
    alloc, table = _shared_batch()
    B, M = table.shape
    lengths = jnp.asarray([LEN_A, LEN_B], jnp.int32)
    state = _state(policy, B, M)
    # Each row alone (the per-row choice): the policies disagree about a shared page.
    alone = [
        select_keep(jax.tree.map(lambda x, b=b: x[b : b + 1], state), lengths[b : b + 1],
                    policy=policy, page_table=jnp.asarray(table[b : b + 1]), mode=mode)
        for b in range(B)
    ]  # fmt: skip
    kept_a = set(table[0][np.asarray(alone[0].keep[0])].tolist())
    evicted_b = set(table[1][_evicted(alone[1])[0]].tolist())
    assert kept_a & evicted_b, "the case must put a shared page in conflict"

    sel = select_keep(state, lengths, policy=policy, page_table=jnp.asarray(table), mode=mode)
    keep = np.asarray(sel.keep)
    for b in range(B):  # no row loses a page it chose
        assert (keep[b] | ~np.asarray(alone[b].keep[0])).all()
    kept_ids = set(table[keep].tolist())
    evicted_ids = np.unique(table[_evicted(sel)]).astype(np.int32)
    assert not kept_ids & set(evicted_ids.tolist()), "an evicted page is still kept by a row"

    kk, kv, kq = jax.random.split(jax.random.key(0), 3)
    k_pages = jax.random.normal(kk, (K, 32, C, H))
    v_pages = jax.random.normal(kv, (K, 32, C, H))
    q = jax.random.normal(kq, (B, 1, N, H))
    # Scrub every evicted page: a row still reading one would get NaN.
    k_dev = k_pages.at[:, evicted_ids].set(jnp.nan)
    v_dev = v_pages.at[:, evicted_ids].set(jnp.nan)
    device_table, cold_table = split_residency(jnp.asarray(table), sel.keep, sel.demote)
    if mode == "drop":
        res = mixed_residency_attention(q, k_dev, v_dev, device_table, lengths)
        reference_table = np.where(keep, table, 0)
    else:
        ids, stage_table = staging_table(cold_table)
        assert set(ids.tolist()) == set(evicted_ids.tolist())
        manager = OffloadManager(make_host_page_pool(k_pages, v_pages, len(ids)))
        manager.wait(manager.page_out(k_pages, v_pages, ids, request_id="r"))
        stage_k, stage_v = make_staging_pool(k_pages, v_pages, len(ids))
        back = manager.page_in(stage_k, stage_v, np.arange(1, len(ids) + 1), request_id="r")
        stage_k, stage_v = manager.wait(back)
        res = mixed_residency_attention(
            q, k_dev, v_dev, device_table, lengths, cold_table=jnp.asarray(stage_table),
            cold_k_pages=stage_k, cold_v_pages=stage_v,
        )  # fmt: skip
        reference_table = table  # every page read: kept ones on device, the rest fetched
    # Traced, the reference masks the null (dropped) slots as documented; eagerly it would
    # reject them as pages the caller forgot to reserve.
    want = jax.jit(paged.paged_attention_reference)(q, k_pages, v_pages, reference_table, lengths).out  # fmt: skip
    assert_close(res.out, want, dtype=jnp.float32, what=f"{kind} {mode}")


def test_split_residency_keeps_a_page_another_row_keeps():
    table = jnp.array([[3, 5, 0], [3, 5, 7]])
    keep = jnp.array([[True, False, False], [False, False, True]])
    demote = jnp.array([[False, True, False], [True, True, False]])
    device, cold = split_residency(table, keep, demote)
    assert device.tolist() == [[3, 0, 0], [3, 0, 7]]
    assert cold.tolist() == [[0, 5, 0], [0, 5, 0]]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_keep_shared_pages_matches_a_loop(data):
    B = data.draw(st.integers(1, 4))
    M = data.draw(st.integers(1, 6))
    table = np.array(data.draw(st.lists(st.integers(0, 5), min_size=B * M, max_size=B * M)))
    table = table.reshape(B, M).astype(np.int32)
    keep = np.array(data.draw(st.lists(st.booleans(), min_size=B * M, max_size=B * M)))
    keep = keep.reshape(B, M)
    got = np.asarray(jax.jit(keep_shared_pages)(jnp.asarray(table), jnp.asarray(keep)))
    kept_ids = {int(p) for p in table[keep]} - {0}
    want = keep | np.isin(table, list(kept_ids))
    np.testing.assert_array_equal(got, want)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_select_keep_with_shared_pages_matches_reference(data):
    kind = data.draw(st.sampled_from(POLICY_KINDS))
    policy = POLICIES[kind]
    B, M = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6))
    table = np.array(data.draw(st.lists(st.integers(0, 6), min_size=B * M, max_size=B * M)))
    table = table.reshape(B, M).astype(np.int32)
    lengths = np.array(data.draw(st.lists(st.integers(0, M * C), min_size=B, max_size=B)))
    # No subnormal scores: XLA:CPU flushes them to zero (numpy does not), which reorders ties
    # between the jitted selection and the numpy reference (1.4e-45 against 0.0 failed here).
    scores = st.floats(0, 4, allow_subnormal=False, width=32)
    scores = np.array(data.draw(st.lists(scores, min_size=B * M, max_size=B * M)))
    scores = scores.reshape(B, M).astype(np.float32)
    mode = data.draw(st.sampled_from(["drop", "demote"]))
    sel = select_keep(init_policy_state(B, M, policy=policy)._replace(scores=jnp.asarray(scores)),
                      jnp.asarray(lengths, jnp.int32), policy=policy,
                      page_table=jnp.asarray(table), mode=mode)  # fmt: skip
    ref = select_keep_reference(scores, lengths, policy=policy, page_table=table, mode=mode)
    for got, want in zip(sel, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.no_typecheck
def test_keep_shared_pages_errors():
    with pytest.raises(ValueError, match="keep_shared_pages: keep: expected bool"):
        keep_shared_pages(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="keep_shared_pages: page_table: expected"):
        keep_shared_pages(jnp.zeros((2, 3)), jnp.zeros((2, 3), bool))


@pytest.mark.no_typecheck
def test_staging_table():
    ids, table = staging_table(np.array([[0, 9, 4], [0, 9, 0]]))
    assert ids.tolist() == [4, 9] and table.tolist() == [[0, 2, 1], [0, 2, 0]]
    ids, table = staging_table(np.array([[7]]))
    assert ids.tolist() == [7] and table.tolist() == [[1]]
    ids, table = staging_table(np.zeros((2, 2), np.int32))
    assert ids.size == 0 and table.tolist() == [[0, 0], [0, 0]]
    with pytest.raises(ValueError, match="staging_table: cold_table: expected page ids >= 0"):
        staging_table(np.array([[-1]]))
