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
"""

from ringattn._blockwise import BlockSizes, blockwise_attention
from ringattn._mask import MaskSpec, attention_mask
from ringattn._online_softmax import (
    OnlineSoftmax,
    finalize_online_softmax,
    init_online_softmax,
    merge_attention,
    update_online_softmax,
)
from ringattn._reference import attention_reference

__all__ = [
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
