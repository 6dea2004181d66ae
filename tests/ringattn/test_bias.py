"""The additive logit bias of blockwise_attention and attention_reference.

attention_reference's bias against a numpy float64 oracle written here; blockwise_attention's
(out, lse, dq, dk, dv, dbias) against attention_reference over every broadcast pattern of the
bias and the library's masks; NaN under the mask; vmap; the bias never broadcast to
[B, N, T, S] inside the kernels; the errors of the paths that take no bias.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringattn
from ringattn import (
    BlockSizes,
    Positions,
    SegmentIds,
    attention_reference,
    blockwise_attention,
)
from tests._util import assert_close, attention_inputs, segments_from_cuts

BLOCKS = BlockSizes(block_q=8, block_kv=16, block_q_bwd=16, block_kv_bwd=8)
F32 = jnp.float32


def _numpy_attention(q, k, v, bias, *, causal, scale):
    """float64 softmax(scale q k^T + bias) v with GQA by repetition; causal over arange."""
    q, k, v, bias = (np.asarray(x, np.float64) for x in (q, k, v, bias))
    G = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale + bias
    if causal:
        T, S = logits.shape[-2:]
        logits = np.where(np.tril(np.ones((T, S), bool)), logits, -np.inf)
    m = logits.max(-1, keepdims=True)
    p = np.exp(logits - m)
    out = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v)
    lse = (m + np.log(p.sum(-1, keepdims=True)))[..., 0].transpose(0, 2, 1)
    return out, lse


@pytest.mark.parametrize("bias_shape", [(2, 4, 9, 9), (1, 4, 9, 1), (2, 1, 1, 9)], ids=str)
def test_reference_bias_matches_numpy(bias_shape):
    q, k, v = attention_inputs(2, 9, 9, 4, 2, 8, F32)
    bias = jax.random.normal(jax.random.key(7), bias_shape, F32) * 2
    out, lse = attention_reference(q, k, v, bias=bias, causal=True, scale=0.5)
    want, want_lse = _numpy_attention(q, k, v, bias, causal=True, scale=0.5)
    assert_close(out, want, dtype=F32, what="out")
    assert_close(lse, want_lse, dtype=F32, what="lse")


def _loss(fn, q, k, v, bias, kw):
    out, lse = fn(q, k, v, bias=bias, **kw)
    weights = jnp.cos(jnp.arange(out.size, dtype=F32)).reshape(out.shape)
    lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * 0.25)
    return jnp.sum(out.astype(F32) * weights) + lse_term


def _suffix(B, T, S):
    return Positions(jnp.broadcast_to(jnp.arange(S - T, S, dtype=jnp.int32), (B, T)), None)


# name: (B, T, S, N, K, H, bias shape with T/S as placeholders, options). Lengths are not
# multiples of the blocks, so the bias is padded and the last blocks are partial.
CASES = {
    "gqa-causal-window-heads": (
        2,
        37,
        37,
        8,
        2,
        8,
        (1, "N", "T", "S"),
        dict(causal=True, window=9),
    ),
    "segments-keybias": (
        2,
        40,
        40,
        4,
        2,
        8,
        (2, 1, 1, "S"),
        dict(causal=True, segments=((11, 30), (11, 30))),
    ),
    "mqa-softcap-rowbias": (1, 29, 53, 4, 1, 8, (1, 1, "T", 1), dict(softcap=3.0)),
    "suffix-perhead-sinks-full": (
        2,
        13,
        45,
        4,
        2,
        8,
        (2, "N", "T", "S"),
        dict(causal=True, window=(5, None, 12, 3), suffix=True, sinks=True),
    ),
}


def _case(name, dtype=F32):
    B, T, S, N, K, H, shape, opts = CASES[name]
    q, k, v = attention_inputs(B, T, S, N, K, H, dtype)
    shape = tuple({"N": N, "T": T, "S": S}.get(d, d) for d in shape)
    bias = jax.random.normal(jax.random.key(5), shape, F32) * 2
    opts = dict(opts)
    if opts.pop("suffix", False):
        opts["positions"] = _suffix(B, T, S)
    segs = opts.pop("segments", None)
    if segs is not None:
        opts["segment_ids"] = SegmentIds(
            segments_from_cuts(B, T, segs[0]), segments_from_cuts(B, S, segs[1])
        )
    if opts.pop("sinks", False):
        opts["sinks"] = jnp.linspace(-1.0, 1.0, N)
    return q, k, v, bias, opts


@pytest.mark.parametrize("name", sorted(CASES))
def test_blockwise_bias_matches_reference(name):
    q, k, v, bias, kw = _case(name)
    fast = functools.partial(blockwise_attention, block_sizes=BLOCKS)
    out, lse = jax.jit(lambda *a: fast(*a[:3], bias=a[3], **kw))(q, k, v, bias)
    want, want_lse = attention_reference(q, k, v, bias=bias, **kw)
    assert_close(out, want, dtype=F32, what="out")
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    assert_close(jnp.where(finite, lse, 0), jnp.where(finite, want_lse, 0), dtype=F32)
    argnums = (0, 1, 2, 3)
    grads = jax.jit(jax.grad(functools.partial(_loss, fast, kw=kw), argnums))(q, k, v, bias)
    want_grads = jax.grad(functools.partial(_loss, attention_reference, kw=kw), argnums)(
        q, k, v, bias
    )
    for g_name, g, w in zip(("dq", "dk", "dv", "dbias"), grads, want_grads, strict=True):
        assert g.shape == w.shape
        assert_close(g, w, dtype=F32, grad=True, what=f"{name} {g_name}")


def test_bfloat16_inputs_and_bias():
    """bfloat16 q, k, v and bias: out and dbias in bfloat16, within the bfloat16 tolerances."""
    q, k, v, bias, kw = _case("segments-keybias", jnp.bfloat16)
    bias = bias.astype(jnp.bfloat16)
    fast = functools.partial(blockwise_attention, block_sizes=BLOCKS)
    out = fast(q, k, v, bias=bias, **kw).out
    f32 = [x.astype(F32) for x in (q, k, v, bias)]
    assert out.dtype == jnp.bfloat16
    assert_close(out, attention_reference(*f32[:3], bias=f32[3], **kw).out, dtype=jnp.bfloat16)
    dbias = jax.grad(functools.partial(_loss, fast, kw=kw), 3)(q, k, v, bias)
    want = jax.grad(functools.partial(_loss, attention_reference, kw=kw), 3)(*f32)
    assert dbias.dtype == jnp.bfloat16
    assert_close(dbias, want, dtype=jnp.bfloat16, grad=True, what="dbias")


def test_nan_bias_where_masked_does_not_leak():
    """NaN in the bias of causally hidden pairs reaches no output or gradient; dbias is 0."""
    q, k, v = attention_inputs(1, 24, 24, 4, 2, 8, F32)
    hidden = ~np.tril(np.ones((24, 24), bool))
    bias = jnp.where(hidden, jnp.nan, jax.random.normal(jax.random.key(1), (24, 24)))[None, None]
    fast = functools.partial(blockwise_attention, block_sizes=BLOCKS, causal=True)
    out = fast(q, k, v, bias=bias).out
    assert np.isfinite(np.asarray(out)).all()
    grads = jax.grad(functools.partial(_loss, fast, kw={}), (0, 1, 2, 3))(q, k, v, bias)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    assert not np.asarray(grads[3])[0, 0][hidden].any()
    clean = jnp.where(hidden, 0.0, bias)
    assert_close(out, attention_reference(q, k, v, bias=clean, causal=True).out, dtype=F32)


@pytest.mark.parametrize("bias_axis", [0, None], ids=["batched-bias", "shared-bias"])
def test_vmap(bias_axis):
    """vmap over a leading axis, the bias mapped (its own batch 1) or shared (its batch B):
    each member as the reference computes it, forward and gradients."""
    V, B, T, N, K, H = 3, 2, 20, 4, 2, 8
    q, k, v = attention_inputs(V * B, T, T, N, K, H, F32)
    q, k, v = (x.reshape(V, B, *x.shape[1:]) for x in (q, k, v))
    shape = (V, 1, N, T, T) if bias_axis == 0 else (B, 1, T, T)
    bias = jax.random.normal(jax.random.key(2), shape, F32)
    kw = dict(causal=True)

    def loss(fn, q, k, v, bias):
        return _loss(fn, q, k, v, bias, kw)

    fast = functools.partial(blockwise_attention, block_sizes=BLOCKS)
    mapped = jax.vmap(functools.partial(loss, fast), in_axes=(0, 0, 0, bias_axis))
    total = lambda *a: jnp.sum(mapped(*a))
    grads = jax.grad(total, (0, 1, 2, 3))(q, k, v, bias)
    for i in range(V):
        b = bias[i] if bias_axis == 0 else bias
        want = jax.grad(functools.partial(loss, attention_reference), (0, 1, 2, 3))(
            q[i], k[i], v[i], b
        )
        for name, g, w in zip(("dq", "dk", "dv"), grads, want, strict=False):
            assert_close(g[i], w, dtype=F32, grad=True, what=f"member {i} {name}")
        if bias_axis == 0:
            assert_close(grads[3][i], want[3], dtype=F32, grad=True, what=f"member {i} dbias")
    if bias_axis is None:  # a shared bias collects every member's gradient
        want = sum(
            jax.grad(functools.partial(loss, attention_reference), 3)(q[i], k[i], v[i], bias)
            for i in range(V)
        )
        assert_close(grads[3], want, dtype=F32, grad=True, what="shared dbias")


def _largest_intermediate(jaxpr) -> int:
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            largest = max(largest, int(np.prod(getattr(var.aval, "shape", ()))))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    largest = max(largest, _largest_intermediate(inner))
    return largest


def test_bias_is_never_broadcast_to_full_size():
    """Forward and backward with a [1, 1, T, S] bias: no intermediate as large as
    [B, N, T, S] (the reference, which builds the logits, does have one)."""
    B, T, N, K, H = 2, 64, 4, 2, 4
    q, k, v = attention_inputs(B, T, T, N, K, H, F32)
    bias = jnp.zeros((1, 1, T, T))
    fast = functools.partial(blockwise_attention, block_sizes=BLOCKS, causal=True)
    grad = jax.grad(functools.partial(_loss, fast, kw={}), (0, 1, 2, 3))
    assert _largest_intermediate(jax.make_jaxpr(grad)(q, k, v, bias).jaxpr) < B * N * T * T
    ref = jax.grad(functools.partial(_loss, attention_reference, kw=dict(causal=True)), 3)
    assert _largest_intermediate(jax.make_jaxpr(ref)(q, k, v, bias).jaxpr) >= B * N * T * T


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    "fn, bias, match",
    [
        (blockwise_attention, np.zeros((2, 3, 8, 8), np.float32), r"bias: .*axis 1: 1 or N=4"),
        (blockwise_attention, np.zeros((1, 1, 8), np.float32), "bias: expected a floating"),
        (blockwise_attention, np.zeros((1, 1, 8, 8), np.int32), "bias: expected a floating"),
        (attention_reference, np.zeros((1, 1, 9, 8), np.float32), r"axis 2: 1 or T=8"),
        (
            functools.partial(blockwise_attention, impl="pallas"),
            np.zeros((1, 1, 8, 8), np.float32),
            "bias: expected None with impl='pallas'",
        ),
    ],
)
def test_bias_errors(fn, bias, match):
    q, k, v = attention_inputs(2, 8, 8, 4, 2, 8, F32)
    with pytest.raises(ValueError, match=match):
        fn(q, k, v, bias=jnp.asarray(bias))


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    "fn",
    [
        functools.partial(ringattn.ring_attention_per_shard, seq_axis="seq"),
        functools.partial(ringattn.sharded_attention, mesh=None, seq_axis="seq"),
    ],
    ids=["ring", "sharded"],
)
def test_paths_without_bias_say_which_take_one(fn):
    q, k, v = attention_inputs(1, 8, 8, 4, 2, 8, F32)
    with pytest.raises(ValueError, match=r"bias: expected None .*ringattn.blockwise_attention"):
        fn(q, k, v, bias=jnp.zeros((1, 1, 8, 8)))
