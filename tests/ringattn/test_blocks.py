"""Block-pair bookkeeping of the blockwise kernels: the kinds table, live ranges, visit order."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from ringattn import MaskSpec
from ringattn._blocks import EMPTY, FULL, PARTIAL, KernelConfig, Summaries, live_range, visit_order


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
    summ = Summaries(q_pos, kv_pos, q_seg, kv_seg, bq, bk, windows, None)
    nq, nk = T // bq, (S + 4) // bk
    table = np.asarray(summ.kinds(cfg, nq, nk))
    assert table.shape == (nq, nk)
    for i in range(nq):
        for j in range(nk):
            assert table[i, j] == int(summ.kind(cfg, i, j)), (i, j)
    if mask.causal:
        assert (table == EMPTY).any()  # something to skip
