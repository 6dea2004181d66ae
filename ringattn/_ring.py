"""Ring attention: exact attention over a sequence sharded on a mesh axis, one shard per device.

Called per shard inside ``jax.shard_map``. Each device keeps its queries; the key/value block
(with its positions and segment ids) travels the ring with ``jax.lax.ppermute`` over
``perm = [(i, (i + 1) % n)]``, so after ``t`` hops device ``i`` holds block ``(i - t) % n``.
Every hop runs the blockwise kernel of :mod:`ringattn._kernels_forward`, whose dynamic block
classification skips key blocks that the mask hides (a causal-future hop, a sliding window,
other documents), folding the hop's keys into one running float32 online-softmax state.

* Exactly ``n - 1`` hops (no final rotation back), one ``collective-permute`` per hop: the
  block's keys, values and ids are packed into one byte buffer, and only the ``K`` key/value
  heads travel (GQA, MQA).
* The next hop's send is issued before the current hop's compute, so on GPU/TPU the
  transfer can overlap it (on CPU ``ppermute`` is synchronous). The middle hops run in one
  ``fori_loop``, so only the current and the incoming block are live at any ring size.
* The backward pass is a ``custom_vjp``: key blocks travel the ring again, together with
  their float32 ``dK``/``dV`` accumulators, which a last shift sends home. Memory stays
  linear in the local shard.
* With ``causal``, a sliding ``window`` and the ``"contiguous"`` layout, hops whose block lies
  outside every local query's window are neither computed nor communicated.
* ``hop_format=KVFormat("int8")`` / ``KVFormat("fp8")`` (or ``"int8"`` / ``"fp8"``): each
  device quantizes its K/V once (per token and kv head, with the codec the pages use,
  :mod:`ringattn._hop_format`), the packed buffer carries the quantized values and
  float32 scales instead of K/V in their dtype, and every block (the local one too) is
  dequantized to float32 before its compute: exact attention over the dequantized K/V, with
  straight-through ``dk``/``dv`` (the backward ring sends the same quantized K/V).
* ``impl="pallas"``: every hop's block is computed by the Pallas forward kernel of
  :mod:`ringattn._pallas`, which returns the hop's ``(out, lse)``; the hops are merged in
  float32 (:func:`ringattn.merge_attention`). The block travels in the canonical layout
  (``[B, S, K, H]`` and ids). The backward ring runs the Pallas ``dq`` and ``dk, dv``
  kernels per hop from the GLOBAL ``lse`` and ``delta`` (FlashAttention-2's ring backward),
  with the float32 dK/dV travelling with the block as above. On CPU the kernels run in
  Pallas's TPU interpret mode (``pltpu.InterpretParams``): the plain ``interpret=True`` HLO
  interpreter fails the ``check_vma`` type check inside ``shard_map`` (JAX 0.10).

This module holds the public entry (:func:`ring_attention_per_shard`, :func:`hop_bytes`) and
the ring on validated inputs (:func:`ring_local`, used by :func:`ringattn.sharded_attention`).
The plan, hop count and transport are in :mod:`ringattn._ring_hops`, the XLA forward and
backward ``custom_vjp`` in :mod:`ringattn._ring_xla`, the Pallas hops in
:mod:`ringattn._ring_pallas`.

References:
  Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
  Context", 2023; Brandon et al., "Striped Attention", 2023; Dao, "FlashAttention-2", 2023.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from ringattn._blocks import MaskIds, round_up
from ringattn._blockwise import (
    BlockSizes,
    check_block_sizes,
    empty_attention,
    head_windows,
    resolve_impl,
    with_window_table,
)
from ringattn._checks import FloatLike, IntLike, check_int, fail, refuse_bias
from ringattn._formats import KVFormat
from ringattn._hop_format import check_hop_format, hop_row_bytes
from ringattn._layout import LAYOUTS, check_layout_positions, shard_positions
from ringattn._online_softmax import AttentionOutput, apply_sinks
from ringattn._options import MaskSpec, Positions, SegmentIds, prepare
from ringattn._ring_hops import _hops, _layout_block_sizes, _RingPlan
from ringattn._ring_pallas import shard_pallas_config
from ringattn._ring_xla import _ring
from ringattn._varying import cast_varying, varying_axes

__all__ = ["hop_bytes", "ring_attention_per_shard"]


def _axis_size(fn: str, seq_axis) -> int:
    try:
        return int(lax.axis_size(seq_axis))
    except NameError as err:
        raise fail(
            fn,
            "seq_axis",
            f"a mesh axis bound by jax.shard_map (call {fn} per shard inside shard_map)",
            repr(seq_axis),
        ) from err


def ring_attention_per_shard(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    seq_axis: str | tuple[str, ...],
    layout: str = "contiguous",
    mask: MaskSpec | None = None,
    causal: bool | np.bool_ | None = None,
    window: IntLike | tuple[IntLike | None, ...] | None = None,
    softcap: FloatLike | None = None,
    scale: FloatLike | None = None,
    segment_ids: SegmentIds | None = None,
    positions: Positions | None = None,
    sinks: Float[Array, " N"] | None = None,
    block_sizes: BlockSizes | None = None,
    hop_format: KVFormat | str | None = None,
    impl: str = "auto",
    bias: Float[Array, "..."] | None = None,
) -> AttentionOutput:
    """Exact attention over a sequence sharded along ``seq_axis``; call it per shard.

    Use inside ``jax.shard_map``: ``q``, ``k``, ``v`` are this device's shard of a global
    sequence laid out by ``layout`` (see :func:`ringattn.to_layout`), and the result is this
    shard's rows of ``attention_reference`` on the global, un-permuted sequence. Key/value
    blocks travel the ring over ``seq_axis`` only, so other mesh axes (batch on ``"data"``,
    heads on ``"model"``) may shard the inputs too. Works under ``check_vma=True``. Sinks
    join the softmax once, after the last hop. Keys no query may see have no effect, even if
    they hold NaN or inf. Options are static: bind them with ``functools.partial`` before
    ``jax.shard_map`` / ``jax.jit`` (see the example).

    Args:
      q: ``[B, T, N, H]`` this shard's queries.
      k: ``[B, S, K, H]`` this shard's keys; ``N % K == 0``. Only the ``K`` heads travel.
      v: ``[B, S, K, H]`` this shard's values.
      seq_axis: the mesh axis (or tuple of axes) the sequence is sharded over.
      layout: one of ``LAYOUTS``: ``"contiguous"``, or the causally load-balanced
        ``"zigzag"`` (``T``, ``S`` even) and ``"striped"``. It sets the default positions of
        ``"contiguous"``; the permuted ones need ``positions`` under a causal or window mask.
      mask: a :class:`ringattn.MaskSpec`, or its fields as the keywords below (not both).
      causal: a query at global position ``p`` sees keys at positions ``<= p``.
      window: hide keys at positions ``<= p - window``; a tuple: one per query head. With
        ``causal``, the contiguous layout, default positions and ``T == S``, hops beyond the
        widest window are not run at all.
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``.
      segment_ids: :class:`ringattn.SegmentIds` of the local queries ``[B, T]`` and keys
        ``[B, S]``; the key ids travel with the keys.
      positions: :class:`ringattn.Positions` of the local queries and keys (global
        positions); default ``shard_positions(layout, axis_index, n, T)`` per batch row,
        except that ``"zigzag"`` / ``"striped"`` under a causal or window mask require both
        (``shard_positions(layout, jax.lax.axis_index(seq_axis), n, T)`` for shards cut by
        :func:`ringattn.to_layout`): a permutation is not visible in the data. With
        ``T != S`` under a causal or window mask ``positions.q`` is required.
      sinks: ``[N]`` per-head sink logit, or None.
      block_sizes: :class:`ringattn.BlockSizes` of the per-hop kernel; with ``"zigzag"`` they
        are clamped to half the local length so causal chunk pairs can be skipped.
      hop_format: None (K/V travel in their dtype: exact), or ``KVFormat("int8")`` /
        ``KVFormat("fp8")`` (a :class:`ringattn.KVFormat`, the same class as
        ``paged.KVFormat``; the strings ``"int8"`` / ``"fp8"`` are shorthand for them): each
        device quantizes its K/V once per token and kv head with the pages' codec
        (:func:`ringattn.quantize_hop`), hops carry the quantized values and float32
        scales (:func:`ringattn.hop_bytes`), and every block, the local one included, is
        dequantized to float32 before its compute.
        The result is exact attention over the dequantized K/V; gradients: ``dq`` exact for
        it, ``dk``/``dv`` straight-through (the gradients with respect to the dequantized
        K/V); the backward ring sends the same quantized K/V and float32 dK/dV.
      impl: ``"auto"`` (the XLA kernels for now, on every backend; see
        :func:`ringattn.blockwise_attention`), ``"xla"`` or ``"pallas"``: every hop's block
        by the Pallas forward kernel returning the hop's ``(out, lse)`` (merged across hops
        in float32; each hop's ``out`` is first rounded to ``q.dtype``), and the backward
        hops by the Pallas ``dq`` and ``dk, dv`` kernels from the global ``lse``. Triton on
        GPU, Mosaic on TPU; on CPU Pallas's TPU interpret mode (slow, for tests; its
        callbacks are effects, so not under ``jax.checkpoint``). Not with ``hop_format``. ``block_sizes`` None takes the Pallas defaults of the backend (see
        :func:`ringattn.blockwise_attention`).
      bias: must be None: this path takes no logit bias (ValueError, naming the
        single-device functions that take one: ringattn.blockwise_attention,
        ringattn.attention_reference, ringattn.dot_product_attention).

    Returns:
      :class:`ringattn.AttentionOutput` ``(out [B, T, N, H] in q.dtype, lse [B, T, N]
      float32)`` over all shards' keys. Rows that see no key get ``out = 0`` and
      ``lse = -inf``. Differentiable (``custom_vjp``) in ``q``, ``k``, ``v`` and ``sinks``,
      also through ``lse``.

    Raises:
      ValueError: on inconsistent shapes or dtypes, ``N % K != 0``, bad segment ids or
        positions, an unknown ``layout`` or ``hop_format`` (not None, a KVFormat or a name
        of :data:`ringattn.HOP_FORMATS`), an odd ``T`` or ``S`` with
        ``"zigzag"``, a bad window, softcap, scale, sinks or ``block_sizes``, or a
        ``seq_axis`` that is not bound (called outside ``shard_map``), an unknown
        ``impl``, or missing positions (``"zigzag"`` / ``"striped"`` under a causal or window
        mask; ``T != S`` under one).
      NotImplementedError: a ``hop_format`` KVFormat of a kind hops do not carry (int4,
        kivi2); ``impl="pallas"`` with a ``hop_format``, on a backend other than
        CPU, GPU and TPU, or with block sizes the compiled kernel cannot take.

    Example:
      >>> import functools, jax, jax.numpy as jnp
      >>> from jax.sharding import AxisType, PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("seq",), axis_types=(AxisType.Auto,))
      >>> f = jax.shard_map(
      ...     functools.partial(ring_attention_per_shard, seq_axis="seq", causal=True),
      ...     mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
      >>> q = jax.random.normal(jax.random.key(0), (1, 64, 4, 16))
      >>> kv = jax.random.normal(jax.random.key(1), (1, 64, 2, 16))
      >>> jax.jit(f)(q, kv, kv).out.shape
      (1, 64, 4, 16)

    References:
      Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
      Context", 2023.
    """
    fn = "ring_attention_per_shard"
    refuse_bias(fn, bias)
    (B, T, S, N, K, H), spec, seg, pos = prepare(
        fn,
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        window=window,
        softcap=softcap,
        scale=scale,
        segment_ids=segment_ids,
        positions=positions,
        sinks=sinks,
    )
    if layout not in LAYOUTS:
        raise fail(fn, "layout", f"one of {LAYOUTS}", repr(layout))
    check_layout_positions(fn, layout, spec, pos, per_shard=True)
    check_block_sizes(fn, block_sizes)
    hop_format = check_hop_format(fn, hop_format)
    impl = resolve_impl(fn, impl, jax.default_backend())
    check_pallas_options(fn, impl, hop_format)
    if layout == "zigzag" and (T % 2 or S % 2):
        raise fail(
            fn,
            "q, k",
            "even local lengths (layout 'zigzag' holds two equal chunks per shard)",
            f"T={T} (q) and S={S} (k/v)",
        )
    _axis_size(fn, seq_axis)  # a ValueError outside shard_map
    if B == 0 or T == 0 or S == 0:
        return apply_sinks(*empty_attention(q, k, v), sinks)
    q_seg, kv_seg = (None, None) if seg is None else seg
    ids = MaskIds(pos.q, pos.kv, q_seg, kv_seg, head_windows(spec, N))
    ring = RingOptions(layout, seq_axis, block_sizes, hop_format=hop_format, impl=impl)
    out, lse = ring_local(q, k, v, ids, spec, ring)
    return apply_sinks(out, lse, sinks)


def check_pallas_options(fn: str, impl: str, hop_format: KVFormat | None) -> None:
    """NotImplementedError for ring options the Pallas hops do not take."""
    if impl == "pallas" and hop_format is not None:
        raise NotImplementedError(
            f"{fn}: hop_format={hop_format.kind!r} (quantized ring hops) is not implemented with "
            "impl='pallas'; use impl='xla' or hop_format=None"
        )


class RingOptions(NamedTuple):
    """How one ring runs (static): what :func:`ring_local` takes besides arrays and mask.

    Attributes:
      layout: the sequence layout over the ring (``"contiguous"``, ``"zigzag"``, ...).
      seq_axis: the ring's mesh axis name (or tuple of names).
      block_sizes: a :class:`BlockSizes`, or None for the defaults of ``impl``.
      hop_format: a :class:`ringattn.KVFormat` quantizing the travelling K/V, or None.
      hops: at most this many hops after the local one can reach a visible key (the caller
        read it off concrete positions); None: what the ring derives itself.
      impl: the resolved ``"xla"`` or ``"pallas"``.
    """

    layout: str
    seq_axis: str | tuple[str, ...]
    block_sizes: BlockSizes | None = None
    hop_format: KVFormat | None = None
    hops: int | None = None
    impl: str = "xla"


def ring_local(q, k, v, ids: MaskIds, spec: MaskSpec, ring: RingOptions):
    """The ring on validated inputs: ``(out, lse)``; positions None take the layout default.

    ``ids``: :class:`ringattn._blocks.MaskIds` of the local shard, ``windows`` the ``[N]``
    per-head windows of THESE query heads (traced or numpy) or None.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    n = _axis_size("ring_attention_per_shard", ring.seq_axis)
    default_pos = ids.q_pos is None and ids.kv_pos is None
    index = lax.axis_index(ring.seq_axis)
    if ids.q_pos is None:
        ids = ids._replace(
            q_pos=jnp.broadcast_to(shard_positions(ring.layout, index, n, T), (B, T))
        )
    if ids.kv_pos is None:
        ids = ids._replace(
            kv_pos=jnp.broadcast_to(shard_positions(ring.layout, index, n, S), (B, S))
        )
    ids = with_window_table(ids, B, K)
    pallas = None
    if ring.impl == "pallas":
        pallas = shard_pallas_config(spec, H, N // K, T, S, ring.block_sizes, ring.layout)
    plan = _RingPlan(
        seq_axis=ring.seq_axis,
        num_shards=n,
        hops=_hops(n, T, S, spec, ring.layout, default_pos, ring.hops),
        mask=spec,
        block_sizes=_layout_block_sizes(ring.block_sizes or BlockSizes(), ring.layout, T, S),
        hop_format=ring.hop_format,
        pallas=pallas,
    )
    # Everything that travels or meets travelling data must vary along the ring axis, and
    # the custom VJP's cotangents must match its inputs' types: cast all inputs to vary
    # together (for a ``k`` replicated over a head axis, the cast's transpose is the psum
    # its gradient needs).
    args = (q, k, v, ids)
    seq_axis = ring.seq_axis
    ring_axes = frozenset(seq_axis if isinstance(seq_axis, tuple) else (seq_axis,))
    args = cast_varying(args, ring_axes | varying_axes(*args))
    return _ring(*args, plan)


def hop_bytes(
    batch: IntLike,
    kv_len: IntLike,
    kv_heads: IntLike,
    head_dim: IntLike,
    dtype,
    *,
    hop_format: KVFormat | str | None = None,
    layout: str = "contiguous",
    block_sizes: BlockSizes | None = None,
    segment_ids: bool = False,
    backward: bool = False,
    impl: str = "auto",
) -> int:
    """Bytes each device sends in one hop of :func:`ring_attention_per_shard`.

    A forward hop is one packed buffer: keys and values of the ``kv_heads`` heads (in
    ``dtype``, or quantized data plus one float32 scale per token and kv head), int32
    positions and, with ``segment_ids``, int32 segment ids, each padded to the kernel's key
    block (``impl="pallas"``: not padded, the block travels in the canonical layout). A
    backward hop sends the same buffer and the block's float32 dK/dV accumulators
    (``2 * head_dim`` floats per token and kv head). With int8 or fp8 K/V take
    ``head_dim + 4`` bytes per token and kv head, against ``4 * head_dim`` in float32 and
    ``2 * head_dim`` in bfloat16.

    Args:
      batch: ``B`` of the local shard.
      kv_len: ``S``, keys per shard (assumed equal to the queries per shard ``T``).
      kv_heads: ``K`` kv heads on this device.
      head_dim: ``H``.
      dtype: dtype of ``k`` and ``v``.
      hop_format: None, ``KVFormat("int8")`` or ``KVFormat("fp8")``, or their shorthand
        ``"int8"`` / ``"fp8"`` (see :func:`ring_attention_per_shard`).
      layout: the ring's layout (``"zigzag"`` clamps the key block to half a shard).
      block_sizes: the ring's :class:`ringattn.BlockSizes` (default ``BlockSizes()``).
      segment_ids: whether segment ids travel with the keys.
      backward: the backward pass's hop (block sizes ``block_sizes.backward``, plus dK/dV).
      impl: the ring's ``impl`` (``"auto"``, ``"xla"`` or ``"pallas"``).

    Returns:
      Bytes per hop per device (an int).

    Raises:
      ValueError: on a negative size, a bad ``hop_format``, ``layout``, ``block_sizes`` or
        ``impl``.
      NotImplementedError: ``impl="pallas"`` with a ``hop_format``; a KVFormat of a kind
        hops do not carry (int4, kivi2).

    Example:
      >>> hop_bytes(1, 1024, 2, 128, "float32", hop_format="int8")  # K/V + int32 positions
      544768
      >>> hop_bytes(1, 1024, 2, 128, "float32")
      2101248
    """
    fn = "hop_bytes"
    B, S, K, H = (
        check_int(fn, name, value, minimum=0)
        for name, value in (
            ("batch", batch),
            ("kv_len", kv_len),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
        )
    )
    hop_format = check_hop_format(fn, hop_format)
    if layout not in LAYOUTS:
        raise fail(fn, "layout", f"one of {LAYOUTS}", repr(layout))
    sizes = _layout_block_sizes(check_block_sizes(fn, block_sizes), layout, S, S)
    impl = resolve_impl(fn, impl, jax.default_backend())
    check_pallas_options(fn, impl, hop_format)
    block_kv = (sizes.backward if backward else sizes.forward)[1]
    Sp = round_up(S, min(block_kv, S)) if S and impl == "xla" else S
    rows = B * K * Sp
    total = 2 * rows * hop_row_bytes(H, dtype, hop_format) + B * Sp * 4 * (1 + bool(segment_ids))
    if backward:
        total += rows * 2 * H * 4
    return int(total)
