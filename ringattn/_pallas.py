"""Pallas kernels of the blockwise attention: forward ``(out, lse)`` and its backward.

Layout. The ``G`` query heads that share a key head are processed together as rows: queries
become ``[B * K, Tp * G, Hp]`` with row ``t * G + g`` holding position ``t`` of head ``g``,
so a query block of ``bq`` positions is ``R = bq * G`` consecutive rows and every block
product is a plain 2-D matmul (no reshape inside a kernel). Keys and values are
``[B * K, Sp, Hp]``; positions and segment ids are given per row (``[B, Tp * G]``, repeated
over ``g``) and per key (``[B, Sp]``), read through the grid index ``b = bk // K``; per-head
windows are a per-row table ``[B * K, Tp * G]``. ``Tp``, ``Sp`` are padded to the blocks,
``Hp`` to a power of two of at least 16 (zero columns change no product).

Grid and skipping. The forward and the ``dq`` kernel are gridded over ``(B * K, query
blocks)`` and loop over key blocks; the ``dk, dv`` kernel over ``(B * K, key blocks)`` and
loops over query blocks (FlashAttention-2's split, ``delta = rowsum(dout * out) - dlse``
precomputed in XLA). Every block pair is classified EMPTY / FULL / PARTIAL outside the kernel
by :class:`ringattn._blocks.Summaries` (the same classification as the XLA path), each loop
runs only over the span of live blocks (:func:`ringattn._blocks.live_range`), EMPTY pairs
inside it are skipped and FULL pairs take the branch with no mask.

Masked keys have no effect: in a PARTIAL pair, keys and values that no row of the block may
see are replaced by zeros (``where``) before any product and hidden logits by ``-inf``, so
NaN or inf stored there reaches neither the outputs nor any gradient.

The kernels are written in the subset of Pallas that Triton lowers (2-D blocks, ``pl.ds``
loads, ``fori_loop``, ``cond``), with ``interpret=True`` on CPU. They have been run in
interpret mode only; no accelerator run has checked the Triton lowering yet.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ringattn._blocks import (
    EMPTY,
    FULL,
    KernelConfig,
    Summaries,
    live_range,
    pad_axis,
    round_up,
)
from ringattn._heads_major import attention_delta, pad_ids
from ringattn._options import MaskSpec
from ringattn._varying import varying_struct


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


def pallas_blocks(block_sizes, G: int, T: int, S: int, interpret: bool):
    """``((bq, bk), (bq_bwd, bk_bwd))``: the given or default sizes, clamped to the lengths.

    Default (``block_sizes`` None): ``128 // G`` query positions (128 rows) and 64 keys
    forward, ``64 // G`` positions and 64 keys backward. Clamped to the next power of two of
    the length. Compiled (not interpreted) kernels need powers of two (Triton), else
    NotImplementedError.
    """
    if block_sizes is None:
        fwd = (max(1, 128 // G), 64)
        bwd = (max(1, 64 // G), 64)
    else:
        fwd, bwd = block_sizes.forward, block_sizes.backward
    T2, S2 = next_pow2(T), next_pow2(S)
    fwd = (min(fwd[0], T2), min(fwd[1], S2))
    bwd = (min(bwd[0], T2), min(bwd[1], S2))
    if not interpret:
        checks = (
            ("rows (block_q * G)", fwd[0] * G),
            ("block_kv", fwd[1]),
            ("backward rows (block_q_bwd * G)", bwd[0] * G),
            ("block_kv_bwd", bwd[1]),
        )
        for name, b in checks:
            if b != next_pow2(b):
                raise NotImplementedError(
                    f"blockwise_attention(impl='pallas'): {name} = {b} must be a power of two "
                    "for the compiled kernel (Triton)"
                )
    return fwd, bwd


# ----------------------------------------------------------------------------- layout


def _rows(x, K: int, Tp: int, Hp: int):
    """``[B, T, N, H]`` → ``[B * K, Tp * G, Hp]`` (row ``t * G + g``), zero-padded."""
    B, T, N, H = x.shape
    G = N // K
    x = pad_axis(pad_axis(x, 1, Tp), 3, Hp)
    x = x.reshape(B, Tp, K, G, Hp).transpose(0, 2, 1, 3, 4)
    return x.reshape(B * K, Tp * G, Hp)


def _from_rows(x, B: int, T: int, N: int, H: int):
    """Inverse of :func:`_rows`: ``[B * K, Tp * G, Hp]`` → ``[B, T, N, H]``."""
    BK, TG, Hp = x.shape
    K = BK // B
    G = N // K
    x = x.reshape(B, K, TG // G, G, Hp).transpose(0, 2, 1, 3, 4)
    return x.reshape(B, TG // G, N, Hp)[:, :T, :, :H]


def _stat_rows(x, K: int, Tp: int):
    """``[B, T, N]`` → ``[B * K, Tp * G]``."""
    B, T, N = x.shape
    x = pad_axis(x, 1, Tp).reshape(B, Tp, K, N // K).transpose(0, 2, 1, 3)
    return x.reshape(B * K, Tp * (N // K))


def _stat_from_rows(x, B: int, T: int, N: int):
    BK, TG = x.shape
    K = BK // B
    G = N // K
    return x.reshape(B, K, TG // G, G).transpose(0, 2, 1, 3).reshape(B, TG // G, N)[:, :T]


def _keys(x, Sp: int, Hp: int):
    """``[B, S, K, H]`` → ``[B * K, Sp, Hp]``, zero-padded."""
    B, S, K, H = x.shape
    x = pad_axis(pad_axis(x, 1, Sp), 3, Hp)
    return x.transpose(0, 2, 1, 3).reshape(B * K, Sp, Hp)


def _from_keys(x, B: int, S: int, H: int):
    BK, Sp, Hp = x.shape
    return x.reshape(B, BK // B, Sp, Hp).transpose(0, 2, 1, 3)[:, :S, :, :H]


class _Prepared:
    """The padded, row-laid-out operands of one call and its block classification."""

    def __init__(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, table, cfg, bq, bk):
        B, T, N, H = q.shape
        S, K = k.shape[1], k.shape[2]
        G = N // K
        self.dims = (B, T, S, N, K, G, H)
        self.Tp, self.Sp = round_up(T, bq), round_up(S, bk)
        self.Hp = max(16, next_pow2(H))
        self.bq, self.bk, self.R = bq, bk, bq * G
        qp, kp = pad_ids(q_pos, self.Tp), pad_ids(kv_pos, self.Sp)
        qs, ks = pad_ids(q_seg, self.Tp), pad_ids(kv_seg, self.Sp)
        kcfg = KernelConfig(mask=cfg.mask, scale=cfg.scale, block_q=bq, block_kv=bk, kv_len=S)
        summ = Summaries(qp, kp, qs, ks, bq, bk, table, None)
        self.kinds = summ.kinds(kcfg, self.Tp // bq, self.Sp // bk)  # [nq, nk]
        rep = lambda x: jnp.repeat(x, G, axis=1)  # [B, Tp] -> [B, Tp * G]
        self.row_pos, self.kv_pos = rep(qp), kp
        self.segments = q_seg is not None
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


# ----------------------------------------------------------------------------- kernel bodies


def _dot(a, b, contract=(1, 1)):
    """2-D matmul in float32 contracting ``a``'s axis ``contract[0]`` with ``b``'s."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _block_mask(cfg: PallasConfig, kv_len, qp, kp, qs, ks, w, kv_start):
    """``[R, bk]`` visibility of one block pair from per-row and per-key ids."""
    bk = kp.shape[0]
    col = kv_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    column = lambda x: None if x is None else x[:, None]
    row = lambda x: None if x is None else x[None, :]
    return visibility(cfg, kv_len, column(qp), row(kp), column(qs), row(ks), column(w), col)


def visibility(cfg: PallasConfig, kv_len, qp, kp, qs, ks, w, col):
    """``[R, bk]`` visibility from per-row columns ``[R, 1]`` and per-key rows ``[1, bk]``.

    ``qp``, ``qs``, ``w``: row positions, segments, windows (``0``: none; or None);
    ``kp``, ``ks``: key positions, segments; ``col``: the keys' indices (``>= kv_len``:
    padding). Shared by the Triton and the Mosaic kernels.
    """
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


def _logits(cfg: PallasConfig, q, k):
    """Scaled, soft-capped float32 logits ``[R, bk]`` and ``tanh`` (None without softcap)."""
    s = _dot(q, k) * cfg.scale
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


def _zero_unseen(mask, *blocks):
    """Zeros the rows (keys) of ``[bk, Hp]`` blocks that no row of ``mask [R, bk]`` sees."""
    seen = jnp.max(mask.astype(jnp.int32), axis=0)[:, None] > 0  # [bk, 1]
    return tuple(jnp.where(seen, x, jnp.zeros_like(x)) for x in blocks)


def _forward_kernel(*refs, cfg, flags, kv_len, bk):
    lo_ref, hi_ref, kinds_ref, q_ref, k_ref, v_ref = refs[:6]
    n_ids = 2 + 2 * flags[0] + flags[1]
    id_refs = refs[6 : 6 + n_ids]
    o_ref, lse_ref = refs[6 + n_ids :]
    segments, per_head = flags
    qp_ref, kp_ref = id_refs[0], id_refs[1]
    qs_ref, ks_ref = (id_refs[2], id_refs[3]) if segments else (None, None)
    w_ref = id_refs[-1] if per_head else None

    i = pl.program_id(1)
    q = q_ref[...]  # [R, Hp]
    qp = qp_ref[...]
    qs = None if qs_ref is None else qs_ref[...]
    w = None if w_ref is None else w_ref[...]
    R, Hp = q.shape

    def visit(j, carry, masked: bool):
        acc, m, l = carry
        sl = pl.ds(j * bk, bk)
        k, v = k_ref[sl, :], v_ref[sl, :]
        if masked:
            kp = kp_ref[sl]
            ks = None if ks_ref is None else ks_ref[sl]
            mask = _block_mask(cfg, kv_len, qp, kp, qs, ks, w, j * bk)
            k, v = _zero_unseen(mask, k, v)
            s, _ = _logits(cfg, q, k)
            s = jnp.where(mask, s, -jnp.inf)
        else:
            s, _ = _logits(cfg, q, k)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, (1, 0))
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    def body(j, carry):
        kind = kinds_ref[j]
        return lax.cond(
            kind == EMPTY,
            lambda c: c,
            lambda c: lax.cond(
                kind == FULL,
                lambda c2: visit(j, c2, False),
                lambda c2: visit(j, c2, True),
                c,
            ),
            carry,
        )

    init = (
        jnp.zeros((R, Hp), jnp.float32),
        jnp.full((R,), -jnp.inf, jnp.float32),
        jnp.zeros((R,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(lo_ref[i], hi_ref[i], body, init)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m_safe + jnp.log(l_safe))


def _dq_kernel(*refs, cfg, flags, kv_len, bk):
    lo_ref, hi_ref, kinds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:9]
    n_ids = 2 + 2 * flags[0] + flags[1]
    id_refs = refs[9 : 9 + n_ids]
    (dq_ref,) = refs[9 + n_ids :]
    segments, per_head = flags
    qp_ref, kp_ref = id_refs[0], id_refs[1]
    qs_ref, ks_ref = (id_refs[2], id_refs[3]) if segments else (None, None)
    w_ref = id_refs[-1] if per_head else None

    i = pl.program_id(1)
    q, do = q_ref[...], do_ref[...]
    lse = lse_ref[...]
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)
    delta = delta_ref[...]
    qp = qp_ref[...]
    qs = None if qs_ref is None else qs_ref[...]
    w = None if w_ref is None else w_ref[...]

    def visit(j, dq, masked: bool):
        sl = pl.ds(j * bk, bk)
        k, v = k_ref[sl, :], v_ref[sl, :]
        if masked:
            kp = kp_ref[sl]
            ks = None if ks_ref is None else ks_ref[sl]
            mask = _block_mask(cfg, kv_len, qp, kp, qs, ks, w, j * bk)
            k, v = _zero_unseen(mask, k, v)
        s, t = _logits(cfg, q, k)
        if masked:
            s = jnp.where(mask, s, -jnp.inf)
        p = jnp.exp(s - lse[:, None])
        dp = _dot(do, v)  # [R, bk]
        ds = score_grads(cfg, p, dp, delta[:, None], t)
        return dq + _dot(ds.astype(k.dtype), k, (1, 0))

    def body(j, dq):
        kind = kinds_ref[j]
        return lax.cond(
            kind == EMPTY,
            lambda c: c,
            lambda c: lax.cond(
                kind == FULL, lambda c2: visit(j, c2, False), lambda c2: visit(j, c2, True), c
            ),
            dq,
        )

    dq = lax.fori_loop(lo_ref[i], hi_ref[i], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq


def _dkv_kernel(*refs, cfg, flags, kv_len, R):
    lo_ref, hi_ref, kinds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:9]
    n_ids = 2 + 2 * flags[0] + flags[1]
    id_refs = refs[9 : 9 + n_ids]
    dk_ref, dv_ref = refs[9 + n_ids :]
    segments, per_head = flags
    qp_ref, kp_ref = id_refs[0], id_refs[1]
    qs_ref, ks_ref = (id_refs[2], id_refs[3]) if segments else (None, None)
    w_ref = id_refs[-1] if per_head else None

    j = pl.program_id(1)
    k_all, v_all = k_ref[...], v_ref[...]  # [bk, Hp]
    bk = k_all.shape[0]
    kp = kp_ref[...]
    ks = None if ks_ref is None else ks_ref[...]

    def visit(i, carry, masked: bool):
        dk, dv = carry
        rows = pl.ds(i * R, R)
        q, do = q_ref[rows, :], do_ref[rows, :]
        lse = lse_ref[rows]
        lse = jnp.where(lse == -jnp.inf, 0.0, lse)
        delta = delta_ref[rows]
        k, v = k_all, v_all
        if masked:
            qp = qp_ref[rows]
            qs = None if qs_ref is None else qs_ref[rows]
            w = None if w_ref is None else w_ref[rows]
            mask = _block_mask(cfg, kv_len, qp, kp, qs, ks, w, j * bk)
            k, v = _zero_unseen(mask, k, v)
        s, t = _logits(cfg, q, k)  # [R, bk]
        if masked:
            s = jnp.where(mask, s, -jnp.inf)
        p = jnp.exp(s - lse[:, None])
        dv = dv + _dot(p.astype(do.dtype), do, (0, 0))  # [bk, Hp]
        dp = _dot(do, v)
        ds = score_grads(cfg, p, dp, delta[:, None], t)
        dk = dk + _dot(ds.astype(q.dtype), q, (0, 0))
        return dk, dv

    def body(i, carry):
        kind = kinds_ref[i]
        return lax.cond(
            kind == EMPTY,
            lambda c: c,
            lambda c: lax.cond(
                kind == FULL, lambda c2: visit(i, c2, False), lambda c2: visit(i, c2, True), c
            ),
            carry,
        )

    zeros = jnp.zeros(k_all.shape, jnp.float32)
    dk, dv = lax.fori_loop(lo_ref[j], hi_ref[j], body, (zeros, zeros))
    dk_ref[...] = dk
    dv_ref[...] = dv


# ----------------------------------------------------------------------------- pallas_calls


def _compiler_params(cfg: PallasConfig):
    if cfg.interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4, num_stages=2)


def _id_specs(prep: _Prepared, K: int, rows_block, keys_block, rows_index, keys_index):
    """BlockSpecs of :meth:`_Prepared.ids` (``rows_index`` / ``keys_index``: grid → block)."""
    specs = []
    for _, kind in prep.ids():
        if kind == "keys":
            specs.append(pl.BlockSpec((None, keys_block), lambda b, x: (b // K, keys_index(x))))
        elif kind == "rows":
            specs.append(pl.BlockSpec((None, rows_block), lambda b, x: (b // K, rows_index(x))))
        else:  # per-row windows, indexed by b * K + k directly
            specs.append(pl.BlockSpec((None, rows_block), lambda b, x: (b, rows_index(x))))
    return specs


def _forward_call(q, k, v, q_pos, kv_pos, q_seg, kv_seg, table, cfg: PallasConfig):
    """``(out [B, T, N, H] in q.dtype, lse [B, T, N] float32)`` and the prepared operands."""
    B, T, N, H = q.shape
    K = k.shape[2]
    prep = _Prepared(q, k, v, q_pos, kv_pos, q_seg, kv_seg, table, cfg, cfg.block_q, cfg.block_kv)
    Tp, Sp, Hp, R, bk = prep.Tp, prep.Sp, prep.Hp, prep.R, prep.bk
    nq, nk = prep.kinds.shape
    lo, hi = jax.vmap(live_range)(prep.kinds != EMPTY)
    qr, kr, vr = _rows(q, K, Tp, Hp), _keys(k, Sp, Hp), _keys(v, Sp, Hp)
    ids = [x for x, _ in prep.ids()]
    in_specs = [
        pl.BlockSpec((nq,), lambda b, i: (0,)),
        pl.BlockSpec((nq,), lambda b, i: (0,)),
        pl.BlockSpec((None, nk), lambda b, i: (i, 0)),
        pl.BlockSpec((None, R, Hp), lambda b, i: (b, i, 0)),
        pl.BlockSpec((None, Sp, Hp), lambda b, i: (b, 0, 0)),
        pl.BlockSpec((None, Sp, Hp), lambda b, i: (b, 0, 0)),
        *_id_specs(prep, K, R, Sp, lambda i: i, lambda i: 0),
    ]
    out_specs = [
        pl.BlockSpec((None, R, Hp), lambda b, i: (b, i, 0)),
        pl.BlockSpec((None, R), lambda b, i: (b, i)),
    ]
    kernel = functools.partial(
        _forward_kernel, cfg=cfg, flags=(prep.segments, prep.per_head), kv_len=prep.kv_len, bk=bk
    )
    out, lse = pl.pallas_call(
        kernel,
        grid=(B * K, nq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[
            varying_struct(qr.shape, q.dtype, prep.kinds, qr, kr, vr, *ids),
            varying_struct(qr.shape[:2], jnp.float32, prep.kinds, qr, kr, vr, *ids),
        ],
        interpret=cfg.interpret,
        compiler_params=_compiler_params(cfg),
        name="ringattn_pallas_forward",
    )(lo, hi, prep.kinds, qr, kr, vr, *ids)
    return _from_rows(out, B, T, N, H), _stat_from_rows(lse, B, T, N)


def _backward_call(q, k, v, q_pos, kv_pos, q_seg, kv_seg, table, lse, dout, delta, cfg):
    """float32 ``(dq, dk, dv)`` in the canonical layouts."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    prep = _Prepared(
        q, k, v, q_pos, kv_pos, q_seg, kv_seg, table, cfg, cfg.block_q_bwd, cfg.block_kv_bwd
    )
    Tp, Sp, Hp, R, bk = prep.Tp, prep.Sp, prep.Hp, prep.R, prep.bk
    nq, nk = prep.kinds.shape
    qr, kr, vr = _rows(q, K, Tp, Hp), _keys(k, Sp, Hp), _keys(v, Sp, Hp)
    dor = _rows(dout.astype(q.dtype), K, Tp, Hp)
    lser, deltar = _stat_rows(lse, K, Tp), _stat_rows(delta, K, Tp)
    ids = [x for x, _ in prep.ids()]
    flags = (prep.segments, prep.per_head)

    # dq: gridded over query blocks, looping over key blocks.
    lo, hi = jax.vmap(live_range)(prep.kinds != EMPTY)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, flags=flags, kv_len=prep.kv_len, bk=bk),
        grid=(B * K, nq),
        in_specs=[
            pl.BlockSpec((nq,), lambda b, i: (0,)),
            pl.BlockSpec((nq,), lambda b, i: (0,)),
            pl.BlockSpec((None, nk), lambda b, i: (i, 0)),
            pl.BlockSpec((None, R, Hp), lambda b, i: (b, i, 0)),
            pl.BlockSpec((None, Sp, Hp), lambda b, i: (b, 0, 0)),
            pl.BlockSpec((None, Sp, Hp), lambda b, i: (b, 0, 0)),
            pl.BlockSpec((None, R, Hp), lambda b, i: (b, i, 0)),
            pl.BlockSpec((None, R), lambda b, i: (b, i)),
            pl.BlockSpec((None, R), lambda b, i: (b, i)),
            *_id_specs(prep, K, R, Sp, lambda i: i, lambda i: 0),
        ],
        out_specs=pl.BlockSpec((None, R, Hp), lambda b, i: (b, i, 0)),
        out_shape=varying_struct(
            qr.shape, jnp.float32, prep.kinds, qr, kr, vr, dor, lser, deltar, *ids
        ),
        interpret=cfg.interpret,
        compiler_params=_compiler_params(cfg),
        name="ringattn_pallas_dq",
    )(lo, hi, prep.kinds, qr, kr, vr, dor, lser, deltar, *ids)

    # dk, dv: gridded over key blocks, looping over query blocks.
    kinds_t = prep.kinds.T  # [nk, nq]
    lo_t, hi_t = jax.vmap(live_range)(kinds_t != EMPTY)
    TG = Tp * (N // K)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, flags=flags, kv_len=prep.kv_len, R=R),
        grid=(B * K, nk),
        in_specs=[
            pl.BlockSpec((nk,), lambda b, j: (0,)),
            pl.BlockSpec((nk,), lambda b, j: (0,)),
            pl.BlockSpec((None, nq), lambda b, j: (j, 0)),
            pl.BlockSpec((None, TG, Hp), lambda b, j: (b, 0, 0)),
            pl.BlockSpec((None, bk, Hp), lambda b, j: (b, j, 0)),
            pl.BlockSpec((None, bk, Hp), lambda b, j: (b, j, 0)),
            pl.BlockSpec((None, TG, Hp), lambda b, j: (b, 0, 0)),
            pl.BlockSpec((None, TG), lambda b, j: (b, 0)),
            pl.BlockSpec((None, TG), lambda b, j: (b, 0)),
            *_id_specs(prep, K, TG, bk, lambda j: 0, lambda j: j),
        ],
        out_specs=[
            pl.BlockSpec((None, bk, Hp), lambda b, j: (b, j, 0)),
            pl.BlockSpec((None, bk, Hp), lambda b, j: (b, j, 0)),
        ],
        out_shape=[
            varying_struct(kr.shape, jnp.float32, kinds_t, qr, kr, vr, dor, lser, deltar, *ids)
        ]
        * 2,
        interpret=cfg.interpret,
        compiler_params=_compiler_params(cfg),
        name="ringattn_pallas_dkv",
    )(lo_t, hi_t, kinds_t, qr, kr, vr, dor, lser, deltar, *ids)
    return _from_rows(dq, B, T, N, H), _from_keys(dk, B, S, H), _from_keys(dv, B, S, H)


# ----------------------------------------------------------------------------- custom VJP


def kernel_calls(cfg: PallasConfig):
    """The ``(forward, backward)`` calls of ``cfg.target``, with the signatures of
    :func:`_forward_call` and :func:`_backward_call` (for callers such as the ring that
    run the kernels per hop)."""
    if cfg.target == "mosaic":
        from ringattn import _pallas_tpu  # imports this module: resolved at call time

        return _pallas_tpu.forward_call, _pallas_tpu.backward_call
    if cfg.target != "triton":
        raise ValueError(f"PallasConfig: target: expected 'triton' or 'mosaic', got {cfg.target!r}")
    return _forward_call, _backward_call


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def pallas_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, table, cfg: PallasConfig):
    """Blockwise ``(out [B, T, N, H] in q.dtype, lse [B, T, N] float32)`` by Pallas kernels.

    ``q_pos [B, T]``, ``kv_pos [B, S]`` int32 positions; ``q_seg``, ``kv_seg`` segment ids
    or None; ``table``: the ``[B, K, G]`` per-head window table (``0``: none) or None.
    Differentiable in ``q``, ``k``, ``v`` and through ``lse`` (``delta - dlse``).
    ``cfg.target`` picks the Triton kernels (here) or the Mosaic ones (TPU).
    """
    return kernel_calls(cfg)[0](q, k, v, q_pos, kv_pos, q_seg, kv_seg, table, cfg)


def _fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, table, cfg):
    out, lse = kernel_calls(cfg)[0](q, k, v, q_pos, kv_pos, q_seg, kv_seg, table, cfg)
    return (out, lse), (q, k, v, q_pos, kv_pos, q_seg, kv_seg, table, out, lse)


def _bwd(cfg, residuals, cotangents):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, table, out, lse = residuals
    dout, dlse = cotangents
    delta = attention_delta(out, dout, dlse)
    backward = kernel_calls(cfg)[1]
    dq, dk, dv = backward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, table, lse, dout, delta, cfg)
    ints = (None,) * 5
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *ints


pallas_attention.defvjp(_fwd, _bwd)
