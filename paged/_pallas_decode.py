"""Pallas decode kernels over heads-major page pools: ``paged_attention(impl="pallas")``.

Layout. The ``T`` query tokens and the ``G`` query heads of one kv head are stacked as rows:
``q [B, T, N, H]`` becomes ``[B, K, R, H]`` with row ``t * G + g`` holding token ``t`` of head
``k * G + g``, padded with zero rows to ``R`` (a power of two, at least 16), so every page is
one 2-D product ``[R, H] x [C, H]^T`` against ``k_pages[k, page] [C, H]``. Row positions
come as ``[B, R, 1]`` int32 (padding rows: ``-1``), per-head windows as ``[K, R, 1]``.

Two variants share one page step (:func:`_visit_page`: logits, mask, float32 online softmax):

* ``"gpu"`` (Triton; on CPU ``interpret=True``): grid ``(B, K, splits)``; split ``s`` walks
  the pages ``s * pages_per_block ...`` of its sequence in a ``fori_loop``, ``PAGES_PER_LOAD``
  a step, loading ``k_ref[page]`` in the kernel (all of a step's loads before its folds). A
  split with no live page writes ``(0, -inf)``; the splits' ``(out, lse)`` are merged in XLA
  (flash-decoding), so short batches still fill the GPU.
* ``"tpu"`` (Mosaic; on CPU ``pltpu.InterpretParams()``): ``PrefetchScalarGridSpec`` with the
  block ranges, lengths and table in SMEM; grid ``(B, K, page blocks)``, the last sequential.
  Each step gets ``pages_per_block`` ``[C, H]`` blocks of ``k`` and ``v`` through BlockSpecs
  whose index maps read the page ids from the table; the state lives in VMEM scratch. Blocks
  outside the live range are skipped and their index maps clamp to a live block.

Safety, as in the XLA page walk (:mod:`paged._page_walk`): a key is visible only below
``lengths[b]`` on a real page ``0 < id < P``; other ids are clamped to the null page before
the load and masked, and keys and values of unreadable slots are zeroed by ``where`` before
any product, so NaN garbage there reaches no result. A row that sees no key gets
``out = 0``, ``lse = -inf``.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

import ringattn

__all__ = ["DecodeConfig", "decode_config", "pallas_decode"]

# "No window" for one head in a per-head window operand (as paged._page_walk).
_NO_WINDOW = 1 << 30
VARIANTS = ("gpu", "tpu")
# Pages the GPU kernel loads per loop step before folding them (memory-level parallelism).
PAGES_PER_LOAD = 4


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static options of one decode kernel call (hashable).

    Attributes:
      scale: logit scale.
      causal: keys at positions ``<= q_position`` only.
      window: one window for every head, a tuple of ``N`` per-head windows (``None``
        entries: none), or None.
      softcap: logit soft cap or None.
      pages_per_block: pages per split (``"gpu"``) or per grid step (``"tpu"``).
      variant: ``"gpu"`` (Triton) or ``"tpu"`` (Mosaic).
      interpret: run in Pallas interpret mode (CPU).
    """

    scale: float
    causal: bool
    window: int | tuple[int | None, ...] | None
    softcap: float | None
    pages_per_block: int
    variant: str
    interpret: bool

    @property
    def widest_window(self) -> int | None:
        if isinstance(self.window, tuple):
            return None if None in self.window else max(self.window)
        return self.window


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def decode_config(fn: str, opts, C: int, H: int, variant: str, interpret: bool) -> DecodeConfig:
    """A :class:`DecodeConfig` from the page walk's ``KernelOptions``; NotImplementedError for
    page or head sizes the compiled Triton kernel cannot take (powers of two >= 16)."""
    if variant not in VARIANTS:
        raise ValueError(f"{fn}: variant: expected one of {VARIANTS}, got {variant!r}")
    if variant == "gpu" and not interpret:
        for name, size in (("page size C", C), ("head dim H", H)):
            if size < 16 or size != _pow2(size):
                raise NotImplementedError(
                    f"{fn}: impl='pallas' on GPU needs {name} to be a power of two >= 16 "
                    f"(Triton block shapes), got {size}; use impl='xla'"
                )
    fields = (opts.scale, opts.causal, opts.window, opts.softcap, opts.pages_per_block)
    return DecodeConfig(*fields, variant=variant, interpret=interpret)


# ----------------------------------------------------------------------------- shared body


def _init_state(R: int, H: int):
    """``(m [R, 1], l [R, 1], acc [R, H])`` of an empty online softmax."""
    return (
        jnp.full((R, 1), -jnp.inf, jnp.float32),
        jnp.zeros((R, 1), jnp.float32),
        jnp.zeros((R, H), jnp.float32),
    )


class _Rows(NamedTuple):
    """Query rows ``q [..., R, H]``, positions ``pos [..., R, 1]``, windows ``win`` or None."""

    q: jax.Array
    pos: jax.Array
    win: jax.Array | None


class _Walk(NamedTuple):
    """``table [B, M]``, ``lengths [B]`` and live slots ``[page_lo, page_hi)`` (int32)."""

    table: jax.Array
    lengths: jax.Array
    page_lo: jax.Array
    page_hi: jax.Array


def _visit_page(cfg: DecodeConfig, rows: _Rows, page, length, state):
    """Folds one page into the online softmax of ``R`` rows (``length``: the sequence's).

    ``page = (k, v, ok, start)``: ``k, v [C, H]`` as loaded (garbage where ``ok`` is False)
    and the position ``start`` of its first token.
    """
    (q, q_pos, win), (k, v, page_ok, start) = rows, page
    m, l, acc = state
    C = k.shape[0]
    key_col = start + lax.broadcasted_iota(jnp.int32, (C, 1), 0)  # [C, 1]
    readable = (key_col < length) & page_ok
    k = jnp.where(readable, k, jnp.zeros((), k.dtype))
    v = jnp.where(readable, v, jnp.zeros((), v.dtype))
    dims = (((1,), (1,)), ((), ()))
    s = lax.dot_general(q, k, dims, preferred_element_type=jnp.float32) * cfg.scale  # [R, C]
    if cfg.softcap is not None:
        s = cfg.softcap * jnp.tanh(s / cfg.softcap)
    key_pos = start + lax.broadcasted_iota(jnp.int32, (1, C), 1)  # [1, C]
    visible = jnp.broadcast_to((key_pos < length) & page_ok, s.shape)  # [R, C]
    if cfg.causal:
        visible = visible & (key_pos <= q_pos)
    if win is not None:
        visible = visible & (key_pos > q_pos - win)
    elif cfg.window is not None:
        visible = visible & (key_pos > q_pos - cfg.window)
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m - m_safe)
    pv = lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return m_new, l * alpha + jnp.sum(p, axis=1, keepdims=True), acc * alpha + pv


def _finish_state(state):
    """``(out [R, H] float32, lse [R, 1])`` of an online softmax; empty rows ``(0, -inf)``."""
    m, l, acc = state
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    return acc / l_safe, jnp.where(empty, -jnp.inf, m_safe + jnp.log(l_safe))


# ----------------------------------------------------------------------------- GPU variant


def _gpu_kernel(lo_ref, hi_ref, len_ref, table_ref, q_ref, pos_ref, *refs, cfg, P):
    win_ref = refs[0] if isinstance(cfg.window, tuple) else None
    k_ref, v_ref, o_ref, lse_ref = refs[-4:]
    b, s = pl.program_id(0), pl.program_id(2)
    ppb = cfg.pages_per_block
    first = jnp.maximum(s * ppb, lo_ref[b])
    last = jnp.minimum((s + 1) * ppb, hi_ref[b])
    R, H = q_ref.shape
    C = k_ref.shape[1]
    M = table_ref.shape[0]
    loads = min(ppb, PAGES_PER_LOAD)

    @pl.when(first < last)
    def _():
        length = len_ref[b]
        rows = _Rows(q_ref[...], pos_ref[...], None if win_ref is None else win_ref[...])

        def body(i, state):
            # All loads of the step first (independent of the softmax state), then the folds.
            loaded = []
            for u in range(loads):
                j = first + i * loads + u
                page = table_ref[jnp.minimum(j, M - 1)]
                ok = (j < last) & (page > 0) & (page < P)
                page = jnp.where(ok, page, 0)
                loaded.append((j, ok, k_ref[page], v_ref[page]))  # [C, H] each
            for j, ok, k, v in loaded:
                state = _visit_page(cfg, rows, (k, v, ok, j * C), length, state)
            return state

        steps = (last - first + loads - 1) // loads
        out, lse = _finish_state(lax.fori_loop(0, steps, body, _init_state(R, H)))
        o_ref[...] = out
        lse_ref[...] = lse

    @pl.when(first >= last)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)
        lse_ref[...] = jnp.full(lse_ref.shape, -jnp.inf, jnp.float32)


def _gpu_call(rows: _Rows, pools, walk: _Walk, cfg: DecodeConfig):
    """Partial ``(out [B, K, splits, R, H], lse [B, K, splits, R, 1])`` float32.

    ``rows``: ``q [B, K, R, H]``, ``pos [B, R, 1]``, ``win [K, R, 1]`` or None; ``pools``:
    ``(k_pages, v_pages)`` ``[K, P, C, H]``.
    """
    (qr, row_pos, row_win), (k_pages, v_pages) = rows, pools
    table, lengths, page_lo, page_hi = walk
    B, K, R, H = qr.shape
    _, P, C, _ = k_pages.shape
    M = table.shape[1]
    splits = -(-M // cfg.pages_per_block)
    whole = lambda n: pl.BlockSpec((n,), lambda b, k, s: (0,))
    in_specs = [
        whole(B),
        whole(B),
        whole(B),
        pl.BlockSpec((None, M), lambda b, k, s: (b, 0)),
        pl.BlockSpec((None, None, R, H), lambda b, k, s: (b, k, 0, 0)),
        pl.BlockSpec((None, R, 1), lambda b, k, s: (b, 0, 0)),
    ]
    operands = [page_lo, page_hi, lengths, table, qr, row_pos]
    if row_win is not None:
        in_specs.append(pl.BlockSpec((None, R, 1), lambda b, k, s: (k, 0, 0)))
        operands.append(row_win)
    pool_spec = pl.BlockSpec((None, P, C, H), lambda b, k, s: (k, 0, 0, 0))
    in_specs += [pool_spec, pool_spec]
    operands += [k_pages, v_pages]
    interpret = cfg.interpret
    if interpret and ringattn.varying_axes(*operands):
        # Inside shard_map(check_vma=True) the HLO interpreter fails the vma check of its
        # grid loop; Pallas's TPU interpret mode runs the same kernel.
        from jax.experimental.pallas import tpu as pltpu

        interpret = pltpu.InterpretParams()
    if cfg.interpret:
        params = None
    else:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    return pl.pallas_call(
        functools.partial(_gpu_kernel, cfg=cfg, P=P),
        grid=(B, K, splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, R, H), lambda b, k, s: (b, k, s, 0, 0)),
            pl.BlockSpec((None, None, None, R, 1), lambda b, k, s: (b, k, s, 0, 0)),
        ],
        out_shape=[
            ringattn.varying_struct((B, K, splits, R, H), jnp.float32, *operands),
            ringattn.varying_struct((B, K, splits, R, 1), jnp.float32, *operands),
        ],
        interpret=interpret,
        compiler_params=params,
        name="paged_pallas_decode",
    )(*operands)


def _merge_splits(out, lse):
    """``[B, K, S, R, H]``, ``[B, K, S, R, 1]`` partials -> ``[B, K, R, H]``, ``[B, K, R]``."""
    top = jnp.max(lse, axis=2, keepdims=True)
    top = jnp.where(jnp.isneginf(top), 0.0, top)
    weight = jnp.exp(lse - top)  # 0 for empty splits
    total = jnp.sum(weight, axis=2)  # [B, K, R, 1]
    merged = jnp.sum(weight * out, axis=2) / jnp.where(total > 0, total, 1.0)
    lse = jnp.where(total > 0, top[:, :, 0] + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return merged, lse[..., 0]


# ----------------------------------------------------------------------------- TPU variant


def _tpu_kernel(lo_ref, hi_ref, len_ref, table_ref, q_ref, pos_ref, *refs, cfg, P, M):
    ppb = cfg.pages_per_block
    per_head = isinstance(cfg.window, tuple)
    win_ref = refs[0] if per_head else None
    pages = refs[int(per_head) :]
    k_refs, v_refs = pages[:ppb], pages[ppb : 2 * ppb]
    o_ref, lse_ref, m_ref, l_ref, acc_ref = pages[2 * ppb :]
    b, j = pl.program_id(0), pl.program_id(2)
    C = k_refs[0].shape[0]

    @pl.when(j == 0)
    def _():
        m0, l0, acc0 = _init_state(*acc_ref.shape)
        m_ref[...], l_ref[...], acc_ref[...] = m0, l0, acc0

    @pl.when((j >= lo_ref[b]) & (j < hi_ref[b]))
    def _():
        length = len_ref[b]
        rows = _Rows(q_ref[...], pos_ref[...], None if win_ref is None else win_ref[...])
        state = (m_ref[...], l_ref[...], acc_ref[...])
        for i in range(ppb):
            slot = j * ppb + i
            page = table_ref[b * M + slot]
            ok = (page > 0) & (page < P)
            k, v = k_refs[i][...], v_refs[i][...]
            state = _visit_page(cfg, rows, (k, v, ok, slot * C), length, state)
        m_ref[...], l_ref[...], acc_ref[...] = state

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        out, lse = _finish_state((m_ref[...], l_ref[...], acc_ref[...]))
        o_ref[...] = out
        lse_ref[...] = lse


def _tpu_call(rows: _Rows, pools, walk: _Walk, cfg: DecodeConfig):
    """``(out [B, K, R, H] float32, lse [B, K, R, 1])``; ``walk.table`` padded to whole
    blocks; ``rows`` and ``pools`` as in :func:`_gpu_call`."""
    (qr, row_pos, row_win), (k_pages, v_pages) = rows, pools
    table, lengths, page_lo, page_hi = walk
    from jax.experimental.pallas import tpu as pltpu

    B, K, R, H = qr.shape
    _, P, C, _ = k_pages.shape
    ppb = cfg.pages_per_block
    M = table.shape[1]
    blocks = M // ppb
    block_lo = page_lo // ppb
    block_hi = jnp.maximum(-(-page_hi // ppb), block_lo)

    def page_map(i):
        def index(b, k, j, lo_ref, hi_ref, len_ref, table_ref):
            live = jnp.clip(j, lo_ref[b], jnp.maximum(hi_ref[b] - 1, lo_ref[b]))
            live = jnp.clip(live, 0, blocks - 1)  # an empty range may start at `blocks`
            page = table_ref[b * M + live * ppb + i]
            page = jnp.where((page > 0) & (page < P), page, 0)
            return k, page, 0, 0

        return pl.BlockSpec((None, None, C, H), index)

    in_specs = [
        pl.BlockSpec((None, None, R, H), lambda b, k, j, *_: (b, k, 0, 0)),
        pl.BlockSpec((None, R, 1), lambda b, k, j, *_: (b, 0, 0)),
    ]
    operands = [qr, row_pos]
    if row_win is not None:
        in_specs.append(pl.BlockSpec((None, R, 1), lambda b, k, j, *_: (k, 0, 0)))
        operands.append(row_win)
    in_specs += [page_map(i) for i in range(ppb)] * 2
    operands += [k_pages] * ppb + [v_pages] * ppb
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(B, K, blocks),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, R, H), lambda b, k, j, *_: (b, k, 0, 0)),
            pl.BlockSpec((None, None, R, 1), lambda b, k, j, *_: (b, k, 0, 0)),
        ],
        scratch_shapes=[
            pltpu.VMEM((R, 1), jnp.float32),
            pltpu.VMEM((R, 1), jnp.float32),
            pltpu.VMEM((R, H), jnp.float32),
        ],
    )
    return pl.pallas_call(
        functools.partial(_tpu_kernel, cfg=cfg, P=P, M=M),
        grid_spec=grid_spec,
        out_shape=[
            ringattn.varying_struct((B, K, R, H), jnp.float32, *operands),
            ringattn.varying_struct((B, K, R, 1), jnp.float32, *operands),
        ],
        interpret=pltpu.InterpretParams() if cfg.interpret else False,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        name="paged_pallas_decode_tpu",
    )(block_lo, block_hi, lengths, table.reshape(-1), *operands)


# ----------------------------------------------------------------------------- entry


def _page_range(q_pos, lengths, C: int, M: int, cfg: DecodeConfig):
    """``[B]`` int32 ``[page_lo, page_hi)``: the table slots holding keys some query sees."""
    hi = lengths
    if cfg.causal:
        hi = jnp.minimum(hi, jnp.max(q_pos, axis=1) + 1)
    hi = jnp.maximum(hi, 0)
    lo = jnp.zeros_like(hi)
    widest = cfg.widest_window
    if widest is not None:
        lo = jnp.clip(jnp.min(q_pos, axis=1) - widest + 1, 0, hi)
    page_lo = lo // C
    page_hi = jnp.maximum(jnp.minimum(-(-hi // C), M), page_lo)
    return page_lo.astype(jnp.int32), page_hi.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg",))
def pallas_decode(q, pools, view, *, cfg: DecodeConfig):
    """``(out [B, T, N, H] float32, lse [B, T, N] float32)`` of paged decode attention.

    ``q [B, T, N, H]``, ``pools = (k_pages, v_pages)`` ``[K, P, C, H]`` (same dtype), ``view =
    (page_table [B, M] int, lengths [B] int, q_positions [B, T] int32)``; the semantics of
    :func:`paged.paged_attention` without sinks or page mass. Inputs are checked by the caller.
    """
    (k_pages, v_pages), (page_table, lengths, q_positions) = pools, view
    B, T, N, H = q.shape
    K, P, C, _ = k_pages.shape
    # Inside shard_map(check_vma=True) every operand varies like the outputs.
    q, k_pages, v_pages, page_table, lengths, q_positions = ringattn.match_varying(
        q, k_pages, v_pages, page_table, lengths, q_positions
    )
    G = N // K
    R = max(16, _pow2(T * G))
    ppb = cfg.pages_per_block
    lengths = lengths.astype(jnp.int32)
    q_positions = q_positions.astype(jnp.int32)
    table = page_table.astype(jnp.int32)
    M = table.shape[1]
    qr = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, R - T * G), (0, 0)))  # [B, K, R, H]
    row_pos = jnp.repeat(q_positions, G, axis=1)  # [B, T * G], row t * G + g
    row_pos = jnp.pad(row_pos, ((0, 0), (0, R - T * G)), constant_values=-1)[..., None]
    row_win = None
    if isinstance(cfg.window, tuple):  # head k * G + g -> rows t * G + g of kv head k
        heads = jnp.asarray([_NO_WINDOW if w is None else w for w in cfg.window], jnp.int32)
        row_win = jnp.tile(heads.reshape(K, G), (1, T))  # [K, T * G]
        row_win = jnp.pad(row_win, ((0, 0), (0, R - T * G)), constant_values=_NO_WINDOW)
        row_win = row_win[..., None]
    page_lo, page_hi = _page_range(q_positions, lengths, C, M, cfg)
    rows, pools = _Rows(qr, row_pos, row_win), (k_pages, v_pages)
    if cfg.variant == "gpu":
        parts = _gpu_call(rows, pools, _Walk(table, lengths, page_lo, page_hi), cfg)
        out, lse = _merge_splits(*parts)
    else:
        table = jnp.pad(table, ((0, 0), (0, -M % ppb)))
        out, lse = _tpu_call(rows, pools, _Walk(table, lengths, page_lo, page_hi), cfg)
        lse = lse[..., 0]
    out = out[:, :, : T * G].reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H)
    lse = lse[:, :, : T * G].reshape(B, K, T, G).transpose(0, 2, 1, 3).reshape(B, T, N)
    return out, lse
