"""Sinks and per-head windows on every path, forward and gradients, against the reference.

A sink is a per-query-head logit that joins the softmax denominator once; on the ring it must
join once, not once per hop. A window tuple gives each query head its own window.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from ringattn import (
    BlockSizes,
    MaskSpec,
    Positions,
    apply_sinks,
    attention_reference,
    blockwise_attention,
    decode_attention_per_shard,
    from_layout,
    ring_attention_per_shard,
    shard_positions,
    sharded_attention,
    sharded_decode_attention,
    to_layout,
)
from tests._util import assert_close, make_test_mesh

B, L, N, K, H = 2, 16, 4, 2, 8
SINKS = jnp.asarray([0.5, -1.0, 2.0, 0.0])
WINDOWS = (None, 3, 7, 1)


def _qkv(T=L, S=L, heads=(N, K), seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    n, kk = heads
    return (
        jax.random.normal(ks[0], (B, T, n, H)),
        jax.random.normal(ks[1], (B, S, kk, H)),
        jax.random.normal(ks[2], (B, S, kk, H)),
    )


def _value_and_grads(attend, q, k, v, sinks):
    """(out, lse, (dq, dk, dv, dsinks)) of a loss through out and lse, jitted."""

    def loss(q, k, v, sinks):
        out, lse = attend(q, k, v, sinks)
        weights = jnp.sin(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out * weights) + 0.2 * jnp.sum(finite), (out, lse)

    run = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    (_, (out, lse)), grads = jax.jit(run)(q, k, v, sinks)
    return out, lse, grads


def _compare(got, want, what):
    for name, a, b in zip(("out", "lse"), got[:2], want[:2], strict=True):
        assert_close(a, b, dtype=jnp.float32, what=f"{what} {name}")
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got[2], want[2], strict=True):
        assert_close(a, b, dtype=jnp.float32, grad=True, what=f"{what} {name}")


def _reference(q, k, v, sinks, **kw):
    return attention_reference(q, k, v, sinks=sinks, **kw)


def test_reference_sinks_formula():
    """The oracle's sinks: an extra logit with no value, joining the denominator once."""
    q, k, v = _qkv()
    out, lse = attention_reference(q, k, v, causal=True)
    got_out, got_lse = attention_reference(q, k, v, causal=True, sinks=SINKS)
    o, l, s = (np.asarray(x, np.float64) for x in (out, lse, SINKS))
    total = np.logaddexp(l, s)
    np.testing.assert_allclose(np.asarray(got_lse), total, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_out), o * np.exp(l - total)[..., None], atol=1e-5)
    # apply_sinks on the unsunk result is the same thing
    again = apply_sinks(out, lse, SINKS)
    assert_close(again.out, got_out, dtype=jnp.float32)
    # an empty row keeps out = 0 and gets lse = sink
    empty = attention_reference(
        q,
        k,
        v,
        causal=True,
        positions=Positions(jnp.full((B, L), -1, jnp.int32), None),
        sinks=SINKS,
    )
    assert not np.asarray(empty.out).any()
    np.testing.assert_allclose(np.asarray(empty.lse), np.broadcast_to(SINKS, (B, L, N)))


def test_reference_head_windows_match_one_head_at_a_time():
    q, k, v = _qkv()
    got = attention_reference(q, k, v, causal=True, window=WINDOWS)
    for n, w in enumerate(WINDOWS):
        one = attention_reference(
            q[:, :, n : n + 1],
            k[:, :, n // 2 : n // 2 + 1],
            v[:, :, n // 2 : n // 2 + 1],
            causal=True,
            window=w,
        )
        assert_close(got.out[:, :, n : n + 1], one.out, dtype=jnp.float32, what=f"head {n}")


@pytest.mark.parametrize("window", [None, WINDOWS], ids=["no-window", "head-windows"])
def test_blockwise(window):
    q, k, v = _qkv(T=13, S=21)
    kw = dict(
        causal=True, window=window, positions=Positions(jnp.arange(8, 21)[None].repeat(B, 0), None)
    )
    fast = functools.partial(blockwise_attention, block_sizes=BlockSizes(4, 4), **kw)
    got = _value_and_grads(lambda q, k, v, s: fast(q, k, v, sinks=s), q, k, v, SINKS)
    want = _value_and_grads(functools.partial(_reference, **kw), q, k, v, SINKS)
    _compare(got, want, "blockwise")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_sinks_join_once(layout):
    n = 4
    q, k, v = _qkv()
    mesh = make_test_mesh((n,), ("seq",))
    to = functools.partial(to_layout, layout=layout, num_shards=n)
    back = functools.partial(from_layout, layout=layout, num_shards=n)
    ring = functools.partial(
        ring_attention_per_shard,
        seq_axis="seq",
        layout=layout,
        mask=MaskSpec(causal=True, window=WINDOWS),
        block_sizes=BlockSizes(2, 2),
    )
    spec = P(None, "seq")

    def body(q, k, v, s):  # this shard's global positions (a permuted layout needs them)
        mine = shard_positions(layout, jax.lax.axis_index("seq"), n, q.shape[1])
        mine = jnp.broadcast_to(mine, q.shape[:2])
        return tuple(ring(q, k, v, sinks=s, positions=Positions(mine, mine)))

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(spec, spec, spec, P()),
        out_specs=(spec, spec),
        check_vma=True,
    )
    attend = lambda q, k, v, s: tuple(back(x) for x in f(to(q), to(k), to(v), s))
    got = _value_and_grads(attend, q, k, v, SINKS)
    want = _value_and_grads(
        functools.partial(_reference, causal=True, window=WINDOWS), q, k, v, SINKS
    )
    _compare(got, want, f"ring {layout}")


SHARDED = {
    "ring-heads": dict(strategy="ring", shape=(2, 2), names=("seq", "model"), head_axis="model"),
    "allgather-heads-explicit": dict(
        strategy="allgather",
        shape=(2, 2),
        names=("seq", "model"),
        head_axis="model",
        axis_type=AxisType.Explicit,
    ),
    "ulysses": dict(strategy="ulysses", shape=(2,), names=("seq",)),
    "usp": dict(strategy="usp", shape=(2, 2), names=("u", "r"), seq_axis=("u", "r")),
}


@pytest.mark.parametrize("name", list(SHARDED))
def test_sharded_strategies(name):
    c = dict(SHARDED[name])
    mesh = make_test_mesh(
        c.pop("shape"), c.pop("names"), axis_type=c.pop("axis_type", AxisType.Auto)
    )
    q, k, v = _qkv()
    attend = lambda q, k, v, s: sharded_attention(
        q,
        k,
        v,
        mesh=mesh,
        seq_axis=c.get("seq_axis", "seq"),
        strategy=c["strategy"],
        head_axis=c.get("head_axis"),
        causal=True,
        window=WINDOWS,
        sinks=s,
        block_sizes=BlockSizes(4, 4),
    )
    got = _value_and_grads(attend, q, k, v, SINKS)
    want = _value_and_grads(
        functools.partial(_reference, causal=True, window=WINDOWS), q, k, v, SINKS
    )
    _compare(got, want, name)


def test_decode_sinks_and_head_windows():
    n, C, T = 4, 8, 2
    q, k, v = _qkv(T=T, S=n * C)
    mesh = make_test_mesh((n,), ("x",))
    total = jnp.asarray([27, 9], jnp.int32)  # valid keys of the global cache, filled in order
    local = jnp.clip(total[None] - C * jnp.arange(n)[:, None], 0, C)  # [n, B]
    valid = jnp.arange(n * C)[None] < total[:, None]
    q_pos = total[:, None] - T + jnp.arange(T)[None]
    kw = dict(causal=True, window=WINDOWS)
    want = _value_and_grads(
        lambda q, k, v, s: _reference(
            q,
            jnp.where(valid[..., None, None], k, 0),
            jnp.where(valid[..., None, None], v, 0),
            s,
            positions=Positions(q_pos, None),
            **kw,
        ),
        q,
        k,
        v,
        SINKS,
    )
    # keys beyond `total` are masked in the reference through causal positions
    f = jax.shard_map(
        lambda q, k, v, l, s: tuple(
            decode_attention_per_shard(q, k, v, seq_axis="x", lengths=l[0], sinks=s, **kw)
        ),
        mesh=mesh,
        in_specs=(P(), P(None, "x"), P(None, "x"), P("x"), P()),
        out_specs=(P(), P()),
        check_vma=True,
    )
    got = _value_and_grads(lambda q, k, v, s: f(q, k, v, local, s), q, k, v, SINKS)
    _compare(got, want, "decode per shard")
    attend = lambda q, k, v, s: sharded_decode_attention(
        q, k, v, mesh=mesh, seq_axis="x", lengths=total, sinks=s, **kw
    )
    _compare(_value_and_grads(attend, q, k, v, SINKS), want, "sharded decode")
