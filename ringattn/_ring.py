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

References:
  Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
  Context", 2023; Brandon et al., "Striped Attention", 2023; Dao, "FlashAttention-2", 2023.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from ringattn._blocks import round_up, window_table
from ringattn._blockwise import (
    BlockSizes,
    check_block_sizes,
    empty_attention,
    head_windows,
    make_pallas_config,
    resolve_impl,
)
from ringattn._checks import FloatLike, IntLike, check_int, fail, refuse_bias
from ringattn._formats import KVFormat
from ringattn._heads_major import (
    attention_delta,
    kv_from_heads_major,
    kv_to_heads_major,
    make_kernel_config,
    pad_ids,
    q_from_heads_major,
    q_to_groups,
    q_to_heads_major,
)
from ringattn._hop_format import check_hop_format, dequantize_rows, hop_row_bytes, quantize_rows
from ringattn._kernels_backward import (
    dq_from_blocks,
    query_blocks,
    update_backward_blocks,
)
from ringattn._kernels_forward import forward_q_rows, init_forward_state, update_forward_blocks
from ringattn._layout import LAYOUTS, check_layout_positions, shard_positions
from ringattn._online_softmax import (
    AttentionOutput,
    apply_sinks,
    finalize_online_softmax,
    merge_attention,
)
from ringattn._options import MaskSpec, Positions, SegmentIds, prepare
from ringattn._pallas import kernel_calls
from ringattn._pallas_common import PallasConfig
from ringattn._varying import cast_varying, varying_axes

__all__ = ["hop_bytes", "ring_attention_per_shard"]

# ---- the ring ----


@dataclasses.dataclass(frozen=True)
class _RingPlan:
    """Everything static about one ring call (hashable: a ``custom_vjp`` nondiff argument)."""

    seq_axis: str | tuple
    num_shards: int
    hops: int  # key blocks received from other devices: n - 1, or fewer with a window
    mask: MaskSpec
    block_sizes: BlockSizes
    hop_format: KVFormat | None = None  # None: K/V travel in their dtype; int8 / fp8
    pallas: PallasConfig | None = None  # None: the XLA kernels; else the Pallas kernels'


def _shift(x, plan: _RingPlan, offset: int):
    """Sends ``x`` from device ``i`` to device ``(i + offset) % n`` along the ring axis."""
    n = plan.num_shards
    return lax.ppermute(x, plan.seq_axis, [(i, (i + offset) % n) for i in range(n)])


def _pack(arrays):
    """Flattens arrays (``None`` allowed) into one buffer: one collective per hop.

    The buffer holds unsigned integers as wide as the narrowest array's elements (``uint32``
    for float32 K/V, ``uint8`` for int8 hop data); each array is bitcast to it, which is free
    at the same width (a wider one becomes ``[..., ratio]`` of it), and comes back the same
    way. (A ``uint8`` buffer made XLA:CPU rebuild every float32 from four bytes, with shifts
    and a reduction, on each hop. An integer buffer, not a float one: XLA:CPU's bfloat16
    concatenate rewrites NaN payloads, which would corrupt integer ids carried in it.)
    """
    present = [x for x in arrays if x is not None]
    width = min(np.dtype(x.dtype).itemsize for x in present)
    unit = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[width]
    parts, spec = [], []
    for x in arrays:
        spec.append(None if x is None else (x.shape, x.dtype))
        if x is not None:
            parts.append(lax.bitcast_convert_type(x, unit).reshape(-1))
    return jnp.concatenate(parts), tuple(spec)


def _unpack(buffer, spec):
    out, offset = [], 0
    unit = np.dtype(buffer.dtype).itemsize
    for item in spec:
        if item is None:
            out.append(None)
            continue
        shape, dtype = item
        ratio = np.dtype(dtype).itemsize // unit
        size = int(np.prod(shape)) * ratio
        chunk = lax.slice(buffer, (offset,), (offset + size,))
        chunk = chunk.reshape(*shape, ratio) if ratio > 1 else chunk.reshape(shape)
        out.append(lax.bitcast_convert_type(chunk, dtype))
        offset += size
    return tuple(out)


def _travelling_block(k, v, kv_pos, kv_seg, Sp: int, plan: _RingPlan):
    """The block as it travels: heads-major K/V (quantized with ``plan.hop_format``) and ids.

    ``(kh, vh, kv_pos, kv_seg)``, or ``(k data, k scale, v data, v scale, kv_pos, kv_seg)``
    with ``data [B, K, Sp, H]`` int8 / float8 and ``scale [B, K, Sp]`` float32. Padding rows
    are zero (scale 0). Quantized once per device, the local block included.
    """
    kh, vh = kv_to_heads_major(k, Sp), kv_to_heads_major(v, Sp)
    ids = (pad_ids(kv_pos, Sp), pad_ids(kv_seg, Sp))
    if plan.hop_format is None:
        return (kh, vh, *ids)
    return (*quantize_rows(kh, plan.hop_format), *quantize_rows(vh, plan.hop_format), *ids)


def _arrived_block(block, plan: _RingPlan):
    """``(kh, vh, kv_pos, kv_seg)`` for the kernels: quantized K/V dequantized to float32."""
    if plan.hop_format is None:
        return block
    k_data, k_scale, v_data, v_scale, kp, ks = block
    fmt = plan.hop_format
    return dequantize_rows(k_data, k_scale, fmt), dequantize_rows(v_data, v_scale, fmt), kp, ks


def _run_hops(plan: _RingPlan, block, carry, compute):
    """Runs ``compute`` on the local block and ``plan.hops`` received ones.

    ``compute(block, carry, arriving) -> (carry, leaving)``, where ``block`` is
    ``(kh, vh, kv_pos, kv_seg)``; ``leaving`` (or None) is sent to the next device together
    with the block and comes back as the next hop's ``arriving`` (None at the local hop).
    Hop 0 and the last hop are peeled; hops ``1 .. hops - 1`` run in one ``fori_loop`` whose
    body issues the next transfer before its compute, so only the current and the incoming
    block (and ``leaving``) are live, whatever the ring size. Returns
    ``(carry, leaving of the last hop)``.
    """
    if not plan.hops:
        return compute(block, carry, None)
    buffer, spec = _pack(block)
    # Issue the first transfer before the local hop's compute (double buffering).
    incoming = _shift(buffer, plan, 1)
    carry, leaving = compute(block, carry, None)
    arriving = None if leaving is None else _shift(leaving, plan, 1)

    def body(_, loop_carry):
        buffer, carry, arriving = loop_carry
        incoming = _shift(buffer, plan, 1)
        carry, leaving = compute(_unpack(buffer, spec), carry, arriving)
        arriving = None if leaving is None else _shift(leaving, plan, 1)
        return incoming, carry, arriving

    if plan.hops > 1:
        incoming, carry, arriving = lax.fori_loop(1, plan.hops, body, (incoming, carry, arriving))
    return compute(_unpack(incoming, spec), carry, arriving)


def _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, windows, plan: _RingPlan):
    if plan.pallas is not None:
        return _ring_forward_pallas(q, k, v, q_pos, kv_pos, q_seg, kv_seg, windows, plan)
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    cfg, Tp, Sp = make_kernel_config(plan.mask, H, T, S, *plan.block_sizes.forward)
    qg, qp, qs = q_to_groups(q, K, Tp), pad_ids(q_pos, Tp), pad_ids(q_seg, Tp)
    block = _travelling_block(k, v, kv_pos, kv_seg, Sp, plan)
    q_rows = forward_q_rows(qg, cfg.block_q)  # block-major once, for every hop

    def compute(block, state, arriving):
        kh, vh, kp, ks = _arrived_block(block, plan)
        state = update_forward_blocks(state, q_rows, kh, vh, qp, kp, qs, ks, windows, cfg)
        return state, None

    # Every hop folds into one float32 online-softmax state: no per-hop (out, lse) to merge.
    state = cast_varying(init_forward_state(qg), varying_axes(qg, *block))
    state, _ = _run_hops(plan, block, state, compute)
    out, lse = finalize_online_softmax(state)
    return q_from_heads_major(out, T).astype(q.dtype), q_from_heads_major(lse, T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _ring(q, k, v, q_pos, kv_pos, q_seg, kv_seg, windows, plan):
    return _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, windows, plan)


def _ring_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, windows, plan):
    out, lse = _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, windows, plan)
    return (out, lse), (q, k, v, q_pos, kv_pos, q_seg, kv_seg, windows, out, lse)


def _ring_bwd(plan: _RingPlan, residuals, cotangents):
    if plan.pallas is not None:
        return _ring_bwd_pallas(plan, residuals, cotangents)
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, windows, out, lse = residuals
    dout, dlse = cotangents
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    cfg, Tp, Sp = make_kernel_config(plan.mask, H, T, S, *plan.block_sizes.backward)
    bq = cfg.block_q  # clamped to T
    qg, qp, qs = q_to_groups(q, K, Tp), pad_ids(q_pos, Tp), pad_ids(q_seg, Tp)
    lse_h = q_to_heads_major(lse, K, Tp)  # [B, K, G, Tp]
    dout_g = q_to_groups(dout, K, Tp)  # [B, Tp, K, G, H]
    delta_h = q_to_heads_major(attention_delta(out, dout, dlse), K, Tp)
    # The same quantized K/V travel again; dK/dV accumulators travel in float32. Gradients are
    # those of attention over the dequantized K/V (straight-through for k, v).
    block = _travelling_block(k, v, kv_pos, kv_seg, Sp, plan)
    axes = varying_axes(qg, lse_h, dout_g, delta_h, *block)
    # The query side and dq (transposed) stay block-major over every hop, laid out once.
    qb = query_blocks(qg, lse_h, dout_g, delta_h, bq)

    def compute(block, dq_t, arriving):
        kh, vh, kp, ks = _arrived_block(block, plan)
        # dK/dV of the block held at this hop: [B, K, Sp, 2H] float32, travelling with it.
        dkv = cast_varying(jnp.zeros((B, K, Sp, 2 * H), jnp.float32), axes)
        dkv = dkv if arriving is None else arriving
        return update_backward_blocks(dq_t, dkv, qb, kh, vh, qp, kp, qs, ks, windows, cfg)

    dq_t = jnp.zeros((Tp // bq, B, K, H, N // K * bq), jnp.float32)  # dq^T, block-major
    dq_t, dkv = _run_hops(plan, block, cast_varying(dq_t, axes), compute)
    dq = dq_from_blocks(dq_t, N // K)
    if plan.hops:
        dkv = _shift(dkv, plan, -plan.hops)  # block (i - hops)'s gradients go home
    dk = kv_from_heads_major(dkv[..., :H], S)
    dv = kv_from_heads_major(dkv[..., H:], S)
    dq = q_from_heads_major(dq, T)
    ints = (None,) * 5
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *ints


_ring.defvjp(_ring_fwd, _ring_bwd)

# ---- the ring with Pallas kernels per hop ----


def _ring_forward_pallas(q, k, v, q_pos, kv_pos, q_seg, kv_seg, table, plan: _RingPlan):
    """The forward ring with the Pallas kernel per hop: ``(out in q.dtype, lse float32)``.

    ``table``: the ``[B, K, G]`` per-head window table or None. The block travels as
    ``(k, v, kv_pos, kv_seg)`` in the canonical layout (the kernel pads it itself); each
    hop's ``(out, lse)`` (``out`` in ``q.dtype``) is merged into a float32 running result.
    """
    B, T, N, H = q.shape
    block = (k, v, kv_pos, kv_seg)

    def compute(block, running: AttentionOutput, arriving):
        kb, vb, kp, ks = block
        out, lse = kernel_calls(plan.pallas)[0](q, kb, vb, q_pos, kp, q_seg, ks, table, plan.pallas)
        return merge_attention(running.out, running.lse, out, lse), None

    empty = AttentionOutput(
        jnp.zeros((B, T, N, H), jnp.float32), jnp.full((B, T, N), -jnp.inf, jnp.float32)
    )
    running = cast_varying(empty, varying_axes(q, q_pos, q_seg, table, *block))
    (out, lse), _ = _run_hops(plan, block, running, compute)
    return out.astype(q.dtype), lse


def _ring_bwd_pallas(plan: _RingPlan, residuals, cotangents):
    """FlashAttention-2's ring backward with the Pallas ``dq`` and ``dk, dv`` kernels per hop.

    Every hop's probabilities are ``exp(s - lse)`` with the GLOBAL ``lse``, and
    ``delta = rowsum(dout * out) - dlse`` of the global output, so each hop's gradients are
    its exact share. The block's float32 ``concat([dk, dv], -1)`` ``[B, S, K, 2H]`` travels
    with it and a last shift sends it home, as in the XLA ring.
    """
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, table, out, lse = residuals
    dout, dlse = cotangents
    B, T, N, H = q.shape
    delta = attention_delta(out, dout, dlse)
    block = (k, v, kv_pos, kv_seg)
    axes = varying_axes(q, q_pos, q_seg, table, lse, dout, delta, *block)

    def compute(block, dq, arriving):
        kb, vb, kp, ks = block
        dq_hop, dk, dv = kernel_calls(plan.pallas)[1](
            q, kb, vb, q_pos, kp, q_seg, ks, table, lse, dout, delta, plan.pallas
        )
        dkv = jnp.concatenate([dk, dv], axis=-1)  # [B, S, K, 2H] float32
        return dq + dq_hop, dkv if arriving is None else arriving + dkv

    dq = cast_varying(jnp.zeros((B, T, N, H), jnp.float32), axes)
    dq, dkv = _run_hops(plan, block, dq, compute)
    if plan.hops:
        dkv = _shift(dkv, plan, -plan.hops)  # block (i - hops)'s gradients go home
    dk, dv = dkv[..., :H], dkv[..., H:]
    ints = (None,) * 5
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *ints


def shard_pallas_config(
    mask: MaskSpec, H: int, G: int, T: int, S: int, block_sizes, layout: str
) -> PallasConfig:
    """The :class:`ringattn._pallas_common.PallasConfig` of Pallas kernels run inside ``shard_map``.

    ``block_sizes``: the caller's :class:`BlockSizes` or None (the Pallas defaults, see
    :func:`ringattn._pallas_triton.pallas_blocks`). With ``"zigzag"`` the blocks are clamped to half
    the local lengths (compiled: rounded down to a power of two for Triton, kept as given
    for Mosaic unless the half is whole tiles), so causal chunk pairs can be skipped. The
    target follows the backend (:func:`ringattn._blockwise.pallas_target`: Mosaic on TPU,
    Triton elsewhere). On CPU the kernels run in Pallas's TPU interpret mode: the
    ``interpret=True`` HLO interpreter fails the ``check_vma`` type check on its grid loop.
    """
    cfg = make_pallas_config(mask, block_sizes, G, T, S, H, jax.default_backend())
    interpret = cfg.interpret
    if layout == "zigzag":

        def half(b: int, L: int, unit: int) -> int:
            h = min(b, L // 2)
            if interpret:
                return h
            if cfg.target == "triton":
                return 1 << (h.bit_length() - 1)  # Triton: a power of two
            return h if h == b or h % unit == 0 else b  # Mosaic: whole tiles, else as given

        rows, lanes = 8 // math.gcd(G, 8), 128  # Mosaic: rows (block_q * G) by 8, keys by 128
        cfg = dataclasses.replace(
            cfg,
            block_q=half(cfg.block_q, T, rows),
            block_q_bwd=half(cfg.block_q_bwd, T, rows),
            block_kv=half(cfg.block_kv, S, lanes),
            block_kv_bwd=half(cfg.block_kv_bwd, S, lanes),
        )
    if interpret:
        from jax.experimental.pallas import tpu as pltpu

        cfg = dataclasses.replace(cfg, interpret=pltpu.InterpretParams())
    return cfg


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


def _window_hops(n: int, T: int, S: int, mask: MaskSpec, layout: str, default_pos: bool) -> int:
    """Hops that can reach a visible key.

    With causal masking, a window ``w`` (the widest over heads) and contiguous shards of
    ``T`` tokens at their default positions, hop ``t``'s newest key ``(i - t + 1) T - 1`` is
    visible to query ``i T`` iff ``(t - 1) T + 1 < w``. Later hops hold blocks outside every
    window or (after wrapping around) in the causal future.
    """
    w = mask.widest_window
    if mask.causal and w is not None and layout == "contiguous" and default_pos and T == S:
        return min(n - 1, (w - 2) // T + 1)
    return n - 1


def _hops(n, T, S, mask, layout, default_pos, bound) -> int:
    if n == 1:
        return 0
    derived = _window_hops(n, T, S, mask, layout, default_pos)
    return derived if bound is None else min(derived, bound)


def _layout_block_sizes(block_sizes: BlockSizes, layout: str, T: int, S: int) -> BlockSizes:
    """With ``"zigzag"``, blocks no larger than one chunk, so the kernel can skip chunk pairs."""
    if layout != "zigzag":
        return block_sizes
    bq_bwd, bk_bwd = block_sizes.backward
    return BlockSizes(
        block_q=min(block_sizes.block_q, T // 2),
        block_kv=min(block_sizes.block_kv, S // 2),
        block_q_bwd=min(bq_bwd, T // 2),
        block_kv_bwd=min(bk_bwd, S // 2),
    )


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
    windows = head_windows(spec, N)
    out, lse = ring_local(
        q,
        k,
        v,
        pos.q,
        pos.kv,
        q_seg,
        kv_seg,
        windows,
        spec,
        layout,
        block_sizes,
        seq_axis,
        hop_format=hop_format,
        impl=impl,
    )
    return apply_sinks(out, lse, sinks)


def check_pallas_options(fn: str, impl: str, hop_format: KVFormat | None) -> None:
    """NotImplementedError for ring options the Pallas hops do not take."""
    if impl == "pallas" and hop_format is not None:
        raise NotImplementedError(
            f"{fn}: hop_format={hop_format.kind!r} (quantized ring hops) is not implemented with "
            "impl='pallas'; use impl='xla' or hop_format=None"
        )


def ring_local(
    q,
    k,
    v,
    q_pos,
    kv_pos,
    q_seg,
    kv_seg,
    windows,
    spec,
    layout,
    block_sizes,
    seq_axis,
    *,
    hop_format: KVFormat | None = None,
    hops: int | None = None,
    impl: str = "xla",
):
    """The ring on validated inputs: ``(out, lse)``; positions None take the layout default.

    ``windows``: ``[N]`` per-head windows of THESE query heads (traced or numpy), or None.
    ``block_sizes``: a :class:`BlockSizes`, or None for the defaults of ``impl``.
    ``hops``: at most this many hops after the local one can reach a visible key (the caller
    read it off concrete positions); None: what the ring derives itself. ``impl``: the
    resolved ``"xla"`` or ``"pallas"``.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    n = _axis_size("ring_attention_per_shard", seq_axis)
    default_pos = q_pos is None and kv_pos is None
    index = lax.axis_index(seq_axis)
    if q_pos is None:
        q_pos = jnp.broadcast_to(shard_positions(layout, index, n, T), (B, T))
    if kv_pos is None:
        kv_pos = jnp.broadcast_to(shard_positions(layout, index, n, S), (B, S))
    table = None if windows is None else window_table(windows, B, K)
    pallas = None
    if impl == "pallas":
        pallas = shard_pallas_config(spec, H, N // K, T, S, block_sizes, layout)
    plan = _RingPlan(
        seq_axis=seq_axis,
        num_shards=n,
        hops=_hops(n, T, S, spec, layout, default_pos, hops),
        mask=spec,
        block_sizes=_layout_block_sizes(block_sizes or BlockSizes(), layout, T, S),
        hop_format=hop_format,
        pallas=pallas,
    )
    # Everything that travels or meets travelling data must vary along the ring axis, and
    # the custom VJP's cotangents must match its inputs' types: cast all inputs to vary
    # together (for a ``k`` replicated over a head axis, the cast's transpose is the psum
    # its gradient needs).
    args = (q, k, v, q_pos, kv_pos, q_seg, kv_seg, table)
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
