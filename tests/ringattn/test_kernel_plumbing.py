"""Plumbing between the kernels and their callers: vmap folded into the batch axis (with the
batch axis elsewhere than 0 in block-major layouts), the ring's one-buffer hop packing, and the
forward's query groups (on ring hops: tests/ringattn/test_ring.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringattn import (
    BlockSizes,
    DenseMask,
    MaskSpec,
    Positions,
    SegmentIds,
    attention_reference,
    blockwise_attention,
)
from ringattn._batching import fold_vmap
from ringattn._ring_hops import _pack, _unpack


def _kernel(blocks, x, y):
    """Batch-polymorphic: ``blocks [n, B, m]`` (B at axis 1), ``x [B, m]``, ``y [B]`` or None.

    Returns ``([n, B, m], [B])``: each row depends on its own batch row only.
    """
    extra = 0.0 if y is None else y[None, :, None]
    return blocks * x[None] + extra, jnp.sum(blocks, axis=(0, 2)) * jnp.sum(x, axis=1)


@pytest.mark.parametrize("with_y", [False, True])
@pytest.mark.parametrize("mapped", ["all", "blocks only", "x only"])
def test_fold_vmap_with_batch_axes_matches_plain_vmap(with_y, mapped):
    V, n, B, m = 3, 4, 2, 5
    rng = np.random.default_rng(0)
    blocks = jnp.asarray(rng.standard_normal((V, n, B, m)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((V, B, m)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((V, B)), jnp.float32) if with_y else None
    in_axes = {"all": (0, 0, 0), "blocks only": (0, None, None), "x only": (None, 0, 0)}[mapped]
    if mapped == "blocks only":
        x, y = x[0], None if y is None else y[0]
    if mapped == "x only":
        blocks = blocks[0]
    if y is None:
        in_axes = (*in_axes[:2], None)
    folded = fold_vmap(_kernel, in_axes=(1, 0, 0), out_axes=(1, 0))
    got = jax.jit(jax.vmap(folded, in_axes=in_axes))(blocks, x, y)
    want = jax.vmap(_kernel, in_axes=in_axes)(blocks, x, y)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    # Unmapped, the folded kernel is the kernel itself.
    one = (blocks if blocks.ndim == 3 else blocks[0], x if x.ndim == 2 else x[0], None)
    for g, w in zip(folded(*one), _kernel(*one), strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize(
    "dtypes",
    [
        (jnp.float32, jnp.float32, jnp.int32, jnp.int32),
        (jnp.bfloat16, jnp.bfloat16, jnp.int32, None),
        (jnp.int8, jnp.float32, jnp.int8, jnp.float32, jnp.int32, jnp.int32),
        (jnp.float8_e4m3fn, jnp.float32, jnp.float8_e4m3fn, jnp.float32, jnp.int32, None),
    ],
    ids=["f32", "bf16", "int8-hops", "fp8-hops"],
)
def test_hop_packing_round_trips_bitwise(dtypes):
    rng = np.random.default_rng(1)
    arrays = []
    for i, dt in enumerate(dtypes):
        if dt is None:
            arrays.append(None)
            continue
        shape = (2, 3, 5) if i % 2 == 0 else (2, 7)
        if dt == jnp.int32:  # every 16-bit half pattern a bfloat16 NaN could take, and more
            halves = np.array([0x7F81, 0x7FFF, 0xFF81, 0xFFC1, 0x0001, 0x7F80], np.uint32)
            x = (halves[rng.integers(0, 6, shape)] << 16) | halves[rng.integers(0, 6, shape)]
            arrays.append(jnp.asarray(x.view(np.int32)))
            continue
        if jnp.issubdtype(dt, jnp.integer):
            info = jnp.iinfo(dt)
            x = rng.integers(info.min, info.max, size=shape, endpoint=True).astype(dt)
        else:
            x = rng.standard_normal(shape).astype(np.float32)
            x.reshape(-1)[0] = np.nan  # any bit pattern survives, NaN included
        arrays.append(jnp.asarray(x, dt))
    narrowest = min(np.dtype(a.dtype).itemsize for a in arrays if a is not None)
    # The bug the integer buffer avoids: a bfloat16 concatenate canonicalizes NaN payloads.
    for fn in (lambda a: _unpack(*_pack(a)), jax.jit(lambda a: _unpack(*_pack(a)))):
        buffer, _ = _pack(arrays)
        assert buffer.ndim == 1 and np.dtype(buffer.dtype).itemsize == narrowest
        assert jnp.issubdtype(buffer.dtype, jnp.unsignedinteger)
        back = fn(arrays)
        assert len(back) == len(arrays)
        for a, b in zip(arrays, back, strict=True):
            if a is None:
                assert b is None
                continue
            assert b.shape == a.shape and b.dtype == a.dtype
            np.testing.assert_array_equal(
                jax.lax.bitcast_convert_type(b, jnp.uint8),
                jax.lax.bitcast_convert_type(a, jnp.uint8),
            )


# ---- the forward's query groups: two query blocks in one product where a key block is full ----


# Paired from MIN_GROUPED_Q_BLOCKS (32) even blocks on; odd counts and fewer blocks: single.
@pytest.mark.parametrize("nq", [1, 2, 31, 32, 34])
@pytest.mark.parametrize("G", [1, 2])  # rows of a group ordered (block, head, row)
@pytest.mark.parametrize("mask", ["causal", "window", "segments", "dense"])
def test_forward_query_groups_match_reference(nq, G, mask):
    """Groups whose blocks see a key block differently (full for one, partial or empty for
    the other) visit it per block; every live pair is folded exactly once, in every row
    order, and keys no query may see (NaN here) have no effect."""
    from ringattn._kernels_forward import query_group

    bq, bk, K, H = 8, 4, 2, 8
    T = S = nq * bq
    assert query_group(nq) == (2 if nq in (32, 34) else 1)
    rng = np.random.default_rng(nq * 10 + G)
    q = jnp.asarray(rng.standard_normal((2, T, K * G, H)), jnp.float32)
    k = np.asarray(rng.standard_normal((2, S, K, H)), np.float32)
    v = np.asarray(rng.standard_normal((2, S, K, H)), np.float32)
    if mask == "causal":
        opts = {"causal": True}
    elif mask == "window":
        opts = {"causal": True, "window": 21}
    elif mask == "segments":
        # Documents end mid-block, so a group's two blocks see a key block differently; keys
        # of segment -1 match no query, and hold NaN.
        q_seg = np.broadcast_to(np.arange(T) // 13, (2, T)).astype(np.int32)
        kv_seg = q_seg.copy()
        kv_seg[:, 1::7] = -1
        k[kv_seg == -1] = v[kv_seg == -1] = np.nan
        opts = {"segment_ids": SegmentIds(jnp.asarray(q_seg), jnp.asarray(kv_seg))}
    else:
        dense = np.tril(np.ones((T, S), bool)) & (np.arange(S)[None] % 3 != 1)
        k[:, 1::3] = v[:, 1::3] = np.nan  # hidden from every query
        opts = {"mask": MaskSpec(dense=DenseMask(dense))}
    k, v = jnp.asarray(k), jnp.asarray(v)
    blocks = BlockSizes(block_q=bq, block_kv=bk)
    attend = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, block_sizes=blocks, **opts))
    got, want = attend(q, k, v), attention_reference(q, k, v, **opts)
    assert not np.isnan(np.asarray(got.out)).any()
    np.testing.assert_allclose(got.out, want.out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got.lse, want.lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("nq", [2, 33, 34])
@pytest.mark.parametrize("G", [1, 2])
def test_forward_query_groups_fold_several_key_sets(nq, G):
    """A state carried over key sets (as a ring's hops) is read and written in the groups'
    row order: two causal key sets folded one after the other equal attention over both."""
    from ringattn._blocks import MaskIds
    from ringattn._heads_major import kv_to_heads_major, make_kernel_config, q_to_groups
    from ringattn._kernels_forward import init_forward_state, update_forward_heads_major
    from ringattn._online_softmax import finalize_online_softmax

    bq, bk, K, H, B = 8, 4, 2, 8, 2
    T, S = nq * bq, 2 * nq * bq  # the keys come in two sets of T
    rng = np.random.default_rng(nq + 5 * G)
    q = jnp.asarray(rng.standard_normal((B, T, K * G, H)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32) for _ in range(2))
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + T // 2, (B, T))
    kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    cfg, Tp, _ = make_kernel_config(MaskSpec(causal=True), H, T, T, bq, bk)
    qg = q_to_groups(q, K, Tp)

    @jax.jit
    def folded(qg, k, v):
        state = init_forward_state(qg)
        for half in range(2):
            part = slice(half * T, (half + 1) * T)
            kh, vh = kv_to_heads_major(k[:, part], T), kv_to_heads_major(v[:, part], T)
            ids = MaskIds(q_pos, kv_pos[:, part])
            state = update_forward_heads_major(state, qg, kh, vh, ids, cfg)
        return finalize_online_softmax(state)

    out, lse = folded(qg, k, v)  # [B, K, G, T, H], [B, K, G, T]
    want = attention_reference(q, k, v, causal=True, positions=Positions(q_pos, kv_pos))
    got_out = jnp.moveaxis(out, 3, 1).reshape(B, T, K * G, H)
    got_lse = jnp.moveaxis(lse, 3, 1).reshape(B, T, K * G)
    np.testing.assert_allclose(got_out, want.out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got_lse, want.lse, atol=1e-5, rtol=1e-5)
