"""DenseMask: arbitrary static boolean masks and their OR/AND combinations, with block skipping."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.sharding import PartitionSpec as P

from ringattn import (
    BlockSizes,
    DenseMask,
    MaskSpec,
    Positions,
    attention_reference,
    blockwise_attention,
    decode_attention_per_shard,
    ring_attention_per_shard,
    sharded_attention,
    sharded_decode_attention,
)
from ringattn._blocks import EMPTY, FULL, PARTIAL, MaskIds, Summaries
from tests._util import assert_close, make_test_mesh


def _qkv(T, S, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(ks[0], (2, T, 4, 8)),
        jax.random.normal(ks[1], (2, S, 2, 8)),
        jax.random.normal(ks[2], (2, S, 2, 8)),
    )


def test_hashable_by_contents_and_combinators():
    rng = np.random.default_rng(0)
    a = rng.random((5, 7)) < 0.5
    m1, m2 = DenseMask(a), DenseMask(a.copy())
    assert m1 == m2 and hash(m1) == hash(m2)
    assert MaskSpec(dense=m1) == MaskSpec(dense=m2)
    other = DenseMask(~a)
    assert m1 != other
    np.testing.assert_array_equal((m1 | other).array, np.ones((5, 7), bool))
    np.testing.assert_array_equal((m1 & other).array, np.zeros((5, 7), bool))
    causal = DenseMask.causal(3, 3)
    assert causal.array.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    prefix = DenseMask(np.zeros((3, 3), bool)).with_block(0, 3, 0, 2)
    assert (causal | prefix).array[0].tolist() == [True, True, False]
    a[0, 0] = not a[0, 0]  # the mask copied its array
    assert m1 == m2


@pytest.mark.slow  # ~60 s of the default run on 2 cores; CI runs it with the slow tests
@settings(max_examples=8, deadline=None)
@given(
    T=st.integers(1, 14),
    S=st.integers(1, 14),
    density=st.floats(0.0, 1.0),
    with_causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 5)),
    bq=st.integers(1, 6),
    bk=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_random_masks_match_reference(T, S, density, with_causal, window, bq, bk, seed):
    rng = np.random.default_rng(seed)
    dense = DenseMask(rng.random((T, S)) < density)
    if with_causal:  # OR-combination, like splash's LogicalOr(CausalMask, NumpyMask)
        dense = dense | DenseMask.causal(T, S)
    spec = MaskSpec(dense=dense, window=window)
    q, k, v = _qkv(T, S, seed)
    pos = None  # T != S under a window needs query positions: the queries at the first ones
    if T != S and window is not None:
        pos = Positions(jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), q.shape[:2]), None)
    fast = functools.partial(
        blockwise_attention, mask=spec, block_sizes=BlockSizes(bq, bk), positions=pos
    )
    ref = functools.partial(attention_reference, mask=spec, positions=pos)
    got, want = fast(q, k, v), ref(q, k, v)
    assert_close(got.out, want.out, dtype=jnp.float32)
    np.testing.assert_array_equal(np.isneginf(got.lse), np.isneginf(want.lse))

    def loss(f, q, k, v):
        out, lse = f(q, k, v)
        return jnp.sum(jnp.sin(out)) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grads = jax.grad(functools.partial(loss, fast), argnums=(0, 1, 2))(q, k, v)
    wants = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, wants, strict=True):
        assert_close(g, w, dtype=jnp.float32, grad=True)


def test_block_classification_comes_from_the_mask():
    """Block pairs the mask hides are EMPTY (skipped), fully allowed ones FULL."""
    a = np.zeros((8, 8), bool)
    a[:4, :4] = True  # block (0, 0): full
    a[4:, 0] = True  # block (1, 0): partial
    dense = DenseMask(a)  # blocks (0, 1), (1, 1): empty
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    summ = Summaries(MaskIds(pos, pos), 4, 4, dense)
    from ringattn._heads_major import make_kernel_config

    cfg, _, _ = make_kernel_config(MaskSpec(dense=dense), 8, 8, 8, 4, 4)
    kinds = [[int(summ.kind(cfg, i, j)) for j in range(2)] for i in range(2)]
    assert kinds == [[FULL, EMPTY], [PARTIAL, EMPTY]]
    # a key hidden by the mask from every query may hold NaN
    q, k, v = _qkv(8, 8)
    k, v = k.at[:, 5].set(jnp.nan), v.at[:, 5].set(jnp.inf)
    out = blockwise_attention(q, k, v, mask=MaskSpec(dense=dense), block_sizes=BlockSizes(4, 4))
    assert np.all(np.isfinite(np.asarray(out.out)))


def test_jit_with_a_dense_mask_bound():
    dense = DenseMask.causal(6, 6) | DenseMask(np.eye(6, k=1, dtype=bool))
    q, k, v = _qkv(6, 6)
    f = jax.jit(functools.partial(blockwise_attention, mask=MaskSpec(dense=dense)))
    assert_close(
        f(q, k, v).out,
        attention_reference(q, k, v, mask=MaskSpec(dense=dense)).out,
        dtype=jnp.float32,
    )


@pytest.mark.no_typecheck
def test_errors_and_unsupported_paths():
    q, k, v = _qkv(4, 4)
    with pytest.raises(ValueError, match="DenseMask: array: expected a 2-d numpy bool"):
        DenseMask(np.zeros((4, 4), int))
    with pytest.raises(ValueError, match=r"MaskSpec: dense: expected a ringattn\.DenseMask"):
        MaskSpec(dense=np.zeros((4, 4), bool))
    with pytest.raises(ValueError, match=r"mask.dense: expected a DenseMask of shape"):
        blockwise_attention(q, k, v, mask=MaskSpec(dense=DenseMask.causal(3, 4)))
    spec = MaskSpec(dense=DenseMask.causal(4, 4))
    mesh = make_test_mesh((2,), ("s",))
    with pytest.raises(NotImplementedError, match="sharded_attention: mask: a DenseMask"):
        sharded_attention(q, k, v, mesh=mesh, seq_axis="s", mask=spec)
    with pytest.raises(NotImplementedError, match="sharded_decode_attention: mask: a DenseMask"):
        sharded_decode_attention(q, k, v, mesh=mesh, seq_axis="s", mask=spec)
    for fn in (ring_attention_per_shard, decode_attention_per_shard):
        body = lambda q, k, v, fn=fn: fn(q, k, v, seq_axis="s", mask=spec).out
        f = jax.shard_map(body, mesh=mesh, in_specs=P(None, "s"), out_specs=P(None, "s"))
        with pytest.raises(NotImplementedError, match="mask: a DenseMask"):
            jax.jit(f).lower(q, k, v)
