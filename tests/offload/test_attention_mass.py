"""Attention-mass helpers: token mass against the reference's probabilities, masked keys
without effect, and the mass-kept fractions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from offload import mass_kept_from_lse, mass_kept_from_page_mass, token_attention_mass
from ringattn import Positions, SegmentIds, attention_reference
from tests._util import assert_close


def test_token_attention_mass_matches_reference_probabilities():
    rng = np.random.default_rng(2)
    B, T, N, K, S = 2, 3, 4, 2, 10
    H = S  # values are one-hot rows of the identity, so v and k share the head dim
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    lengths = jnp.array([10, 6])
    mass = token_attention_mass(q, k, lengths)
    # Attention probabilities are the output for identity values: v = one-hot of the key.
    eye = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32)[None, :, None, :], (B, S, K, S))
    q_pos = lengths[:, None] - T + jnp.arange(T)[None]
    seg_kv = (jnp.arange(S)[None] < lengths[:, None]).astype(jnp.int32)
    probs = jax.jit(attention_reference, static_argnames=("causal",))(
        q,
        k,
        eye,
        causal=True,
        positions=Positions(q_pos, jnp.broadcast_to(jnp.arange(S)[None], (B, S))),
        segment_ids=SegmentIds(jnp.ones((B, T), jnp.int32), seg_kv),
    ).out  # [B, T, N, S]
    assert_close(mass, probs.sum(1), dtype=jnp.float32, what="token mass")
    assert_close(mass.sum(-1), jnp.full((B, N), T), dtype=jnp.float32, what="row sums")


@pytest.mark.parametrize("causal", [True, False])
def test_masked_keys_have_no_effect_even_when_nan(causal):
    """Keys beyond lengths, or in the causal future, may hold NaN/inf: nothing changes."""
    rng = np.random.default_rng(5)
    B, T, N, K, S, H = 2, 2, 2, 1, 8, 4
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    lengths = jnp.array([5, 3])
    q_positions = jnp.array([[1, 2], [1, 2]])
    clean = token_attention_mass(q, k, lengths, q_positions=q_positions, causal=causal)
    hidden = jnp.arange(S)[None, :] >= lengths[:, None]  # beyond lengths
    if causal:
        hidden |= jnp.arange(S)[None, :] > 2  # in every query's future
    poison = jnp.where(jnp.arange(S) % 2 == 0, jnp.nan, jnp.inf)[None, :, None, None]
    dirty_k = jnp.where(hidden[:, :, None, None], poison, k)
    dirty = token_attention_mass(q, dirty_k, lengths, q_positions=q_positions, causal=causal)
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))
    assert not np.asarray(dirty)[np.broadcast_to(hidden[:, None], dirty.shape)].any()


def test_mass_kept_helpers():
    lse_full = jnp.array([0.0, -jnp.inf, 1.0])
    lse_kept = jnp.array([jnp.log(0.25), -jnp.inf, -jnp.inf])
    np.testing.assert_allclose(np.asarray(mass_kept_from_lse(lse_kept, lse_full)), [0.25, 1, 0])
    pm = jnp.array([[[0.5, 0.25, 0.25], [0.0, 0.0, 0.0]]])
    keep = jnp.array([[True, False, True]])
    np.testing.assert_allclose(np.asarray(mass_kept_from_page_mass(pm, keep)), [[0.75, 1.0]])


@pytest.mark.no_typecheck
def test_mass_kept_errors():
    with pytest.raises(ValueError, match="mass_kept_from_lse: lse_kept: expected lse_full's shape"):
        mass_kept_from_lse(jnp.zeros(2), jnp.zeros(3))
    with pytest.raises(
        ValueError, match=r"mass_kept_from_page_mass: page_mass: expected \[B, N, M\]"
    ):
        mass_kept_from_page_mass(jnp.zeros((2, 3)), jnp.ones((1, 3), bool))
