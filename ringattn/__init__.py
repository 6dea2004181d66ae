"""Attention math and its distribution over a device mesh.

Shape legend (used in every signature and docstring of the library):

====  ==========================================
B     batch
T     query length (per shard inside shard_map)
S     key/value length (per shard inside shard_map)
N     query heads
K     key/value heads, ``N % K == 0``
G     ``N // K`` query heads per kv head (GQA)
H     head dim
====  ==========================================

Canonical layout: ``q [B, T, N, H]``, ``k, v [B, S, K, H]``, ``lse [B, T, N]`` (float32).

Every attention function returns an :class:`AttentionOutput` ``(out, lse)`` and takes its mask
as ``mask=MaskSpec(...)`` or the keyword sugar ``causal=, window=, softcap=, scale=`` (one
validator, :func:`resolve_mask`), plus ``segment_ids=SegmentIds(q, kv)``,
``positions=Positions(q, kv)`` and ``sinks=`` (a per-head sink logit, applied once with
:func:`apply_sinks`). Options are static: jit with ``functools.partial`` or
``static_argnames``.

Arbitrary static boolean masks (:class:`DenseMask`, combined with ``|`` / ``&``, as splash
attention's ``NumpyMask`` / ``LogicalOr``) go through ``MaskSpec(dense=...)`` and are supported
by :func:`attention_reference` and :func:`blockwise_attention` (block skipping computed from
the mask); the distributed paths raise ``NotImplementedError`` for them.

Guarantees: a key that no query may see (causal future, another segment, outside the window,
a decode slot beyond ``lengths``, padding) has no effect on any output or gradient, even if it
holds NaN or inf; a row that sees nothing gives ``out = 0``, ``lse = -inf``.

Single device: :func:`attention_reference` (the dense oracle), :func:`blockwise_attention`,
:func:`merge_attention` and the online-softmax primitives. Both attention functions take an
additive logit ``bias`` ``[B or 1, N or 1, T or 1, S or 1]`` (the distributed and Pallas paths
do not). :func:`dot_product_attention` is ``jax.nn.dot_product_attention`` (its arguments, its
``[B, T, N, H]`` array result) on the blockwise kernels, for a Flax ``attention_fn``.

Per shard inside ``shard_map``: :func:`ring_attention_per_shard`,
:func:`decode_attention_per_shard`, :func:`allreduce_attention_per_shard`,
:func:`match_varying` (with :func:`varying_axes` and :func:`varying_struct`, the
``out_shape`` of a ``pallas_call`` under ``check_vma=True``), and the load-balanced sequence layouts :data:`LAYOUTS`
(:func:`to_layout`, :func:`from_layout`, :func:`shard_positions`).

KV formats: :class:`KVFormat` (int8, fp8, int4, kivi2) is the one vocabulary for how keys and
values are stored or sent, with one codec per format (:meth:`KVFormat.encode` /
:meth:`KVFormat.decode`); ``paged.KVFormat`` is the same class. Quantized ring hops
(``hop_format=KVFormat("int8")`` / ``KVFormat("fp8")``, or the shorthand ``"int8"`` /
``"fp8"``, on the ring and USP): K/V travel as per-token, per-kv-head absmax-quantized values
with float32 scales (:func:`quantize_hop`, :func:`dequantize_hop`, :func:`hop_bytes`), the same
bytes a page of that format stores; the result is exact attention over the dequantized K/V,
with straight-through ``dk``/``dv``.

On global arrays over a mesh: :func:`sharded_attention` (ring / all-gather / Ulysses / USP)
and :func:`sharded_decode_attention` (decode over a sequence-sharded KV cache, tree attention).

Kernels: :func:`blockwise_attention`, :func:`ring_attention_per_shard` and
:func:`sharded_attention` take ``impl="auto" | "xla" | "pallas"``. ``"pallas"`` runs Pallas
kernels that return ``(out, lse)`` (Triton on GPU, interpret mode on CPU; per hop in the
ring); ``"auto"`` is the XLA path on every backend until the compiled kernels have been
checked on a GPU.
"""

from ringattn._blockwise import BlockSizes, blockwise_attention, resolve_impl
from ringattn._decode import (
    allreduce_attention_per_shard,
    decode_attention_per_shard,
    sharded_decode_attention,
)
from ringattn._dense_mask import DenseMask
from ringattn._formats import KVFormat
from ringattn._hop_format import HOP_FORMATS, QuantizedHop, dequantize_hop, quantize_hop
from ringattn._layout import LAYOUTS, from_layout, shard_positions, to_layout
from ringattn._nn_api import dot_product_attention
from ringattn._online_softmax import (
    AttentionOutput,
    OnlineSoftmax,
    apply_sinks,
    finalize_online_softmax,
    init_online_softmax,
    merge_attention,
    update_online_softmax,
)
from ringattn._options import MaskSpec, Positions, SegmentIds, attention_mask, resolve_mask
from ringattn._reference import attention_reference
from ringattn._ring import hop_bytes, ring_attention_per_shard
from ringattn._sharded import STRATEGIES, sharded_attention
from ringattn._varying import match_varying, varying_axes, varying_struct

__all__ = [
    # options and results
    "AttentionOutput",
    "BlockSizes",
    "DenseMask",
    "MaskSpec",
    "Positions",
    "SegmentIds",
    "attention_mask",
    "resolve_mask",
    # single device
    "attention_reference",
    "blockwise_attention",
    "dot_product_attention",
    "resolve_impl",
    "apply_sinks",
    "merge_attention",
    "OnlineSoftmax",
    "finalize_online_softmax",
    "init_online_softmax",
    "update_online_softmax",
    # per shard, inside shard_map
    "LAYOUTS",
    "from_layout",
    "shard_positions",
    "to_layout",
    "allreduce_attention_per_shard",
    "decode_attention_per_shard",
    "match_varying",
    "varying_axes",
    "varying_struct",
    "ring_attention_per_shard",
    # KV formats and quantized ring hops
    "KVFormat",
    "HOP_FORMATS",
    "QuantizedHop",
    "dequantize_hop",
    "hop_bytes",
    "quantize_hop",
    # global arrays over a mesh
    "STRATEGIES",
    "sharded_attention",
    "sharded_decode_attention",
]
