"""Keys no query may see have no effect: NaN/inf there reaches no output and no gradient.

Every path (reference, blockwise, ring, each sharded strategy, both decode functions) is run
twice: on clean inputs and on inputs whose hidden keys and values hold NaN and inf. Outputs
and all gradients must be finite and identical, and the hidden keys' gradients zero.
"""

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
    Positions,
    SegmentIds,
    attention_reference,
    blockwise_attention,
    decode_attention_per_shard,
    ring_attention_per_shard,
    sharded_attention,
    sharded_decode_attention,
)
from tests._util import make_test_mesh

B, L, N, K, H = 2, 16, 4, 2, 8


def _poison(x, hidden):
    """NaN in the first half of the head dim, inf in the second, at hidden keys."""
    bad = jnp.concatenate(
        [
            jnp.full((*x.shape[:-1], x.shape[-1] // 2), jnp.nan),
            jnp.full((*x.shape[:-1], x.shape[-1] - x.shape[-1] // 2), jnp.inf),
        ],
        -1,
    )
    return jnp.where(hidden[:, :, None, None], bad.astype(x.dtype), x)


def _check(attend, q, k, v, hidden, *, sinks=None):
    """``attend(q, k, v, sinks) -> (out, lse)``: clean and poisoned runs agree exactly."""

    def loss(q, k, v, sinks):
        out, lse = attend(q, k, v, sinks)
        weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return jnp.sum(out * weights) + 0.3 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (
            out,
            lse,
        )

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    sinks = jnp.zeros((q.shape[2],)) if sinks is None else sinks
    (_, clean), clean_grads = run(q, k, v, sinks)
    (_, dirty), dirty_grads = run(q, _poison(k, hidden), _poison(v, hidden), sinks)
    for name, a, b in zip(("out", "lse"), clean, dirty, strict=True):
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b), err_msg=name)
        np.testing.assert_allclose(
            np.where(np.isfinite(a), a, 0), np.where(np.isfinite(b), b, 0), atol=1e-6, err_msg=name
        )
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), clean_grads, dirty_grads, strict=True):
        assert np.all(np.isfinite(np.asarray(b))), f"{name}: non-finite gradient"
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, err_msg=name)
    for name, g in zip(("dk", "dv"), dirty_grads[1:3], strict=True):
        assert not np.asarray(g)[np.asarray(hidden)].any(), f"{name} at hidden keys"


def _qkv(T=L, S=L, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(ks[0], (B, T, N, H)),
        jax.random.normal(ks[1], (B, S, K, H)),
        jax.random.normal(ks[2], (B, S, K, H)),
    )


def _hidden_setup():
    """Segments, positions and a mask hiding three kinds of keys from every query.

    Queries sit at positions ``0 .. L/2`` (each twice), keys at ``0 .. L - 1``: with causal,
    keys at positions ``> L/2`` are in every query's future; key segment 9 exists in no query;
    with a window of 4, key 0 is outside every window (the smallest query position is 0, so
    it is not: we hide key 0 and 1 through segment 9 instead).
    """
    q_pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32) // 2 + 2, (B, L))
    kv_pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    kv_seg = np.zeros((B, L), np.int32)
    kv_seg[:, 3] = 9
    kv_seg[1, 5] = 9
    seg = SegmentIds(jnp.zeros((B, L), jnp.int32), jnp.asarray(kv_seg))
    # hidden: the future (kv_pos > max q_pos = 9), segment 9, outside window 6 of the
    # smallest query position 2 (none: 2 - 6 < 0), so window hides nothing globally.
    hidden = (np.asarray(kv_pos) > 9) | (kv_seg == 9)
    return Positions(q_pos, kv_pos), seg, jnp.asarray(hidden)


OPTIONS = dict(causal=True, window=(None, 6, 3, None))


@pytest.mark.parametrize("fn", ["reference", "blockwise"])
def test_single_device(fn):
    pos, seg, hidden = _hidden_setup()
    q, k, v = _qkv()
    impl = attention_reference
    if fn == "blockwise":
        impl = functools.partial(blockwise_attention, block_sizes=BlockSizes(4, 4))
    attend = lambda q, k, v, s: impl(q, k, v, positions=pos, segment_ids=seg, sinks=s, **OPTIONS)
    _check(attend, q, k, v, hidden, sinks=jnp.asarray([0.0, 1.0, -1.0, 0.5]))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring(layout):
    pos, seg, hidden = _hidden_setup()
    q, k, v = _qkv()
    mesh = make_test_mesh((4,), ("seq",))
    # Natural order inputs; the ring takes explicit global positions, so no permutation is
    # needed for the guarantee (the layout only sets block sizes and default positions).
    ring = functools.partial(
        ring_attention_per_shard,
        seq_axis="seq",
        layout=layout,
        block_sizes=BlockSizes(2, 2),
        **OPTIONS,
    )

    def body(q, k, v, qp, kp, qs, ks, s):
        return tuple(
            ring(q, k, v, positions=Positions(qp, kp), segment_ids=SegmentIds(qs, ks), sinks=s)
        )

    spec = P(None, "seq")
    f = jax.shard_map(
        body, mesh=mesh, in_specs=(spec,) * 7 + (P(),), out_specs=(spec, spec), check_vma=True
    )
    attend = lambda q, k, v, s: f(q, k, v, pos.q, pos.kv, seg.q, seg.kv, s)
    _check(attend, q, k, v, hidden)


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_sharded(strategy):
    pos, seg, hidden = _hidden_setup()
    q, k, v = _qkv()
    mesh = make_test_mesh((2,), ("s",))
    attend = lambda q, k, v, s: sharded_attention(
        q,
        k,
        v,
        mesh=mesh,
        seq_axis="s",
        strategy=strategy,
        positions=pos,
        segment_ids=seg,
        sinks=s,
        block_sizes=BlockSizes(4, 4),
        **OPTIONS,
    )
    _check(attend, q, k, v, hidden)


def test_decode_slots_beyond_lengths():
    """Per-shard lengths and the global-array decode: slots beyond lengths hold NaN/inf."""
    n, C, T = 4, 8, 2
    q, k, v = _qkv(T=T, S=n * C)
    lengths = jnp.asarray([[8, 3], [8, 0], [2, 0], [0, 0]], jnp.int32)  # [n, B] per shard
    hidden = np.ones((B, n * C), bool)
    for i in range(n):
        for b in range(B):
            hidden[b, i * C : i * C + int(lengths[i, b])] = False
    mesh = make_test_mesh((n,), ("x",))

    def body(q, k, v, lengths, s):
        return tuple(
            decode_attention_per_shard(
                q, k, v, seq_axis="x", lengths=lengths[0], sinks=s, **OPTIONS
            )
        )

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(None, "x"), P(None, "x"), P("x"), P()),
        out_specs=(P(), P()),
        check_vma=True,
    )
    _check(lambda q, k, v, s: f(q, k, v, lengths, s), q, k, v, jnp.asarray(hidden))

    total = jnp.asarray([19, 3], jnp.int32)  # global lengths, the cache filled in order
    hidden = np.arange(n * C)[None] >= np.asarray(total)[:, None]
    attend = lambda q, k, v, s: sharded_decode_attention(
        q, k, v, mesh=mesh, seq_axis="x", lengths=total, sinks=s, **OPTIONS
    )
    _check(attend, q, k, v, jnp.asarray(hidden))


@pytest.mark.slow  # ~60 s of the default run on 2 cores; CI runs it with the slow tests
@settings(max_examples=8, deadline=None)
@given(
    T=st.integers(1, 12),
    S=st.integers(1, 12),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 6)),
    n_segments=st.integers(1, 3),
    bq=st.integers(1, 5),
    bk=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_random_hidden_keys(T, S, causal, window, n_segments, bq, bk, seed):
    """Any mask: every key that no query sees (computed from the oracle's own mask) may be
    poisoned without changing the blockwise kernel's or the reference's results."""
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(T, S, seed)
    pos = Positions(
        jnp.asarray(np.sort(rng.integers(0, 12, (B, T)), 1), jnp.int32),
        jnp.asarray(np.sort(rng.integers(0, 12, (B, S)), 1), jnp.int32),
    )
    seg = SegmentIds(
        jnp.asarray(rng.integers(0, n_segments, (B, T)), jnp.int32),
        jnp.asarray(rng.integers(0, n_segments + 1, (B, S)), jnp.int32),
    )
    qp, kp = np.asarray(pos.q)[:, :, None], np.asarray(pos.kv)[:, None, :]
    seen = np.asarray(seg.q)[:, :, None] == np.asarray(seg.kv)[:, None, :]
    if causal:
        seen &= kp <= qp
    if window is not None:
        seen &= kp > qp - window
    hidden = jnp.asarray(~seen.any(axis=1))
    for impl in (
        attention_reference,
        functools.partial(blockwise_attention, block_sizes=BlockSizes(bq, bk)),
    ):
        attend = lambda q, k, v, s, impl=impl: impl(
            q, k, v, causal=causal, window=window, positions=pos, segment_ids=seg, sinks=s
        )
        _check(attend, q, k, v, hidden)
