"""The forward kernel's fixed-max loop and the bound that guards it.

Per query block the first full key block sets each row's max; the remaining full blocks run
with that max kept (no row max, no rescaling) only if the Cauchy-Schwarz bound
``|q| * max |k| * |scale|`` (capped by the soft cap) is within ``FIXED_MAX_HEADROOM`` of it.
These tests drive both sides of the guard: ordinary inputs take the fixed-max loop, logits
that grow far past the first block's take the exact loop, and, with the guard switched off,
those same inputs overflow (so the guard is what keeps them exact).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringattn._kernels_forward as kernels_forward
from ringattn import BlockSizes, attention_reference, blockwise_attention
from tests._util import assert_close, attention_inputs

B, T, S, N, K, H = 1, 64, 64, 4, 2, 16
BLOCKS = BlockSizes(block_q=16, block_kv=16)


@pytest.fixture
def headroom(monkeypatch):
    """Sets FIXED_MAX_HEADROOM for programs traced in this test only."""
    jax.clear_caches()
    yield functools.partial(monkeypatch.setattr, kernels_forward, "FIXED_MAX_HEADROOM")
    jax.clear_caches()


def _growing_logits(scale_last: float):
    """Queries and keys whose logits grow block by block: the last key block's keys are
    aligned with every query and ``scale_last`` times longer."""
    q, k, v = attention_inputs(B, T, S, N, K, H, jnp.float32, seed=1)
    direction = jnp.ones((H,)) / np.sqrt(H)
    q = q + 2.0 * direction
    growth = jnp.where(jnp.arange(S) >= S - 16, scale_last, 1.0)[None, :, None, None]
    return q, (k + direction) * growth, v


def _run(q, k, v, **kw):
    return jax.jit(lambda q, k, v: blockwise_attention(q, k, v, block_sizes=BLOCKS, **kw))(q, k, v)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(softcap=5.0, scale=-0.2)])
def test_fixed_max_loop_is_exact_on_ordinary_inputs(headroom, kw):
    q, k, v = attention_inputs(B, T, S, N, K, H, jnp.float32, seed=2)
    headroom(-np.inf)  # the exact loop everywhere: the kernel before the fixed-max loop
    exact = _run(q, k, v, **kw)
    jax.clear_caches()
    headroom(40.0)
    fixed = _run(q, k, v, **kw)
    want = attention_reference(q, k, v, **kw)
    for got in (exact, fixed):
        assert_close(got.out, want.out, dtype=jnp.float32, what="out")
        assert_close(got.lse, want.lse, dtype=jnp.float32, what="lse")
    np.testing.assert_allclose(fixed.out, exact.out, atol=2e-6)
    assert not np.array_equal(fixed.out, exact.out)  # rounding differs: the fixed-max loop ran


def test_guard_sends_growing_logits_to_the_exact_loop(headroom):
    """Logits of the last key block reach about 200 above the first block's max: past the
    headroom the exact loop runs and the result matches the reference; without the guard
    (an infinite headroom) ``exp`` overflows and the output is not finite."""
    q, k, v = _growing_logits(scale_last=25.0)
    want = attention_reference(q, k, v)
    assert float(jnp.max(want.lse)) > 100.0
    guarded = _run(q, k, v)
    # Logits near 200 carry float32 rounding of about 2e-5 in either implementation.
    np.testing.assert_allclose(guarded.out, want.out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(guarded.lse, want.lse, rtol=1e-6)
    jax.clear_caches()
    headroom(-np.inf)
    np.testing.assert_array_equal(_run(q, k, v).out, guarded.out)  # it was the exact loop
    jax.clear_caches()
    headroom(np.inf)
    unguarded = _run(q, k, v)
    assert not np.all(np.isfinite(np.asarray(unguarded.out)))


def test_fixed_max_loop_within_the_headroom_is_exact(headroom):
    """Logits that grow by up to ~30 over the first block's max stay under the headroom of
    40 for these inputs: the fixed-max loop runs (its result differs from the exact loop's
    by rounding only) and both match the reference, forward and gradients."""
    q, k, v = _growing_logits(scale_last=3.0)
    want = attention_reference(q, k, v)
    fixed = _run(q, k, v)
    assert_close(fixed.out, want.out, dtype=jnp.float32, what="out")
    assert_close(fixed.lse, want.lse, dtype=jnp.float32, what="lse")
    jax.clear_caches()
    headroom(-np.inf)
    assert not np.array_equal(_run(q, k, v).out, fixed.out)  # the fixed-max loop ran
    jax.clear_caches()
    headroom(40.0)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v).out ** 2)

    fast = functools.partial(blockwise_attention, block_sizes=BLOCKS)
    grads = jax.jit(jax.grad(functools.partial(loss, fast), argnums=(0, 1, 2)))(q, k, v)
    want_grads = jax.grad(functools.partial(loss, attention_reference), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, want_grads, strict=True):
        assert_close(g, w, dtype=jnp.float32, grad=True)
