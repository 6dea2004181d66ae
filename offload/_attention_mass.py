"""Token attention mass, what H2O and TOVA rank a contiguous cache by.

:func:`token_attention_mass`: dense attention probability per query head and key token (the
token-granular counterpart of ``paged``'s ``page_mass``), the observation a policy folds into
its scores; :func:`mass_kept_from_lse`: the exact fraction of the attention mass on kept
keys, from two log-sum-exps (what ``mixed_residency_attention`` reports as ``mass_kept``).
The estimate from an observed page mass is ``offload.monitoring.mass_kept_from_page_mass``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from offload._checks import check_array, check_float, check_lengths

__all__ = ["mass_kept_from_lse", "token_attention_mass"]


def token_attention_mass(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    lengths: Int[Array, " B"],
    *,
    q_positions: Int[Array, "B T"] | None = None,
    causal: bool = True,
    scale: float | int | np.floating | None = None,
) -> Float[Array, "B N S"]:
    """Dense attention probability per query head and key token, summed over the queries.

    The token-granular counterpart of ``paged_attention``'s ``page_mass``, for contiguous KV
    (``T x S`` logits are built: keep it to observation windows and small shapes). Jittable
    with the options bound: ``jax.jit(functools.partial(token_attention_mass, causal=False))``.

    Args:
      q: ``[B, T, N, H]`` queries (the observation window, or the last query).
      k: ``[B, S, K, H]`` keys, ``N % K == 0``; keys at index ``>= lengths[b]`` are ignored.
      lengths: ``[B]`` int valid keys per sequence.
      q_positions: ``[B, T]`` int positions, default ``lengths - T + arange(T)`` (the last
        ``T`` tokens).
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      scale: logit scale, default ``1 / sqrt(H)``.

    Returns:
      ``[B, N, S]`` float32; each query row that sees a key contributes total mass 1.

    Raises:
      ValueError: on inconsistent shapes or dtypes, a zero head dim or zero kv heads, or a
        non-positive ``scale``.

    Example:
      >>> q = jnp.ones((1, 2, 2, 4)); k = jnp.ones((1, 5, 1, 4))
      >>> token_attention_mass(q, k, jnp.array([4])).sum(-1).tolist()
      [[2.0, 2.0]]
    """
    fn = "token_attention_mass"
    B, T, N, H = check_array(fn, "q", q, ndim=4, kind=jnp.floating, layout="[B, T, N, H]")
    check_array(fn, "k", k, ndim=4, kind=jnp.floating, layout="[B, S, K, H]")
    if k.shape[0] != B or k.shape[3] != H:
        raise ValueError(f"{fn}: k: expected [B={B}, S, K, H={H}] matching q, got {tuple(k.shape)}")
    _, S, K, _ = k.shape
    if H == 0:
        raise ValueError(f"{fn}: q: expected head dim H >= 1, got shape {tuple(q.shape)}")
    if K == 0 or N % K:
        raise ValueError(f"{fn}: k: expected kv heads K >= 1 dividing q heads N={N}, got K={K}")
    check_lengths(fn, lengths, B)
    lengths = lengths.astype(jnp.int32)
    if q_positions is None:
        q_positions = lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None]
    elif q_positions.shape != (B, T):
        raise ValueError(
            f"{fn}: q_positions: expected shape [B={B}, T={T}], got {tuple(q_positions.shape)}"
        )
    if scale is None:
        scale = 1.0 / float(np.sqrt(H))
    else:
        scale = check_float(fn, "scale", scale, low=0.0, low_open=True)
    return _token_mass_impl(
        q, k, lengths, q_positions.astype(jnp.int32), causal=bool(causal), scale=scale
    )


@functools.partial(jax.jit, static_argnames=("causal", "scale"))
def _token_mass_impl(q, k, lengths, q_positions, *, causal, scale):
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    kv_pos = jnp.arange(S, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    mask = kv_pos < lengths[:, None, None]  # [B, 1, S]
    if causal:
        mask = mask & (kv_pos <= q_positions[:, :, None])  # [B, T, S]
    mask = jnp.broadcast_to(mask, (B, T, S))
    G = N // K
    qf = q.astype(jnp.float32).reshape(B, T, K, G, H)
    logits = jnp.einsum("btkgh,bskh->bkgts", qf, k.astype(jnp.float32)) * scale
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)  # [B, K, G, T, S]
    m = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)
    p = jnp.exp(logits - jnp.where(jnp.isneginf(m), 0.0, m))
    p = jnp.where(mask[:, None, None], p, 0.0)  # masked keys have no effect, even NaN ones
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    return jnp.sum(p, axis=3).reshape(B, N, S)  # [B, K, G, S] -> [B, N, S]


def mass_kept_from_lse(
    lse_kept: Float[Array, "*R"], lse_full: Float[Array, "*R"]
) -> Float[Array, "*R"]:
    """Fraction of the attention mass in the kept keys: ``exp(lse_kept - lse_full)``.

    Jittable as is: ``jax.jit(mass_kept_from_lse)`` (no options).

    Args:
      lse_kept: log-sum-exp over the kept keys (``-inf`` when none).
      lse_full: log-sum-exp over all keys (``>= lse_kept``), same shape.

    Returns:
      float32 in ``[0, 1]``; 1 where the row has no key at all (nothing was lost).

    Raises:
      ValueError: if the shapes differ.

    Example:
      >>> float(mass_kept_from_lse(jnp.log(jnp.array(0.25)), jnp.array(0.0)))
      0.25
    """
    if lse_kept.shape != lse_full.shape:
        raise ValueError(
            f"mass_kept_from_lse: lse_kept: expected lse_full's shape {tuple(lse_full.shape)}, "
            f"got {tuple(lse_kept.shape)}"
        )
    lse_kept = lse_kept.astype(jnp.float32)
    lse_full = lse_full.astype(jnp.float32)
    empty = jnp.isneginf(lse_full)
    frac = jnp.exp(lse_kept - jnp.where(empty, 0.0, lse_full))
    return jnp.where(empty, 1.0, jnp.clip(frac, 0.0, 1.0))
