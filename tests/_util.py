"""Shared test helpers: one tolerance table, a max-error comparison, a mesh factory, random
attention inputs and packed segment ids, and a counter of the primitives a program runs."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

# Max abs error allowed against the float32 reference, by the dtype of the computation.
TOLERANCES = {
    np.dtype(np.float32): 1e-5,
    np.dtype(jax.numpy.bfloat16): 2e-2,
}
# Gradients accumulate over more terms than the forward pass: allow a few times more.
GRAD_TOLERANCES = {
    np.dtype(np.float32): 5e-5,
    np.dtype(jax.numpy.bfloat16): 6e-2,
}


def tolerance(dtype, *, grad: bool = False) -> float:
    table = GRAD_TOLERANCES if grad else TOLERANCES
    return table[np.dtype(dtype)]


def assert_close(actual, expected, *, dtype, grad: bool = False, what: str = ""):
    """Max-abs comparison against a float32 reference that prints the error it saw."""
    actual = np.asarray(jax.numpy.asarray(actual, jax.numpy.float32))
    expected = np.asarray(jax.numpy.asarray(expected, jax.numpy.float32))
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values in result"
    err = float(np.max(np.abs(actual - expected))) if actual.size else 0.0
    tol = tolerance(dtype, grad=grad)
    assert err <= tol, f"{what}: max abs error {err:.3g} > tolerance {tol:.3g} ({np.dtype(dtype)})"


def make_test_mesh(shape, names, *, axis_type=AxisType.Auto):
    """A mesh over the first prod(shape) CPU devices with explicit axis types."""
    n = int(np.prod(shape))
    devices = np.asarray(jax.devices()[:n]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(axis_type,) * len(names))


def _subjaxprs(value):
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _subjaxprs(item)
    elif hasattr(value, "eqns"):
        yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):
        yield value.jaxpr


def count_executed(jaxpr, primitive: str) -> int:
    """How many times ``primitive`` runs in ``jaxpr``: a ``scan`` (a ``fori_loop`` with static bounds)
    multiplies its body by its length, a ``cond`` counts its costliest branch."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == primitive
        counts = [
            count_executed(sub, primitive) for v in eqn.params.values() for sub in _subjaxprs(v)
        ]
        if eqn.primitive.name == "cond":
            total += max(counts, default=0)
        elif eqn.primitive.name == "scan":
            total += eqn.params["length"] * sum(counts)
        elif eqn.primitive.name == "while":
            assert sum(counts) == 0, f"{primitive} in a while loop of unknown trip count"
        else:
            total += sum(counts)
    return total


def attention_inputs(B, T, S, N, K, H, dtype, seed=0):
    """Standard-normal ``q [B, T, N, H]``, ``k, v [B, S, K, H]`` drawn in float32, cast."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, K, H), jnp.float32).astype(dtype)
    return q, k, v


def segments_from_cuts(B, L, cuts):
    """``[B, L]`` int32 segment ids of packed documents starting at each of ``cuts``."""
    ids = np.zeros((B, L), np.int32)
    for c in cuts:
        ids[:, c:] += 1
    return jnp.asarray(ids)
