"""The mass-kept fractions: exact from log-sum-exps (the core's) and estimated from a page
mass (offload.monitoring's), and their errors (the fraction a mixed-residency decode reports is checked against them in
tests/offload/test_mixed.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from offload import mass_kept_from_lse
from offload.monitoring import mass_kept_from_page_mass


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
