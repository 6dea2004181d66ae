"""Block-pair bookkeeping of the blockwise kernels: the kinds table, live ranges, visit order."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from ringattn import MaskSpec
from ringattn._blocks import (
    EMPTY,
    FULL,
    PARTIAL,
    KernelConfig,
    MaskIds,
    Summaries,
    grouped_visit_orders,
    kv_cols_blocks,
    kv_rows_blocks,
    live_range,
    rows_blocks,
    visit_order,
    visit_orders,
)


@settings(max_examples=30, deadline=None)
@given(live=st.lists(st.booleans(), min_size=1, max_size=12))
def test_live_range_spans_every_live_index(live):
    lo, hi = (int(x) for x in live_range(jnp.asarray(live)))
    idx = [i for i, x in enumerate(live) if x]
    if idx:
        assert (lo, hi) == (idx[0], idx[-1] + 1)
    else:
        assert lo == hi == 0


@settings(max_examples=40, deadline=None)
@given(kinds=st.lists(st.sampled_from([EMPTY, FULL, PARTIAL]), min_size=1, max_size=12))
def test_visit_order_lists_full_then_partial_blocks_each_once(kinds):
    for fn in (visit_order, jax.jit(visit_order)):
        order, n_full, n_live = (np.asarray(x) for x in fn(jnp.asarray(kinds, jnp.int32)))
        full = [j for j, k in enumerate(kinds) if k == FULL]
        partial = [j for j, k in enumerate(kinds) if k == PARTIAL]
        assert order.dtype == np.int32 and sorted(order.tolist()) == list(range(len(kinds)))
        assert (int(n_full), int(n_live)) == (len(full), len(full) + len(partial))
        assert order[: len(full)].tolist() == full
        assert order[len(full) : len(full) + len(partial)].tolist() == partial
        assert all(kinds[j] == EMPTY for j in order[len(full) + len(partial) :])


@settings(max_examples=20, deadline=None)
@given(
    kinds=st.integers(1, 6).flatmap(
        lambda n: st.lists(
            st.lists(st.sampled_from([EMPTY, FULL, PARTIAL]), min_size=n, max_size=n),
            min_size=1,
            max_size=5,
        )
    )
)
def test_visit_orders_is_visit_order_of_each_row_and_column(kinds):
    table = jnp.asarray(kinds, jnp.int32)  # [n_rows, n]
    for rows in (table, table.T):
        for fn in (visit_orders, jax.jit(visit_orders)):
            orders, n_fulls, n_lives = fn(rows)
            assert orders.shape == rows.shape and n_fulls.shape == n_lives.shape == rows.shape[:1]
            for r in range(rows.shape[0]):
                order, n_full, n_live = visit_order(rows[r])
                np.testing.assert_array_equal(orders[r], order)
                assert (int(n_fulls[r]), int(n_lives[r])) == (int(n_full), int(n_live))


@settings(max_examples=30, deadline=None)
@given(
    group=st.sampled_from([1, 2, 3]),
    data=st.data(),
)
def test_grouped_visit_orders_visit_every_live_pair_once(group, data):
    n_groups = data.draw(st.integers(1, 3))
    n = data.draw(st.integers(1, 6))
    cell = st.sampled_from([EMPTY, FULL, PARTIAL])
    kinds = data.draw(
        st.lists(
            st.lists(cell, min_size=n, max_size=n),
            min_size=n_groups * group,
            max_size=n_groups * group,
        )
    )
    table = jnp.asarray(kinds, jnp.int32)  # [nq, n]
    for fn in (grouped_visit_orders, jax.jit(grouped_visit_orders, static_argnums=1)):
        (shared, n_shared), (orders, n_fulls, n_lives) = fn(table, group)
        assert shared.shape == (n_groups, n) and n_shared.shape == (n_groups,)
        visits = {}  # (query block, key block) -> how it is visited
        for g in range(n_groups):
            for j in np.asarray(shared[g, : int(n_shared[g])]).tolist():
                for h in range(group):
                    assert kinds[g * group + h][j] == FULL  # shared only if full for all
                    assert (g * group + h, j) not in visits
                    visits[(g * group + h, j)] = FULL
        for i in range(n_groups * group):
            nf, nl = int(n_fulls[i]), int(n_lives[i])
            for t, j in enumerate(np.asarray(orders[i, :nl]).tolist()):
                assert (i, j) not in visits
                visits[(i, j)] = FULL if t < nf else PARTIAL
        live = {(i, j): k for i, row in enumerate(kinds) for j, k in enumerate(row) if k != EMPTY}
        assert visits == live  # every live pair once, unmasked exactly when FULL
        # A key block full for the whole group is always shared (one product for the group).
        for g in range(n_groups):
            for j in range(n):
                if all(kinds[g * group + h][j] == FULL for h in range(group)):
                    assert j in np.asarray(shared[g, : int(n_shared[g])]).tolist()


@pytest.mark.parametrize("group", [1, 2, 3])
def test_rows_blocks_stacks_groups_of_query_blocks(group):
    B, K, G, H, bq, n = 2, 3, 2, 5, 4, 2
    Tp = n * group * bq
    x = jnp.arange(B * Tp * K * G * H, dtype=jnp.float32).reshape(B, Tp, K, G, H)
    single, grouped = rows_blocks(x, bq), rows_blocks(x, bq, group)
    assert single.shape == (n * group, B, K, G * bq, H)
    assert grouped.shape == (n, B, K, group * G * bq, H)
    for i in range(n * group):  # block i: rows (head, row) of x's block, head-grouped
        blk = x[:, i * bq : (i + 1) * bq]  # [B, bq, K, G, H]
        np.testing.assert_array_equal(
            single[i], blk.transpose(0, 2, 3, 1, 4).reshape(B, K, G * bq, H)
        )
        R = G * bq
        g, h = divmod(i, group)
        np.testing.assert_array_equal(grouped[g][:, :, h * R : (h + 1) * R], single[i])


def test_kv_blocks_are_the_key_blocks_and_their_transposes():
    B, K, Sp, H, bk = 2, 3, 12, 5, 4
    x = jnp.arange(B * K * Sp * H, dtype=jnp.float32).reshape(B, K, Sp, H)
    rows, cols = kv_rows_blocks(x, bk), kv_cols_blocks(x, bk)
    assert rows.shape == (Sp // bk, B, K, bk, H) and cols.shape == (Sp // bk, B, K, H, bk)
    for j in range(Sp // bk):
        blk = x[:, :, j * bk : (j + 1) * bk]
        np.testing.assert_array_equal(rows[j], blk)
        np.testing.assert_array_equal(cols[j], jnp.swapaxes(blk, 2, 3))


@pytest.mark.parametrize(
    "mask",
    [
        MaskSpec(),
        MaskSpec(causal=True),
        MaskSpec(causal=True, window=5),
        MaskSpec(window=(3, None)),
    ],
    ids=["full", "causal", "causal-window", "head-windows"],
)
@pytest.mark.parametrize("segments", [False, True])
def test_kinds_table_matches_each_pair(mask, segments):
    B, T, S, bq, bk = 2, 24, 20, 4, 8
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    kv_pos = jnp.broadcast_to(jnp.arange(S + 4, dtype=jnp.int32), (B, S + 4))  # padded to 24
    q_seg = kv_seg = None
    if segments:
        q_seg = jnp.asarray(np.repeat([[0, 1, 1, 2]], 6, axis=1).repeat(B, 0), jnp.int32)
        kv_seg = jnp.asarray(np.repeat([[0, 0, 1, 2]], 6, axis=1).repeat(B, 0), jnp.int32)
    windows = None
    if mask.per_head:
        windows = jnp.asarray([[[3], [0]]] * B, jnp.int32)  # [B, K=2, G=1]
    cfg = KernelConfig(mask=mask, scale=1.0, block_q=bq, block_kv=bk, kv_len=S)
    summ = Summaries(MaskIds(q_pos, kv_pos, q_seg, kv_seg, windows), bq, bk, None)
    nq, nk = T // bq, (S + 4) // bk
    table = np.asarray(summ.kinds(cfg, nq, nk))
    assert table.shape == (nq, nk)
    for i in range(nq):
        for j in range(nk):
            assert table[i, j] == int(summ.kind(cfg, i, j)), (i, j)
    if mask.causal:
        assert (table == EMPTY).any()  # something to skip
