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
import numpy as np
from jaxtyping import Array, Float

from ringattn._checks import check_int, describe, fail
from ringattn._varying import match_varying

__all__ = [
    "AttentionOutput",
    "OnlineSoftmax",
    "apply_sinks",
    "finalize_online_softmax",
    "init_online_softmax",
    "merge_attention",
    "update_online_softmax",
]


class AttentionOutput(NamedTuple):
    """What every attention function of ``ringattn`` returns.

    Attributes:
      out: ``[B, T, N, H]`` attention output in the queries' dtype (``0`` for a row that sees
        no key and has no sink).
      lse: ``[B, T, N]`` float32 log-sum-exp of the row's logits (sink included), ``-inf`` for
        a row that sees nothing.
    """

    out: Float[Array, "*B T N H"]
    lse: Float[Array, "*B T N"]


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


def init_online_softmax(
    shape: tuple[int | np.integer, ...], head_dim: int | np.integer
) -> OnlineSoftmax:
    """An empty state for query rows of shape ``shape`` (``[..., T]``) and value dim ``H``.

    ``shape`` and ``head_dim`` are static (bind them with ``functools.partial`` under jit).
    """
    fn = "init_online_softmax"
    shape = tuple(check_int(fn, f"shape[{i}]", d, minimum=0) for i, d in enumerate(shape))
    head_dim = check_int(fn, "head_dim", head_dim, minimum=1)
    return OnlineSoftmax(
        acc=jnp.zeros((*shape, head_dim), jnp.float32),
        m=jnp.full(shape, -jnp.inf, jnp.float32),
        l=jnp.zeros(shape, jnp.float32),
    )


def update_online_softmax(
    state: OnlineSoftmax,
    scores: Float[Array | np.ndarray, "... T S"],
    v: Float[Array | np.ndarray, "... S H"],
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
    out_a: Float[Array | np.ndarray, "*rows H"],
    lse_a: Float[Array | np.ndarray, "*rows"],
    out_b: Float[Array | np.ndarray, "*rows H"],
    lse_b: Float[Array | np.ndarray, "*rows"],
) -> AttentionOutput:
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
      :class:`AttentionOutput` ``(out, lse)`` over A ∪ B; ``out`` in ``out_a``'s dtype,
      ``lse`` float32.

    Raises:
      ValueError: if shapes disagree.

    Example:
      >>> import jax.numpy as jnp
      >>> out, lse = merge_attention(jnp.ones((1, 2, 1, 4)), jnp.zeros((1, 2, 1)),
      ...                            jnp.zeros((1, 2, 1, 4)), jnp.full((1, 2, 1), -jnp.inf))
      >>> float(out[0, 0, 0, 0]), float(lse[0, 0, 0])
      (1.0, 0.0)
    """
    fn = "merge_attention"
    if out_a.shape != out_b.shape:
        raise fail(fn, "out_b", f"the shape of out_a {tuple(out_a.shape)}", describe(out_b))
    if lse_a.shape != lse_b.shape:
        raise fail(fn, "lse_b", f"the shape of lse_a {tuple(lse_a.shape)}", describe(lse_b))
    if out_a.ndim < 1 or lse_a.shape != out_a.shape[:-1]:
        raise fail(
            fn,
            "lse_a",
            f"the shape of out without its last (head) dim {out_a.shape[:-1]}",
            describe(lse_a),
        )
    lse_a = lse_a.astype(jnp.float32)
    lse_b = lse_b.astype(jnp.float32)
    lse = _safe_logaddexp(lse_a, lse_b)
    lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    w_a = jnp.exp(lse_a - lse_safe)[..., None]
    w_b = jnp.exp(lse_b - lse_safe)[..., None]
    out = w_a * out_a.astype(jnp.float32) + w_b * out_b.astype(jnp.float32)
    return AttentionOutput(out.astype(out_a.dtype), lse)


def apply_sinks(
    out: Float[Array, "*rows N H"],
    lse: Float[Array, "*rows N"],
    sinks: Float[Array, " N"] | None,
) -> AttentionOutput:
    """Adds a per-head sink logit to the softmax denominator of a complete attention.

    A sink is a logit with no value (a learnable "attend to nothing" option, as in
    StreamingLLM-style models and splash attention's ``sinks=``): it joins the softmax once,
    ``lse' = logaddexp(lse, sink)`` and ``out' = out * exp(lse - lse')``. Apply it once, after
    all partial attentions are merged (never once per ring hop or page block). Gradients
    flow to ``out``, ``lse`` and ``sinks``; a row that saw no key keeps ``out = 0`` and gets
    ``lse' = sink``.

    Args:
      out: ``[..., N, H]`` normalised attention output over all keys.
      lse: ``[..., N]`` its log-sum-exp.
      sinks: ``[N]`` sink logit per query head (any float dtype; used in float32), or None
        (then ``(out, lse)`` is returned unchanged).

    Returns:
      :class:`AttentionOutput` with ``out`` in ``out.dtype`` and ``lse`` float32.

    Raises:
      ValueError: if ``lse.shape != out.shape[:-1]`` or ``sinks`` is not ``[N]`` float.

    Example:
      >>> import jax.numpy as jnp
      >>> o, l = apply_sinks(jnp.ones((1, 1, 2, 4)), jnp.zeros((1, 1, 2)), jnp.zeros(2))
      >>> float(o[0, 0, 0, 0]), round(float(l[0, 0, 0]), 4)
      (0.5, 0.6931)
    """
    fn = "apply_sinks"
    if out.ndim < 2 or tuple(lse.shape) != tuple(out.shape[:-1]):
        raise fail(
            fn, "lse", f"the shape of out without its last dim {out.shape[:-1]}", describe(lse)
        )
    if sinks is None:
        return AttentionOutput(out, lse.astype(jnp.float32))
    check_sinks(fn, sinks, out.shape[-2])
    lse32, sinks32 = match_varying(lse.astype(jnp.float32), sinks.astype(jnp.float32))
    total = _safe_logaddexp(lse32, sinks32)
    total_safe = jnp.where(jnp.isneginf(total), 0.0, total)
    weight = jnp.exp(lse32 - total_safe)  # 0 where the row saw no key
    out, weight = match_varying(out, weight)
    return AttentionOutput((out.astype(jnp.float32) * weight[..., None]).astype(out.dtype), total)


def check_sinks(fn: str, sinks, num_heads: int) -> None:
    """Checks ``sinks [N]`` floating point."""
    if sinks is None:
        return
    if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
        raise fail(fn, "sinks", f"a float array of shape ({num_heads},)", type(sinks).__name__)
    if tuple(sinks.shape) != (num_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise fail(fn, "sinks", f"a float array of shape ({num_heads},) (N)", describe(sinks))
