"""Shared test helpers: one tolerance table, a max-error comparison and a mesh factory."""

import jax
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
