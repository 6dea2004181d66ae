"""Block pairs of the blockwise kernels: static configuration, classification and masks.

Every ``(query block, key block)`` pair is classified from per-block position and segment
ranges as *empty* (skipped: no compute), *full* (no mask needed) or *partial* (masked
elementwise). The classification is dynamic, so it also skips work for arbitrary positions: a
ring hop whose block lies in the causal future, a zigzag layout, a sliding window, packed
documents. With one window per query head a pair is live if it is live for the widest window
and full only if it is full for the narrowest.

Masked keys have no effect: in a partial block, logits of hidden pairs are replaced (``where``)
by ``-inf``, and keys and values that no query of the block may see are replaced by zeros
before any product, so NaN or inf stored there reaches neither outputs nor gradients.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from ringattn._options import MaskSpec

EMPTY, FULL, PARTIAL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Everything static about one kernel call (hashable; a jit static argument)."""

    mask: MaskSpec
    scale: float
    block_q: int
    block_kv: int
    kv_len: int  # valid keys; keys at index >= kv_len are padding


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_axis(x, axis: int, size: int, mode: str = "constant"):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, mode=mode)


def dslice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def q_block(x, i, size: int):
    """Query block ``i`` of ``x [B, Tp, K, G, ...]``, transposed to ``[B, K, G, size, ...]``."""
    return jnp.moveaxis(dslice(x, i * size, size, 1), 1, 3)


def _block_ranges(ids, block: int):
    """Per-block (min, max) of ``ids [B, Lp]`` over batch and block: two ``[Lp // block]``."""
    B, Lp = ids.shape
    blocks = ids.reshape(B, Lp // block, block)
    return jnp.min(blocks, axis=(0, 2)), jnp.max(blocks, axis=(0, 2))


class Summaries:
    """Per-block ranges of positions (and segment ids) used to classify block pairs."""

    def __init__(self, q_pos, kv_pos, q_seg, kv_seg, block_q, block_kv):
        self.q_pos = _block_ranges(q_pos, block_q)
        self.kv_pos = _block_ranges(kv_pos, block_kv)
        self.segments = q_seg is not None
        if self.segments:
            self.q_seg = _block_ranges(q_seg, block_q)
            self.kv_seg = _block_ranges(kv_seg, block_kv)

    def kind(self, cfg: KernelConfig, i, j):
        """EMPTY, FULL or PARTIAL for query block ``i`` against key block ``j``."""
        qmin, qmax = self.q_pos[0][i], self.q_pos[1][i]
        kmin, kmax = self.kv_pos[0][j], self.kv_pos[1][j]
        live = jnp.bool_(True)
        full = (j + 1) * cfg.block_kv <= cfg.kv_len
        if cfg.mask.causal:
            live &= qmax >= kmin
            full &= qmin >= kmax
        widest, narrowest = cfg.mask.widest_window, cfg.mask.narrowest_window
        if widest is not None:
            live &= kmax > qmin - widest
        if narrowest is not None:
            full &= kmin > qmax - narrowest
        if self.segments:
            qsmin, qsmax = self.q_seg[0][i], self.q_seg[1][i]
            ksmin, ksmax = self.kv_seg[0][j], self.kv_seg[1][j]
            live &= (qsmax >= ksmin) & (ksmax >= qsmin)
            full &= (qsmin == qsmax) & (ksmin == ksmax) & (qsmin == ksmin)
        return jnp.where(live, jnp.where(full, FULL, PARTIAL), EMPTY).astype(jnp.int32)


def block_mask(cfg: KernelConfig, K: int, G: int, q_pos, kv_pos, q_seg, kv_seg, kv_start):
    """Visibility of one block pair, broadcastable to the logits ``[B, K, G, bq, bk]``.

    ``[B, 1, 1, bq, bk]``, or ``[B, K, G, bq, bk]`` with one window per query head; padding
    keys (index ``>= kv_len``) are hidden.
    """
    qp = q_pos[:, :, None]
    kp = kv_pos[:, None, :]
    col = kv_start + lax.broadcasted_iota(jnp.int32, (1, 1, kp.shape[-1]), 2)
    mask = jnp.broadcast_to(col < cfg.kv_len, (qp.shape[0], qp.shape[1], kp.shape[-1]))
    spec = cfg.mask
    if spec.causal:
        mask &= kp <= qp
    if q_seg is not None:
        mask &= q_seg[:, :, None] == kv_seg[:, None, :]
    if not spec.per_head:
        if spec.uniform_window is not None:
            mask &= kp > qp - spec.uniform_window
        return mask[:, None, None]
    windows = spec.windows(K * G)
    w = np.asarray([0 if x is None else x for x in windows], np.int32).reshape(K, G)
    has = np.asarray([x is not None for x in windows]).reshape(K, G)
    in_window = kp[:, None, None] > qp[:, None, None] - w[None, :, :, None, None]
    return mask[:, None, None] & (in_window | ~has[None, :, :, None, None])


def visible_keys(mask):
    """``[B, 1, bk, 1]``: keys that some query (any head, any row) of the block may see."""
    return jnp.any(mask, axis=(1, 2, 3))[:, None, :, None]


def hide_keys(mask, k_blk, v_blk):
    """Zeros (``where``, not a product) the keys and values ``[B, K, bk, H]`` no query sees."""
    seen = visible_keys(mask)
    return jnp.where(seen, k_blk, 0), jnp.where(seen, v_blk, 0)


def logits(cfg: KernelConfig, q_blk, k_blk):
    """Scaled, soft-capped logits ``[B, K, G, bq, bk]`` in float32, and ``tanh`` for softcap."""
    s = jnp.einsum("bkgqh,bksh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32)
    s = s * cfg.scale
    if cfg.mask.softcap is None:
        return s, None
    t = jnp.tanh(s / cfg.mask.softcap)
    return cfg.mask.softcap * t, t


def apply_mask(s, mask):
    return jnp.where(mask, s, -jnp.inf)
