"""Memory-linear exact attention: an online softmax over blocks, with skipped masked blocks.

:func:`blockwise_attention` is the public entry: it validates its options once, pads and
reshapes to the kernels' heads-major layout (:mod:`ringattn._heads_major`), and runs the
forward kernel (:mod:`ringattn._kernels_forward`) under a ``custom_vjp`` whose backward
(:mod:`ringattn._kernels_backward`) recomputes each block's probabilities from
``(q, k, v, lse)`` (FlashAttention-2), so memory stays linear in ``T + S`` for training.

Block pairs that the mask hides entirely are skipped, so keys no query can see are never
read; in partial blocks they are selected away (``where``), so NaN or inf stored in a masked
key or value reaches neither the output nor any gradient.

``impl="pallas"`` runs the same computation as Pallas kernels (:mod:`ringattn._pallas_triton`:
Triton on GPU, interpret mode on CPU; :mod:`ringattn._pallas_tpu`: Mosaic on TPU);
``impl="auto"`` still picks the XLA path everywhere: the compiled kernels have not yet run
on a GPU or a TPU (see ``AUTO_PALLAS_BACKENDS``).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ringattn._bias import biased_attention, check_logit_term
from ringattn._blocks import MaskIds, window_table
from ringattn._checks import FloatLike, IntLike, check_int, describe, fail, fold_traced_scale
from ringattn._heads_major import attention_backward, attention_delta, attention_forward
from ringattn._kernels_bias import LogitTerms
from ringattn._mosaic_blocks import mosaic_blocks
from ringattn._online_softmax import AttentionOutput, apply_sinks
from ringattn._options import MaskSpec, Positions, SegmentIds, arange_positions, prepare
from ringattn._pallas import pallas_attention
from ringattn._pallas_common import PallasConfig
from ringattn._pallas_triton import pallas_blocks
from ringattn._varying import cast_varying, varying_axes

__all__ = ["BlockSizes", "blockwise_attention"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Block sizes of the blockwise kernels (clamped to the sequence lengths).

    Attributes:
      block_q: query rows per block in the forward pass.
      block_kv: keys per block in the forward pass.
      block_q_bwd: query rows per block in the backward pass (default ``block_q``).
      block_kv_bwd: keys per block in the backward pass (default ``block_kv``).

    Numpy integers are accepted (normalised to Python ints). The working set of one step is
    about ``B * N * block_q * block_kv * 4`` bytes of logits; the defaults keep it near the
    L2 cache of a CPU core for ``N = 8``.
    """

    # Annotated with what __init__ accepts; __post_init__ stores Python ints.
    block_q: IntLike = 512
    block_kv: IntLike = 512
    block_q_bwd: IntLike | None = None
    block_kv_bwd: IntLike | None = None

    def __post_init__(self):
        for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
            value = getattr(self, name)
            if value is None and name.endswith("_bwd"):
                continue
            object.__setattr__(self, name, check_int("BlockSizes", name, value, minimum=1))

    @property
    def forward(self) -> tuple[int, int]:
        return (self.block_q, self.block_kv)

    @property
    def backward(self) -> tuple[int, int]:
        return (self.block_q_bwd or self.block_q, self.block_kv_bwd or self.block_kv)


def check_block_sizes(fn: str, block_sizes) -> BlockSizes:
    if block_sizes is None:
        return BlockSizes()
    if not isinstance(block_sizes, BlockSizes):
        raise fail(fn, "block_sizes", "a ringattn.BlockSizes or None", describe(block_sizes))
    return block_sizes


def empty_attention(q, k, v) -> AttentionOutput:
    """The result when there are no queries or no keys: ``out = 0``, ``lse = -inf``."""
    B, T, N, H = q.shape
    axes = varying_axes(q, k, v)
    out = cast_varying(jnp.zeros((B, T, N, H), q.dtype), axes)
    lse = cast_varying(jnp.full((B, T, N), -jnp.inf, jnp.float32), axes)
    return AttentionOutput(out, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, ids: MaskIds, mask: MaskSpec, block_sizes: BlockSizes):
    out, lse = attention_forward(q, k, v, ids, mask=mask, blocks=block_sizes.forward)
    return out.astype(q.dtype), lse


def _attention_fwd(q, k, v, ids, mask, block_sizes):
    out, lse = _attention(q, k, v, ids, mask, block_sizes)
    return (out, lse), (q, k, v, ids, out, lse)


def _attention_bwd(mask, block_sizes, residuals, cotangents):
    q, k, v, ids, out, lse = residuals
    dout, dlse = cotangents
    delta = attention_delta(out, dout, dlse)
    dq, dk, dv = attention_backward(
        q, k, v, ids, (lse, dout, delta), mask=mask, blocks=block_sizes.backward
    )
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def head_windows(spec: MaskSpec, num_heads: int):
    """``[N]`` int32 per-head windows (``0``: none) when ``spec.per_head``, else None."""
    if not spec.per_head:
        return None
    return np.asarray([0 if w is None else w for w in spec.windows(num_heads)], np.int32)


def with_window_table(ids: MaskIds, B: int, K: int) -> MaskIds:
    """``ids`` with its ``[N]`` per-head windows (or None) as the kernels' ``[B, K, G]`` table."""
    if ids.windows is None:
        return ids
    return ids._replace(windows=window_table(ids.windows, B, K))


def local_attention(q, k, v, ids: MaskIds, spec: MaskSpec, block_sizes: BlockSizes):
    """Blockwise ``(out, lse)`` on validated inputs (positions filled in).

    ``ids.windows``: ``[N]`` per-head windows of THESE query heads (traced or numpy), or None.
    Used by :func:`blockwise_attention` and by the strategies of ``sharded_attention``,
    which slice the windows of their local heads.
    """
    ids = with_window_table(ids, q.shape[0], k.shape[2])
    return _attention(q, k, v, ids, spec, block_sizes)


@functools.partial(jax.jit, static_argnums=(6,))
def _blockwise(q, k, v, ids: MaskIds, sinks, terms: LogitTerms, static):
    mask, block_sizes = static
    ids = ids._replace(windows=head_windows(mask, q.shape[2]))
    if terms.bias is None and terms.allowed is None:
        return apply_sinks(*local_attention(q, k, v, ids, mask, block_sizes), sinks)
    ids = with_window_table(ids, q.shape[0], k.shape[2])
    out, lse = biased_attention(q, k, v, ids, terms, mask, block_sizes)
    return apply_sinks(out, lse, sinks)


IMPLS = ("auto", "xla", "pallas")
# Backends on which impl="auto" picks the Pallas kernels. Empty until the compiled kernels
# have run and been checked on the hardware (benchmarks/bench_accel.py): only interpret mode
# (Triton's and the TPU interpret mode of the Mosaic kernels) and the lowerings (to Triton IR
# for CUDA, to Mosaic for TPU) are tested so far, so "auto" must not hand an unrun kernel to
# every GPU or TPU user. Add "gpu" / "tpu" here once they have.
AUTO_PALLAS_BACKENDS: frozenset[str] = frozenset()


def resolve_impl(fn: str, impl, backend: str) -> str:
    """``"xla"`` or ``"pallas"`` for ``impl`` on ``backend`` (``jax.default_backend()``).

    ``"auto"`` is Pallas on ``AUTO_PALLAS_BACKENDS`` (none yet) and XLA elsewhere.
    ``"pallas"`` runs the Triton kernels on GPU, the Mosaic kernels on TPU and the Triton
    kernels in interpret mode on CPU; on any other backend it raises NotImplementedError.

    Args:
      fn: the caller's name, for error messages.
      impl: ``"auto"``, ``"xla"`` or ``"pallas"``.
      backend: ``"cpu"``, ``"gpu"``, ``"tpu"``, ...

    Returns:
      ``"xla"`` or ``"pallas"``.

    Raises:
      ValueError: an unknown ``impl``.
      NotImplementedError: ``"pallas"`` on a backend with no kernels.

    Example:
      >>> resolve_impl("my_fn", "auto", "cpu"), resolve_impl("my_fn", "pallas", "gpu")
      ('xla', 'pallas')
    """
    if not isinstance(fn, str) or not isinstance(backend, str):
        raise ValueError(f"resolve_impl: fn and backend must be str, got {fn!r}, {backend!r}")
    if not isinstance(impl, str) or impl not in IMPLS:
        raise fail(fn, "impl", "one of 'auto', 'xla', 'pallas'", describe(impl))
    if impl == "auto":
        return "pallas" if backend in AUTO_PALLAS_BACKENDS else "xla"
    if impl == "pallas" and backend not in ("gpu", "tpu", "cpu"):
        raise NotImplementedError(
            f"{fn}: impl='pallas' is implemented for GPU (Triton), TPU (Mosaic) and CPU "
            f"(interpret mode), not for the {backend!r} backend; use impl='xla'"
        )
    return impl


def pallas_target(backend: str) -> str:
    """The Pallas kernels run on ``backend``: ``"mosaic"`` on TPU, ``"triton"`` elsewhere.

    On CPU the Triton kernels run in interpret mode; tests that check the Mosaic kernels on
    CPU (TPU interpret mode) replace this function (``monkeypatch``).
    """
    return "mosaic" if backend == "tpu" else "triton"


def make_pallas_config(spec: MaskSpec, block_sizes, G: int, T: int, S: int, H: int, backend):
    """The :class:`PallasConfig` of one call on ``backend`` (interpret mode on CPU).

    ``block_sizes``: the caller's :class:`BlockSizes` or None (the target's defaults).
    Raises NotImplementedError for block sizes the compiled kernels cannot take.
    """
    target = pallas_target(backend)
    interpret = backend == "cpu"
    blocks = mosaic_blocks if target == "mosaic" else pallas_blocks
    fwd, bwd = blocks(block_sizes, G, T, S, interpret)
    return PallasConfig(spec, spec.scale_for(H), *fwd, *bwd, interpret=interpret, target=target)


@functools.partial(jax.jit, static_argnums=(5,))
def _blockwise_pallas(q, k, v, ids: MaskIds, sinks, cfg: PallasConfig):
    ids = ids._replace(windows=head_windows(cfg.mask, q.shape[2]))
    ids = with_window_table(ids, q.shape[0], k.shape[2])
    args = (q, k, v, ids)
    axes = varying_axes(*args)
    if axes:  # inside shard_map(check_vma=True): every operand varies like the outputs
        args = cast_varying(args, axes)
        if cfg.interpret is True:  # the HLO interpreter fails check_vma: TPU interpret mode
            from jax.experimental.pallas import tpu as pltpu

            cfg = dataclasses.replace(cfg, interpret=pltpu.InterpretParams())
    out, lse = pallas_attention(*args, cfg)
    return apply_sinks(out, lse, sinks)


def blockwise_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    mask: MaskSpec | None = None,
    causal: bool | np.bool_ | None = None,
    window: IntLike | tuple[IntLike | None, ...] | None = None,
    softcap: FloatLike | None = None,
    scale: FloatLike | Float[Array, ""] | None = None,
    segment_ids: SegmentIds | None = None,
    positions: Positions | None = None,
    sinks: Float[Array, " N"] | None = None,
    bias: Float[Array, "#B #N #T #S"] | None = None,
    block_sizes: BlockSizes | None = None,
    impl: str = "auto",
) -> AttentionOutput:
    """Exact attention computed block by block, never materialising the ``T x S`` matrix.

    Same semantics as :func:`ringattn.attention_reference`. Softmax statistics accumulate in
    float32 and the output comes back in ``q.dtype``. Block pairs that the mask hides entirely
    (causal future, outside every head's window, other segments) are skipped. The gradient is
    a ``custom_vjp`` that recomputes blocks from ``(q, k, v, out, lse)``, so training memory
    is linear in ``T + S``; gradients flow to ``q``, ``k``, ``v``, ``bias``, ``sinks`` and
    through ``lse``. Keys no query may see have no effect, even if they hold NaN or inf.

    Options are static: to ``jit`` with them, bind them first,
    ``jax.jit(functools.partial(blockwise_attention, causal=True))``, or pass a
    :class:`ringattn.MaskSpec` through ``static_argnames=("mask",)``.

    Args:
      q: ``[B, T, N, H]`` queries.
      k: ``[B, S, K, H]`` keys; ``N % K == 0``.
      v: ``[B, S, K, H]`` values.
      mask: a :class:`ringattn.MaskSpec`; or give its fields as the keywords below (not both).
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      window: hide keys at positions ``<= p - window`` (``>= 1``); a tuple gives one window
        per query head (``None``: that head has none).
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``. A float, or a float JAX scalar that
        may be traced (a temperature trained with the model, under ``jit`` / ``grad``): it
        then multiplies ``q`` (in ``q``'s dtype) and the kernel runs at scale 1, so the
        logits are ``scale * q k^T`` up to rounding (softcap applies after, as always) and
        ``jax.grad`` reaches ``scale``. Only this keyword takes one: a ``MaskSpec`` is
        static.
      segment_ids: :class:`ringattn.SegmentIds` ``(q [B, T], kv [B, S])`` of packed documents.
      positions: :class:`ringattn.Positions` ``(q [B, T], kv [B, S])``, default ``arange``.
        With ``T != S`` under a causal or window mask ``positions.q`` is required (where a
        shorter query block sits is ambiguous: ``paged`` puts it last): a ``ValueError``.
      sinks: ``[N]`` per-head sink logit (joins the softmax denominator once), or None.
      bias: an additive logit bias ``[B or 1, N or 1, T or 1, S or 1]`` (any float dtype; an
        axis of size 1 is broadcast), or None: the logits are ``softcap(scale * q k^T) +
        bias`` before the mask. Each kernel step slices the block it needs, so the bias is
        never broadcast to ``[B, N, T, S]`` (a padded copy is made where ``T`` or ``S`` is
        not a multiple of the block size). Its gradient comes back in its own shape and
        dtype, summed over its broadcast axes. Where the mask hides a pair the bias has no
        effect (NaN there reaches nothing). With a bias every live block is computed masked
        (no unmasked fast path), and only the XLA path takes one (``impl="pallas"``:
        ValueError; ``"auto"`` runs XLA).
      block_sizes: :class:`ringattn.BlockSizes`; default ``BlockSizes()`` for the XLA path;
        for Pallas on GPU and CPU ``128 // G`` query positions (``128`` rows) by ``64`` keys
        forward, ``64 // G`` by ``64`` backward (``G = N // K``), clamped to the next power
        of two of the lengths, and the compiled (GPU) kernels need ``block_q * G`` and
        ``block_kv`` to be powers of two; for Pallas on TPU ``8 * max(1, 64 // G)`` positions
        (about 512 rows) by ``512`` keys forward, ``8 * max(1, 32 // G)`` by ``256``
        backward, clamped to the lengths, and the compiled
        kernels need ``block_q * G`` to be a multiple of 8 and ``block_kv`` of 128 unless
        the block spans the whole length.
      impl: ``"auto"`` (the XLA path for now, on every backend: the compiled Pallas kernels
        have not run on a GPU or TPU yet), ``"xla"`` or ``"pallas"`` (Pallas kernels:
        Triton on GPU, Mosaic on TPU, Triton's interpret mode on CPU). Pallas does not take
        a :class:`ringattn.DenseMask`.

    Returns:
      :class:`ringattn.AttentionOutput` ``(out [B, T, N, H] in q.dtype, lse [B, T, N]
      float32)``. Rows that see no key: ``out = 0``, ``lse = -inf`` (the identity of
      :func:`ringattn.merge_attention`; ``lse = sink`` with sinks).

    Raises:
      ValueError: on inconsistent shapes or dtypes, ``N % K != 0``, a zero head dim or head
        count, segment ids or positions of the wrong type, shape or dtype, a bad window,
        softcap, scale, sinks or block size, an unknown ``impl``, both ``mask`` and a
        keyword, or ``T != S`` under a causal or window mask without ``positions.q``; a
        ``bias`` that is not a float array broadcastable as above, or a bias with
        ``impl="pallas"``.
      NotImplementedError: ``impl="pallas"`` with a DenseMask, on a backend other than
        CPU, GPU and TPU, or with block sizes the compiled kernel cannot take.
      TypeError: forward-mode autodiff (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize`` of
        a function of the inputs) is not supported: the gradient is a ``jax.custom_vjp``, and
        JAX raises ``can't apply forward-mode autodiff (jvp) to a custom_vjp function``.
        Reverse mode (``jax.grad``, ``jax.vjp``, ``jax.jacrev``) is supported; for
        forward-mode derivatives, use :func:`ringattn.attention_reference` (plain
        ``jax.numpy``, differentiable both ways, quadratic memory).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = jax.random.normal(jax.random.key(0), (1, 256, 8, 64))
      >>> kv = jax.random.normal(jax.random.key(1), (1, 256, 2, 64))
      >>> blockwise_attention(q, kv, kv, causal=True).out.shape
      (1, 256, 8, 64)

    References:
      Dao, "FlashAttention-2", 2023; Liu & Abbeel, "Blockwise Parallel Transformer", 2023.
    """
    fn = "blockwise_attention"
    q, scale = fold_traced_scale(fn, q, scale)
    (B, T, S, N, K, H), spec, seg, pos = prepare(
        fn,
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        window=window,
        softcap=softcap,
        scale=scale,
        segment_ids=segment_ids,
        positions=positions,
        sinks=sinks,
        dense_ok=True,
    )
    given_blocks = block_sizes
    block_sizes = check_block_sizes(fn, block_sizes)
    if bias is not None:
        bias = check_logit_term(fn, "bias", bias, (B, N, T, S), boolean=False)
    if bias is not None and impl == "pallas":
        raise ValueError(
            f"{fn}: bias: expected None with impl='pallas' (the Pallas kernels take no logit "
            f"bias), got {describe(bias)}: a bias runs on impl='xla' or impl='auto' (the XLA "
            f"blockwise kernels); ringattn.attention_reference and "
            f"ringattn.dot_product_attention take one too"
        )
    impl = resolve_impl(fn, impl, jax.default_backend())
    if bias is not None:
        impl = "xla"  # "auto" never hands a bias to the Pallas kernels
    if impl == "pallas" and spec.dense is not None:
        raise NotImplementedError(f"{fn}: impl='pallas' does not support mask.dense (DenseMask)")
    if impl == "pallas" and 0 not in (B, T, S):
        q_pos = arange_positions(B, T) if pos.q is None else pos.q
        kv_pos = arange_positions(B, S) if pos.kv is None else pos.kv
        q_seg, kv_seg = (None, None) if seg is None else seg
        cfg = make_pallas_config(spec, given_blocks, N // K, T, S, H, jax.default_backend())
        return _blockwise_pallas(q, k, v, MaskIds(q_pos, kv_pos, q_seg, kv_seg), sinks, cfg)
    return run_xla(q, k, v, (seg, pos, sinks), LogitTerms(bias, None), spec, block_sizes)


def run_xla(
    q, k, v, ids, terms: LogitTerms, spec: MaskSpec, block_sizes: BlockSizes
) -> AttentionOutput:
    """The XLA blockwise path on validated inputs (``prepare`` and the term checks done).

    ``ids = (SegmentIds or None, Positions, sinks or None)``; ``terms``: :class:`LogitTerms`
    ``(bias, allowed)``, each ``[B or 1, N or 1, T or 1, S or 1]`` or None
    (:mod:`ringattn._bias`).
    """
    seg, pos, sinks = ids
    (B, T, _, _), S = q.shape, k.shape[1]
    if B == 0 or T == 0 or S == 0:
        return apply_sinks(*empty_attention(q, k, v), sinks)
    q_pos = arange_positions(B, T) if pos.q is None else pos.q
    kv_pos = arange_positions(B, S) if pos.kv is None else pos.kv
    q_seg, kv_seg = (None, None) if seg is None else seg
    ids = MaskIds(q_pos, kv_pos, q_seg, kv_seg)
    return _blockwise(q, k, v, ids, sinks, LogitTerms(*terms), (spec, block_sizes))
