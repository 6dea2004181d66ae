"""merge_attention and the online-softmax primitives: exactness, identity, no NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringattn import (
    AttentionOutput,
    Positions,
    attention_reference,
    finalize_online_softmax,
    init_online_softmax,
    merge_attention,
    update_online_softmax,
)
from tests._util import assert_close


def _qkv(S=12, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (2, 5, 4, 8))
    k = jax.random.normal(ks[1], (2, S, 2, 8))
    v = jax.random.normal(ks[2], (2, S, 2, 8))
    return q, k, v


def _partial(q, k, v, idx):
    return attention_reference(
        q, k[:, idx], v[:, idx], positions=Positions(None, jnp.asarray(idx)[None].repeat(2, 0))
    )


def test_merge_of_disjoint_key_sets_is_exact_and_associative():
    q, k, v = _qkv()
    want, want_lse = attention_reference(q, k, v)
    parts = [_partial(q, k, v, idx) for idx in (np.arange(0, 3), np.arange(3, 9), np.arange(9, 12))]
    left = merge_attention(*merge_attention(*parts[0], *parts[1]), *parts[2])
    right = merge_attention(*parts[0], *merge_attention(*parts[1], *parts[2]))
    swapped = merge_attention(*parts[2], *merge_attention(*parts[1], *parts[0]))
    for merged in (left, right, swapped):
        assert isinstance(merged, AttentionOutput)
        out, lse = merged
        assert_close(out, want, dtype=jnp.float32)
        assert_close(lse, want_lse, dtype=jnp.float32)


def test_empty_side_is_identity_and_both_empty_is_finite():
    q, k, v = _qkv()
    out, lse = attention_reference(q, k, v)
    empty_out, empty_lse = jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf)
    for merged in (
        merge_attention(out, lse, empty_out, empty_lse),
        merge_attention(empty_out, empty_lse, out, lse),
    ):
        assert_close(merged[0], out, dtype=jnp.float32)
        assert_close(merged[1], lse, dtype=jnp.float32)
    both = merge_attention(empty_out, empty_lse, empty_out, empty_lse)
    assert not np.asarray(both[0]).any() and np.isneginf(np.asarray(both[1])).all()

    def loss(oa, la, ob, lb):
        o, lse = merge_attention(oa, la, ob, lb)
        return jnp.sum(o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(empty_out, empty_lse, empty_out, empty_lse)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_merge_gradients_match_joint_attention():
    q, k, v = _qkv()
    idx_a, idx_b = np.arange(0, 7), np.arange(7, 12)

    def merged_loss(q, k, v):
        out, lse = merge_attention(*_partial(q, k, v, idx_a), *_partial(q, k, v, idx_b))
        return jnp.sum(out * jnp.sin(out)) + jnp.sum(lse)

    def joint_loss(q, k, v):
        out, lse = attention_reference(q, k, v)
        return jnp.sum(out * jnp.sin(out)) + jnp.sum(lse)

    for g, w in zip(
        jax.grad(merged_loss, (0, 1, 2))(q, k, v),
        jax.grad(joint_loss, (0, 1, 2))(q, k, v),
        strict=True,
    ):
        assert_close(g, w, dtype=jnp.float32, grad=True)


def test_merge_keeps_dtype():
    out = jnp.ones((1, 3, 2, 4), jnp.bfloat16)
    lse = jnp.zeros((1, 3, 2))
    merged, merged_lse = merge_attention(out, lse, out, lse)
    assert merged.dtype == jnp.bfloat16 and merged_lse.dtype == jnp.float32
    assert_close(merged_lse, jnp.full((1, 3, 2), np.log(2.0)), dtype=jnp.float32)


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((1, 3, 2, 4), (1, 3, 2), (1, 3, 2, 5), (1, 3, 2)), "out_b: expected the shape of out_a"),
        (((1, 3, 2, 4), (1, 3, 2), (1, 3, 2, 4), (1, 3, 1)), "lse_b: expected the shape of lse_a"),
        (((1, 3, 2, 4), (1, 3, 4), (1, 3, 2, 4), (1, 3, 4)), "without its last"),
    ],
)
@pytest.mark.no_typecheck
def test_merge_errors(shapes, match):
    with pytest.raises(ValueError, match=match):
        merge_attention(*(jnp.zeros(s) for s in shapes))


def test_online_softmax_blocks_equal_dense_softmax():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(3, 5, 20)).astype(np.float32)
    scores[1, 2, :] = -np.inf  # an empty row
    scores[2, :, 7:] = -np.inf  # masked tail
    v = rng.normal(size=(3, 20, 6)).astype(np.float32)
    state = init_online_softmax((3, 5), 6)
    for start in range(0, 20, 6):
        state = update_online_softmax(
            state, scores[..., start : start + 6], v[:, start : start + 6]
        )
    out, lse = finalize_online_softmax(state)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = scores.max(-1, keepdims=True)
        p = np.exp(scores - np.where(np.isneginf(m), 0, m))
        want = np.nan_to_num((p / p.sum(-1, keepdims=True)) @ v)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)
    assert np.isneginf(np.asarray(lse)[1, 2]) and not np.asarray(out)[1, 2].any()
    with pytest.raises(ValueError, match=r"init_online_softmax: shape\[1\]: expected an int >= 0"):
        init_online_softmax((3, -1), 6)
