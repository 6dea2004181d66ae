"""The ring's static plan and its transport, shared by the XLA and the Pallas rings.

:class:`_RingPlan` (everything static about one ring call: the ``custom_vjp``'s nondiff
argument), the number of hops that can reach a visible key (fewer than ``n - 1`` with a causal
sliding window on the contiguous layout), the zigzag block sizes, and the transport: a block
packed into one buffer (one ``collective-permute`` per hop), shifted along the ring with
``jax.lax.ppermute``, and the hop loop :func:`_run_hops` that issues the next transfer before
the current hop's compute. The per-hop compute lives in :mod:`ringattn._ring_xla` and
:mod:`ringattn._ring_pallas`; the public entry in :mod:`ringattn._ring`.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from ringattn._blockwise import BlockSizes
from ringattn._formats import KVFormat
from ringattn._options import MaskSpec
from ringattn._pallas_common import PallasConfig


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
