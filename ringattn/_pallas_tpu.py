"""Mosaic (TPU) variant of the Pallas blockwise attention: forward ``(out, lse)`` and backward.

Same operands, layout, classification and semantics as :mod:`ringattn._pallas_triton` (rows
``t * G + g`` of the ``G`` query heads of one key head, ``[B * K, Tp * G, Hp]``; EMPTY /
FULL / PARTIAL block pairs from :class:`ringattn._blocks.Summaries`), and the same per-block
math (:func:`ringattn._pallas_common.visibility`, the logits, :func:`ringattn._pallas_common.score_grads`),
but in Mosaic's style:

- The loop over the reduced blocks is the last grid axis, ``"arbitrary"``: the forward and
  ``dq`` kernels are gridded ``(B * K, query blocks, key blocks)``, the ``dk, dv`` kernel
  ``(B * K, key blocks, query blocks)``. The running max ``m``, sum ``l`` and the
  accumulators live in VMEM scratch carried across that axis, initialised at its first step
  and written out at its last.
- The block kinds ``[nq * nk]`` and the live span ``lo, hi`` of every row of blocks are
  scalar-prefetched into SMEM. A step runs under ``pl.when(kind == FULL)`` (no mask) or
  ``pl.when(kind == PARTIAL)`` (masked); EMPTY steps do nothing, and the index maps clamp
  the reduced block index into ``[lo, hi)``, so steps outside the live span re-use the block
  already in VMEM (no DMA).
- Block shapes obey the (8, 128) tiling: ``H`` is zero-padded to a multiple of 128; per-row
  vectors (positions, segments, windows, ``lse``, ``delta``) are laid out ``[.., rows, 128]``
  (replicated over lanes, read as a column ``[R, 1]``) and per-key vectors ``[.., 8, keys]``
  (replicated over sublanes, read as a row ``[1, bk]``), as in JAX's TPU flash attention;
  the compiled kernel needs ``block_q * G`` to be a multiple of 8 and ``block_kv`` a
  multiple of 128 unless a block spans its whole axis
  (:func:`ringattn._mosaic_blocks.mosaic_blocks`).
- Keys no row of a PARTIAL pair may see are zeroed before any product; which keys those are
  is a column count of the mask taken on the MXU (``mask.T @ ones``), because Mosaic has no
  cheap lane-to-sublane transpose of a reduced mask.

The kernels run on CPU in TPU interpret mode (``pltpu.InterpretParams``) and lower to Mosaic
for the ``tpu`` platform with ``jax.export`` on any host; they have not run on a TPU.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringattn._blocks import EMPTY, FULL, PARTIAL, MaskIds, live_range, round_up
from ringattn._mosaic_blocks import LANES, SUBLANES
from ringattn._pallas_common import (
    PallasConfig,
    Prepared,
    dot,
    from_keys,
    from_rows,
    from_stat_rows,
    logits,
    score_grads,
    to_keys,
    to_rows,
    to_stat_rows,
    visibility,
)
from ringattn._varying import varying_struct

# ----------------------------------------------------------------------------- layout


def _lanes(x):
    """``[.., L]`` → ``[.., L, 128]``: a per-row vector replicated over lanes."""
    return lax.broadcast_in_dim(x, (*x.shape, LANES), tuple(range(x.ndim)))


def _sublanes(x):
    """``[B, L]`` → ``[B, 8, L]``: a per-key vector replicated over sublanes."""
    B, L = x.shape
    return lax.broadcast_in_dim(x, (B, SUBLANES, L), (0, 2))


def _clamp(x, lo, hi):
    """``x`` clamped into ``[lo, hi)`` (``lo`` when the span is empty)."""
    return jnp.maximum(jnp.minimum(x, hi - 1), lo)


class _Operands:
    """The Mosaic operands of one call: padded rows and keys, ids laid out for tiling."""

    def __init__(self, prep: Prepared, q, k, v):
        B, T, S, N, K, G, H = prep.dims
        self.K = K
        self.Hp = round_up(H, LANES)
        self.q = to_rows(q, K, prep.Tp, self.Hp)  # [B * K, Tp * G, Hp]
        self.k = to_keys(k, prep.Sp, self.Hp)  # [B * K, Sp, Hp]
        self.v = to_keys(v, prep.Sp, self.Hp)
        self.ids = []  # (array, kind): rows [B, TG, 128] / keys [B, 8, Sp] / win [BK, TG, 128]
        for x, kind in prep.ids():
            self.ids.append((_sublanes(x) if kind == "keys" else _lanes(x), kind))

    def id_specs(self, R: int, bk: int, row_block, key_block):
        """BlockSpecs of the ids; ``row_block`` / ``key_block``: ``(b, x, y, *refs)`` → index."""
        K = self.K
        specs = []
        for _, kind in self.ids:
            if kind == "keys":
                index = lambda b, x, y, *refs: (lax.div(b, K), 0, key_block(x, y, *refs))
                specs.append(pl.BlockSpec((None, SUBLANES, bk), index))
            elif kind == "rows":
                index = lambda b, x, y, *refs: (lax.div(b, K), row_block(x, y, *refs), 0)
                specs.append(pl.BlockSpec((None, R, LANES), index))
            else:  # per-row windows, indexed by b * K + k directly
                index = lambda b, x, y, *refs: (b, row_block(x, y, *refs), 0)
                specs.append(pl.BlockSpec((None, R, LANES), index))
        return specs


def _compiler_params(cfg: PallasConfig):
    # TPU interpret mode (JAX 0.10.2) does not extend dimension_semantics over the grid axes
    # that vmap adds (the Mosaic lowering does), so it gets none: every axis is then
    # sequential there, which these kernels allow.
    if cfg.interpret:
        return pltpu.CompilerParams()
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _interpret(cfg: PallasConfig):
    return pltpu.InterpretParams() if cfg.interpret else False


# ----------------------------------------------------------------------------- kernel bodies


def _split_ids(id_refs, flags) -> MaskIds:
    """The id refs (None for absent ones) in :meth:`Prepared.ids` order, as a ``MaskIds``."""
    segments, per_head = flags
    qs, ks = (id_refs[2], id_refs[3]) if segments else (None, None)
    return MaskIds(id_refs[0], id_refs[1], qs, ks, id_refs[-1] if per_head else None)


def _load(id_refs: MaskIds) -> MaskIds:
    """The id blocks the refs of :func:`_split_ids` hold."""
    return MaskIds(*(None if r is None else r[...] for r in id_refs))


def _mask(cfg, kv_len, ids: MaskIds, kv_start, bk):
    """``[R, bk]`` visibility from the id blocks (rows ``[R, 128]``, keys ``[8, bk]``)."""
    column = lambda r: None if r is None else r[:, :1]  # [R, 1]
    row = lambda r: None if r is None else r[:1, :]  # [1, bk]
    col = kv_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    qp, kp, qs, ks, w = ids
    ids = MaskIds(column(qp), row(kp), column(qs), row(ks), column(w))
    return visibility(cfg, kv_len, ids, col)


def _zero_unseen(mask, k, v):
    """Zeros the keys (rows of ``k``, ``v [bk, Hp]``) that no row of ``mask [R, bk]`` sees."""
    ones = jnp.ones((mask.shape[0], k.shape[1]), jnp.bfloat16)
    counts = dot(jnp.where(mask, 1.0, 0.0).astype(jnp.bfloat16), ones, (0, 0))  # [bk, Hp]
    seen = counts > 0.0
    return jnp.where(seen, k, jnp.zeros_like(k)), jnp.where(seen, v, jnp.zeros_like(v))


def _kind(kinds_ref, row, col, n):
    return kinds_ref[row * n + col]


def _forward_kernel(*refs, cfg, flags, kv_len, bk, nk):
    n_ids = 2 + 2 * flags[0] + flags[1]
    _, _, kinds_ref, q_ref, k_ref, v_ref = refs[:6]
    id_refs = _split_ids(refs[6 : 6 + n_ids], flags)
    o_ref, lse_ref, m_ref, l_ref, acc_ref = refs[6 + n_ids :]
    i, j = pl.program_id(1), pl.program_id(2)
    kind = _kind(kinds_ref, i, j, nk)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def visit(masked: bool):
        q, k, v = q_ref[...], k_ref[...], v_ref[...]  # [R, Hp], [bk, Hp], [bk, Hp]
        if masked:
            mask = _mask(cfg, kv_len, _load(id_refs), j * bk, bk)
            k, v = _zero_unseen(mask, k, v)
        s, _ = logits(cfg, q, k)  # [R, bk]
        if masked:
            s = jnp.where(mask, s, -jnp.inf)
        m_prev, l_prev = m_ref[:, :1], l_ref[:, :1]  # [R, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_new = l_prev * alpha + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l_new, l_ref.shape)
        acc_ref[...] = acc_ref[...] * alpha + dot(p.astype(v.dtype), v, (1, 0))

    pl.when(kind == FULL)(lambda: visit(False))
    pl.when(kind == PARTIAL)(lambda: visit(True))

    @pl.when(j == nk - 1)
    def _finish():
        m, l = m_ref[:, :1], l_ref[:, :1]
        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        m_safe = jnp.where(m == -jnp.inf, 0.0, m)
        o_ref[...] = (acc_ref[...] / l_safe).astype(o_ref.dtype)
        lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(l_safe))
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def _backward_block(cfg, q, kv, cotangents, mask):
    """``(p, ds, k, v)`` of one block pair: probabilities ``[R, bk]``, logit gradients and the
    (zeroed where unseen) keys and values.

    ``kv = (k, v)`` ``[bk, Hp]``; ``cotangents = (do [R, Hp], lse [R, 1], delta [R, 1])``;
    ``mask``: the pair's ``[R, bk]`` visibility, or None for a full pair.
    """
    (k, v), (do, lse, delta) = kv, cotangents
    masked = mask is not None
    if masked:
        k, v = _zero_unseen(mask, k, v)
    s, t = logits(cfg, q, k)
    if masked:
        s = jnp.where(mask, s, -jnp.inf)
    p = jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse))
    dp = dot(do, v)  # [R, bk]
    return p, score_grads(cfg, p, dp, delta, t), k, v


def _dq_kernel(*refs, cfg, flags, kv_len, bk, nk):
    n_ids = 2 + 2 * flags[0] + flags[1]
    _, _, kinds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:9]
    id_refs = _split_ids(refs[9 : 9 + n_ids], flags)
    dq_ref, acc_ref = refs[9 + n_ids :]
    i, j = pl.program_id(1), pl.program_id(2)
    kind = _kind(kinds_ref, i, j, nk)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def visit(masked: bool):
        mask = None
        if masked:
            mask = _mask(cfg, kv_len, _load(id_refs), j * bk, bk)
        lse, delta = lse_ref[:, :1], delta_ref[:, :1]  # [R, 1]
        q = q_ref[...]
        kv, cotangents = (k_ref[...], v_ref[...]), (do_ref[...], lse, delta)
        _, ds, k, _ = _backward_block(cfg, q, kv, cotangents, mask)
        acc_ref[...] += dot(ds.astype(k.dtype), k, (1, 0))

    pl.when(kind == FULL)(lambda: visit(False))
    pl.when(kind == PARTIAL)(lambda: visit(True))

    @pl.when(j == nk - 1)
    def _finish():
        dq_ref[...] = acc_ref[...]


def _dkv_kernel(*refs, cfg, flags, kv_len, bk, nq):
    n_ids = 2 + 2 * flags[0] + flags[1]
    _, _, kinds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:9]
    id_refs = _split_ids(refs[9 : 9 + n_ids], flags)
    dk_ref, dv_ref, dk_acc, dv_acc = refs[9 + n_ids :]
    j, i = pl.program_id(1), pl.program_id(2)
    kind = _kind(kinds_ref, j, i, nq)

    @pl.when(i == 0)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    def visit(masked: bool):
        mask = None
        if masked:
            mask = _mask(cfg, kv_len, _load(id_refs), j * bk, bk)
        q, do = q_ref[...], do_ref[...]
        lse, delta = lse_ref[:, :1], delta_ref[:, :1]
        kv, cotangents = (k_ref[...], v_ref[...]), (do, lse, delta)
        p, ds, _, _ = _backward_block(cfg, q, kv, cotangents, mask)
        dv_acc[...] += dot(p.astype(do.dtype), do, (0, 0))  # [bk, Hp]
        dk_acc[...] += dot(ds.astype(q.dtype), q, (0, 0))

    pl.when(kind == FULL)(lambda: visit(False))
    pl.when(kind == PARTIAL)(lambda: visit(True))

    @pl.when(i == nq - 1)
    def _finish():
        dk_ref[...] = dk_acc[...]
        dv_ref[...] = dv_acc[...]


# ----------------------------------------------------------------------------- pallas_calls


def forward_call(q, k, v, ids: MaskIds, cfg: PallasConfig):
    """``(out [B, T, N, H] in q.dtype, lse [B, T, N] float32)`` by the Mosaic kernel.

    Same contract as :func:`ringattn._pallas_triton.forward_call`.
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    prep = Prepared(q, k, v, ids, cfg, (cfg.block_q, cfg.block_kv))
    ops = _Operands(prep, q, k, v)
    Hp, R, bk = ops.Hp, prep.R, prep.bk
    nq, nk = prep.kinds.shape
    lo, hi = jax.vmap(live_range)(prep.kinds != EMPTY)  # [nq] each
    kv_block = lambda i, j, lo, hi, kinds: _clamp(j, lo[i], hi[i])
    in_specs = [
        pl.BlockSpec((None, R, Hp), lambda b, i, j, *refs: (b, i, 0)),
        pl.BlockSpec((None, bk, Hp), lambda b, i, j, *refs: (b, kv_block(i, j, *refs), 0)),
        pl.BlockSpec((None, bk, Hp), lambda b, i, j, *refs: (b, kv_block(i, j, *refs), 0)),
        *ops.id_specs(R, bk, lambda i, j, *refs: i, kv_block),
    ]
    out_specs = [
        pl.BlockSpec((None, R, Hp), lambda b, i, j, *refs: (b, i, 0)),
        pl.BlockSpec((None, R, LANES), lambda b, i, j, *refs: (b, i, 0)),
    ]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(B * K, nq, nk),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((R, LANES), jnp.float32),  # m
            pltpu.VMEM((R, LANES), jnp.float32),  # l
            pltpu.VMEM((R, Hp), jnp.float32),  # acc
        ],
    )
    kernel = functools.partial(
        _forward_kernel,
        cfg=cfg,
        flags=(prep.segments, prep.per_head),
        kv_len=prep.kv_len,
        bk=bk,
        nk=nk,
    )
    TG = ops.q.shape[1]
    fwd_operands = (ops.q, ops.k, ops.v, *[x for x, _ in ops.ids])
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            varying_struct(ops.q.shape, q.dtype, *fwd_operands),
            varying_struct((B * K, TG, LANES), jnp.float32, *fwd_operands),
        ],
        interpret=_interpret(cfg),
        compiler_params=_compiler_params(cfg),
        name="ringattn_mosaic_forward",
    )(lo, hi, prep.kinds.reshape(-1), *fwd_operands)
    return from_rows(out, B, T, N, H), from_stat_rows(lse[..., 0], B, T, N)


def backward_call(q, k, v, ids: MaskIds, cotangents, cfg: PallasConfig):
    """float32 ``(dq, dk, dv)`` in the canonical layouts by the Mosaic kernels.

    Same contract as :func:`ringattn._pallas_triton.backward_call`.
    """
    lse, dout, delta = cotangents
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    prep = Prepared(q, k, v, ids, cfg, (cfg.block_q_bwd, cfg.block_kv_bwd))
    ops = _Operands(prep, q, k, v)
    Hp, R, bk = ops.Hp, prep.R, prep.bk
    nq, nk = prep.kinds.shape
    dor = to_rows(dout.astype(q.dtype), K, prep.Tp, Hp)
    lser = _lanes(to_stat_rows(lse, K, prep.Tp))  # [B * K, TG, 128]
    deltar = _lanes(to_stat_rows(delta, K, prep.Tp))
    ids = [x for x, _ in ops.ids]
    flags = (prep.segments, prep.per_head)
    operands = (ops.q, ops.k, ops.v, dor, lser, deltar, *ids)

    # dq: grid (b, query block i, key block j), j reduced.
    lo, hi = jax.vmap(live_range)(prep.kinds != EMPTY)
    kv_block = lambda i, j, lo, hi, kinds: _clamp(j, lo[i], hi[i])
    rows = lambda b, i, j, *refs: (b, i, 0)
    keys = lambda b, i, j, *refs: (b, kv_block(i, j, *refs), 0)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, flags=flags, kv_len=prep.kv_len, bk=bk, nk=nk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B * K, nq, nk),
            in_specs=[
                pl.BlockSpec((None, R, Hp), rows),
                pl.BlockSpec((None, bk, Hp), keys),
                pl.BlockSpec((None, bk, Hp), keys),
                pl.BlockSpec((None, R, Hp), rows),
                pl.BlockSpec((None, R, LANES), rows),
                pl.BlockSpec((None, R, LANES), rows),
                *ops.id_specs(R, bk, lambda i, j, *refs: i, kv_block),
            ],
            out_specs=pl.BlockSpec((None, R, Hp), rows),
            scratch_shapes=[pltpu.VMEM((R, Hp), jnp.float32)],
        ),
        out_shape=varying_struct(ops.q.shape, jnp.float32, *operands),
        interpret=_interpret(cfg),
        compiler_params=_compiler_params(cfg),
        name="ringattn_mosaic_dq",
    )(lo, hi, prep.kinds.reshape(-1), *operands)

    # dk, dv: grid (b, key block j, query block i), i reduced.
    kinds_t = prep.kinds.T  # [nk, nq]
    lo_t, hi_t = jax.vmap(live_range)(kinds_t != EMPTY)
    q_block = lambda j, i, lo, hi, kinds: _clamp(i, lo[j], hi[j])
    rows_t = lambda b, j, i, *refs: (b, q_block(j, i, *refs), 0)
    keys_t = lambda b, j, i, *refs: (b, j, 0)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, flags=flags, kv_len=prep.kv_len, bk=bk, nq=nq),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B * K, nk, nq),
            in_specs=[
                pl.BlockSpec((None, R, Hp), rows_t),
                pl.BlockSpec((None, bk, Hp), keys_t),
                pl.BlockSpec((None, bk, Hp), keys_t),
                pl.BlockSpec((None, R, Hp), rows_t),
                pl.BlockSpec((None, R, LANES), rows_t),
                pl.BlockSpec((None, R, LANES), rows_t),
                *ops.id_specs(R, bk, q_block, lambda j, i, *refs: j),
            ],
            out_specs=[
                pl.BlockSpec((None, bk, Hp), keys_t),
                pl.BlockSpec((None, bk, Hp), keys_t),
            ],
            scratch_shapes=[pltpu.VMEM((bk, Hp), jnp.float32)] * 2,
        ),
        out_shape=[varying_struct(ops.k.shape, jnp.float32, *operands)] * 2,
        interpret=_interpret(cfg),
        compiler_params=_compiler_params(cfg),
        name="ringattn_mosaic_dkv",
    )(lo_t, hi_t, kinds_t.reshape(-1), *operands)
    return from_rows(dq, B, T, N, H), from_keys(dk, B, S, H), from_keys(dv, B, S, H)
