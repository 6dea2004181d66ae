"""Memory-linear exact attention: an online softmax over blocks, with skipped masked blocks.

The kernels read queries as ``q [B, T, K, G, H]`` (a free reshape of ``[B, T, N, H]``, so no
transposed copy of the queries or of the output cotangent is made) and keys and values
heads-major, ``k, v [B, K, S, H]``; each query block is transposed to ``[B, K, G, bq, H]`` on
the fly, so each block product is one batched matmul over ``(B, K)`` with the ``G`` query
heads of a group stacked as rows. Results accumulate in place in preallocated float32 arrays
(``dynamic_update_slice`` in a loop), and the ``update_*`` kernels fold further key sets (ring
hops) into the same accumulators.

Every ``(query block, key block)`` pair is classified from per-block position and segment
ranges as *empty* (skipped: no compute), *full* (no mask needed) or *partial* (masked
elementwise). The classification is dynamic, so it also skips work for arbitrary positions: a
ring hop whose block lies in the causal future, a zigzag layout, a sliding window, packed
documents.

The backward pass recomputes each block's probabilities from ``(q, k, v, lse)``
(FlashAttention-2), so memory stays linear in ``T + S`` for training.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from ringattn._mask import MaskSpec, check_qkv, normalize_mask_inputs, resolve_scale
from ringattn._online_softmax import (
    OnlineSoftmax,
    finalize_online_softmax,
    init_online_softmax,
    update_online_softmax,
)

__all__ = ["BlockSizes", "blockwise_attention"]

_EMPTY, _FULL, _PARTIAL = 0, 1, 2


def _is_positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Block sizes of the blockwise kernels (clamped to the sequence lengths).

    Attributes:
      block_q: query rows per block in the forward pass.
      block_kv: keys per block in the forward pass.
      block_q_bwd: query rows per block in the backward pass (default ``block_q``).
      block_kv_bwd: keys per block in the backward pass (default ``block_kv``).

    The working set of one step is about ``B * N * block_q * block_kv * 4`` bytes of
    logits; the defaults keep it near the L2 cache of a CPU core for ``N = 8``.
    """

    block_q: int = 512
    block_kv: int = 512
    block_q_bwd: int | None = None
    block_kv_bwd: int | None = None

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            if not _is_positive_int(getattr(self, name)):
                raise ValueError(
                    f"BlockSizes.{name}: expected a positive int, got {getattr(self, name)!r}"
                )
        for name in ("block_q_bwd", "block_kv_bwd"):
            value = getattr(self, name)
            if value is not None and not _is_positive_int(value):
                raise ValueError(
                    f"BlockSizes.{name}: expected a positive int or None, got {value!r}"
                )

    @property
    def backward(self) -> tuple[int, int]:
        return (self.block_q_bwd or self.block_q, self.block_kv_bwd or self.block_kv)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Everything static about one kernel call (hashable; a jit static argument)."""

    mask: MaskSpec
    scale: float
    block_q: int
    block_kv: int
    kv_len: int  # valid keys; keys at index >= kv_len are padding


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_axis(x, axis: int, size: int, mode: str = "constant"):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, mode=mode)


def _block_ranges(ids, block: int):
    """Per-block (min, max) of ``ids [B, L]`` over batch and block: two ``[L // block]``."""
    B, L = ids.shape
    blocks = ids.reshape(B, L // block, block)
    return jnp.min(blocks, axis=(0, 2)), jnp.max(blocks, axis=(0, 2))


class _Summaries:
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
        if cfg.mask.window is not None:
            w = cfg.mask.window
            live &= kmax > qmin - w
            full &= kmin > qmax - w
        if self.segments:
            qsmin, qsmax = self.q_seg[0][i], self.q_seg[1][i]
            ksmin, ksmax = self.kv_seg[0][j], self.kv_seg[1][j]
            live &= (qsmax >= ksmin) & (ksmax >= qsmin)
            full &= (qsmin == qsmax) & (ksmin == ksmax) & (qsmin == ksmin)
        return jnp.where(live, jnp.where(full, _FULL, _PARTIAL), _EMPTY).astype(jnp.int32)


def _block_mask(cfg: KernelConfig, q_pos, kv_pos, q_seg, kv_seg, kv_start):
    """``[B, bq, bk]`` visibility of one block pair (padding keys hidden)."""
    qp = q_pos[:, :, None]
    kp = kv_pos[:, None, :]
    col = kv_start + lax.broadcasted_iota(jnp.int32, (1, 1, kp.shape[-1]), 2)
    mask = jnp.broadcast_to(col < cfg.kv_len, (qp.shape[0], qp.shape[1], kp.shape[-1]))
    if cfg.mask.causal:
        mask &= kp <= qp
    if cfg.mask.window is not None:
        mask &= kp > qp - cfg.mask.window
    if q_seg is not None:
        mask &= q_seg[:, :, None] == kv_seg[:, None, :]
    return mask


def _logits(cfg: KernelConfig, q_blk, k_blk):
    """Scaled, soft-capped logits ``[B, K, G, bq, bk]`` in float32, and ``tanh`` for softcap."""
    s = jnp.einsum("bkgqh,bksh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32)
    s = s * cfg.scale
    if cfg.mask.softcap is None:
        return s, None
    t = jnp.tanh(s / cfg.mask.softcap)
    return cfg.mask.softcap * t, t


def _apply_mask(s, mask):
    return jnp.where(mask[:, None, None], s, -jnp.inf)


def _slice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def varying_axes(*xs) -> frozenset:
    """Mesh axes along which any of ``xs`` varies (empty outside ``shard_map``)."""
    axes = frozenset()
    for x in xs:
        if x is None:
            continue
        aval = jax.typeof(x)
        mat = getattr(aval, "mat", None)  # JAX 0.10: ManualAxisType(varying=...)
        varying = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)
        axes |= frozenset(varying or ())
    return axes


def cast_varying(tree, axes: frozenset):
    """``pcast`` every leaf to vary along ``axes``, so loop carries and ``switch`` branches
    type-check under ``shard_map(check_vma=True)`` (a no-op outside ``shard_map``)."""

    def one(x):
        missing = tuple(sorted(axes - varying_axes(x), key=str))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def _q_block(x, i, size: int):
    """Query block ``i`` of ``x [B, Tp, K, G, ...]``, transposed to ``[B, K, G, size, ...]``."""
    return jnp.moveaxis(_slice(x, i * size, size, 1), 1, 3)


def init_forward_state(qg) -> OnlineSoftmax:
    """An empty float32 online-softmax state for ``qg [B, Tp, K, G, H]``, varying like ``qg``.

    Fields (heads-major): ``acc [B, K, G, Tp, H]``, ``m`` and ``l`` ``[B, K, G, Tp]``.
    """
    B, Tp, K, G, H = qg.shape
    state = init_online_softmax((B, K, G, Tp), H)
    return cast_varying(state, varying_axes(qg))


def update_forward_heads_major(
    state: OnlineSoftmax, qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, cfg: KernelConfig
) -> OnlineSoftmax:
    """Folds one key/value set into a running online-softmax state, block by block, in place.

    Args:
      state: from :func:`init_forward_state` or a previous update (earlier key sets).
      qg: ``[B, Tp, K, G, H]`` queries in row-major order (a free reshape of ``[B, T, N, H]``,
        so no transposed copy of the queries is made); ``Tp % cfg.block_q == 0``.
      kh, vh: ``[B, K, Sp, H]``; ``Sp % cfg.block_kv == 0``.
      q_pos, q_seg: ``[B, Tp]`` int32 (``q_seg`` may be None).
      kv_pos, kv_seg: ``[B, Sp]`` int32 (``kv_seg`` may be None).

    Returns:
      The state over all key sets so far. Each query block's rows are read, updated over the
      key blocks and written back with ``dynamic_update_slice`` (no stacked per-block output).
    """
    B, Tp, K, G, H = qg.shape
    Sp = kh.shape[2]
    bq, bk = cfg.block_q, cfg.block_kv
    nq, nk = Tp // bq, Sp // bk
    summ = _Summaries(q_pos, kv_pos, q_seg, kv_seg, bq, bk)

    def q_block(i, state: OnlineSoftmax):
        q_blk = _q_block(qg, i, bq)  # [B, K, G, bq, H]
        qp = _slice(q_pos, i * bq, bq, 1)
        qs = None if q_seg is None else _slice(q_seg, i * bq, bq, 1)

        def visit(j, st: OnlineSoftmax, masked: bool):
            k_blk = _slice(kh, j * bk, bk, 2)  # [B, K, bk, H]
            v_blk = _slice(vh, j * bk, bk, 2)
            s, _ = _logits(cfg, q_blk, k_blk)
            if masked:
                kp = _slice(kv_pos, j * bk, bk, 1)
                ks = None if kv_seg is None else _slice(kv_seg, j * bk, bk, 1)
                s = _apply_mask(s, _block_mask(cfg, qp, kp, qs, ks, j * bk))
            s = s.reshape(B, K, G * bq, bk)
            return update_online_softmax(st, s, v_blk)

        def step(j, st):
            return lax.switch(
                summ.kind(cfg, i, j),
                [lambda st: st, lambda st: visit(j, st, False), lambda st: visit(j, st, True)],
                st,
            )

        block = OnlineSoftmax(
            acc=_slice(state.acc, i * bq, bq, 3).reshape(B, K, G * bq, H),
            m=_slice(state.m, i * bq, bq, 3).reshape(B, K, G * bq),
            l=_slice(state.l, i * bq, bq, 3).reshape(B, K, G * bq),
        )
        block = lax.fori_loop(0, nk, step, block)
        return OnlineSoftmax(
            acc=lax.dynamic_update_slice_in_dim(
                state.acc, block.acc.reshape(B, K, G, bq, H), i * bq, 3
            ),
            m=lax.dynamic_update_slice_in_dim(state.m, block.m.reshape(B, K, G, bq), i * bq, 3),
            l=lax.dynamic_update_slice_in_dim(state.l, block.l.reshape(B, K, G, bq), i * bq, 3),
        )

    axes = varying_axes(state.acc, qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg)
    return lax.fori_loop(0, nq, q_block, cast_varying(state, axes))


def forward_heads_major(qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, cfg: KernelConfig):
    """Blockwise forward on padded arrays (heads-major keys, values and results).

    Args:
      qg, kh, vh, positions, segments: as in :func:`update_forward_heads_major`.

    Returns:
      ``out [B, K, G, Tp, H]`` float32 and ``lse [B, K, G, Tp]`` float32.
    """
    state = update_forward_heads_major(
        init_forward_state(qg), qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, cfg
    )
    return finalize_online_softmax(state)


def update_backward_heads_major(
    dq, dkv, qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, lse, dout, delta, cfg: KernelConfig
):
    """Adds one key set's blockwise gradients to float32 accumulators, in place.

    Args:
      dq: ``[B, K, G, Tp, H]`` float32 accumulator of the query gradient.
      dkv: ``[B, K, Sp, 2H]`` float32 accumulator of ``concat([dk, dv], -1)`` for this key set.
      qg, kh, vh, positions, segments: as in :func:`update_forward_heads_major`.
      lse: ``[B, K, G, Tp]`` float32 log-sum-exp of the *complete* attention the gradient is
        for (for a ring hop, the global one): probabilities are ``exp(s - lse)``.
      dout: ``[B, Tp, K, G, H]`` cotangent of the normalised output (row-major, like ``qg``).
      delta: ``[B, K, G, Tp]`` float32 ``sum(dout * out, -1) - dlse``.

    Returns:
      ``(dq, dkv)`` with this key set's contributions added.
    """
    B, Tp, K, G, H = qg.shape
    Sp = kh.shape[2]
    bq, bk = cfg.block_q, cfg.block_kv
    nq, nk = Tp // bq, Sp // bk
    summ = _Summaries(q_pos, kv_pos, q_seg, kv_seg, bq, bk)
    axes = varying_axes(dq, dkv, qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, lse, dout, delta)
    lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    softcap = cfg.mask.softcap
    zero_dq_blk = cast_varying(jnp.zeros((B, K, G, bq, H), jnp.float32), axes)

    def kv_block(j, carry):
        dq, dkv = carry
        k_blk = _slice(kh, j * bk, bk, 2)  # [B, K, bk, H]
        v_blk = _slice(vh, j * bk, bk, 2)
        kp = _slice(kv_pos, j * bk, bk, 1)
        ks = None if kv_seg is None else _slice(kv_seg, j * bk, bk, 1)
        dkv_blk = _slice(dkv, j * bk, bk, 2)  # [B, K, bk, 2H]

        def visit(i, carry, masked: bool):
            dk, dv = carry
            q_blk = _q_block(qg, i, bq)  # [B, K, G, bq, H]
            do_blk = _q_block(dout, i, bq)
            s, t = _logits(cfg, q_blk, k_blk)  # [B, K, G, bq, bk]
            if masked:
                qp = _slice(q_pos, i * bq, bq, 1)
                qs = None if q_seg is None else _slice(q_seg, i * bq, bq, 1)
                s = _apply_mask(s, _block_mask(cfg, qp, kp, qs, ks, j * bk))
            p = jnp.exp(s - _slice(lse_safe, i * bq, bq, 3)[..., None])
            dv = dv + jnp.einsum(
                "bkgqs,bkgqh->bksh",
                p.astype(do_blk.dtype),
                do_blk,
                preferred_element_type=jnp.float32,
            )
            dp = jnp.einsum("bkgqh,bksh->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32)
            ds = p * (dp - _slice(delta, i * bq, bq, 3)[..., None])
            if softcap is not None:
                ds = ds * (1.0 - t * t)
            ds = ds * cfg.scale
            dq_blk = jnp.einsum(
                "bkgqs,bksh->bkgqh",
                ds.astype(k_blk.dtype),
                k_blk,
                preferred_element_type=jnp.float32,
            )
            dk = dk + jnp.einsum(
                "bkgqs,bkgqh->bksh",
                ds.astype(q_blk.dtype),
                q_blk,
                preferred_element_type=jnp.float32,
            )
            return dq_blk, dk, dv

        def step(i, carry):
            # Only block-sized values pass through the switch: a conditional that carried the
            # whole dq accumulator would copy it on every block pair (quadratic traffic).
            dq, dk, dv = carry
            dq_blk, dk, dv = lax.switch(
                summ.kind(cfg, i, j),
                [
                    lambda c: (zero_dq_blk, *c),
                    lambda c: visit(i, c, False),
                    lambda c: visit(i, c, True),
                ],
                (dk, dv),
            )
            dq = lax.dynamic_update_slice_in_dim(dq, _slice(dq, i * bq, bq, 3) + dq_blk, i * bq, 3)
            return dq, dk, dv

        dq, dk, dv = lax.fori_loop(0, nq, step, (dq, dkv_blk[..., :H], dkv_blk[..., H:]))
        dkv = lax.dynamic_update_slice_in_dim(dkv, jnp.concatenate([dk, dv], -1), j * bk, 2)
        return dq, dkv

    return lax.fori_loop(0, nk, kv_block, cast_varying((dq, dkv), axes))


def backward_heads_major(
    qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, lse, dout, delta, cfg: KernelConfig
):
    """Blockwise backward on padded arrays (row-major queries, heads-major the rest).

    Args:
      As in :func:`update_backward_heads_major`, without the accumulators.

    Returns:
      ``dq [B, K, G, Tp, H]``, ``dk, dv [B, K, Sp, H]``, all float32, for the key block given.
    """
    B, Tp, K, G, H = qg.shape
    Sp = kh.shape[2]
    dq = jnp.zeros((B, K, G, Tp, H), jnp.float32)
    dkv = jnp.zeros((B, K, Sp, 2 * H), jnp.float32)
    dq, dkv = update_backward_heads_major(
        dq, dkv, qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, lse, dout, delta, cfg
    )
    return dq, dkv[..., :H], dkv[..., H:]


# ---- canonical-layout wrappers ([B, T, N, H]) used by blockwise_attention and the ring ----


def q_to_groups(x, K: int, length: int):
    """``[B, T, N, ...]`` → ``[B, Tp, K, G, ...]`` zero-padded to ``length`` (a reshape)."""
    B, T, N = x.shape[:3]
    x = _pad_axis(x, 1, length)
    return x.reshape(B, length, K, N // K, *x.shape[3:])


def q_to_heads_major(x, K: int, length: int):
    """``[B, T, N, ...]`` → ``[B, K, G, Tp, ...]`` zero-padded to ``length``."""
    B, T, N = x.shape[:3]
    x = _pad_axis(x, 1, length)
    x = x.reshape(B, length, K, N // K, *x.shape[3:])
    return jnp.moveaxis(x, 1, 3)


def q_from_heads_major(x, T: int):
    """``[B, K, G, Tp, ...]`` → ``[B, T, N, ...]``."""
    B, K, G, Tp = x.shape[:4]
    x = jnp.moveaxis(x, 3, 1)
    return x.reshape(B, Tp, K * G, *x.shape[4:])[:, :T]


def kv_to_heads_major(x, length: int):
    """``[B, S, K, H]`` → ``[B, K, Sp, H]`` zero-padded to ``length``."""
    return jnp.moveaxis(_pad_axis(x, 1, length), 1, 2)


def kv_from_heads_major(x, S: int):
    return jnp.moveaxis(x, 2, 1)[:, :S]


def pad_ids(x, length: int):
    """Edge-pads ``[B, L]`` ids so padding does not widen any block's range."""
    return None if x is None else _pad_axis(x, 1, length, mode="edge")


def make_kernel_config(
    mask: MaskSpec, head_dim: int, T: int, S: int, block_q: int, block_kv: int
) -> tuple[KernelConfig, int, int]:
    """Clamps block sizes to the lengths; returns ``(config, padded T, padded S)``."""
    bq, bk = min(block_q, T), min(block_kv, S)
    cfg = KernelConfig(
        mask=mask, scale=resolve_scale(mask.scale, head_dim), block_q=bq, block_kv=bk, kv_len=S
    )
    return cfg, _round_up(T, bq), _round_up(S, bk)


def attention_forward(
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, mask: MaskSpec, block_sizes: BlockSizes
):
    """Canonical-layout forward: ``(out [B, T, N, H] float32, lse [B, T, N] float32)``."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    cfg, Tp, Sp = make_kernel_config(mask, H, T, S, block_sizes.block_q, block_sizes.block_kv)
    out, lse = forward_heads_major(
        q_to_groups(q, K, Tp),
        kv_to_heads_major(k, Sp),
        kv_to_heads_major(v, Sp),
        pad_ids(q_pos, Tp),
        pad_ids(kv_pos, Sp),
        pad_ids(q_seg, Tp),
        pad_ids(kv_seg, Sp),
        cfg,
    )
    return q_from_heads_major(out, T), q_from_heads_major(lse, T)


def attention_delta(out, dout, dlse):
    """``sum(dout * out, -1) - dlse`` in float32: ``[B, T, N]``."""
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    return delta if dlse is None else delta - dlse.astype(jnp.float32)


def attention_backward(
    q,
    k,
    v,
    q_pos,
    kv_pos,
    q_seg,
    kv_seg,
    lse,
    dout,
    delta,
    *,
    mask: MaskSpec,
    block_sizes: BlockSizes,
):
    """Canonical-layout backward for one key set: float32 ``(dq, dk, dv)``.

    ``lse [B, T, N]`` and ``delta [B, T, N]`` describe the complete attention (all key sets)
    whose output the cotangent ``dout [B, T, N, H]`` is for.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    bq, bk = block_sizes.backward
    cfg, Tp, Sp = make_kernel_config(mask, H, T, S, bq, bk)
    dq, dk, dv = backward_heads_major(
        q_to_groups(q, K, Tp),
        kv_to_heads_major(k, Sp),
        kv_to_heads_major(v, Sp),
        pad_ids(q_pos, Tp),
        pad_ids(kv_pos, Sp),
        pad_ids(q_seg, Tp),
        pad_ids(kv_seg, Sp),
        q_to_heads_major(lse, K, Tp),
        q_to_groups(dout, K, Tp),
        q_to_heads_major(delta, K, Tp),
        cfg,
    )
    return q_from_heads_major(dq, T), kv_from_heads_major(dk, S), kv_from_heads_major(dv, S)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, block_sizes):
    out, lse = attention_forward(
        q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask=mask, block_sizes=block_sizes
    )
    return out.astype(q.dtype), lse


def _attention_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, block_sizes):
    out, lse = _attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, block_sizes)
    return (out, lse), (q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _attention_bwd(mask, block_sizes, residuals, cotangents):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse = residuals
    dout, dlse = cotangents
    delta = attention_delta(out, dout, dlse)
    dq, dk, dv = attention_backward(
        q, k, v, q_pos, kv_pos, q_seg, kv_seg, lse, dout, delta, mask=mask, block_sizes=block_sizes
    )
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)

_attention_jit = jax.jit(_attention, static_argnums=(7, 8))


def blockwise_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    causal: bool = False,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    q_positions: Int[Array, "B T"] | None = None,
    kv_positions: Int[Array, "B S"] | None = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    block_sizes: BlockSizes | None = None,
):
    """Exact attention computed block by block, never materialising the ``T x S`` matrix.

    Same semantics as :func:`ringattn.attention_reference`. Softmax statistics accumulate in
    float32 and the output comes back in ``q.dtype``. Block pairs that the mask hides entirely
    (causal future, outside the window, other segments) are skipped. The gradient is a
    ``custom_vjp`` that recomputes blocks from ``(q, k, v, out, lse)``, so training memory is
    linear in ``T + S``; gradients flow to ``q``, ``k``, ``v`` (and through ``lse`` when
    returned).

    Args:
      q: ``[B, T, N, H]`` queries.
      k: ``[B, S, K, H]`` keys; ``N % K == 0``.
      v: ``[B, S, K, H]`` values.
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      q_segment_ids: ``[B, T]`` int segment ids (packed documents), with ``kv_segment_ids``.
      kv_segment_ids: ``[B, S]`` int segment ids.
      q_positions: ``[B, T]`` int positions, default ``arange(T)``.
      kv_positions: ``[B, S]`` int positions, default ``arange(S)``.
      window: hide keys at positions ``<= p - window`` (sliding window, ``>= 1``).
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``.
      return_lse: also return the float32 log-sum-exp ``[B, T, N]``.
      block_sizes: :class:`BlockSizes`; default ``BlockSizes()``.

    Returns:
      ``out [B, T, N, H]``, or ``(out, lse)``. Rows that see no key: ``out = 0``,
      ``lse = -inf`` (the identity of :func:`ringattn.merge_attention`).

    Raises:
      ValueError: on inconsistent shapes or dtypes, ``N % K != 0``, segment ids or positions
        of the wrong shape or dtype, a bad window, softcap, scale or block size.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = jax.random.normal(jax.random.key(0), (1, 256, 8, 64))
      >>> kv = jax.random.normal(jax.random.key(1), (1, 256, 2, 64))
      >>> blockwise_attention(q, kv, kv, causal=True).shape
      (1, 256, 8, 64)

    References:
      Dao, "FlashAttention-2", 2023; Liu & Abbeel, "Blockwise Parallel Transformer", 2023.
    """
    fn = "blockwise_attention"
    B, T, S, N, K, H = check_qkv(fn, q, k, v)
    mask = MaskSpec(causal=bool(causal), window=window, softcap=softcap, scale=scale)
    if block_sizes is None:
        block_sizes = BlockSizes()
    elif not isinstance(block_sizes, BlockSizes):
        raise ValueError(
            f"{fn}: block_sizes must be a BlockSizes, got {type(block_sizes).__name__}"
        )
    q_seg, kv_seg, q_pos, kv_pos = normalize_mask_inputs(
        fn,
        B,
        T,
        S,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        q_positions=q_positions,
        kv_positions=kv_positions,
    )
    out, lse = _attention_jit(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, block_sizes)
    return (out, lse) if return_lse else out
