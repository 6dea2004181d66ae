"""Every jittable public function of ``offload`` under ``jax.jit`` with its options bound by
``functools.partial`` (as the docstrings say), equal to the eager call; degenerate shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from offload import (
    RetentionPolicy,
    budget_units,
    init_policy_state,
    mass_kept_from_lse,
    mixed_residency_attention,
    select_keep,
    split_residency,
    token_attention_mass,
    update_policy_state,
)
from offload.monitoring import mass_kept_from_page_mass

B, T, N, K, H, C, M = 2, 1, 4, 2, 8, 4, 3
POOL = B * M + 1


def _equal(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


def _both(fn, *args):
    """Runs ``fn`` eagerly and under jit and checks they agree."""
    eager = fn(*args)
    jitted = jax.jit(fn)(*args)
    _equal(jitted, eager)
    return jitted


def _data(seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, M * C, K, H)), jnp.float32)
    pages = jnp.asarray(rng.standard_normal((K, POOL, C, H)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, POOL)).reshape(B, M), jnp.int32)
    lengths = jnp.array([C + 1, M * C], jnp.int32)
    return q, k, pages, table, lengths


@pytest.mark.parametrize(
    "policy",
    [
        RetentionPolicy("h2o", 0.5, page_size=C, sink=1, recent=1),
        RetentionPolicy("scissorhands", 0.5, page_size=C, sink=1, recent=1, history=4),
    ],
    ids=lambda p: p.kind,
)
def test_policy_functions_under_jit(policy):
    state = _both(functools.partial(init_policy_state, B, M, policy=policy))
    mass = jnp.asarray(np.random.default_rng(1).random((B, N, M)), jnp.float32)
    state = _both(functools.partial(update_policy_state, policy=policy), state, mass)
    _, _, _, table, lengths = _data()
    select = functools.partial(select_keep, policy=policy, mode="drop")
    sel = _both(lambda s, n, t: select(s, n, page_table=t), state, lengths, table)
    assert not np.asarray(sel.demote).any() and np.asarray(sel.drop).any()
    n_live = jnp.array([2, 3], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(_both(functools.partial(budget_units, policy), n_live)), [1, 2]
    )


def test_attention_mass_functions_under_jit():
    q, k, _, _, lengths = _data(2)
    mass = _both(functools.partial(token_attention_mass, causal=False, scale=0.5), q, k, lengths)
    assert mass.shape == (B, N, M * C)
    _both(mass_kept_from_lse, jnp.array([-1.0, -jnp.inf]), jnp.array([0.0, -jnp.inf]))
    keep = jnp.array([[True, False, True], [False, True, True]])
    _both(mass_kept_from_page_mass, mass.reshape(B, N, M, C).sum(-1), keep)
    _both(split_residency, jnp.array([[3, 5, 7], [1, 2, 4]]), keep, ~keep)


@pytest.mark.parametrize(
    "options",
    [dict(), dict(window=3, softcap=4.0), dict(causal=False, return_page_mass=True)],
    ids=["default", "window-softcap", "noncausal-page-mass"],
)
def test_mixed_residency_attention_under_jit(options):
    q, _, pages, table, lengths = _data(3)
    keep = jnp.asarray(np.random.default_rng(3).random((B, M)) < 0.5)
    device_table, cold_table = split_residency(table, keep, ~keep)
    fn = functools.partial(mixed_residency_attention, **options)

    def run(q, kp, vp, dt, ln, ct):
        return fn(q, kp, vp, dt, ln, cold_table=ct)

    res = _both(run, q, pages, pages, device_table, lengths, cold_table)
    assert (res.page_mass is None) == ("return_page_mass" not in options)


def test_degenerate_shapes_name_the_argument():
    q, k, pages, table, lengths = _data(4)
    empty_q = jnp.zeros((0, T, N, H))
    # Batch 0 works: an empty result.
    assert token_attention_mass(empty_q, k[:0], lengths[:0]).shape == (0, N, M * C)
    res = mixed_residency_attention(empty_q, pages, pages, table[:0], lengths[:0])
    assert res.out.shape == (0, T, N, H)


@pytest.mark.no_typecheck
def test_degenerate_shapes_rejected_with_named_argument():
    q, k, pages, table, lengths = _data(4)
    with pytest.raises(ValueError, match=r"token_attention_mass: q: expected head dim H >= 1"):
        token_attention_mass(q[..., :0], k[..., :0], lengths)
    with pytest.raises(ValueError, match=r"token_attention_mass: k: expected kv heads K >= 1"):
        token_attention_mass(q, k[:, :, :0], lengths)
    with pytest.raises(ValueError, match=r"mixed_residency_attention: k_pages: expected non-zero"):
        mixed_residency_attention(q[..., :0], pages[..., :0], pages[..., :0], table, lengths)
    with pytest.raises(
        ValueError, match=r"mixed_residency_attention: k_pages: expected kv heads K >= 1 .* got K=0"
    ):
        mixed_residency_attention(q, pages[:0], pages[:0], table, lengths)
    with pytest.raises(ValueError, match=r"token_attention_mass: scale: expected a float in"):
        token_attention_mass(q, k, lengths, scale=0.0)
    with pytest.raises(
        ValueError, match=r"token_attention_mass: scale: expected a float, got bool"
    ):
        token_attention_mass(q, k, lengths, scale=True)


def test_mixed_residency_attention_under_vmap_over_layers():
    """Pools stacked over layers: vmap over L equals the per-layer calls (jit on top)."""
    q, _, pages, table, lengths = _data(5)
    layers = jnp.stack([pages, -pages, 2 * pages])  # [L, K, P, C, H]
    keep = jnp.asarray(np.random.default_rng(5).random((B, M)) < 0.5)
    device_table, cold_table = split_residency(table, keep, ~keep)
    sinks = jnp.linspace(-1.0, 1.0, N)
    fn = functools.partial(mixed_residency_attention, window=5, sinks=sinks)

    def one(kp):
        return fn(q, kp, kp, device_table, lengths, cold_table=cold_table)

    stacked = jax.jit(jax.vmap(one))(layers)
    for layer in range(layers.shape[0]):
        _equal(jax.tree.map(lambda x, i=layer: x[i], stacked), one(layers[layer]))
