"""Decoding against a KV cache sharded along the sequence: local partials, one LSE all-reduce.

Each device attends the few new query tokens (replicated) to its own chunk of the cache,
which gives a partial ``(out, lse)`` over a disjoint key set; one all-reduce combines the
partials exactly (tree attention): ``m = pmax(lse)``, ``w = exp(lse - m)``,
``out = psum(w * out) / psum(w)``, ``lse = m + log(psum(w))``. Nothing but ``[B, T, N, H]``
outputs crosses devices, so a 1M-token cache costs one small all-reduce per step.

References:
  Shyam et al., "Tree Attention: Topology-aware Decoding for Long-Context Attention on
  GPU clusters", 2024.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from ringattn._blockwise import blockwise_attention
from ringattn._mask import MaskSpec, check_ids, check_qkv

__all__ = ["allreduce_attention", "sharded_decode_attention"]


def _varying_axes(x) -> frozenset:
    """Mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", ()) or ())


def _vary_together(*xs):
    """Casts arrays to vary over the union of their varying axes (replicated ``q`` meets a
    sharded cache): a custom VJP's cotangents must match its inputs' types, and the
    transpose of this cast is the ``psum`` that a replicated input's gradient needs."""
    axes = frozenset().union(*(_varying_axes(x) for x in xs))
    out = []
    for x in xs:
        missing = tuple(sorted(axes - _varying_axes(x), key=str))
        out.append(lax.pcast(x, missing, to="varying") if missing else x)
    return out


def allreduce_attention(
    out: Float[Array, "*B T N H"],
    lse: Float[Array, "*B T N"],
    *,
    axis_name: str | tuple[str, ...],
) -> tuple[Float[Array, "*B T N H"], Float[Array, "*B T N"]]:
    """Exactly combines per-device partial attentions over disjoint key sets (inside shard_map).

    The all-reduce form of :func:`ringattn.merge_attention`: every device holds ``(out, lse)``
    for its own keys; every device gets ``(out, lse)`` over the union. Two collectives of
    statistics (``pmax`` of ``lse``, then one ``psum`` of the weights and one of the weighted
    outputs), all in float32. Partials with ``lse = -inf`` (no visible key) weigh nothing;
    if every device is empty the result is ``(0, -inf)``, without NaN in values or gradients.
    The max is a shift that cancels, so no gradient flows through it.

    Args:
      out: ``[..., H]`` this device's normalised partial output (any float dtype).
      lse: ``[...]`` its log-sum-exp (``out.shape[:-1]``).
      axis_name: the mesh axis (or axes) the key set is split over.

    Returns:
      ``(out, lse)`` over all devices' keys, identical on every device of ``axis_name``;
      ``out`` in ``out.dtype``, ``lse`` float32.

    Raises:
      ValueError: if ``lse.shape != out.shape[:-1]``.

    Example:
      >>> import functools, jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import AxisType, Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",), axis_types=(AxisType.Auto,))
      >>> f = jax.shard_map(functools.partial(allreduce_attention, axis_name="x"), mesh=mesh,
      ...                   in_specs=P("x"), out_specs=P("x"))
      >>> out, lse = f(jnp.ones((1, 2, 4)), jnp.zeros((1, 2)))
      >>> float(out[0, 0, 0]), float(lse[0, 0])
      (1.0, 0.0)
    """
    if not hasattr(out, "shape") or not hasattr(lse, "shape"):
        raise ValueError("allreduce_attention: out and lse must be arrays")
    if out.ndim < 1 or tuple(lse.shape) != tuple(out.shape[:-1]):
        raise ValueError(
            "allreduce_attention: lse must have the shape of out without its last (head) dim; "
            f"got out {tuple(out.shape)} and lse {tuple(lse.shape)}"
        )
    lse32 = lse.astype(jnp.float32)
    m = lax.pmax(lax.stop_gradient(lse32), axis_name)
    m = jnp.where(jnp.isneginf(m), 0.0, m)  # all empty: any finite shift will do
    w = jnp.exp(lse32 - m)  # 0 for empty partials
    denom = lax.psum(w, axis_name)
    num = lax.psum(w[..., None] * out.astype(jnp.float32), axis_name)
    empty = denom == 0.0
    denom_safe = jnp.where(empty, 1.0, denom)
    merged = jnp.where(empty[..., None], 0.0, num / denom_safe[..., None])
    merged_lse = jnp.where(empty, -jnp.inf, m + jnp.log(denom_safe))
    return merged.astype(out.dtype), merged_lse


def sharded_decode_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    axis_name: str,
    lengths: Int[Array, " B"] | None = None,
    kv_positions: Int[Array, "B S"] | None = None,
    q_positions: Int[Array, "B T"] | None = None,
    causal: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Attention of a few query tokens to a KV cache sharded over ``axis_name`` (in shard_map).

    Call per shard inside ``jax.shard_map``. Each device attends ``q`` (the same on every
    device of the axis) to its chunk of the cache with :func:`ringattn.blockwise_attention`
    and the partials are combined by :func:`allreduce_attention`. Here ``S`` is the LOCAL
    chunk length.

    Args:
      q: ``[B, T, N, H]`` queries, replicated over ``axis_name`` (a few decode tokens).
      k: ``[B, S, K, H]`` this shard's keys; ``N % K == 0``.
      v: ``[B, S, K, H]`` this shard's values.
      axis_name: the mesh axis the cache's sequence is sharded over.
      lengths: ``[B]`` int, number of valid keys in THIS shard's chunk (keys at local index
        ``>= lengths[b]`` are hidden; ``0`` is an empty shard). Default: all ``S`` valid.
      kv_positions: ``[B, S]`` int global positions of this shard's keys; default
        ``axis_index * S + arange(S)`` (a contiguous split of the cache).
      q_positions: ``[B, T]`` int global positions of the queries; default ``arange(T)``
        (as :func:`ringattn.attention_reference`); pass the real ones with ``causal`` or
        ``window``.
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      window: hide keys at positions ``<= p - window``.
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``.
      return_lse: also return the float32 log-sum-exp ``[B, T, N]``.

    Returns:
      ``out [B, T, N, H]`` in ``q.dtype``, replicated over ``axis_name``, and ``lse
      [B, T, N]`` float32 if ``return_lse``. A query that sees no valid key anywhere gets
      zeros (``lse = -inf``). With bfloat16 inputs each partial is rounded to bfloat16 before
      the float32 all-reduce.

    Raises:
      ValueError: on inconsistent q/k/v shapes or dtypes, ``lengths`` or positions of the
        wrong shape or dtype, a bad window, softcap or scale.

    Example:
      >>> import functools, jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import AxisType, Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",), axis_types=(AxisType.Auto,))
      >>> q = jnp.ones((1, 1, 4, 8))
      >>> kv = jnp.ones((1, 64, 2, 8))
      >>> f = jax.shard_map(functools.partial(sharded_decode_attention, axis_name="x"),
      ...                   mesh=mesh, in_specs=(P(), P(None, "x"), P(None, "x")),
      ...                   out_specs=P())
      >>> f(q, kv, kv).shape
      (1, 1, 4, 8)

    References:
      Shyam et al., "Tree Attention", 2024.
    """
    fn = "sharded_decode_attention"
    B, T, S, N, K, H = check_qkv(fn, q, k, v)
    if not isinstance(axis_name, str):
        raise ValueError(f"{fn}: axis_name must be a mesh axis name (str), got {axis_name!r}")
    MaskSpec(causal=bool(causal), window=window, softcap=softcap, scale=scale)
    index = lax.axis_index(axis_name)
    if kv_positions is None:
        kv_positions = jnp.broadcast_to(index * S + jnp.arange(S, dtype=jnp.int32), (B, S))
    else:
        kv_positions = check_ids(fn, "kv_positions", kv_positions, (B, S))
    if q_positions is not None:
        q_positions = check_ids(fn, "q_positions", q_positions, (B, T))
    q_seg = kv_seg = None
    if lengths is not None:
        lengths = check_ids(fn, "lengths", lengths, (B,))
        # Hidden keys get segment 1, queries segment 0: whole hidden blocks are skipped.
        q_seg = jnp.zeros((B, T), jnp.int32)
        kv_seg = (jnp.arange(S, dtype=jnp.int32)[None, :] >= lengths[:, None]).astype(jnp.int32)
    q, k, v = _vary_together(q, k, v)
    out, lse = blockwise_attention(
        q,
        k,
        v,
        causal=causal,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        q_positions=q_positions,
        kv_positions=kv_positions,
        window=window,
        softcap=softcap,
        scale=scale,
        return_lse=True,
    )
    out, lse = allreduce_attention(out, lse, axis_name=axis_name)
    return (out, lse) if return_lse else out
