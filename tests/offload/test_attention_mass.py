"""Token attention mass (the H2O / TOVA input of a contiguous cache) against the reference's
probabilities, masked keys without effect (the mass-kept fractions, monitoring's, are in
tests/offload/monitoring/test_mass_kept.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from offload import token_attention_mass
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
