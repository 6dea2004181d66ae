"""A ``jax.nn.dot_product_attention``-compatible entry point on the blockwise kernels.

:func:`dot_product_attention` takes ``jax.nn.dot_product_attention``'s arguments and returns
its array, computed by the XLA blockwise kernels (memory linear in ``T + S``, masked blocks
skipped), so a model written against ``jax.nn`` (or a Flax ``attention_fn``) swaps it in.
Each ``jax.nn`` option maps onto the library's own masking, never onto a dense ``[T, S]``
mask: ``is_causal`` and ``local_window_size`` onto causal masks and windows over positions,
the sequence lengths onto segment ids, ``bias`` and ``mask`` onto the blockwise kernels'
logit terms (:mod:`ringattn._bias`), sliced block by block.
"""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ringattn._bias import check_logit_term
from ringattn._blockwise import BlockSizes, check_block_sizes, run_xla
from ringattn._checks import (
    FloatLike,
    IntLike,
    check_bool,
    check_ids,
    check_int,
    describe,
    fail,
    fold_traced_scale,
)
from ringattn._kernels_bias import LogitTerms
from ringattn._options import Positions, SegmentIds, arange_positions, prepare

__all__ = ["dot_product_attention"]

# jax.nn's `implementation` values and what they run here.
IMPLEMENTATIONS = {None: "xla", "xla": "xla"}


def _check_implementation(fn: str, implementation) -> None:
    if implementation == "cudnn":
        raise ValueError(
            f"{fn}: implementation: expected None or 'xla', got 'cudnn': this function runs "
            f"the ringattn XLA blockwise kernels (memory linear in T + S) on every backend; "
            f"for cuDNN's fused kernel call jax.nn.dot_product_attention(..., "
            f"implementation='cudnn') itself"
        )
    if not isinstance(implementation, (str, type(None))) or implementation not in IMPLEMENTATIONS:
        raise fail(fn, "implementation", "None or 'xla'", describe(implementation))


def _check_inputs(fn: str, query, key, value) -> None:
    """``jax.nn``'s shape rules, named as ``jax.nn`` names the arguments."""
    for arg, x, layout in (
        ("query", query, "BTNH or TNH"),
        ("key", key, "BSKH or SKH"),
        ("value", value, "BSKH or SKH"),
    ):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise fail(fn, arg, f"a floating-point array [{layout}]", type(x).__name__)
        if x.ndim not in (3, 4) or not jnp.issubdtype(x.dtype, jnp.floating):
            raise fail(fn, arg, f"a floating-point array [{layout}]", describe(x))
    if not query.ndim == key.ndim == value.ndim:
        raise fail(fn, "key", f"rank {query.ndim} (that of query)", describe(key))
    if tuple(value.shape) != tuple(key.shape):
        raise fail(fn, "value", f"the shape of key {tuple(key.shape)}", describe(value))
    if not query.dtype == key.dtype == value.dtype:
        raise fail(fn, "key, value", f"the dtype of query ({query.dtype})", describe(key))
    *qb, _, N, H = query.shape
    *kb, _, K, Hk = key.shape
    if qb != kb or H != Hk or K < 1 or N < 1 or N % K:
        raise fail(
            fn,
            "key",
            f"the batch and head dim of query {tuple(query.shape)} and heads K dividing N={N}",
            describe(key),
        )


def _expand_term(fn: str, arg: str, x, dims, boolean: bool):
    """``jax.nn``'s rank rule (missing leading axes are 1), then the term's shape check."""
    if x is None:
        return None
    if hasattr(x, "ndim") and x.ndim < 4:
        x = jnp.asarray(x).reshape((1,) * (4 - x.ndim) + tuple(x.shape))
    return check_logit_term(fn, arg, x, dims, boolean=boolean)


def _window(fn: str, local_window_size) -> tuple[int, int] | None:
    if local_window_size is None:
        return None
    if isinstance(local_window_size, tuple) and len(local_window_size) == 2:
        left, right = local_window_size
        return (
            check_int(fn, "local_window_size[0]", left, minimum=0),
            check_int(fn, "local_window_size[1]", right, minimum=0),
        )
    size = check_int(fn, "local_window_size", local_window_size, minimum=0)
    return size, size


def dot_product_attention(
    query: Float[Array | np.ndarray, "*B T N H"],
    key: Float[Array | np.ndarray, "*B S K H"],
    value: Float[Array | np.ndarray, "*B S K H"],
    bias: Float[Array | np.ndarray, "..."] | None = None,
    mask: Bool[Array | np.ndarray, "..."] | None = None,
    *,
    scale: FloatLike | Float[Array, ""] | None = None,
    is_causal: bool | np.bool_ = False,
    query_seq_lengths: Int[Array | np.ndarray, " B"] | None = None,
    key_value_seq_lengths: Int[Array | np.ndarray, " B"] | None = None,
    local_window_size: IntLike | tuple[IntLike, IntLike] | None = None,
    implementation: str | None = None,
    block_sizes: BlockSizes | None = None,
) -> Float[Array, "*B T N H"]:
    """``jax.nn.dot_product_attention``, computed blockwise: the same arguments and result.

    ``softmax(scale * q k^T + bias)`` with the masks applied, per head, in float32 (the
    output in ``query``'s dtype), by the XLA kernels of :func:`ringattn.blockwise_attention`:
    memory linear in ``T + S``, blocks that the causal mask, the window or the sequence
    lengths hide entirely skipped, ``bias`` and ``mask`` sliced per block (never broadcast to
    ``[B, N, T, S]``). Gradients reach ``query``, ``key``, ``value`` and ``bias`` (reverse
    mode: a ``jax.custom_vjp``). The layout is ``jax.nn``'s and the library's,
    ``[B, T, N, H]``, with GQA as ``jax.nn`` groups it (query head ``n`` reads kv head
    ``n // (N // K)``). A Flax model swaps it in through ``attention_fn`` (see the docs,
    "jax.nn compatibility").

    One difference: a query that sees no key at all (every key masked by ``mask``, outside
    its window, or ``key_value_seq_lengths`` 0) gets ``0`` here, where ``jax.nn`` gives the
    mean of all ``S`` values (its masked logits are a large finite negative, so such a row's
    softmax is uniform). Padding queries (``query_seq_lengths``) get ``0`` in both. ``jax.nn``'s
    ``return_residual`` is not taken: :func:`ringattn.blockwise_attention` returns
    ``(out, lse)``.

    Args:
      query: ``[B, T, N, H]`` or ``[T, N, H]``.
      key: ``[B, S, K, H]`` or ``[S, K, H]`` (the rank of ``query``), ``N % K == 0``.
      value: the shape and dtype of ``key`` (and of ``query``'s dtype).
      bias: additive logit bias, rank at most 4, broadcastable to ``[B, N, T, S]`` (missing
        leading axes are 1, as in ``jax.nn``; each axis 1 or full), any float dtype.
      mask: boolean, shaped as ``bias``; True: the query may see the key (``jax.nn``'s
        meaning). NaN in ``bias``, ``key`` or ``value`` where nothing may see it has no
        effect.
      scale: logit scale, default ``1 / sqrt(H)``; a traced scalar reaches ``jax.grad``.
      is_causal: query ``t`` sees keys ``s <= t`` (``jax.nn``'s top-left alignment when
        ``T != S``).
      query_seq_lengths: ``[B]`` integer: queries ``t >= length`` are padding (output 0).
      key_value_seq_lengths: ``[B]`` integer: keys ``s >= length`` are hidden.
      local_window_size: ``(left, right)`` ints ``>= 0`` or one int for both: query ``t``
        sees keys ``t - left <= s <= t + right``.
      implementation: ``None`` or ``"xla"`` (both: the XLA blockwise kernels).
        ``"cudnn"`` is a ValueError: call ``jax.nn.dot_product_attention`` for it.
      block_sizes: :class:`ringattn.BlockSizes` (not in ``jax.nn``), default ``BlockSizes()``.

    Returns:
      ``[B, T, N, H]`` (or ``[T, N, H]``) in ``query``'s dtype.

    Raises:
      ValueError: inputs of the wrong rank, shape or dtype (named ``query``, ``key``,
        ``value`` as in ``jax.nn``); a ``bias`` or ``mask`` that does not broadcast to
        ``[B, N, T, S]`` or of the wrong dtype; sequence lengths that are not ``[B]``
        integers; a negative or non-integer window; ``implementation`` other than ``None``
        or ``"xla"``; static options (``is_causal``, ``local_window_size``,
        ``implementation``) passed traced.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))
      >>> kv = jax.random.normal(jax.random.key(1), (2, 16, 2, 8))
      >>> bias = jnp.zeros((1, 4, 16, 16))
      >>> dot_product_attention(q, kv, kv, bias, is_causal=True).shape
      (2, 16, 4, 8)
    """
    fn = "dot_product_attention"
    _check_implementation(fn, implementation)
    query, key, value = (
        jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in (query, key, value)
    )
    _check_inputs(fn, query, key, value)
    is_causal = check_bool(fn, "is_causal", is_causal)
    window = _window(fn, local_window_size)
    block_sizes = check_block_sizes(fn, block_sizes)
    out_shape = query.shape
    if query.ndim == 3:
        query, key, value = query[None], key[None], value[None]
    B, T, N, H = query.shape
    S = key.shape[1]
    dims = (B, N, T, S)
    bias = _expand_term(fn, "bias", bias, dims, boolean=False)
    mask = _expand_term(fn, "mask", mask, dims, boolean=True)

    causal, width, shift = _causal_window(is_causal, window)
    positions = Positions(arange_positions(B, T, shift), None) if causal else None
    segment_ids = None
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        # Padding queries are segment 1 and padding keys segment 2: they see, and are seen
        # by, nothing.
        q_seg = _padding_segments(fn, "query_seq_lengths", query_seq_lengths, B, T, 1)
        kv_seg = _padding_segments(fn, "key_value_seq_lengths", key_value_seq_lengths, B, S, 2)
        segment_ids = SegmentIds(q_seg, kv_seg)
    query, scale = fold_traced_scale(fn, query, scale)
    _, spec, seg, pos = prepare(
        fn,
        query,
        key,
        value,
        mask=None,
        causal=causal,
        window=width,
        softcap=None,
        scale=scale,
        segment_ids=segment_ids,
        positions=positions,
        sinks=None,
    )
    terms = LogitTerms(bias, mask)
    out = run_xla(query, key, value, (seg, pos, None), terms, spec, block_sizes).out
    return out.reshape(out_shape)


def _causal_window(is_causal: bool, window) -> tuple[bool, int | None, int]:
    """``jax.nn``'s causal mask and window over ``arange`` positions as the library's
    ``(causal, window, query shift)``: query ``t`` sees keys ``t - left <= s <= t + right``,
    which is a causal mask over queries moved right by ``right`` (0 under ``is_causal``),
    with a window of ``left + right + 1``."""
    if window is None:
        return is_causal, None, 0
    left, right = window
    right = 0 if is_causal else right
    return True, left + right + 1, right


def _padding_segments(fn: str, arg: str, lengths, B: int, length: int, pad_id: int):
    """``[B, length]`` int32: 0 before ``lengths[b]``, ``pad_id`` from there (no lengths:
    all 0)."""
    if lengths is None:
        return jnp.zeros((B, length), jnp.int32)
    lengths = check_ids(fn, arg, lengths, (B,))
    index = jnp.arange(length, dtype=jnp.int32)[None, :]
    return jnp.where(index < lengths[:, None], 0, pad_id).astype(jnp.int32)
