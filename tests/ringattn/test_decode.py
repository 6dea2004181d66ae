"""Sharded decode (tree attention) and the LSE all-reduce, against the dense reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ringattn import (
    Positions,
    SegmentIds,
    allreduce_attention_per_shard,
    attention_reference,
    decode_attention_per_shard,
)
from tests._util import assert_close, make_test_mesh

B, T, C, H = 3, 2, 16, 8  # C: cache slots per shard


def make_inputs(n, N, K, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, N, H), np.float32)).astype(dtype)
    k = jnp.asarray(rng.standard_normal((B, n * C, K, H), np.float32)).astype(dtype)
    v = jnp.asarray(rng.standard_normal((B, n * C, K, H), np.float32)).astype(dtype)
    # [n, B] valid keys per shard: empty shards, a full one, partial ones; batch row 2 is
    # empty on every shard (its queries see nothing and must give zeros, not NaN).
    lengths = np.array([[0, C, 1, C - 1, 5, 0, 9, 3][i % 8] for i in range(n * B)]).reshape(n, B)
    lengths[:, 2] = 0
    if n == 1:
        lengths[0, :2] = [C - 3, 1]
    return q, k, v, jnp.asarray(lengths, jnp.int32)


def sharded(mesh, q, k, v, lengths, q_positions, **kw):
    """Per shard, with the keys at their cache slot (``axis_index * C + arange(C)``)."""

    def body(q, k, v, lengths, q_positions, kv_positions):
        return tuple(
            decode_attention_per_shard(
                q,
                k,
                v,
                seq_axis="x",
                lengths=lengths[0],
                positions=Positions(q_positions, kv_positions),
                **kw,
            )
        )

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(None, "x"), P(None, "x"), P("x"), P(), P(None, "x")),
        out_specs=(P(), P()),
        check_vma=True,
    )
    slots = jnp.broadcast_to(jnp.arange(k.shape[1], dtype=jnp.int32), k.shape[:2])
    return f(q, k, v, lengths, q_positions, slots)


def reference(n, q, k, v, lengths, q_positions, **kw):
    valid = jnp.arange(C)[None, None, :] < lengths[:, :, None]  # [n, B, C]
    kv_seg = jnp.where(jnp.moveaxis(valid, 0, 1).reshape(B, n * C), 0, 1)
    f32 = lambda x: x.astype(jnp.float32)
    return attention_reference(
        f32(q),
        f32(k),
        f32(v),
        segment_ids=SegmentIds(jnp.zeros((B, T), jnp.int32), kv_seg),
        positions=Positions(q_positions, None),
        **kw,
    )


def out_and_grads(f, q, k, v):
    def run(q, k, v):
        (out, lse), vjp = jax.vjp(lambda *a: tuple(f(*a)), q, k, v)
        dout = jnp.cos(out.astype(jnp.float32)).astype(out.dtype)
        dlse = jnp.where(jnp.isneginf(lse), 0.0, 0.1 * jnp.sin(lse))
        return out, lse, vjp((dout, dlse))

    return jax.jit(run)(q, k, v)


@pytest.mark.parametrize(
    "n, N, K, dtype, options",
    [
        (8, 4, 2, "float32", dict(causal=True, window=40)),
        (4, 4, 1, "bfloat16", dict(softcap=5.0)),
        (2, 4, 4, "float32", dict(causal=True)),
        (1, 4, 2, "float32", {}),
    ],
)
def test_matches_reference(n, N, K, dtype, options):
    mesh = make_test_mesh((n,), ("x",))
    q, k, v, lengths = make_inputs(n, N, K, jnp.dtype(dtype))
    # decode tokens near the end of the cache: causal and window both cut keys
    q_positions = jnp.array([[n * C - 3, n * C - 2]] * B, jnp.int32) - jnp.arange(B)[:, None]
    out, lse, grads = out_and_grads(
        lambda q, k, v: sharded(mesh, q, k, v, lengths, q_positions, **options), q, k, v
    )
    ref_out, ref_lse, ref_grads = out_and_grads(
        lambda q, k, v: reference(n, q, k, v, lengths, q_positions, **options),
        *(x.astype(jnp.float32) for x in (q, k, v)),
    )
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_close(out, ref_out, dtype=dtype, what="out")
    assert bool(jnp.all(jnp.isneginf(lse[2]))) and bool(jnp.all(out[2] == 0))
    finite = jnp.isfinite(ref_lse)
    assert bool(jnp.all(finite == jnp.isfinite(lse)))
    assert_close(jnp.where(finite, lse, 0), jnp.where(finite, ref_lse, 0), dtype=dtype, what="lse")
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert_close(g, r, dtype=dtype, grad=True, what=f"d{name}")


def test_default_lengths_and_positions():
    """No lengths: every key valid; default kv positions are a contiguous split, and the
    queries are the last T positions of the cache (issue 8, trap 1: not arange(T))."""
    n = 4
    mesh = make_test_mesh((n,), ("x",))
    q, k, v, _ = make_inputs(n, 4, 2, jnp.float32, seed=1)
    f = jax.shard_map(
        lambda q, k, v: decode_attention_per_shard(q, k, v, seq_axis="x", causal=True).out,
        mesh=mesh,
        in_specs=(P(), P(None, "x"), P(None, "x")),
        out_specs=P(),
    )
    S = n * C
    last = Positions(jnp.broadcast_to(jnp.arange(S - T, S, dtype=jnp.int32), (B, T)), None)
    want = attention_reference(q, k, v, causal=True, positions=last).out
    assert_close(jax.jit(f)(q, k, v), want, dtype=jnp.float32)
    # the newest token sees the whole cache
    full = attention_reference(q[:, -1:], k, v).out
    assert_close(jax.jit(f)(q, k, v)[:, -1:], full, dtype=jnp.float32)


def test_allreduce_attention_merges_partials():
    """Four partials over disjoint key chunks (one empty) reduce to the full attention."""
    n, N, K = 4, 4, 2
    mesh = make_test_mesh((n,), ("x",))
    q, k, v, _ = make_inputs(n, N, K, jnp.float32, seed=2)
    kv_seg = jnp.where(jnp.arange(n * C) < C, 1, 0)[None].repeat(B, 0)  # chunk 0: hidden
    q_seg = jnp.zeros((B, T), jnp.int32)
    parts = [
        attention_reference(
            q,
            k[:, i * C : (i + 1) * C],
            v[:, i * C : (i + 1) * C],
            segment_ids=SegmentIds(q_seg, kv_seg[:, i * C : (i + 1) * C]),
        )
        for i in range(n)
    ]
    outs = jnp.stack([p[0] for p in parts])  # [n, B, T, N, H]
    lses = jnp.stack([p[1] for p in parts])
    assert bool(jnp.all(jnp.isneginf(lses[0])))
    f = jax.shard_map(
        lambda o, l: tuple(allreduce_attention_per_shard(o[0], l[0], seq_axis="x")),
        mesh=mesh,
        in_specs=(P("x"), P("x")),
        out_specs=(P(), P()),
    )
    out, lse = jax.jit(f)(outs, lses)
    ref_out, ref_lse = attention_reference(q, k, v, segment_ids=SegmentIds(q_seg, kv_seg))
    assert_close(out, ref_out, dtype=jnp.float32, what="out")
    assert_close(lse, ref_lse, dtype=jnp.float32, what="lse")


def test_allreduce_attention_all_empty_no_nan():
    mesh = make_test_mesh((2,), ("x",))
    out = jnp.zeros((2, 3, 4))
    lse = jnp.full((2, 3), -jnp.inf)

    def loss(out, lse):
        f = jax.shard_map(
            lambda o, l: tuple(allreduce_attention_per_shard(o[0], l[0], seq_axis="x")),
            mesh=mesh,
            in_specs=(P("x"), P("x")),
            out_specs=(P(), P()),
        )
        o, l = f(out, lse)
        return jnp.sum(o) + jnp.sum(jnp.where(jnp.isneginf(l), 0.0, l)), (o, l)

    (_, (o, l)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(out, lse)
    assert bool(jnp.all(o == 0)) and bool(jnp.all(jnp.isneginf(l)))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


def _decode_in_map(q, k, v, **kw):
    mesh = make_test_mesh((2,), ("x",))
    f = jax.shard_map(
        lambda q, k, v: decode_attention_per_shard(q, k, v, **kw).out,
        mesh=mesh,
        in_specs=(P(), P(None, "x"), P(None, "x")),
        out_specs=P(),
    )
    return jax.jit(f)(q, k, v)


@pytest.mark.no_typecheck
def test_errors():
    q, k, v, _ = make_inputs(2, 4, 2, jnp.float32)
    with pytest.raises(ValueError, match="lse: expected the shape of out without its last"):
        allreduce_attention_per_shard(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4)), seq_axis="x")
    with pytest.raises(ValueError, match="seq_axis: expected a mesh axis name"):
        _decode_in_map(q, k, v, seq_axis=None)
    with pytest.raises(ValueError, match=r"lengths: expected shape \(3,\)"):
        _decode_in_map(q, k, v, seq_axis="x", lengths=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="lengths: expected an integer array"):
        _decode_in_map(q, k, v, seq_axis="x", lengths=jnp.zeros((B,), jnp.float32))
    with pytest.raises(ValueError, match=r"positions\.kv: expected shape \(3, 16\)"):
        bad = Positions(None, jnp.zeros((B, 32), jnp.int32))
        _decode_in_map(q, k, v, seq_axis="x", positions=bad)
    with pytest.raises(ValueError, match=r"positions\.q: expected shape \(3, 2\)"):
        _decode_in_map(
            q, k, v, seq_axis="x", positions=Positions(jnp.zeros((B, 1), jnp.int32), None)
        )
    with pytest.raises(ValueError, match="v: expected the shape of k"):
        _decode_in_map(q, k, v[:, :16], seq_axis="x")
    with pytest.raises(ValueError, match="window: expected an int >= 1"):
        _decode_in_map(q, k, v, seq_axis="x", window=-1)


def test_default_positions_number_the_valid_cache_shard_by_shard():
    """Issue 8, trap 1, with per-shard lengths and holes: the valid keys are numbered in cache
    order (shard by shard) and the queries are the last T positions of that valid cache, so a
    causal decode token sees every valid key of every shard."""
    n = 4
    mesh = make_test_mesh((n,), ("x",))
    q, k, v, lengths = make_inputs(n, 4, 2, jnp.float32, seed=3)  # lengths [n, B], holes
    f = jax.shard_map(
        lambda q, k, v, l: tuple(
            decode_attention_per_shard(q, k, v, seq_axis="x", lengths=l[0], causal=True)
        ),
        mesh=mesh,
        in_specs=(P(), P(None, "x"), P(None, "x"), P("x")),
        out_specs=(P(), P()),
        check_vma=True,
    )
    out, lse = jax.jit(f)(q, k, v, lengths)
    for b in range(B):
        keep = np.concatenate(
            [np.arange(i * C, i * C + int(lengths[i, b])) for i in range(n)]
        ).astype(int)
        n_valid = len(keep)
        if n_valid == 0:
            assert not np.asarray(out[b]).any() and np.isneginf(np.asarray(lse[b])).all()
            continue
        q_pos = jnp.arange(n_valid - T, n_valid, dtype=jnp.int32)[None]
        want = attention_reference(
            q[b : b + 1],
            k[b : b + 1, keep],
            v[b : b + 1, keep],
            causal=True,
            positions=Positions(q_pos, None),
        )
        assert_close(out[b : b + 1], want.out, dtype=jnp.float32, what=f"row {b}")
        # the newest token sees the whole valid cache
        full = attention_reference(q[b : b + 1, -1:], k[b : b + 1, keep], v[b : b + 1, keep])
        assert_close(out[b : b + 1, -1:], full.out, dtype=jnp.float32, what=f"row {b} last")
