"""A traced ``scale`` (a temperature trained with the model) is accepted by
``blockwise_attention``, ``attention_reference`` and ``sharded_attention``: it folds into the
queries, and its gradient comes back. Checked against plain jax.numpy attention written here,
with the scale as an ordinary multiplier of the logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringattn import MaskSpec, attention_reference, blockwise_attention, sharded_attention
from tests._util import make_test_mesh

B, T, N, H = 1, 8, 2, 8


def plain(q, k, v, s, softcap=None):
    """Causal attention, ``logits = s * q k^T`` (then softcap), in jax.numpy."""
    logits = s * jnp.einsum("btnh,bsnh->bnts", q, k)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    logits = jnp.where(jnp.tril(jnp.ones((T, T), bool)), logits, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)


def inputs():
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (B, T, N, H)) for key in keys[:3])
    w = jax.random.normal(keys[3], (B, T, N, H))  # a loss that weighs every output
    return q, k, v, w


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("attend", ["blockwise", "reference"])
def test_traced_scale_forward_and_gradients_under_jit(attend, softcap):
    fn = {"blockwise": blockwise_attention, "reference": attention_reference}[attend]
    q, k, v, w = inputs()
    s = jnp.float32(0.7)

    def loss(q, k, v, s):
        return jnp.sum(fn(q, k, v, causal=True, softcap=softcap, scale=s).out * w)

    def want(q, k, v, s):
        return jnp.sum(plain(q, k, v, s, softcap) * w)

    out = jax.jit(lambda s: fn(q, k, v, causal=True, softcap=softcap, scale=s).out)(s)
    np.testing.assert_allclose(out, plain(q, k, v, s, softcap), rtol=1e-5, atol=1e-6)
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, s)
    ref = jax.grad(want, argnums=(0, 1, 2, 3))(q, k, v, s)
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    assert abs(float(got[3])) > 1e-3  # the temperature's gradient is not trivially zero


def test_traced_scale_through_sharded_attention():
    mesh = make_test_mesh((2,), ("seq",))
    q, k, v, w = inputs()

    def loss(q, s):
        out = sharded_attention(q, k, v, mesh=mesh, seq_axis="seq", causal=True, scale=s).out
        return jnp.sum(out * w)

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, jnp.float32(0.7))
    ref = jax.grad(lambda q, s: jnp.sum(plain(q, k, v, s) * w), argnums=(0, 1))(q, 0.7)
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.no_typecheck
def test_a_traced_scale_must_be_a_float_scalar():
    q, k, v, _ = inputs()
    with pytest.raises(ValueError, match=r"blockwise_attention: scale: expected a float scalar"):
        jax.jit(lambda s: blockwise_attention(q, k, v, scale=s))(jnp.ones(2))


@pytest.mark.no_typecheck
def test_other_traced_options_and_a_traced_mask_spec_scale_still_say_bind_them():
    """Only the ``scale=`` keyword folds; a MaskSpec is static, so a traced scale inside one is
    the "options are static" error, as is a traced softcap."""
    q, k, v, _ = inputs()
    with pytest.raises(ValueError, match=r"MaskSpec: scale: expected .* known before tracing"):
        jax.jit(lambda s: blockwise_attention(q, k, v, mask=MaskSpec(scale=s)))(0.5)
    with pytest.raises(ValueError, match=r"softcap: expected .* known before tracing"):
        jax.jit(lambda c: blockwise_attention(q, k, v, softcap=c))(2.0)
