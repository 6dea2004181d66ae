"""How much of the attention mass a retention selection kept.

:func:`mass_kept_from_page_mass`: the fraction of the attention mass on kept pages,
estimated from an observed page mass (the exact one, from log-sum-exps, is the core's
``offload.mass_kept_from_lse``, which ``offload.mixed_residency_attention`` reports).
"""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

__all__ = ["mass_kept_from_page_mass"]


def mass_kept_from_page_mass(
    page_mass: Float[Array, "B N M"], keep: Bool[Array, "B M"]
) -> Float[Array, "B N"]:
    """Fraction of an observed attention mass that falls on kept slots.

    Jittable as is: ``jax.jit(mass_kept_from_page_mass)`` (no options).

    Args:
      page_mass: ``[B, N, M]`` attention mass per query head and page-table slot (the
        ``page_mass`` of a paged attention over all pages, e.g. the previous step's).
      keep: ``[B, M]`` bool kept slots.

    Returns:
      ``[B, N]`` float32 in ``[0, 1]``; 1 where the observed mass is 0.

    Raises:
      ValueError: if ``page_mass`` is not ``[B, N, M]`` with ``keep``'s ``B`` and ``M``.

    Example:
      >>> pm = jnp.array([[[0.5, 0.25, 0.25]]])
      >>> mass_kept_from_page_mass(pm, jnp.array([[True, False, True]])).tolist()
      [[0.75]]
    """
    if page_mass.ndim != 3 or keep.ndim != 2 or page_mass.shape[::2] != keep.shape:
        raise ValueError(
            "mass_kept_from_page_mass: page_mass: expected [B, N, M] with keep's [B, M] "
            f"{tuple(keep.shape)}, got {tuple(page_mass.shape)}"
        )
    page_mass = page_mass.astype(jnp.float32)
    total = jnp.sum(page_mass, axis=-1)
    kept = jnp.sum(jnp.where(keep[:, None, :], page_mass, 0.0), axis=-1)
    return jnp.where(total > 0, kept / jnp.where(total > 0, total, 1.0), 1.0)
