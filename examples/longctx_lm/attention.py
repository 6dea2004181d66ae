"""The attention switch: one model, the library's attention paths, the same weights.

Each factory returns ``attend(q [B, T, N, H], k [B, T, K, H], v [B, T, K, H],
positions [B, T]) -> out [B, T, N, H]``, causal over the explicit positions:

* :func:`dense`: ``ringattn.attention_reference`` (the float32 oracle, ``T x T`` memory).
* :func:`blockwise`: ``ringattn.blockwise_attention`` on one device (memory-linear, skips
  the causal future block by block).
* :func:`sharded`: ``ringattn.sharded_attention`` over a mesh: batch over ``batch_axis``,
  sequence over ``seq_axis`` with the ring (or all-gather / Ulysses) strategy. The tokens must
  already be in ``layout`` order (``ringattn.to_layout``); the positions say where each one
  truly is, so the rotary embedding and the causal mask see true positions.

Decoding from a paged cache lives in :mod:`examples.longctx_lm.generate`.
"""

import functools

import ringattn

__all__ = ["blockwise", "dense", "sharded"]


def dense():
    def attend(q, k, v, positions):
        pos = ringattn.Positions(positions, positions)
        return ringattn.attention_reference(q, k, v, causal=True, positions=pos).out

    return attend


def blockwise(block_sizes: ringattn.BlockSizes | None = None):
    def attend(q, k, v, positions):
        pos = ringattn.Positions(positions, positions)
        return ringattn.blockwise_attention(
            q, k, v, causal=True, positions=pos, block_sizes=block_sizes
        ).out

    return attend


def sharded(
    mesh,
    *,
    seq_axis: str = "seq",
    batch_axis: str | None = "data",
    strategy: str = "ring",
    layout: str = "zigzag",
    block_sizes: ringattn.BlockSizes | None = None,
):
    fn = functools.partial(
        ringattn.sharded_attention,
        mesh=mesh,
        seq_axis=seq_axis,
        batch_axis=batch_axis,
        strategy=strategy,
        layout=layout,
        causal=True,
        block_sizes=block_sizes,
    )

    def attend(q, k, v, positions):
        return fn(q, k, v, positions=ringattn.Positions(positions, positions)).out

    return attend
