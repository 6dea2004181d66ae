"""blockwise_attention against the dense float32 reference: forward, gradients, masks, errors."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from ringattn import (
    BlockSizes,
    MaskSpec,
    Positions,
    SegmentIds,
    attention_reference,
    blockwise_attention,
)
from tests._util import assert_close, attention_inputs, segments_from_cuts

SMALL_BLOCKS = BlockSizes(block_q=8, block_kv=16, block_q_bwd=16, block_kv_bwd=8)


# name: (B, T, S, N, K, H, options). Lengths are not multiples of the block sizes on purpose.
CASES = {
    "mha": (2, 37, 37, 4, 4, 16, dict()),
    "mha-causal": (1, 45, 45, 4, 4, 8, dict(causal=True)),
    "gqa-causal-window": (2, 37, 37, 8, 2, 16, dict(causal=True, window=9)),
    "mqa-softcap": (1, 29, 53, 4, 1, 16, dict(softcap=3.0)),
    "gqa-segments": (2, 40, 40, 8, 2, 8, dict(causal=True, segments=((11, 30), (11, 30)))),
    "suffix-chunk": (2, 13, 61, 8, 2, 16, dict(causal=True, offset=True)),
    "suffix-window-softcap": (
        1,
        21,
        50,
        4,
        2,
        8,
        dict(causal=True, offset=True, window=17, softcap=5.0),
    ),
}


def _options(B, T, S, opts):
    opts = dict(opts)
    kw = {}
    if opts.pop("offset", False):
        q_pos = jnp.broadcast_to(jnp.arange(S - T, S, dtype=jnp.int32), (B, T))
        kw["positions"] = Positions(q_pos, None)
    segs = opts.pop("segments", None)
    if segs is not None:
        kw["segment_ids"] = SegmentIds(
            segments_from_cuts(B, T, segs[0]), segments_from_cuts(B, S, segs[1])
        )
    kw.update(opts)
    return kw


def _loss(fn, q, k, v, kw):
    out, lse = fn(q, k, v, **kw)
    weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * 0.25)
    return jnp.sum(out.astype(jnp.float32) * weights) + lse_term


# Every case in both dtypes under jit; two cases also eagerly (op-by-op outside any jit).
# bfloat16 under jit runs with the slow tests (CI runs them): the default suite's budget.
MATRIX = [(case, dtype, True) for case in sorted(CASES) for dtype in (jnp.float32, jnp.bfloat16)]
MATRIX += [("gqa-causal-window", jnp.float32, False), ("mqa-softcap", jnp.bfloat16, False)]
PARAMS = [
    pytest.param(
        c,
        d,
        j,
        id=f"{c}-{jnp.dtype(d).name}-{'jit' if j else 'eager'}",
        marks=[pytest.mark.slow] if j and d == jnp.bfloat16 else [],
    )
    for c, d, j in MATRIX
]


@pytest.mark.parametrize(("case", "dtype", "use_jit"), PARAMS)
def test_forward_and_gradients_match_reference(case, dtype, use_jit):
    B, T, S, N, K, H, opts = CASES[case]
    q, k, v = attention_inputs(B, T, S, N, K, H, dtype)
    kw = _options(B, T, S, opts)
    fast = functools.partial(blockwise_attention, block_sizes=SMALL_BLOCKS)

    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    want, want_lse = attention_reference(q32, k32, v32, **kw)
    run = (
        jax.jit(lambda q, k, v: fast(q, k, v, **kw))
        if use_jit
        else (lambda q, k, v: fast(q, k, v, **kw))
    )
    out, lse = run(q, k, v)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert_close(out, want, dtype=dtype, what=f"{case} out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(np.asarray(want_lse))
    assert_close(
        jnp.where(finite, lse, 0), jnp.where(finite, want_lse, 0), dtype=dtype, what=f"{case} lse"
    )

    grad = jax.grad(functools.partial(_loss, fast, kw=kw), argnums=(0, 1, 2))
    if use_jit:
        grad = jax.jit(grad)
    want_grads = jax.grad(functools.partial(_loss, attention_reference, kw=kw), argnums=(0, 1, 2))(
        q32, k32, v32
    )
    for name, g, w in zip("qkv", grad(q, k, v), want_grads, strict=True):
        assert g.dtype == dtype
        assert_close(g, w, dtype=dtype, grad=True, what=f"{case} d{name}")


def test_default_block_sizes_and_no_lse():
    q, k, v = attention_inputs(1, 600, 1100, 4, 2, 8, jnp.float32)
    kw = dict(causal=True, positions=Positions(q=jnp.arange(600)[None], kv=None))  # T != S
    out = blockwise_attention(q, k, v, **kw).out
    assert_close(out, attention_reference(q, k, v, **kw).out, dtype=jnp.float32)


def test_fully_masked_rows_give_zeros_and_finite_gradients():
    q, k, v = attention_inputs(1, 12, 12, 4, 2, 8, jnp.float32)
    # Queries of segment 2 have no key of their segment.
    q_seg = jnp.asarray([[0] * 4 + [1] * 4 + [2] * 4], jnp.int32)
    kv_seg = jnp.asarray([[0] * 6 + [1] * 6], jnp.int32)
    kw = dict(segment_ids=SegmentIds(q_seg, kv_seg), causal=True)
    fast = functools.partial(blockwise_attention, block_sizes=BlockSizes(4, 4))
    out, lse = fast(q, k, v, **kw)
    assert not np.asarray(out[0, 8:]).any()
    assert np.isneginf(np.asarray(lse[0, 8:])).all()
    grads = jax.grad(functools.partial(_loss, fast, kw=kw), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(functools.partial(_loss, attention_reference, kw=kw), argnums=(0, 1, 2))(
        q, k, v
    )
    for g, w in zip(grads, want, strict=True):
        assert_close(g, w, dtype=jnp.float32, grad=True)
    assert not np.asarray(grads[0][0, 8:]).any()


def test_masked_blocks_are_skipped_not_computed():
    """NaN in keys/values no query can see must not reach the output: those blocks never run."""
    q, k, v = attention_inputs(1, 16, 64, 4, 2, 8, jnp.float32)
    q_pos = jnp.arange(16, 32, dtype=jnp.int32)[None]  # keys 32.. are in every query's future
    k = k.at[:, 32:].set(jnp.nan)
    v = v.at[:, 32:].set(jnp.nan)
    fast = functools.partial(blockwise_attention, block_sizes=BlockSizes(8, 16))
    out = fast(q, k, v, causal=True, positions=Positions(q_pos, None)).out
    want = attention_reference(
        q, k[:, :32], v[:, :32], causal=True, positions=Positions(q_pos, None)
    ).out
    assert_close(out, want, dtype=jnp.float32)
    # Same with a sliding window: keys before position 8 are outside every window.
    k2, v2 = attention_inputs(1, 16, 64, 4, 2, 8, jnp.float32, seed=1)[1:]
    k2 = k2.at[:, :16].set(jnp.nan)
    v2 = v2.at[:, :16].set(jnp.nan)
    out = fast(q, k2, v2, causal=True, window=8, positions=Positions(q_pos + 16, None)).out
    want = attention_reference(
        q, k2, v2.at[:, :16].set(0.0), causal=True, window=8, positions=Positions(q_pos + 16, None)
    ).out
    assert_close(out, want, dtype=jnp.float32)


def test_memory_is_linear_not_quadratic():
    """Compiled temporaries grow ~linearly with the length; the T x S matrix never exists."""

    def temp_bytes(L):
        shape = jax.ShapeDtypeStruct((1, L, 4, 32), jnp.float32)
        f = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, causal=True).out)
        return f.lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes

    small, big = temp_bytes(4096), temp_bytes(16384)
    assert big < 16384 * 16384 * 4 / 8, big  # far below one float32 logits matrix per head
    assert big / small < 6.0, (small, big)  # linear (4x), not quadratic (16x)


@pytest.mark.slow  # ~40 s on 2 cores (compiles per example); CI runs it with the slow tests
@settings(max_examples=10, deadline=None)
@given(
    B=st.integers(1, 2),
    T=st.integers(1, 24),
    S=st.integers(1, 24),
    K=st.sampled_from([1, 2]),
    G=st.sampled_from([1, 2]),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 10)),
    n_segments=st.integers(0, 3),
    bq=st.integers(1, 9),
    bk=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_and_masks(B, T, S, K, G, causal, window, n_segments, bq, bk, seed):
    rng = np.random.default_rng(seed)
    q, k, v = attention_inputs(B, T, S, K * G, K, 8, jnp.float32, seed=seed)
    kw = dict(causal=causal, window=window)
    kw["positions"] = Positions(
        jnp.asarray(np.sort(rng.integers(0, 30, (B, T)), axis=1), jnp.int32),
        jnp.asarray(np.sort(rng.integers(0, 30, (B, S)), axis=1), jnp.int32),
    )
    if n_segments:
        kw["segment_ids"] = SegmentIds(
            jnp.asarray(np.sort(rng.integers(0, n_segments, (B, T)), 1)),
            jnp.asarray(np.sort(rng.integers(0, n_segments, (B, S)), 1)),
        )
    fast = functools.partial(blockwise_attention, block_sizes=BlockSizes(bq, bk))
    out, lse = fast(q, k, v, **kw)
    want, want_lse = attention_reference(q, k, v, **kw)
    assert_close(out, want, dtype=jnp.float32)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    grads = jax.grad(functools.partial(_loss, fast, kw=kw), argnums=(0, 1, 2))(q, k, v)
    wants = jax.grad(functools.partial(_loss, attention_reference, kw=kw), argnums=(0, 1, 2))(
        q, k, v
    )
    for g, w in zip(grads, wants, strict=True):
        assert_close(g, w, dtype=jnp.float32, grad=True)


# ---- errors: every documented ValueError -------------------------------------------------

_Q, _K, _V = (jnp.zeros(s, jnp.float32) for s in [(1, 4, 4, 8), (1, 6, 2, 8), (1, 6, 2, 8)])


_I = lambda *shape: jnp.zeros(shape, jnp.int32)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((_Q[0], _K, _V), {}, r"q: expected rank 4"),
        ((_Q, _K[..., :4], _V[..., :4]), {}, "k: expected head dim 8"),
        ((_Q, _K, _V[:, :5]), {}, r"v: expected the shape of k"),
        ((_Q, jnp.zeros((2, 6, 2, 8)), jnp.zeros((2, 6, 2, 8))), {}, "k: expected batch 1"),
        ((jnp.zeros((1, 4, 3, 8)), _K, _V), {}, "multiple of kv heads"),
        ((_Q.astype(jnp.bfloat16), _K, _V), {}, "k, v: expected the dtype of q"),
        ((_Q.astype(jnp.int32), _K, _V), {}, "q: expected a floating-point array"),
        ((_Q[..., :0], _K[..., :0], _V[..., :0]), {}, "q: expected head dim H >= 1"),
        ((_Q, _K[:, :, :0], _V[:, :, :0]), {}, "k: expected kv heads K >= 1"),
        (
            (_Q, _K, _V),
            {"segment_ids": (_I(1, 4), _I(1, 6))},
            "segment_ids: expected a ringattn.SegmentIds",
        ),
        (
            (_Q, _K, _V),
            {"segment_ids": SegmentIds(_I(1, 5), _I(1, 6))},
            r"segment_ids.q: expected shape \(1, 4\)",
        ),
        (
            (_Q, _K, _V),
            {"positions": Positions(jnp.zeros((1, 4)), None)},
            "positions.q: expected an integer array",
        ),
        (
            (_Q, _K, _V),
            {"positions": Positions(None, _I(6))},
            r"positions.kv: expected shape \(1, 6\)",
        ),
        ((_Q, _K, _V), {"window": 0}, "window: expected an int >= 1"),
        ((_Q, _K, _V), {"window": 2.5}, "window: expected an int >= 1"),
        ((_Q, _K, _V), {"window": (2, 3)}, "window: expected a tuple of one window per query head"),
        ((_Q, _K, _V), {"softcap": -1.0}, "softcap: expected a positive"),
        ((_Q, _K, _V), {"scale": float("nan")}, "scale: expected a finite"),
        ((_Q, _K, _V), {"causal": 1}, "causal: expected a bool"),
        ((_Q, _K, _V), {"mask": MaskSpec(), "causal": True}, "mask: expected either mask= or"),
        ((_Q, _K, _V), {"sinks": jnp.zeros(3)}, r"sinks: expected a float array of shape \(4,\)"),
        ((_Q, _K, _V), {"block_sizes": (8, 8)}, "block_sizes: expected a ringattn.BlockSizes"),
    ],
)
@pytest.mark.no_typecheck
def test_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        blockwise_attention(*args, **kwargs)
    if "block_sizes" not in kwargs:  # the oracle checks the same things
        with pytest.raises(ValueError, match=match):
            attention_reference(*args, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_q": 0}, "block_q: expected an int >= 1"),
        ({"block_kv": 1.5}, "block_kv: expected an int >= 1"),
        ({"block_q_bwd": -2}, "block_q_bwd: expected an int >= 1"),
        ({"block_kv_bwd": True}, "block_kv_bwd: expected an int >= 1"),
    ],
)
@pytest.mark.no_typecheck
def test_block_size_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockSizes(**kwargs)


@pytest.mark.parametrize(
    ("softcap", "scale"),
    [(None, -0.7)] + [pytest.param(c, s, marks=pytest.mark.slow) for c, s in
                      [(None, 0.0), (None, 0.3), (2.0, -0.7), (2.0, 0.0), (2.0, 0.3)]],
)  # fmt: skip
def test_explicit_scales_of_either_sign(scale, softcap):
    # Unmasked blocks take their row max from the raw products (the min for a negative
    # scale), masked ones from the masked logits. Every other key gets a logit near -100 and
    # the rest near 0, so a stabiliser taken from the wrong end of a row overflows exp.
    q, k, v = attention_inputs(1, 24, 32, 4, 2, 8, jnp.float32, seed=3)
    far = -100.0 / (8 * scale) if scale else 0.0
    offsets = jnp.where(jnp.arange(32) % 2 == 1, far, 0.0)[None, :, None, None]
    q = 1.0 + 0.05 * q
    k = offsets + 0.05 * k
    first = Positions(q=jnp.arange(24)[None], kv=None)  # T != S: the queries' positions
    kw = dict(scale=scale, softcap=softcap, causal=True, positions=first)
    fast = functools.partial(blockwise_attention, block_sizes=BlockSizes(8, 8))
    out, lse = fast(q, k, v, **kw)
    want, want_lse = attention_reference(q, k, v, **kw)
    assert_close(out, want, dtype=jnp.float32, what="out")
    assert_close(lse, want_lse, dtype=jnp.float32, what="lse")
    grads = jax.grad(functools.partial(_loss, fast, kw=kw), argnums=(0, 1, 2))(q, k, v)
    wants = jax.grad(functools.partial(_loss, attention_reference, kw=kw), argnums=(0, 1, 2))(
        q, k, v
    )
    for name, g, w in zip("qkv", grads, wants, strict=True):
        assert_close(g, w, dtype=jnp.float32, grad=True, what=f"d{name}")
