"""Decoding against a KV cache sharded along the sequence: local partials, one LSE all-reduce.

Each device attends the few new query tokens (replicated) to its own chunk of the cache,
which gives a partial ``(out, lse)`` over a disjoint key set; one all-reduce combines the
partials exactly (tree attention): ``m = pmax(lse)``, ``w = exp(lse - m)``,
``out = psum(w * out) / psum(w)``, ``lse = m + log(psum(w))``. Nothing but ``[B, T, N, H]``
outputs crosses devices, so a 1M-token cache costs one small all-reduce per step.

Default positions (the same in every decode function of the library, ``paged`` included): the
valid keys are numbered in cache order, shard by shard (shard ``i``'s valid key ``j`` is at
``sum(lengths of shards before i) + j``), and the ``T`` queries are the last ``T`` positions
of the valid cache, ``n_valid - T + arange(T)`` with ``n_valid`` the number of valid keys
over all shards. So ``causal=True`` lets the newest token see the whole valid cache.
Slots beyond ``lengths`` have no effect, even if they hold NaN.

References:
  Shyam et al., "Tree Attention: Topology-aware Decoding for Long-Context Attention on
  GPU clusters", 2024.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from ringattn._blockwise import blockwise_attention, empty_attention
from ringattn._checks import FloatLike, IntLike, check_ids, describe, fail
from ringattn._online_softmax import AttentionOutput, apply_sinks
from ringattn._options import MaskSpec, Positions, SegmentIds, arange_positions, prepare
from ringattn._varying import match_varying

__all__ = [
    "allreduce_attention_per_shard",
    "decode_attention_per_shard",
    "sharded_decode_attention",
]


def allreduce_attention_per_shard(
    out: Float[Array, "*rows H"],
    lse: Float[Array, "*rows"],
    *,
    seq_axis: str | tuple[str, ...],
) -> AttentionOutput:
    """Exactly combines per-device partial attentions over disjoint key sets (in shard_map).

    The all-reduce form of :func:`ringattn.merge_attention`: every device holds ``(out, lse)``
    for its own keys; every device gets ``(out, lse)`` over the union. Two collectives of
    statistics (``pmax`` of ``lse``, then one ``psum`` of the weights and one of the weighted
    outputs), all in float32. Partials with ``lse = -inf`` (no visible key) weigh nothing;
    if every device is empty the result is ``(0, -inf)``, without NaN in values or gradients.
    The max is a shift that cancels, so no gradient flows through it. Call it per shard
    inside ``jax.shard_map``, with ``seq_axis`` bound by ``functools.partial``.

    Args:
      out: ``[..., H]`` this device's normalised partial output (any float dtype).
      lse: ``[...]`` its log-sum-exp (``out.shape[:-1]``).
      seq_axis: the mesh axis (or axes) the key set is split over.

    Returns:
      :class:`ringattn.AttentionOutput` over all devices' keys, identical on every device of
      ``seq_axis``; ``out`` in ``out.dtype``, ``lse`` float32.

    Raises:
      ValueError: if ``lse.shape != out.shape[:-1]``.

    Example:
      >>> import functools, jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import AxisType, Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",), axis_types=(AxisType.Auto,))
      >>> f = jax.shard_map(functools.partial(allreduce_attention_per_shard, seq_axis="x"),
      ...                   mesh=mesh, in_specs=P("x"), out_specs=P("x"))
      >>> out, lse = f(jnp.ones((1, 2, 4)), jnp.zeros((1, 2)))
      >>> float(out[0, 0, 0]), float(lse[0, 0])
      (1.0, 0.0)
    """
    fn = "allreduce_attention_per_shard"
    if not hasattr(out, "shape") or not hasattr(lse, "shape"):
        raise fail(fn, "out, lse", "arrays", f"{type(out).__name__}, {type(lse).__name__}")
    if out.ndim < 1 or tuple(lse.shape) != tuple(out.shape[:-1]):
        raise fail(
            fn,
            "lse",
            f"the shape of out without its last (head) dim {tuple(out.shape[:-1])}",
            describe(lse),
        )
    lse32 = lse.astype(jnp.float32)
    m = lax.pmax(lax.stop_gradient(lse32), seq_axis)
    m = jnp.where(jnp.isneginf(m), 0.0, m)  # all empty: any finite shift will do
    w = jnp.exp(lse32 - m)  # 0 for empty partials
    denom = lax.psum(w, seq_axis)
    num = lax.psum(w[..., None] * out.astype(jnp.float32), seq_axis)
    empty = denom == 0.0
    denom_safe = jnp.where(empty, 1.0, denom)
    merged = jnp.where(empty[..., None], 0.0, num / denom_safe[..., None])
    merged_lse = jnp.where(empty, -jnp.inf, m + jnp.log(denom_safe))
    return AttentionOutput(merged.astype(out.dtype), merged_lse)


def _check_axis_name(fn: str, seq_axis) -> None:
    if not isinstance(seq_axis, str):
        raise fail(fn, "seq_axis", "a mesh axis name (str)", repr(seq_axis))


def decode_attention_per_shard(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    seq_axis: str,
    lengths: Int[Array, " B"] | None = None,
    mask: MaskSpec | None = None,
    causal: bool | np.bool_ | None = None,
    window: IntLike | tuple[IntLike | None, ...] | None = None,
    softcap: FloatLike | None = None,
    scale: FloatLike | None = None,
    positions: Positions | None = None,
    sinks: Float[Array, " N"] | None = None,
) -> AttentionOutput:
    """Attention of a few query tokens to a KV cache sharded over ``seq_axis`` (in shard_map).

    Call per shard inside ``jax.shard_map`` (bind the options with ``functools.partial``).
    Each device attends ``q`` (the same on every device of the axis) to its chunk of the
    cache with :func:`ringattn.blockwise_attention` and the partials are combined by
    :func:`allreduce_attention_per_shard`; sinks join once, after the all-reduce. Here ``S``
    is the LOCAL chunk length.

    Args:
      q: ``[B, T, N, H]`` queries, replicated over ``seq_axis`` (a few decode tokens).
      k: ``[B, S, K, H]`` this shard's keys; ``N % K == 0``.
      v: ``[B, S, K, H]`` this shard's values.
      seq_axis: the mesh axis the cache's sequence is sharded over.
      lengths: ``[B]`` int, number of valid keys in THIS shard's chunk (keys at local index
        ``>= lengths[b]`` are hidden; ``0`` is an empty shard). Default: all ``S`` valid.
      mask: a :class:`ringattn.MaskSpec`, or its fields as the keywords below (not both).
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      window: hide keys at positions ``<= p - window``; a tuple: one per query head.
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``.
      positions: :class:`ringattn.Positions`; ``kv`` are this shard's keys' global
        positions, default their rank in the valid cache (shard by shard); ``q`` default the
        last ``T`` positions of the valid cache, ``n_valid - T + arange(T)``.
      sinks: ``[N]`` per-head sink logit, or None.

    Returns:
      :class:`ringattn.AttentionOutput` ``(out [B, T, N, H] in q.dtype, lse [B, T, N]
      float32)``, replicated over ``seq_axis``. A query that sees no valid key anywhere gets
      zeros (``lse = -inf``). With bfloat16 inputs each partial is rounded to bfloat16 before
      the float32 all-reduce.

    Raises:
      ValueError: on inconsistent q/k/v shapes or dtypes, ``lengths`` or positions of the
        wrong shape or dtype, a bad window, softcap, scale or sinks.

    Example:
      >>> import functools, jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import AxisType, Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",), axis_types=(AxisType.Auto,))
      >>> q = jnp.ones((1, 1, 4, 8))
      >>> kv = jnp.ones((1, 64, 2, 8))
      >>> f = jax.shard_map(functools.partial(decode_attention_per_shard, seq_axis="x"),
      ...                   mesh=mesh, in_specs=(P(), P(None, "x"), P(None, "x")),
      ...                   out_specs=P())
      >>> f(q, kv, kv).out.shape
      (1, 1, 4, 8)

    References:
      Shyam et al., "Tree Attention", 2024.
    """
    fn = "decode_attention_per_shard"
    (B, T, S, N, K, H), spec, _, pos = prepare(
        fn,
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        window=window,
        softcap=softcap,
        scale=scale,
        segment_ids=None,
        positions=positions,
        sinks=sinks,
        decode=True,
    )
    _check_axis_name(fn, seq_axis)
    index = lax.axis_index(seq_axis)
    if lengths is None:
        local = jnp.full((B,), S, jnp.int32)
    else:
        local = check_ids(fn, "lengths", lengths, (B,))
    local = jnp.clip(local, 0, S)
    # [n, B] valid keys per shard: offsets of this shard's keys and the global count.
    every = lax.all_gather(local, seq_axis)
    before = jnp.sum(jnp.where(jnp.arange(every.shape[0])[:, None] < index, every, 0), axis=0)
    n_valid = jnp.sum(every, axis=0)  # [B]
    kv_pos = arange_positions(B, S, before) if pos.kv is None else pos.kv
    q_pos = arange_positions(B, T, n_valid - T) if pos.q is None else pos.q
    seg = None
    if lengths is not None:
        # Hidden keys get segment 1, queries segment 0: whole hidden blocks are skipped.
        seg = SegmentIds(
            q=jnp.zeros((B, T), jnp.int32),
            kv=(jnp.arange(S, dtype=jnp.int32)[None, :] >= local[:, None]).astype(jnp.int32),
        )
    q, k, v = match_varying(q, k, v)
    out, lse = blockwise_attention(
        q, k, v, mask=spec, segment_ids=seg, positions=Positions(q_pos, kv_pos)
    )
    out, lse = allreduce_attention_per_shard(out, lse, seq_axis=seq_axis)
    return apply_sinks(out, lse, sinks)


class _DecodeMesh(NamedTuple):
    """Where and how :func:`sharded_decode_attention` runs (static)."""

    mesh: jax.sharding.Mesh
    seq_axis: str
    batch_axis: str | None
    mask: MaskSpec


@functools.partial(jax.jit, static_argnums=(6,))
def _sharded_decode(q, k, v, lengths, positions: Positions, sinks, where: _DecodeMesh):
    """``positions.kv`` given; ``positions.q`` None only with ``lengths [B]``, which then put
    the queries at the end of each row's valid cache."""
    mesh, seq_axis, batch_axis, mask = where
    q_pos, kv_pos = positions
    S = k.shape[1]
    n = mesh.shape[seq_axis]
    chunk = S // n

    def body(q, k, v, lengths, q_pos, kv_pos):
        index = lax.axis_index(seq_axis)
        local = None if lengths is None else jnp.clip(lengths - index * chunk, 0, chunk)
        if q_pos is None and lengths is not None:
            q_pos = arange_positions(q.shape[0], q.shape[1], lengths - q.shape[1])
        positions = None if q_pos is None and kv_pos is None else Positions(q_pos, kv_pos)
        return decode_attention_per_shard(
            q, k, v, seq_axis=seq_axis, lengths=local, mask=mask, positions=positions
        )

    b = batch_axis
    specs = (P(b), P(b, seq_axis), P(b, seq_axis), P(b), P(b), P(b, seq_axis))
    args = (q, k, v, lengths, q_pos, kv_pos)
    specs = tuple(None if x is None else s for x, s in zip(args, specs, strict=True))
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        args = tuple(
            None if x is None else jax.sharding.reshard(x, NamedSharding(mesh, s))
            for x, s in zip(args, specs, strict=True)
        )
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(b), check_vma=True)
    out, lse = f(*args)
    return apply_sinks(out, lse, sinks)


def sharded_decode_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    mesh: jax.sharding.Mesh,
    seq_axis: str,
    batch_axis: str | None = None,
    lengths: Int[Array | np.ndarray, " B"] | None = None,
    mask: MaskSpec | None = None,
    causal: bool | np.bool_ | None = None,
    window: IntLike | tuple[IntLike | None, ...] | None = None,
    softcap: FloatLike | None = None,
    scale: FloatLike | None = None,
    positions: Positions | None = None,
    sinks: Float[Array, " N"] | None = None,
) -> AttentionOutput:
    """Decode attention on GLOBAL arrays: a KV cache sharded along ``S`` over ``seq_axis``.

    Builds the ``jax.shard_map`` (``check_vma=True``) around
    :func:`decode_attention_per_shard`: ``k, v`` are split evenly along ``S`` over
    ``seq_axis`` (and the batch over ``batch_axis``), ``q`` is replicated over ``seq_axis``,
    and one exact LSE all-reduce combines the shards. Works on Auto and Explicit meshes. To
    ``jit`` with options: ``jax.jit(functools.partial(sharded_decode_attention, mesh=mesh,
    seq_axis="seq", causal=True))``.

    Args:
      q: ``[B, T, N, H]`` the new query tokens.
      k: ``[B, S, K, H]`` the global key cache; ``S`` divisible by the size of ``seq_axis``.
      v: ``[B, S, K, H]`` the global value cache.
      mesh: the device mesh.
      seq_axis: the mesh axis the cache is sharded over.
      batch_axis: mesh axis the batch is sharded over, or None.
      lengths: ``[B]`` int number of valid keys of the global cache (slots ``>= lengths[b]``
        are hidden, whatever they hold). Default: all ``S``.
      mask: a :class:`ringattn.MaskSpec`, or its fields as the keywords below (not both).
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      window: hide keys at positions ``<= p - window``; a tuple: one per query head.
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``.
      positions: :class:`ringattn.Positions`; defaults: keys at ``arange(S)``, queries the
        last ``T`` positions of the valid cache, ``lengths - T + arange(T)``.
      sinks: ``[N]`` per-head sink logit, or None.

    Returns:
      :class:`ringattn.AttentionOutput` ``(out [B, T, N, H] in q.dtype, lse [B, T, N]
      float32)``.

    Raises:
      ValueError: on a bad mesh or axis, ``S`` not divisible by the shards, bad shapes,
        lengths, positions or options.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import AxisType, Mesh
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",), axis_types=(AxisType.Auto,))
      >>> kv = jnp.ones((1, 64, 2, 8))
      >>> sharded_decode_attention(jnp.ones((1, 1, 4, 8)), kv, kv, mesh=mesh,
      ...                          seq_axis="x", causal=True).out.shape
      (1, 1, 4, 8)
    """
    fn = "sharded_decode_attention"
    (B, T, S, N, K, H), spec, _, pos = prepare(
        fn,
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        window=window,
        softcap=softcap,
        scale=scale,
        segment_ids=None,
        positions=positions,
        sinks=sinks,
        decode=True,
    )
    if not isinstance(mesh, jax.sharding.Mesh):
        raise fail(fn, "mesh", "a jax.sharding.Mesh", type(mesh).__name__)
    for arg, name in (("seq_axis", seq_axis), ("batch_axis", batch_axis)):
        if name is None and arg == "batch_axis":
            continue
        if not isinstance(name, str) or name not in mesh.axis_names:
            raise fail(fn, arg, f"an axis of the mesh {mesh.axis_names}", repr(name))
    if batch_axis == seq_axis:
        raise fail(fn, "batch_axis", "an axis other than seq_axis", repr(batch_axis))
    n = int(mesh.shape[seq_axis])
    if S % n:
        raise fail(fn, "k", f"a cache length S divisible by the {n} shards of {seq_axis!r}", S)
    if batch_axis is not None and B % int(mesh.shape[batch_axis]):
        raise fail(fn, "q", f"a batch divisible by the size of {batch_axis!r}", B)
    if lengths is not None:
        lengths = check_ids(fn, "lengths", jnp.asarray(lengths), (B,))
    if B == 0 or T == 0 or S == 0:
        return apply_sinks(*empty_attention(q, k, v), sinks)
    kv_pos = pos.kv
    q_pos = pos.q
    if q_pos is None and lengths is None:
        q_pos = arange_positions(B, T, S - T)
    if kv_pos is None:
        kv_pos = arange_positions(B, S)
    where = _DecodeMesh(mesh, seq_axis, batch_axis, spec)
    return _sharded_decode(q, k, v, lengths, Positions(q_pos, kv_pos), sinks, where)
