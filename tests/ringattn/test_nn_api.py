"""ringattn.dot_product_attention against jax.nn.dot_product_attention itself.

The cases are those of JAX's own tests of ``jax.nn.dot_product_attention`` (``tests/nn_test.py``:
``testDotProductAttention`` over GQA group sizes with and without ``vmap``,
``testDotProductAttentionMask`` over its mask modes, ``testDotProductAttentionBiasGradient``
with a full bias, a 3-D mask and ``vmap`` over 3-D inputs), in float32 with
``implementation="xla"`` as the oracle, at a smaller size (``T = S = 24``) with 8 x 8 blocks,
so every case crosses several blocks of the kernels. Forward and ``(dq, dk, dv, dbias)`` are
compared with the library's tolerance table (float32: 1e-5 forward, 5e-5 gradients, max abs).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringattn
from ringattn import BlockSizes
from tests._util import assert_close

B, T, S, N, H = 2, 24, 24, 4, 8
BLOCKS = BlockSizes(block_q=8, block_kv=8)
F32 = jnp.float32


def _inputs(T=T, S=S, K=N, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, T, N, H), F32)
    k = jax.random.normal(ks[1], (B, S, K, H), F32)
    v = jax.random.normal(ks[2], (B, S, K, H), F32)
    dout = jax.random.normal(ks[3], (B, T, N, H), F32)
    return q, k, v, dout, ks[4]


def _ours(*args, **kwargs):
    return ringattn.dot_product_attention(*args, block_sizes=BLOCKS, **kwargs)


def _theirs(*args, **kwargs):
    return jax.nn.dot_product_attention(*args, implementation="xla", **kwargs)


def _compare(q, k, v, dout, bias, mask, what, **kwargs):
    """Forward and (dq, dk, dv[, dbias]) of ours against jax.nn's, one vjp each."""
    results = []
    for fn in (_ours, _theirs):
        f = functools.partial(fn, **kwargs)
        primals = (q, k, v) if bias is None else (q, k, v, bias)
        out, vjp = jax.vjp(lambda *a, f=f: f(*a[:3], a[3] if len(a) > 3 else None, mask), *primals)
        results.append((out, vjp(dout)))
    (out, grads), (ref, ref_grads) = results
    assert_close(out, ref, dtype=F32, what=f"{what}: out")
    names = ("dq", "dk", "dv", "dbias")[: len(grads)]
    for name, g, r in zip(names, grads, ref_grads, strict=True):
        assert_close(g, r, dtype=F32, grad=True, what=f"{what}: {name}")


# vmap with G = 2 runs by default (and vmap over 3-D inputs with a bias in
# test_full_bias_gradient_matches_jax_nn); G = 1 and 4 under vmap with the slow tests.
@pytest.mark.parametrize(
    "group, use_vmap",
    [(1, False), (2, False), (4, False), (2, True)]
    + [pytest.param(g, True, marks=pytest.mark.slow) for g in (1, 4)],
)
def test_gqa_matches_jax_nn(group, use_vmap):
    """testDotProductAttention: MHA, GQA and MQA (N // K = 1, 2, 4), with and without vmap."""
    q, k, v, dout, _ = _inputs(K=N // group)
    if not use_vmap:
        _compare(q, k, v, dout, None, None, f"G={group}")
        return
    ours = jax.vmap(_ours, in_axes=(0, 0, 0, None, None))  # vmap over B: 3-D inputs inside
    theirs = jax.vmap(_theirs, in_axes=(0, 0, 0, None, None))
    out, vjp = jax.vjp(lambda *a: ours(*a, None, None), q, k, v)
    ref, ref_vjp = jax.vjp(lambda *a: theirs(*a, None, None), q, k, v)
    assert_close(out, ref, dtype=F32, what="vmap out")
    for name, g, r in zip(("dq", "dk", "dv"), vjp(dout), ref_vjp(dout), strict=True):
        assert_close(g, r, dtype=F32, grad=True, what=f"vmap {name}")


# jax.nn's single modes "bias", "causal" and "custom" are each inside a composite that runs
# by default ("bias" and "causal" in ("bias", "causal"), "custom" in ("custom", "padding"));
# they run alone with the slow tests.
SINGLE_MODES = ["bias", "causal", "custom"]
MASK_MODES = [pytest.param(m, marks=pytest.mark.slow) for m in SINGLE_MODES] + [
    "padding",
    ("causal", "padding"),
    ("custom", "padding"),
    ("bias", "causal"),
    ("causal", "sliding_window"),
    ("causal", "custom"),
    ("sliding_window",),  # not in jax.nn's list (cuDNN lacks it): a two-sided window
    # A wider left window: with (3, 2), padding would leave queries 9-11 of batch 0 seeing
    # no key, where jax.nn differs (test_fully_masked_rows_differ_from_jax_nn_as_documented).
    ("bias", "padding", "wide_window", "scale"),
]


@pytest.mark.parametrize("mode", MASK_MODES, ids=str)
def test_mask_modes_match_jax_nn(mode):
    """testDotProductAttentionMask's modes: bias [1, N, T, S], causal, padding lengths,
    a custom [1, 1, T, S] mask, a (3, 2) window; gradients include dbias."""
    mode = (mode,) if isinstance(mode, str) else mode
    q, k, v, dout, key = _inputs()
    bias = jax.random.normal(key, (1, N, T, S), F32) if "bias" in mode else None
    mask = jnp.tril(jnp.ones((T, S), bool))[None, None] if "custom" in mode else None
    kwargs = dict(is_causal="causal" in mode)
    if "padding" in mode:
        kwargs["query_seq_lengths"] = jnp.array([T // 2, T // 4], jnp.int32)
        kwargs["key_value_seq_lengths"] = jnp.array([S // 4, S // 2], jnp.int32)
    if "sliding_window" in mode:
        kwargs["local_window_size"] = (3, 2)
    if "wide_window" in mode:
        kwargs["local_window_size"] = (8, 2)
    if "scale" in mode:
        kwargs["scale"] = 0.3
    _compare(q, k, v, dout, bias, mask, str(mode), **kwargs)


TQ, SK = 16, 24  # T != S for the broadcast cases


@pytest.mark.parametrize(
    "bias_shape, mask_shape",
    [
        ((B, N, TQ, SK), None),
        ((B, 1, 1, SK), (1, N, TQ, 1)),  # key-padding-style bias, per-head row mask
        ((TQ, SK), (B, 1, TQ, SK)),  # 2-D bias: leading axes added, as jax.nn does
        (None, (N, TQ, SK)),  # 3-D mask
    ],
    ids=str,
)
def test_bias_and_mask_shapes_match_jax_nn(bias_shape, mask_shape):
    """Every broadcast pattern of bias and mask (axes of size 1, missing leading axes),
    with GQA (K = 2) and T != S under a causal mask (jax.nn aligns it top-left)."""
    q, k, v, dout, key = _inputs(T=TQ, S=SK, K=2)
    kb, km = jax.random.split(key)
    bias = None if bias_shape is None else jax.random.normal(kb, bias_shape, F32)
    mask = None
    if mask_shape is not None:
        mask = jax.random.bernoulli(km, 0.8, mask_shape)
        # every query keeps key 0 (no row fully masked: there jax.nn differs, see below)
        mask = mask.at[..., 0].set(True)
    _compare(q, k, v, dout, bias, mask, f"{bias_shape} {mask_shape}", is_causal=True)


@pytest.mark.parametrize("use_vmap", [False, True])
def test_full_bias_gradient_matches_jax_nn(use_vmap):
    """testDotProductAttentionBiasGradient: x as q, k and v, bias [B, N, S, S], a 3-D mask
    [1, 1, S]; with vmap over B (3-D inputs and bias inside, the mask shared)."""
    x, _, _, _, key = _inputs()
    bias = jax.random.normal(key, (B, N, S, S), F32)
    mask = jnp.ones((1, 1, S), bool)

    def attention(fn, x, bias, mask):
        return fn(x, x, x, bias, mask)

    grads = []
    for fn in (_ours, _theirs):
        f = functools.partial(attention, fn)
        if use_vmap:
            f = jax.vmap(f, in_axes=(0, 0, None))
        out, vjp = jax.vjp(f, x, bias, mask)
        grads.append((out, *vjp(x)[:2]))
    for name, a, r in zip(("out", "dx", "dbias"), *grads, strict=True):
        assert_close(a, r, dtype=F32, grad=name != "out", what=name)


def test_jit_and_traced_lengths_and_scale():
    """Under jit with the static options bound, lengths, bias and a traced scale as
    arguments; the scale's gradient too."""
    q, k, v, dout, key = _inputs()
    bias = jax.random.normal(key, (B, 1, T, S), F32)
    lengths = jnp.array([T - 3, 5], jnp.int32)

    def loss(fn, q, bias, scale, lengths):
        out = fn(q, k, v, bias, None, scale=scale, is_causal=True, key_value_seq_lengths=lengths)
        return jnp.sum(out * dout)

    ours = jax.jit(jax.value_and_grad(functools.partial(loss, _ours), argnums=(0, 1, 2)))
    theirs = jax.value_and_grad(functools.partial(loss, _theirs), argnums=(0, 1, 2))
    (val, grads), (ref, ref_grads) = ours(q, bias, 0.4, lengths), theirs(q, bias, 0.4, lengths)
    assert_close(val, ref, dtype=F32, grad=True, what="loss")
    for name, g, r in zip(("dq", "dbias", "dscale"), grads, ref_grads, strict=True):
        assert_close(g, r, dtype=F32, grad=True, what=name)


def test_nan_under_the_mask_does_not_leak():
    """NaN in the bias where the mask hides the pair, and in the keys and values no query
    may see (masked out for every query, or beyond key_value_seq_lengths), reach nothing.
    jax.nn agrees on the bias (its where drops it) but not on the values (0 * NaN), so the
    output is compared with jax.nn run on the same inputs with those values zeroed."""
    q, k, v, dout, key = _inputs()
    allowed = jax.random.bernoulli(key, 0.7, (B, N, T, S)).at[..., 0].set(True)
    allowed = allowed.at[..., 5].set(False)  # key 5: no query sees it
    bias = jnp.where(allowed, jax.random.normal(key, (B, N, T, S), F32), jnp.nan)
    lengths = jnp.array([S - 2, S], jnp.int32)
    hidden = (jnp.arange(S) == 5)[None, :, None, None] | (
        jnp.arange(S)[None, :, None, None] >= lengths[:, None, None, None]
    )
    poisoned = [jnp.where(hidden, jnp.nan, x) for x in (k, v)]
    clean = [jnp.where(hidden, 0.0, x) for x in (k, v)]
    kw = dict(key_value_seq_lengths=lengths)

    def grads(fn, k, v):
        f = lambda q, k, v, b: jnp.sum(fn(q, k, v, b, allowed, **kw) * dout)
        return jax.value_and_grad(f, argnums=(0, 1, 2, 3))(q, k, v, bias)

    (val, g), (ref, ref_g) = grads(_ours, *poisoned), grads(_theirs, *clean)
    assert_close(val, ref, dtype=F32, grad=True, what="loss")
    # jax.nn lets such NaN through (0 * NaN in probs @ value), as the docs say.
    assert np.isnan(np.asarray(_theirs(q, *poisoned, bias, allowed, **kw))).any()
    # assert_close also checks that every entry is finite (dk, dv are 0 at hidden keys).
    for name, a, r in zip(("dq", "dk", "dv", "dbias"), g, ref_g, strict=True):
        assert_close(a, r, dtype=F32, grad=True, what=name)


def test_fully_masked_rows_differ_from_jax_nn_as_documented():
    """A query that sees no key: 0 here (and zero gradients), the mean of all values in
    jax.nn (uniform softmax over its large finite negative logits)."""
    q, k, v, dout, _ = _inputs()
    mask = jnp.ones((B, 1, T, S), bool).at[0, 0, 3].set(False)  # batch 0, query 3: nothing
    out = _ours(q, k, v, None, mask)
    ref = _theirs(q, k, v, None, mask)
    np.testing.assert_array_equal(np.asarray(out[0, 3]), 0.0)
    assert_close(ref[0, 3], jnp.mean(v[0], axis=0), dtype=F32, what="jax.nn's masked row")
    keep = jnp.ones((B, T), bool).at[0, 3].set(False)[..., None, None]
    assert_close(jnp.where(keep, out, 0), jnp.where(keep, ref, 0), dtype=F32, what="others")
    dq = jax.grad(lambda q: jnp.sum(_ours(q, k, v, None, mask) * dout))(q)
    np.testing.assert_array_equal(np.asarray(dq[0, 3]), 0.0)


def test_flax_nnx_multi_head_attention_swaps_it_in():
    """flax.nnx.MultiHeadAttention(attention_fn=...) with GQA, a causal mask from
    nnx.make_causal_mask (a float mask, cast as Flax casts it): the same outputs and
    parameter gradients as Flax's default (which calls jax.nn.dot_product_attention)."""
    nnx = pytest.importorskip("flax.nnx")

    # The adapter of docs/concepts/semantics.md ("jax.nn compatibility"), with our blocks.
    def attention_fn(
        query, key, value, bias=None, mask=None, *, dropout_rate=0.0, module=None,
        is_causal=False, **unused,
    ):  # fmt: skip
        if dropout_rate or module is not None:
            raise NotImplementedError("no attention dropout or sown weights")
        mask = None if mask is None else mask.astype(bool)  # Flax's masks are float
        return _ours(query, key, value, bias, mask, is_causal=is_causal)

    x = jax.random.normal(jax.random.key(3), (B, T, 16), F32)
    mask = nnx.make_causal_mask(jnp.ones((B, T)))

    def loss(model):
        return jnp.sum(model(x, mask=mask) ** 2)

    grads = []
    for fn in (attention_fn, nnx.dot_product_attention):
        model = nnx.MultiHeadAttention(
            num_heads=N,
            num_kv_heads=2,
            in_features=16,
            qkv_features=16,
            attention_fn=fn,
            decode=False,
            rngs=nnx.Rngs(0),
        )
        grads.append((model(x, mask=mask), nnx.grad(loss)(model)))
    (out, g), (ref, ref_g) = grads
    assert_close(out, ref, dtype=F32, what="nnx out")
    for a, r in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g), strict=True):
        assert_close(a, r, dtype=F32, grad=True, what="nnx param grads")


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(implementation="cudnn"), "implementation: expected None or 'xla', got 'cudnn'"),
        (dict(implementation="pallas"), "implementation: expected None or 'xla'"),
        (dict(bias=np.zeros((1, 3, T, S), np.float32)), r"bias: .*axis 1: 1 or N=4"),
        (dict(bias=np.zeros((1, 1, 1, 1, S), np.float32)), "bias: expected a floating-point"),
        (dict(bias=np.zeros((T, S), np.int32)), "bias: expected a floating-point array"),
        (dict(mask=np.ones((1, 1, T, S), np.float32)), "mask: expected a bool array"),
        (dict(mask=np.ones((1, 1, T + 1, S), bool)), r"mask: .*axis 2: 1 or T=24"),
        (dict(query_seq_lengths=jnp.ones((3,), jnp.int32)), r"query_seq_lengths: .*\(2,\)"),
        (dict(key_value_seq_lengths=jnp.ones((B,))), "key_value_seq_lengths: expected an int"),
        (dict(local_window_size=-1), "local_window_size: expected an int >= 0"),
        (dict(local_window_size=(2, 1.5)), r"local_window_size\[1\]: expected an int"),
        (dict(is_causal=1), "is_causal: expected a bool"),
        (dict(query=np.zeros((T, N), np.float32)), "query: expected a floating-point array"),
        (dict(value=np.zeros((B, S, N, H + 1), np.float32)), "value: expected the shape of"),
        (
            dict(key=np.zeros((B, S, 3, H), F32), value=np.zeros((B, S, 3, H), F32)),
            "key: expected the",
        ),
        (dict(key=np.zeros((S, N, H), np.float32)), "key: expected rank 4"),
        (dict(value=np.zeros((B, S, N, H), np.float16)), "key, value: expected the dtype"),
    ],
    ids=lambda x: str(x)[:40] if isinstance(x, str) else None,
)
def test_errors(change, match):
    q, k, v, _, _ = _inputs()
    args = dict(query=q, key=k, value=v)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        ringattn.dot_product_attention(**args)


@pytest.mark.no_typecheck
def test_dtype_mismatch_and_traced_option_errors():
    q, k, v, _, _ = _inputs()
    with pytest.raises(ValueError, match=r"key, value: expected the dtype of query \(float32\)"):
        ringattn.dot_product_attention(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="is_causal: expected a bool known before tracing"):
        jax.jit(ringattn.dot_product_attention)(q, k, v, is_causal=True)
