"""Attention math and its distribution over a device mesh.

Shape legend (used in every signature and docstring of the library):

====  ==========================================
B     batch
T     query length (per shard inside shard_map)
S     key/value length
N     query heads
K     key/value heads, ``N % K == 0``
G     ``N // K`` query heads per kv head (GQA)
H     head dim
====  ==========================================

Canonical layout: ``q [B, T, N, H]``, ``k, v [B, S, K, H]``, ``lse [B, T, N]`` (float32).

Per shard inside ``shard_map``: :func:`ring_attention` (the ring over a mesh axis) and the
load-balanced sequence layouts :data:`LAYOUTS` (:func:`to_layout`, :func:`from_layout`,
:func:`shard_positions`).

Over a mesh: :func:`sharded_attention` (ring / all-gather / Ulysses / USP on global arrays),
:func:`sharded_decode_attention` and :func:`allreduce_attention` (decode over a
sequence-sharded KV cache, tree attention).
"""

from ringattn._blockwise import BlockSizes, blockwise_attention
from ringattn._decode import allreduce_attention, sharded_decode_attention
from ringattn._layout import LAYOUTS, from_layout, shard_positions, to_layout
from ringattn._mask import MaskSpec, attention_mask
from ringattn._online_softmax import (
    OnlineSoftmax,
    finalize_online_softmax,
    init_online_softmax,
    merge_attention,
    update_online_softmax,
)
from ringattn._reference import attention_reference
from ringattn._ring import ring_attention
from ringattn._sharded import STRATEGIES, sharded_attention

__all__ = [
    "LAYOUTS",
    "from_layout",
    "ring_attention",
    "shard_positions",
    "to_layout",
    "STRATEGIES",
    "allreduce_attention",
    "sharded_attention",
    "sharded_decode_attention",
    "BlockSizes",
    "MaskSpec",
    "OnlineSoftmax",
    "attention_mask",
    "attention_reference",
    "blockwise_attention",
    "finalize_online_softmax",
    "init_online_softmax",
    "merge_attention",
    "update_online_softmax",
]
