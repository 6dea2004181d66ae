"""Triton-subset Pallas kernels of the blockwise attention (GPU; interpret mode on CPU):
forward ``(out, lse)`` and its backward ``(dq, dk, dv)``.

The operands' row layout and the shared math are in :mod:`ringattn._pallas_common`; the
custom VJP and the choice of backend in :mod:`ringattn._pallas`.

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

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ringattn._blocks import EMPTY, FULL, MaskIds, live_range
from ringattn._pallas_common import (
    PallasConfig,
    Prepared,
    dot,
    from_keys,
    from_rows,
    from_stat_rows,
    logits,
    next_pow2,
    score_grads,
    to_keys,
    to_rows,
    to_stat_rows,
    visibility,
)
from ringattn._varying import varying_struct


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


# ----------------------------------------------------------------------------- kernel bodies


def _block_mask(cfg: PallasConfig, kv_len, ids: MaskIds, kv_start):
    """``[R, bk]`` visibility of one block pair from per-row ids ``[R]`` (``q_pos``,
    ``q_seg``, ``windows``) and per-key ids ``[bk]`` (``kv_pos``, ``kv_seg``)."""
    bk = ids.kv_pos.shape[0]
    col = kv_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    column = lambda x: None if x is None else x[:, None]
    row = lambda x: None if x is None else x[None, :]
    qp, kp, qs, ks, w = ids
    ids = MaskIds(column(qp), row(kp), column(qs), row(ks), column(w))
    return visibility(cfg, kv_len, ids, col)


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
            mask = _block_mask(cfg, kv_len, MaskIds(qp, kp, qs, ks, w), j * bk)
            k, v = _zero_unseen(mask, k, v)
            s, _ = logits(cfg, q, k)
            s = jnp.where(mask, s, -jnp.inf)
        else:
            s, _ = logits(cfg, q, k)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, (1, 0))
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
            mask = _block_mask(cfg, kv_len, MaskIds(qp, kp, qs, ks, w), j * bk)
            k, v = _zero_unseen(mask, k, v)
        s, t = logits(cfg, q, k)
        if masked:
            s = jnp.where(mask, s, -jnp.inf)
        p = jnp.exp(s - lse[:, None])
        dp = dot(do, v)  # [R, bk]
        ds = score_grads(cfg, p, dp, delta[:, None], t)
        return dq + dot(ds.astype(k.dtype), k, (1, 0))

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
            mask = _block_mask(cfg, kv_len, MaskIds(qp, kp, qs, ks, w), j * bk)
            k, v = _zero_unseen(mask, k, v)
        s, t = logits(cfg, q, k)  # [R, bk]
        if masked:
            s = jnp.where(mask, s, -jnp.inf)
        p = jnp.exp(s - lse[:, None])
        dv = dv + dot(p.astype(do.dtype), do, (0, 0))  # [bk, Hp]
        dp = dot(do, v)
        ds = score_grads(cfg, p, dp, delta[:, None], t)
        dk = dk + dot(ds.astype(q.dtype), q, (0, 0))
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


def _id_specs(prep: Prepared, K: int, rows_block, keys_block, rows_index, keys_index):
    """BlockSpecs of :meth:`Prepared.ids` (``rows_index`` / ``keys_index``: grid → block)."""
    specs = []
    for _, kind in prep.ids():
        if kind == "keys":
            specs.append(pl.BlockSpec((None, keys_block), lambda b, x: (b // K, keys_index(x))))
        elif kind == "rows":
            specs.append(pl.BlockSpec((None, rows_block), lambda b, x: (b // K, rows_index(x))))
        else:  # per-row windows, indexed by b * K + k directly
            specs.append(pl.BlockSpec((None, rows_block), lambda b, x: (b, rows_index(x))))
    return specs


def forward_call(q, k, v, ids: MaskIds, cfg: PallasConfig):
    """``(out [B, T, N, H] in q.dtype, lse [B, T, N] float32)``.

    ``ids``: :class:`ringattn._blocks.MaskIds` ``[B, T]`` / ``[B, S]`` int32, ``windows`` the
    ``[B, K, G]`` per-head window table (``0``: none) or None.
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    prep = Prepared(q, k, v, ids, cfg, (cfg.block_q, cfg.block_kv))
    Tp, Sp, Hp, R, bk = prep.Tp, prep.Sp, prep.Hp, prep.R, prep.bk
    nq, nk = prep.kinds.shape
    lo, hi = jax.vmap(live_range)(prep.kinds != EMPTY)
    qr, kr, vr = to_rows(q, K, Tp, Hp), to_keys(k, Sp, Hp), to_keys(v, Sp, Hp)
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
    return from_rows(out, B, T, N, H), from_stat_rows(lse, B, T, N)


def backward_call(q, k, v, ids: MaskIds, cotangents, cfg: PallasConfig):
    """float32 ``(dq, dk, dv)`` in the canonical layouts.

    ``cotangents = (lse [B, T, N], dout [B, T, N, H], delta [B, T, N])``; ``ids`` as in
    :func:`forward_call`.
    """
    lse, dout, delta = cotangents
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    prep = Prepared(q, k, v, ids, cfg, (cfg.block_q_bwd, cfg.block_kv_bwd))
    Tp, Sp, Hp, R, bk = prep.Tp, prep.Sp, prep.Hp, prep.R, prep.bk
    nq, nk = prep.kinds.shape
    qr, kr, vr = to_rows(q, K, Tp, Hp), to_keys(k, Sp, Hp), to_keys(v, Sp, Hp)
    dor = to_rows(dout.astype(q.dtype), K, Tp, Hp)
    lser, deltar = to_stat_rows(lse, K, Tp), to_stat_rows(delta, K, Tp)
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
    return from_rows(dq, B, T, N, H), from_keys(dk, B, S, H), from_keys(dv, B, S, H)
