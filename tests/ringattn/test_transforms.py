"""Every public attention function under jax.jit (options bound), jax.vmap and jax.checkpoint,
on meshes with Auto and Explicit axes, against the reference (issue 9: vmap with a causal mask
or a window used to fail inside shard_map with "varying manual axes to match")."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from ringattn import (
    BlockSizes,
    MaskSpec,
    Positions,
    allreduce_attention_per_shard,
    apply_sinks,
    attention_reference,
    blockwise_attention,
    decode_attention_per_shard,
    merge_attention,
    ring_attention_per_shard,
    sharded_attention,
    sharded_decode_attention,
)
from tests._util import assert_close, make_test_mesh

V, B, L, N, K, H = 3, 1, 16, 4, 2, 8
MASK = MaskSpec(causal=True, window=5)
SINKS = jnp.asarray([0.3, -0.2, 1.0, 0.0])
AXES = [AxisType.Auto, AxisType.Explicit]
AXIS_IDS = ["auto", "explicit"]


def _batched(T=L, S=L, seed=0):
    """``[V, B, ...]`` inputs: V independent problems to vmap over."""
    ks = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(ks[0], (V, B, T, N, H)),
        jax.random.normal(ks[1], (V, B, S, K, H)),
        jax.random.normal(ks[2], (V, B, S, K, H)),
    )


def _reference(q, k, v, **kw):
    return attention_reference(q, k, v, mask=MASK, sinks=SINKS, **kw)


def _check(attend, want, q, k, v):
    """vmap, jit and checkpoint together, forward and gradients, against ``want``."""

    def loss(f, q, k, v):
        out = jax.vmap(f)(q, k, v)
        return jnp.sum(out * jnp.cos(out)), out

    grad = lambda f: jax.jit(jax.grad(functools.partial(loss, f), argnums=(0, 1, 2), has_aux=True))
    got_grads, got = grad(jax.checkpoint(attend))(q, k, v)
    want_grads, ref = grad(want)(q, k, v)
    assert_close(got, ref, dtype=jnp.float32, what="out")
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        assert_close(g, w, dtype=jnp.float32, grad=True, what=f"d{name}")


def test_blockwise_and_reference():
    q, k, v = _batched(T=11, S=13)
    # T != S under a causal mask: the queries sit at the last 11 of the 13 key positions.
    pos = Positions(q=jnp.broadcast_to(2 + jnp.arange(11), (B, 11)), kv=None)
    fast = functools.partial(
        blockwise_attention, mask=MASK, sinks=SINKS, block_sizes=BlockSizes(4, 4), positions=pos
    )
    ref = functools.partial(_reference, positions=pos)
    _check(lambda q, k, v: fast(q, k, v).out, lambda q, k, v: ref(q, k, v).out, q, k, v)
    jitted = jax.jit(functools.partial(attention_reference, mask=MASK, sinks=SINKS, positions=pos))
    assert_close(jitted(q[0], k[0], v[0]).out, ref(q[0], k[0], v[0]).out, dtype=jnp.float32)


@pytest.mark.parametrize("axis_type", AXES, ids=AXIS_IDS)
def test_ring_per_shard(axis_type):
    mesh = make_test_mesh((4,), ("seq",), axis_type=axis_type)
    ring = functools.partial(
        ring_attention_per_shard, seq_axis="seq", mask=MASK, block_sizes=BlockSizes(2, 2)
    )
    spec = P(None, "seq")
    f = jax.shard_map(
        lambda q, k, v, s: ring(q, k, v, sinks=s).out,
        mesh=mesh,
        in_specs=(spec, spec, spec, P()),
        out_specs=spec,
        check_vma=True,
    )
    q, k, v = _batched()

    def attend(q, k, v):
        if axis_type == AxisType.Explicit:  # shard_map on Explicit axes: inputs as in_specs
            q, k, v = (jax.sharding.reshard(x, spec) for x in (q, k, v))
        return f(q, k, v, SINKS)

    with jax.set_mesh(mesh):
        _check(attend, lambda q, k, v: _reference(q, k, v).out, q, k, v)


@pytest.mark.parametrize("axis_type", AXES, ids=AXIS_IDS)
@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_sharded_attention(strategy, axis_type):
    mesh = make_test_mesh((2,), ("seq",), axis_type=axis_type)
    attend = jax.jit(
        functools.partial(
            sharded_attention,
            mesh=mesh,
            seq_axis="seq",
            strategy=strategy,
            mask=MASK,
            block_sizes=BlockSizes(4, 4),
        )
    )
    q, k, v = _batched()
    with jax.set_mesh(mesh):
        _check(
            lambda q, k, v: attend(q, k, v, sinks=SINKS).out,
            lambda q, k, v: _reference(q, k, v).out,
            q,
            k,
            v,
        )


@pytest.mark.parametrize("axis_type", AXES, ids=AXIS_IDS)
def test_decode(axis_type):
    n, T = 2, 2
    mesh = make_test_mesh((n,), ("x",), axis_type=axis_type)
    q, k, v = _batched(T=T)
    last = jnp.broadcast_to(jnp.arange(L - T, L, dtype=jnp.int32), (B, T))
    want = lambda q, k, v: _reference(q, k, v, positions=Positions(last, None)).out
    per_shard = jax.shard_map(
        functools.partial(decode_attention_per_shard, seq_axis="x", mask=MASK, sinks=SINKS),
        mesh=mesh,
        in_specs=(P(), P(None, "x"), P(None, "x")),
        out_specs=P(),
        check_vma=True,
    )
    glob = jax.jit(
        functools.partial(sharded_decode_attention, mesh=mesh, seq_axis="x", mask=MASK, sinks=SINKS)
    )

    def local(q, k, v):
        if axis_type == AxisType.Explicit:  # shard_map on Explicit axes: inputs as in_specs
            q = jax.sharding.reshard(q, P())
            k, v = (jax.sharding.reshard(x, P(None, "x")) for x in (k, v))
        return per_shard(q, k, v).out

    with jax.set_mesh(mesh):
        _check(local, want, q, k, v)
        _check(lambda q, k, v: glob(q, k, v).out, want, q, k, v)


def test_merge_allreduce_and_sinks_under_transforms():
    q, k, v = _batched()
    half = L // 2
    part = lambda q, k, v: attention_reference(q, k, v)
    a = jax.vmap(part)(q, k[:, :, :half], v[:, :, :half])
    b = jax.vmap(part)(q, k[:, :, half:], v[:, :, half:])
    merged = jax.jit(jax.vmap(merge_attention))(a.out, a.lse, b.out, b.lse)
    whole = jax.vmap(part)(q, k, v)
    assert_close(merged.out, whole.out, dtype=jnp.float32)
    sunk = jax.jit(jax.vmap(apply_sinks, in_axes=(0, 0, None)))(whole.out, whole.lse, SINKS)
    assert_close(
        sunk.out,
        jax.vmap(lambda q, k, v: attention_reference(q, k, v, sinks=SINKS).out)(q, k, v),
        dtype=jnp.float32,
    )
    mesh = make_test_mesh((2,), ("x",))
    reduce = jax.shard_map(
        lambda o, l: tuple(allreduce_attention_per_shard(o[0], l[0], seq_axis="x")),
        mesh=mesh,
        in_specs=(P("x"), P("x")),
        out_specs=(P(), P()),
    )
    stacked = lambda x, y: jnp.stack([x, y])
    out, lse = jax.jit(jax.vmap(reduce, in_axes=(1, 1)))(
        stacked(a.out, b.out), stacked(a.lse, b.lse)
    )
    assert_close(out, whole.out, dtype=jnp.float32)
    assert_close(lse, whole.lse, dtype=jnp.float32)


def test_small_public_functions_under_jit():
    """The mask, layout and online-softmax helpers, jitted with their options bound."""
    from ringattn import (
        attention_mask,
        finalize_online_softmax,
        from_layout,
        init_online_softmax,
        shard_positions,
        to_layout,
        update_online_softmax,
    )

    qpos = jnp.array([[5, 6]])
    kpos = jnp.arange(8)[None]
    mask = jax.jit(functools.partial(attention_mask, causal=True, window=3))(qpos, kpos)
    assert mask[0, 0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0]
    x = jnp.arange(16)[None]
    to = jax.jit(functools.partial(to_layout, layout="zigzag", num_shards=4))
    back = jax.jit(functools.partial(from_layout, layout="zigzag", num_shards=4))
    assert back(to(x)).tolist() == x.tolist()
    pos = jax.jit(functools.partial(shard_positions, "striped", num_shards=4, local_len=3))
    assert pos(jnp.int32(1)).tolist() == [1, 5, 9]
    scores = jax.random.normal(jax.random.key(0), (2, 3, 5))
    values = jax.random.normal(jax.random.key(1), (2, 5, 4))

    @jax.jit
    def online(scores, values):
        state = init_online_softmax((2, 3), 4)
        state = update_online_softmax(state, scores[..., :2], values[:, :2])
        state = update_online_softmax(state, scores[..., 2:], values[:, 2:])
        return finalize_online_softmax(state)

    out, lse = online(scores, values)
    want = jax.nn.softmax(scores, axis=-1) @ values
    assert_close(out, want, dtype=jnp.float32)
    assert_close(lse, jax.nn.logsumexp(scores, axis=-1), dtype=jnp.float32)


def test_forward_mode_through_blockwise_attention_is_the_documented_type_error():
    """``blockwise_attention``'s gradient is a ``custom_vjp``: ``jax.jvp`` / ``jacfwd`` raise
    the ``TypeError`` its docstring and docs/concepts/semantics.md quote; reverse mode works."""
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, 4, 2, 8)) for key in keys)
    f = lambda q: blockwise_attention(q, k, v, causal=True).out
    match = r"can't apply forward-mode autodiff \(jvp\) to a custom_vjp function"
    with pytest.raises(TypeError, match=match):
        jax.jvp(f, (q,), (q,))
    with pytest.raises(TypeError, match=match):
        jax.jacfwd(f)(q)
    g = jax.grad(lambda q: f(q).sum())(q)
    want = jax.grad(lambda q: attention_reference(q, k, v, causal=True).out.sum())(q)
    assert jnp.allclose(g, want, rtol=1e-5, atol=1e-6)
