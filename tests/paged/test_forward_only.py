"""Paged attention is forward only: differentiating it says so and names what to train with
(it ended in JAX's "Reverse-mode differentiation does not work for lax.while_loop")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged

MESSAGE = r"paged_attention: differentiation .* not supported: paged attention is forward only"
RAGGED = r"ragged_paged_attention: differentiation .* not supported"
TRAIN = r"ringattn.blockwise_attention .* paged.gather_kv"


def pools(seed=0):
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal((1, 4, 4, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 4, 4, 8)), jnp.float32)
    return k, v, jnp.array([[2, 1, 3]]), jnp.array([10])


def decode(q, k, v, table, lengths):
    return paged.paged_attention(q, k, v, table, lengths).out


def ragged(q, k, v):
    table, lengths = jnp.array([[1, 2], [3, 0]]), jnp.array([6, 3])
    return paged.ragged_paged_attention(q, k, v, table, lengths, jnp.array([0, 2, 3]), 2).out


def test_grad_of_paged_attention_says_forward_only_and_what_to_use():
    k, v, table, lengths = pools()
    q = jnp.ones((1, 1, 2, 8))
    for argnums in (0, 1, 2):
        loss = lambda *a: decode(*a, table, lengths).sum()
        with pytest.raises(NotImplementedError, match=MESSAGE) as err:
            jax.grad(loss, argnums=argnums)(q, k, v)
        assert "ringattn.blockwise_attention" in str(err.value)
        assert "paged.gather_kv" in str(err.value)
    with pytest.raises(NotImplementedError, match=MESSAGE):
        jax.jit(jax.grad(lambda q: decode(q, k, v, table, lengths).sum()))(q)


def test_jvp_and_jacfwd_of_paged_attention_say_forward_only():
    k, v, table, lengths = pools()
    q = jnp.ones((1, 1, 2, 8))
    f = lambda q: decode(q, k, v, table, lengths)
    with pytest.raises(NotImplementedError, match=MESSAGE):
        jax.jvp(f, (q,), (q,))
    with pytest.raises(NotImplementedError, match=MESSAGE):
        jax.jacfwd(f)(q)


def test_grad_of_ragged_paged_attention_says_forward_only():
    k, v, _, _ = pools()
    q = jnp.ones((3, 2, 8))
    with pytest.raises(NotImplementedError, match=RAGGED):
        jax.grad(lambda q: ragged(q, k, v).sum())(q)
    with pytest.raises(NotImplementedError, match=RAGGED):
        jax.jvp(lambda q: ragged(q, k, v), (q,), (q,))


def test_grad_of_sharded_paged_attention_says_forward_only():
    from jax.sharding import AxisType, Mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",), axis_types=(AxisType.Auto,))
    k, v, _, _ = pools()
    table, lengths = jnp.array([[1, 2]]), jnp.array([7])

    def f(q):
        return paged.sharded_paged_attention(q, k, v, table, lengths, mesh=mesh, seq_axis="seq")

    q = jnp.ones((1, 1, 2, 8))
    assert f(q).out.shape == (1, 1, 2, 8)
    with pytest.raises(NotImplementedError, match="sharded_paged_attention: differentiation"):
        jax.grad(lambda q: f(q).out.sum())(q)


def test_the_message_names_what_to_train_with():
    k, v, table, lengths = pools()
    with pytest.raises(NotImplementedError, match=TRAIN):
        jax.grad(lambda q: decode(q, k, v, table, lengths).sum())(jnp.ones((1, 1, 2, 8)))


def test_forward_and_stop_gradient_are_unaffected():
    """The guard changes no value: eager, jit and vmap agree, and a loss that stops the
    gradient at paged attention's inputs differentiates (the rule is never called)."""
    k, v, table, lengths = pools()
    q = jnp.asarray(np.random.default_rng(1).standard_normal((1, 1, 2, 8)), jnp.float32)
    eager = decode(q, k, v, table, lengths)
    np.testing.assert_array_equal(jax.jit(decode)(q, k, v, table, lengths), eager)
    batched = jax.vmap(decode, in_axes=(0, None, None, None, None))(q[None], k, v, table, lengths)
    np.testing.assert_array_equal(batched[0], eager)

    def loss(q):
        attended = decode(jax.lax.stop_gradient(q), k, v, table, lengths)
        return jnp.sum(attended * q)

    np.testing.assert_allclose(jax.grad(loss)(q), eager, rtol=0, atol=0)
