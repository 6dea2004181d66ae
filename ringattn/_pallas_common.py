"""What the Triton and the Mosaic attention kernels share: the static configuration, the
row layout of the operands, the block classification and the in-kernel mask and score math.

Layout. The ``G`` query heads that share a key head are processed together as rows: queries
become ``[B * K, Tp * G, Hp]`` with row ``t * G + g`` holding position ``t`` of head ``g``,
so a query block of ``bq`` positions is ``R = bq * G`` consecutive rows and every block
product is a plain 2-D matmul (no reshape inside a kernel). Keys and values are
``[B * K, Sp, Hp]``; positions and segment ids are given per row (``[B, Tp * G]``, repeated
over ``g``) and per key (``[B, Sp]``), read through the grid index ``b = bk // K``; per-head
windows are a per-row table ``[B * K, Tp * G]``. ``Tp``, ``Sp`` are padded to the blocks,
``Hp`` to a power of two of at least 16 (zero columns change no product).

Kernels layout (as tokamax lays out its own): this module (common), :mod:`ringattn._pallas_triton`
(GPU kernels), :mod:`ringattn._pallas_tpu` (Mosaic kernels), :mod:`ringattn._pallas` (backend
dispatch and the custom VJP). Nothing here imports a backend.
"""

import dataclasses

import jax.numpy as jnp
from jax import lax

from ringattn._blocks import KernelConfig, MaskIds, Summaries, pad_axis, round_up
from ringattn._options import MaskSpec


@dataclasses.dataclass(frozen=True)
class PallasConfig:
    """Static configuration of one Pallas attention call (hashable)."""

    mask: MaskSpec
    scale: float
    block_q: int  # query positions per forward block (rows: block_q * G)
    block_kv: int
    block_q_bwd: int
    block_kv_bwd: int
    interpret: bool | object  # or a pltpu.InterpretParams: TPU interpret mode (on CPU)
    # "triton" (GPU; these kernels) or "mosaic" (TPU; ringattn._pallas_tpu). With
    # interpret=True each runs on CPU in its interpret mode (Mosaic: TPU interpret mode).
    target: str = "triton"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------- layout


def to_rows(x, K: int, Tp: int, Hp: int):
    """``[B, T, N, H]`` → ``[B * K, Tp * G, Hp]`` (row ``t * G + g``), zero-padded."""
    B, T, N, H = x.shape
    G = N // K
    x = pad_axis(pad_axis(x, 1, Tp), 3, Hp)
    x = x.reshape(B, Tp, K, G, Hp).transpose(0, 2, 1, 3, 4)
    return x.reshape(B * K, Tp * G, Hp)


def from_rows(x, B: int, T: int, N: int, H: int):
    """Inverse of :func:`to_rows`: ``[B * K, Tp * G, Hp]`` → ``[B, T, N, H]``."""
    BK, TG, Hp = x.shape
    K = BK // B
    G = N // K
    x = x.reshape(B, K, TG // G, G, Hp).transpose(0, 2, 1, 3, 4)
    return x.reshape(B, TG // G, N, Hp)[:, :T, :, :H]


def to_stat_rows(x, K: int, Tp: int):
    """``[B, T, N]`` → ``[B * K, Tp * G]``."""
    B, T, N = x.shape
    x = pad_axis(x, 1, Tp).reshape(B, Tp, K, N // K).transpose(0, 2, 1, 3)
    return x.reshape(B * K, Tp * (N // K))


def from_stat_rows(x, B: int, T: int, N: int):
    BK, TG = x.shape
    K = BK // B
    G = N // K
    return x.reshape(B, K, TG // G, G).transpose(0, 2, 1, 3).reshape(B, TG // G, N)[:, :T]


def to_keys(x, Sp: int, Hp: int):
    """``[B, S, K, H]`` → ``[B * K, Sp, Hp]``, zero-padded."""
    B, S, K, H = x.shape
    x = pad_axis(pad_axis(x, 1, Sp), 3, Hp)
    return x.transpose(0, 2, 1, 3).reshape(B * K, Sp, Hp)


def from_keys(x, B: int, S: int, H: int):
    BK, Sp, Hp = x.shape
    return x.reshape(B, BK // B, Sp, Hp).transpose(0, 2, 1, 3)[:, :S, :, :H]


class Prepared:
    """The padded, row-laid-out operands of one call and its block classification."""

    def __init__(self, q, k, v, ids: MaskIds, cfg: "PallasConfig", blocks: tuple[int, int]):
        """``ids``: :class:`ringattn._blocks.MaskIds` ``[B, T]`` / ``[B, S]`` int32, ``windows``
        the ``[B, K, G]`` per-head window table or None; ``blocks``: ``(block_q, block_kv)``."""
        bq, bk = blocks
        B, T, N, H = q.shape
        S, K = k.shape[1], k.shape[2]
        G = N // K
        self.dims = (B, T, S, N, K, G, H)
        self.Tp, self.Sp = round_up(T, bq), round_up(S, bk)
        self.Hp = max(16, next_pow2(H))
        self.bq, self.bk, self.R = bq, bk, bq * G
        ids = ids.padded(self.Tp, self.Sp)
        qp, kp, qs, ks, table = ids
        kcfg = KernelConfig(mask=cfg.mask, scale=cfg.scale, block_q=bq, block_kv=bk, kv_len=S)
        summ = Summaries(ids, bq, bk, None)
        self.kinds = summ.kinds(kcfg, self.Tp // bq, self.Sp // bk)  # [nq, nk]
        rep = lambda x: jnp.repeat(x, G, axis=1)  # [B, Tp] -> [B, Tp * G]
        self.row_pos, self.kv_pos = rep(qp), kp
        self.segments = qs is not None
        self.row_seg, self.kv_seg = (rep(qs), ks) if self.segments else (None, None)
        self.per_head = table is not None
        if self.per_head:  # [B, K, G] -> [B * K, Tp * G]
            self.row_win = jnp.tile(table.reshape(B * K, 1, G), (1, self.Tp, 1)).reshape(
                B * K, self.Tp * G
            )
        self.kv_len = S

    def ids(self):
        """The id operands in kernel order, and their specs' kinds (``rows`` / ``keys``)."""
        ops = [(self.row_pos, "rows"), (self.kv_pos, "keys")]
        if self.segments:
            ops += [(self.row_seg, "rows"), (self.kv_seg, "keys")]
        if self.per_head:
            ops.append((self.row_win, "win"))
        return ops


# ----------------------------------------------------------------------------- shared kernel math


def dot(a, b, contract=(1, 1)):
    """2-D matmul in float32 contracting ``a``'s axis ``contract[0]`` with ``b``'s."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def visibility(cfg: PallasConfig, kv_len, ids: MaskIds, col):
    """``[R, bk]`` visibility from per-row columns ``[R, 1]`` and per-key rows ``[1, bk]``.

    ``ids``: :class:`ringattn._blocks.MaskIds` of one block: row positions, segments and
    windows (``0``: none; or None) ``q_pos, q_seg, windows [R, 1]``, key positions and
    segments ``kv_pos, kv_seg [1, bk]``; ``col``: the keys' indices (``>= kv_len``:
    padding). Shared by the Triton and the Mosaic kernels.
    """
    qp, kp, qs, ks, w = ids
    mask = jnp.broadcast_to(col < kv_len, (qp.shape[0], col.shape[1]))
    spec = cfg.mask
    if spec.causal:
        mask = mask & (kp <= qp)
    if qs is not None:
        mask = mask & (qs == ks)
    if w is not None:
        mask = mask & ((w == 0) | (kp > qp - w))
    elif spec.window is not None:
        mask = mask & (kp > qp - spec.uniform_window)
    return mask


def logits(cfg: PallasConfig, q, k):
    """Scaled, soft-capped float32 logits ``[R, bk]`` and ``tanh`` (None without softcap)."""
    s = dot(q, k) * cfg.scale
    if cfg.mask.softcap is None:
        return s, None
    t = jnp.tanh(s / cfg.mask.softcap)
    return cfg.mask.softcap * t, t


def score_grads(cfg: PallasConfig, p, dp, delta, t):
    """Gradient of the logits' inputs ``[R, bk]`` from ``p``, ``dp = dout @ v.T``, ``delta``
    (broadcastable ``[R, 1]``) and the softcap's ``tanh`` (None without softcap)."""
    ds = p * (dp - delta)
    if t is not None:
        ds = ds * (1.0 - t * t)
    return ds * cfg.scale
