"""Block pairs of the blockwise kernels: static configuration, classification and masks.

Every ``(query block, key block)`` pair is classified from per-block position and segment
ranges as *empty* (skipped: no compute), *full* (no mask needed) or *partial* (masked
elementwise). The classification is dynamic, so it also skips work for arbitrary positions: a
ring hop whose block lies in the causal future, a zigzag layout, a sliding window, packed
documents. :meth:`Summaries.kinds` tabulates all pairs once per call; :func:`visit_order`
lists a row's full blocks, then its partial ones, for the XLA kernels' two branch-free loops,
and :func:`live_range` gives the span of live blocks the Pallas kernels visit (dynamic trip
counts). With one window per query head (a traced ``[B, K, G]`` int32 table, ``0`` for a
head without a window, so head-sharded strategies can slice it per device) a pair is live if
it is live for the widest window and full only if it is full for the narrowest.

Masked keys have no effect: in a partial block, logits of hidden pairs are replaced (``where``)
by ``-inf``, and keys and values that no query of the block may see are replaced by zeros
before any product, so NaN or inf stored there reaches neither outputs nor gradients.
"""

import dataclasses
from typing import NamedTuple

import jax
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


class MaskIds(NamedTuple):
    """The per-token arrays a mask reads, travelling as one pytree through the kernels.

    Attributes:
      q_pos: ``[B, T]`` int32 query positions.
      kv_pos: ``[B, S]`` int32 key positions.
      q_seg: ``[B, T]`` int32 query segment ids, or None (no segments).
      kv_seg: ``[B, S]`` int32 key segment ids (None exactly when ``q_seg`` is).
      windows: per-query-head windows (``0``: none), or None (the mask's one window). The
        kernels take the ``[B, K, G]`` int32 table (:func:`window_table`); the strategies
        and :func:`ringattn._blockwise.local_attention` the ``[N]`` windows of their heads.
    """

    q_pos: jax.Array
    kv_pos: jax.Array
    q_seg: jax.Array | None = None
    kv_seg: jax.Array | None = None
    windows: jax.Array | None = None

    def padded(self, Tp: int, Sp: int) -> "MaskIds":
        """Ids edge-padded to ``Tp`` queries and ``Sp`` keys (:func:`pad_ids`)."""
        return self._replace(
            q_pos=pad_ids(self.q_pos, Tp),
            kv_pos=pad_ids(self.kv_pos, Sp),
            q_seg=pad_ids(self.q_seg, Tp),
            kv_seg=pad_ids(self.kv_seg, Sp),
        )

    def q_block(self, start, size: int) -> "MaskIds":
        """The query side cut to ``[start, start + size)`` (the key side as it is)."""
        cut = lambda x: None if x is None else dslice(x, start, size, 1)
        return self._replace(q_pos=cut(self.q_pos), q_seg=cut(self.q_seg))

    def kv_block(self, start, size: int) -> "MaskIds":
        """The key side cut to ``[start, start + size)`` (the query side as it is)."""
        cut = lambda x: None if x is None else dslice(x, start, size, 1)
        return self._replace(kv_pos=cut(self.kv_pos), kv_seg=cut(self.kv_seg))


def pad_ids(x, length: int):
    """Edge-pads ``[B, S]`` ids (or None) so padding does not widen any block's range."""
    return None if x is None else pad_axis(x, 1, length, mode="edge")


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


def rows_blocks(x, bq: int, group: int = 1):
    """``[B, Tp, K, G, H]`` → ``[nq, B, K, G * bq, H]``: each query block's rows, head-grouped.

    With ``group > 1``, ``group`` consecutive query blocks are stacked as one:
    ``[nq // group, B, K, group * G * bq, H]``, rows ordered ``(block, head, row)``, so each
    block of the group is a contiguous row range of it.
    """
    B, Tp, K, G, H = x.shape
    n = Tp // (bq * group)
    x = x.reshape(B, n, group, bq, K, G, H).transpose(1, 0, 4, 2, 5, 3, 6)
    return x.reshape(n, B, K, group * G * bq, H)


def cols_blocks(x, bq: int):
    """``[B, Tp, K, G, H]`` → ``[nq, B, K, H, G * bq]``: each query block, transposed."""
    B, Tp, K, G, H = x.shape
    x = x.reshape(B, Tp // bq, bq, K, G, H).transpose(1, 0, 3, 5, 4, 2)
    return x.reshape(Tp // bq, B, K, H, G * bq)


def kv_rows_blocks(x, bk: int):
    """``[B, K, Sp, H]`` → ``[nk, B, K, bk, H]``: each key (or value) block, block-major."""
    B, K, Sp, H = x.shape
    return jnp.moveaxis(x.reshape(B, K, Sp // bk, bk, H), 2, 0)


def kv_cols_blocks(x, bk: int):
    """``[B, K, Sp, H]`` → ``[nk, B, K, H, bk]``: each key block transposed (``k^T``)."""
    return kv_rows_blocks(x, bk).swapaxes(3, 4)


def _block_ranges(ids, block: int):
    """Per-block (min, max) of ``ids [B, Lp]`` over batch and block: two ``[Lp // block]``."""
    B, Lp = ids.shape
    blocks = ids.reshape(B, Lp // block, block)
    return jnp.min(blocks, axis=(0, 2)), jnp.max(blocks, axis=(0, 2))


_NO_WINDOW = np.iinfo(np.int32).max // 2


def window_table(windows, B: int, K: int):
    """``[N]`` per-query-head windows (``0`` = none) → the kernels' ``[B, K, G]`` int32 table."""
    windows = jnp.asarray(windows, jnp.int32)
    return jnp.broadcast_to(windows.reshape(K, -1), (B, K, windows.shape[0] // K))


class Summaries:
    """Per-block ranges of positions (and segment ids) used to classify block pairs.

    ``ids``: :class:`MaskIds` (``windows`` the ``[B, K, G]`` per-head table, or None:
    ``cfg.mask``'s window); ``dense``: the mask's :class:`ringattn.DenseMask`, or None.
    """

    def __init__(self, ids: MaskIds, block_q: int, block_kv: int, dense):
        q_pos, kv_pos, q_seg, kv_seg, windows = ids
        self.q_pos = _block_ranges(q_pos, block_q)
        self.kv_pos = _block_ranges(kv_pos, block_kv)
        self.segments = q_seg is not None
        if self.segments:
            self.q_seg = _block_ranges(q_seg, block_q)
            self.kv_seg = _block_ranges(kv_seg, block_kv)
        self.windows = windows is not None
        if self.windows:
            self.any_unbounded = jnp.any(windows == 0)
            self.all_unbounded = jnp.all(windows == 0)
            self.widest = jnp.max(windows)
            self.narrowest = jnp.min(jnp.where(windows == 0, _NO_WINDOW, windows))
        self.dense = None  # the DenseMask padded to [Tp, Sp], and its per-block any/all
        if dense is not None:
            Tp, Sp = q_pos.shape[1], kv_pos.shape[1]
            table_any, table_all = dense.block_table(Tp, Sp, block_q, block_kv)
            self.dense = jnp.asarray(dense.padded(Tp, Sp))
            self.dense_any, self.dense_all = jnp.asarray(table_any), jnp.asarray(table_all)

    def kind(self, cfg: KernelConfig, i, j):
        """EMPTY, FULL or PARTIAL for query block ``i`` against key block ``j``."""
        qmin, qmax = self.q_pos[0][i], self.q_pos[1][i]
        kmin, kmax = self.kv_pos[0][j], self.kv_pos[1][j]
        live = jnp.bool_(True)
        full = (j + 1) * cfg.block_kv <= cfg.kv_len
        if cfg.mask.causal:
            live &= qmax >= kmin
            full &= qmin >= kmax
        if self.windows:
            live &= self.any_unbounded | (kmax > qmin - self.widest)
            full &= self.all_unbounded | (kmin > qmax - self.narrowest)
        elif cfg.mask.uniform_window is not None:
            live &= kmax > qmin - cfg.mask.uniform_window
            full &= kmin > qmax - cfg.mask.uniform_window
        if self.dense is not None:
            live &= self.dense_any[i, j]
            full &= self.dense_all[i, j]
        if self.segments:
            qsmin, qsmax = self.q_seg[0][i], self.q_seg[1][i]
            ksmin, ksmax = self.kv_seg[0][j], self.kv_seg[1][j]
            live &= (qsmax >= ksmin) & (ksmax >= qsmin)
            full &= (qsmin == qsmax) & (ksmin == ksmax) & (qsmin == ksmin)
        return jnp.where(live, jnp.where(full, FULL, PARTIAL), EMPTY).astype(jnp.int32)

    def kinds(self, cfg: KernelConfig, nq: int, nk: int):
        """``[nq, nk]`` int32 table of :meth:`kind` for every block pair (computed once)."""
        i = jnp.arange(nq, dtype=jnp.int32)[:, None]
        j = jnp.arange(nk, dtype=jnp.int32)[None, :]
        return jnp.broadcast_to(self.kind(cfg, i, j), (nq, nk))


def live_range(live):
    """``(lo, hi)`` int32: the first live index and one past the last of ``live [n]`` bool.

    ``lo == hi`` when nothing is live; a loop over ``range(lo, hi)`` visits every live index.
    """
    n = live.shape[0]
    lo = jnp.argmax(live).astype(jnp.int32)
    hi = (n - jnp.argmax(live[::-1])).astype(jnp.int32)
    any_live = jnp.any(live)
    return jnp.where(any_live, lo, 0), jnp.where(any_live, hi, 0)


def visit_order(kinds_row):
    """``(order, n_full, n_live)`` for one row of the kinds table, ``kinds_row [n]`` int32.

    ``order [n]`` int32 lists the FULL blocks (ascending), then the PARTIAL ones (ascending),
    then the EMPTY ones; ``n_full`` and ``n_live`` count the first two groups. A kernel runs
    two branch-free loops, ``order[:n_full]`` unmasked and ``order[n_full:n_live]`` masked,
    instead of a ``lax.switch`` per block pair (a conditional per block that XLA:CPU pays
    for in every iteration). The online softmax does not depend on the order of key blocks.
    """
    rank = jnp.where(kinds_row == FULL, 0, jnp.where(kinds_row == PARTIAL, 1, 2))
    order = jnp.argsort(rank, stable=True).astype(jnp.int32)
    n_full = jnp.sum(kinds_row == FULL).astype(jnp.int32)
    n_live = n_full + jnp.sum(kinds_row == PARTIAL).astype(jnp.int32)
    return order, n_full, n_live


def grouped_visit_orders(kinds, group: int):
    """Visit orders for query blocks taken ``group`` at a time where a key block is FULL for all.

    For ``kinds [nq, n]`` (``nq % group == 0``), key block ``j`` is *shared* by group ``I``
    (query blocks ``I * group .. I * group + group - 1``) when it is FULL for each of them:
    one product over all the group's rows instead of ``group`` products. Returns
    ``(shared_order [nq // group, n], n_shared [nq // group])``, each group's shared blocks
    first (ascending), and ``(order, n_full, n_live)``: :func:`visit_orders` of what the
    shared blocks leave per query block (full, then partial), so together they visit every
    live pair exactly once. ``group = 1`` shares every FULL block, leaving the partial ones.
    """
    nq, n = kinds.shape
    shared = jnp.all(kinds.reshape(nq // group, group, n) == FULL, axis=1)  # [nq // group, n]
    shared_order, n_shared, _ = visit_orders(jnp.where(shared, FULL, EMPTY).astype(jnp.int32))
    rest = jnp.where(jnp.repeat(shared, group, axis=0), EMPTY, kinds)
    return (shared_order, n_shared), visit_orders(rest)


def visit_orders(kinds):
    """:func:`visit_order` of every row of ``kinds [n_rows, n]``, computed once per call.

    Returns ``order [n_rows, n]``, ``n_full [n_rows]`` and ``n_live [n_rows]`` int32; a kernel's
    loop over rows indexes them, so no sort runs inside the loop. Pass ``kinds.T`` for the
    columns (the backward's loop over key blocks).
    """
    return jax.vmap(visit_order)(kinds)


def block_mask(cfg: KernelConfig, summ: Summaries, ids: MaskIds, q_start, kv_start):
    """Visibility of one block pair, broadcastable to the logits ``[B, K, G, bq, bk]``.

    ``ids`` are the pair's own (:meth:`MaskIds.q_block`, :meth:`MaskIds.kv_block`; ``windows`` the ``[B, K, G]`` table or
    None). ``[B, 1, 1, bq, bk]``, or ``[B, K, G, bq, bk]`` with a window table; padding keys
    (index ``>= kv_len``) are hidden; the block of the dense mask (``summ.dense``) is ANDed in.
    """
    qp = ids.q_pos[:, :, None]
    kp = ids.kv_pos[:, None, :]
    col = kv_start + lax.broadcasted_iota(jnp.int32, (1, 1, kp.shape[-1]), 2)
    mask = jnp.broadcast_to(col < cfg.kv_len, (qp.shape[0], qp.shape[1], kp.shape[-1]))
    spec = cfg.mask
    if spec.causal:
        mask &= kp <= qp
    if ids.q_seg is not None:
        mask &= ids.q_seg[:, :, None] == ids.kv_seg[:, None, :]
    if summ.dense is not None:
        bq, bk = qp.shape[1], kp.shape[-1]
        mask &= lax.dynamic_slice(summ.dense, (q_start, kv_start), (bq, bk))[None]
    if ids.windows is None:
        if spec.uniform_window is not None:
            mask &= kp > qp - spec.uniform_window
        return mask[:, None, None]
    w = ids.windows[:, :, :, None, None]
    in_window = (w == 0) | (kp[:, None, None] > qp[:, None, None] - w)
    return mask[:, None, None] & in_window


def visible_keys(mask):
    """``[B, 1, bk, 1]``: keys that some query (any head, any row) of the block may see."""
    return jnp.any(mask, axis=(1, 2, 3))[:, None, :, None]


def cap_logits(cfg: KernelConfig, products):
    """Raw float32 products ``q . k`` (any layout) → scaled, soft-capped logits, and ``tanh``."""
    s = products * cfg.scale
    if cfg.mask.softcap is None:
        return s, None
    t = jnp.tanh(s / cfg.mask.softcap)
    return cfg.mask.softcap * t, t


def apply_mask(s, mask):
    return jnp.where(mask, s, -jnp.inf)
