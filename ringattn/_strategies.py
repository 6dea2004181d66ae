"""The per-shard bodies of :func:`ringattn.sharded_attention`'s four strategies.

Each body runs inside ``jax.shard_map`` on one device's shard: ``"ring"`` (the ring over
``seq_axis``), ``"allgather"`` (gather K/V, attend locally), ``"ulysses"`` (all-to-all to a
head sharding and back) and ``"usp"`` (Ulysses over one axis, ring over the other). Per-head
windows are sliced to the query heads each device holds (heads split over ``head_axis`` and,
for Ulysses, over the Ulysses axis, in order). Sinks join once, at the end of each body.
With ``impl="pallas"`` the ring hops and the local attention of ``"allgather"`` and
``"ulysses"`` run the Pallas kernels of :mod:`ringattn._pallas`.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ringattn._blocks import MaskIds
from ringattn._blockwise import BlockSizes, head_windows, local_attention, with_window_table
from ringattn._formats import KVFormat
from ringattn._layout import from_layout, to_layout
from ringattn._online_softmax import apply_sinks
from ringattn._options import MaskSpec, arange_positions
from ringattn._pallas import pallas_attention
from ringattn._ring import RingOptions, ring_local
from ringattn._ring_pallas import shard_pallas_config
from ringattn._varying import cast_varying, varying_axes


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one :func:`sharded_attention` call (a jit static argument)."""

    mesh: jax.sharding.Mesh
    strategy: str
    layout: str
    seq_axis: str  # the ring / all-gather / Ulysses axis ("usp": the ring axis)
    ulysses_axis: str | None  # "usp" only
    batch_axis: str | None
    head_axis: str | None
    layout_shards: int  # shards the layout permutation is over
    kv_repeat: int  # Ulysses: each kv head is repeated this many times before the all-to-all
    mask: MaskSpec
    block_sizes: BlockSizes | None
    num_heads: int  # global query heads N (per-head windows are sliced per device)
    hop_format: KVFormat | None = None  # "ring" / "usp": quantized K/V hops (int8, fp8)
    ring_hops: int | None = None  # "ring" / "usp": hops that can reach a visible key (None: all)
    impl: str = "xla"  # the resolved kernels: "xla" or "pallas"

    @property
    def seq_spec(self):
        # "usp": the ring axis is major, so after the Ulysses all-to-all each device holds one
        # contiguous chunk of the ring layout.
        if self.ulysses_axis is None:
            return self.seq_axis
        return (self.seq_axis, self.ulysses_axis)

    def spec(self, ndim: int) -> P:
        """Partition spec of a ``[B, T|S, ...]`` array: 2 ids, 3 lse, 4 q/k/v/out."""
        return P(self.batch_axis, self.seq_spec, *((self.head_axis, None)[: ndim - 2]))


def _natural(x, plan: Plan, axis: int = 1):
    """Gathered layout-order sequence → natural order (a static local permutation)."""
    if plan.layout == "contiguous" or plan.layout_shards == 1 or x is None:
        return x
    return from_layout(x, plan.layout, num_shards=plan.layout_shards, axis=axis)


def permuted(x, plan: Plan, axis: int = 1):
    if plan.layout == "contiguous" or plan.layout_shards == 1:
        return x
    return to_layout(x, plan.layout, num_shards=plan.layout_shards, axis=axis)


def _windows(plan: Plan, start, count: int):
    """Per-head windows of ``count`` local query heads from global head ``start`` (or None)."""
    if not plan.mask.per_head:
        return None
    every = jnp.asarray(head_windows(plan.mask, plan.num_heads))
    return lax.dynamic_slice_in_dim(every, start, count)


def _attend_local(q, k, v, ids: MaskIds, plan: Plan, layout: str = "contiguous"):
    """Local attention; ``ids.windows``: the ``[N]`` windows of the local query heads, or
    None; ``layout``: the order of the local queries (Pallas block clamping)."""
    if plan.impl == "pallas":
        (B, T, N, H), (S, K) = q.shape, k.shape[1:3]
        cfg = shard_pallas_config(plan.mask, H, N // K, T, S, plan.block_sizes, layout)
        # The custom VJP's cotangents vary like the kernels' outputs: cast the inputs alike.
        args = (q, k, v, with_window_table(ids, B, K))
        return pallas_attention(*cast_varying(args, varying_axes(*args)), cfg)
    sizes = plan.block_sizes or BlockSizes()
    return local_attention(q, k, v, ids, plan.mask, sizes)


def _attend_ring(q, k, v, ids: MaskIds, plan: Plan):
    ring = RingOptions(
        layout=plan.layout,
        seq_axis=plan.seq_axis,
        block_sizes=plan.block_sizes,
        hop_format=plan.hop_format,
        hops=plan.ring_hops,
        impl=plan.impl,
    )
    return ring_local(q, k, v, ids, plan.mask, ring)


def _gather(x, axis_name, axis: int = 1):
    return None if x is None else lax.all_gather(x, axis_name, axis=axis, tiled=True)


def _allgather_body(q, k, v, ids: MaskIds, head_start, plan: Plan):
    a = plan.seq_axis
    k, v, ks, kp = (_natural(_gather(x, a), plan) for x in (k, v, ids.kv_seg, ids.kv_pos))
    ids = ids._replace(kv_pos=kp, kv_seg=ks, windows=_windows(plan, head_start, q.shape[2]))
    return _attend_local(q, k, v, ids, plan, plan.layout)


def _ulysses_body(q, k, v, ids: MaskIds, head_start, plan: Plan):
    """Sequence-sharded → head-sharded, attend over the full (ring-local) sequence, and back."""
    u = plan.ulysses_axis if plan.strategy == "usp" else plan.seq_axis
    if plan.kv_repeat > 1:
        k = jnp.repeat(k, plan.kv_repeat, axis=2)  # [B, S/n, K * r, H]: copies stay adjacent
        v = jnp.repeat(v, plan.kv_repeat, axis=2)

    def to_heads(x):  # [B, T/n, N, H] -> [B, T, N/n, H]
        return lax.all_to_all(x, u, split_axis=2, concat_axis=1, tiled=True)

    def to_sequence(x):  # [B, T, N/n, ...] -> [B, T/n, N, ...]
        return lax.all_to_all(x, u, split_axis=1, concat_axis=2, tiled=True)

    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    ids = jax.tree.map(lambda x: _gather(x, u), ids)  # positions, segments: no windows yet
    if plan.strategy != "usp":  # local attention in natural order
        q, k, v = (_natural(x, plan) for x in (q, k, v))
        ids = jax.tree.map(lambda x: _natural(x, plan), ids)
    start = head_start + lax.axis_index(u) * q.shape[2]
    ids = ids._replace(windows=_windows(plan, start, q.shape[2]))
    if plan.strategy == "usp":
        out, lse = _attend_ring(q, k, v, ids, plan)
    else:
        out, lse = _attend_local(q, k, v, ids, plan)
        out, lse = permuted(out, plan), permuted(lse, plan)
    return to_sequence(out), to_sequence(lse)


def body(q, k, v, ids: MaskIds, sinks, *, plan: Plan):
    """The ``shard_map`` body: ``ids`` hold the local shard's positions and segments
    (positions None under ring and USP: the layout's defaults)."""
    # First global query head held here (heads are split over head_axis, in order).
    head_start = 0 if plan.head_axis is None else lax.axis_index(plan.head_axis) * q.shape[2]
    if plan.strategy == "ring":
        ids = ids._replace(windows=_windows(plan, head_start, q.shape[2]))
        out, lse = _attend_ring(q, k, v, ids, plan)
    elif plan.strategy == "allgather":
        out, lse = _allgather_body(q, k, v, ids, head_start, plan)
    else:
        out, lse = _ulysses_body(q, k, v, ids, head_start, plan)
    return apply_sinks(out, lse, sinks)  # once, on the complete attention of each row


def default_positions(B: int, length: int, plan: Plan):
    return permuted(arange_positions(B, length), plan)
