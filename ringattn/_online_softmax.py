"""Online-softmax state and the exact merge of partial attentions.

A partial attention over a subset of keys is summarised by ``(out, lse)``: the softmax-weighted
average of the values it saw and the log-sum-exp of its logits. Two partials over disjoint key
sets combine exactly (Milakov & Gimelshein 2018; FlashAttention; Ring Attention). Every kernel in
this library, and in ``paged`` and ``offload``, uses these functions, so the numerics of empty
rows live in one place:

* a query row that saw no key has ``out = 0`` and ``lse = -inf``;
* ``-inf`` is the identity of :func:`merge_attention`, and no function here returns NaN for it,
  in the forward pass or in gradients.
"""

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float

__all__ = [
    "OnlineSoftmax",
    "finalize_online_softmax",
    "init_online_softmax",
    "merge_attention",
    "update_online_softmax",
]


class OnlineSoftmax(NamedTuple):
    """Running state of a softmax over keys that arrive block by block.

    Shapes use ``...`` for any leading dims (batch, heads), ``T`` for query rows and ``H`` for
    the value dim. All fields are float32.

    Attributes:
      acc: ``[..., T, H]`` unnormalised sum of ``exp(s - m) * v``.
      m: ``[..., T]`` running max of the logits seen so far (``-inf`` before any key).
      l: ``[..., T]`` running sum of ``exp(s - m)``.
    """

    acc: Float[Array, "... T H"]
    m: Float[Array, "... T"]
    l: Float[Array, "... T"]


def init_online_softmax(shape: tuple[int, ...], head_dim: int) -> OnlineSoftmax:
    """An empty state for query rows of shape ``shape`` (``[..., T]``) and value dim ``H``."""
    shape = tuple(int(d) for d in shape)
    if head_dim < 1 or any(d < 0 for d in shape):
        raise ValueError(f"init_online_softmax: bad shape {shape} or head_dim {head_dim}")
    return OnlineSoftmax(
        acc=jnp.zeros((*shape, head_dim), jnp.float32),
        m=jnp.full(shape, -jnp.inf, jnp.float32),
        l=jnp.zeros(shape, jnp.float32),
    )


def update_online_softmax(
    state: OnlineSoftmax,
    scores: Float[Array, "... T S"],
    v: Float[Array, "... S H"],
) -> OnlineSoftmax:
    """Folds one block of logits and values into the state.

    Args:
      state: the running state for ``[..., T]`` query rows.
      scores: ``[..., T S]`` logits of this block, already scaled, soft-capped and masked:
        masked entries must be ``-inf`` (never a finite stand-in, which would give a fully
        masked row weight on garbage).
      v: ``[..., S, H]`` values of this block (any float dtype; the product accumulates in
        float32). Leading dims broadcast against ``scores``' (a GQA group axis, say).

    Returns:
      The updated state. Rows with no visible key so far keep ``m = -inf`` and ``l = 0``.
    """
    scores = scores.astype(jnp.float32)
    m_new = jnp.maximum(state.m, jnp.max(scores, axis=-1))
    # A row that has seen only masked keys keeps m_new = -inf; subtracting 0 instead keeps
    # exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN.
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    p = jnp.exp(scores - m_safe[..., None])
    alpha = jnp.exp(state.m - m_safe)
    pv = jnp.matmul(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return OnlineSoftmax(
        acc=state.acc * alpha[..., None] + pv,
        m=m_new,
        l=state.l * alpha + jnp.sum(p, axis=-1),
    )


def finalize_online_softmax(
    state: OnlineSoftmax, dtype=jnp.float32
) -> tuple[Float[Array, "... T H"], Float[Array, "... T"]]:
    """Returns ``(out, lse)``: ``out`` in ``dtype``, ``lse`` float32; empty rows give ``(0, -inf)``."""
    empty = state.l == 0.0
    l_safe = jnp.where(empty, 1.0, state.l)
    out = jnp.where(empty[..., None], 0.0, state.acc / l_safe[..., None])
    lse = jnp.where(empty, -jnp.inf, state.m + jnp.log(l_safe))
    return out.astype(dtype), lse


def _safe_logaddexp(a, b):
    """``log(exp(a) + exp(b))`` that is ``-inf`` (with zero gradients) when both are ``-inf``."""
    m = jnp.maximum(a, b)
    both_empty = jnp.isneginf(m)
    m_safe = jnp.where(both_empty, 0.0, m)
    total = jnp.exp(a - m_safe) + jnp.exp(b - m_safe)
    total_safe = jnp.where(both_empty, 1.0, total)
    return jnp.where(both_empty, -jnp.inf, m_safe + jnp.log(total_safe))


def merge_attention(
    out_a: Float[Array, "*B T N H"],
    lse_a: Float[Array, "*B T N"],
    out_b: Float[Array, "*B T N H"],
    lse_b: Float[Array, "*B T N"],
) -> tuple[Float[Array, "*B T N H"], Float[Array, "*B T N"]]:
    """Exactly combines two partial attentions over disjoint key sets.

    ``out`` arrays carry a trailing head dim ``H`` that ``lse`` lacks; all other dims match
    (the canonical layout is ``out [B, T, N, H]`` with ``lse [B, T, N]``). The merge is
    associative and commutative, and a side with ``lse = -inf`` (no keys) is its identity,
    also when both sides are empty (the result is then ``(0, -inf)``, without NaN, and so are
    its gradients).

    Args:
      out_a: ``[..., H]`` normalised attention output over key set A.
      lse_a: ``[...]`` log-sum-exp of the logits over key set A (float32 recommended).
      out_b: ``[..., H]`` the same over key set B, disjoint from A.
      lse_b: ``[...]`` its log-sum-exp.

    Returns:
      ``(out, lse)`` over A ∪ B; ``out`` in ``out_a``'s dtype, ``lse`` float32.

    Raises:
      ValueError: if shapes disagree.

    Example:
      >>> import jax.numpy as jnp
      >>> out, lse = merge_attention(jnp.ones((1, 2, 1, 4)), jnp.zeros((1, 2, 1)),
      ...                            jnp.zeros((1, 2, 1, 4)), jnp.full((1, 2, 1), -jnp.inf))
      >>> float(out[0, 0, 0, 0]), float(lse[0, 0, 0])
      (1.0, 0.0)
    """
    if out_a.shape != out_b.shape:
        raise ValueError(f"merge_attention: out_a shape {out_a.shape} != out_b shape {out_b.shape}")
    if lse_a.shape != lse_b.shape:
        raise ValueError(f"merge_attention: lse_a shape {lse_a.shape} != lse_b shape {lse_b.shape}")
    if out_a.ndim < 1 or lse_a.shape != out_a.shape[:-1]:
        raise ValueError(
            "merge_attention: lse must have the shape of out without its last (head) dim; "
            f"got out {out_a.shape} and lse {lse_a.shape}"
        )
    lse_a = lse_a.astype(jnp.float32)
    lse_b = lse_b.astype(jnp.float32)
    lse = _safe_logaddexp(lse_a, lse_b)
    lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    w_a = jnp.exp(lse_a - lse_safe)[..., None]
    w_b = jnp.exp(lse_b - lse_safe)[..., None]
    out = w_a * out_a.astype(jnp.float32) + w_b * out_b.astype(jnp.float32)
    return out.astype(out_a.dtype), lse
