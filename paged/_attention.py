"""Attention over a paged KV pool: decode steps and mixed prefill/decode batches.

Layout (heads-major, as JAX's TPU paged attention): ``k_pages, v_pages [K, P, C, H]``. Token
``i`` of sequence ``b`` and kv head ``h`` lives at ``k_pages[h, page_table[b, i // C], i % C]``.
Page 0 is the reserved *null page*: padding slots of ``page_table`` point to it and writes to it
are dropped. (JAX's and vLLM's tables use page 0 as an ordinary page: convert them with
:func:`paged.from_zero_based_table`.)

This module holds :func:`paged.paged_attention` and the helpers both entry points share;
:func:`paged.ragged_paged_attention` lives in :mod:`paged._ragged`.

Both functions return :class:`PagedAttentionOutput` ``(out, lse, page_mass)`` whatever flags
are passed (``page_mass`` is None unless asked for). The mask comes as ``mask=`` (a
:class:`ringattn.MaskSpec`) or through the keywords ``causal=, window=, softcap=, scale=``,
validated by :func:`ringattn.resolve_mask`; here ``causal`` defaults to True. ``window`` may
be a tuple with one window per query head. ``sinks`` (a per-query-head logit) joins the
softmax once, after all pages, through :func:`ringattn.apply_sinks`.

Eager calls (concrete ``page_table`` and ``lengths``, not traced) check their values and
raise ``ValueError``: a length outside ``[0, M * C]``, or a slot holding one of a sequence's
tokens that is not a real page (the null page 0, a negative id or one ``>= P``). Slots past a
length are never read and may hold anything. Under ``jit`` nothing value-dependent can raise,
so the functions are safe by construction instead:

* a token is visible only if its position is ``< lengths[b]`` *and* its page id is a real page
  (``0 < id < P``); the null page and out-of-range ids (negative, ``>= P``) are masked, and the
  gather index is clamped into range first, so a corrupt table can never pull in another
  sequence's data; masked keys and values are removed with ``where``, so NaN/inf garbage in
  unused slots, freed pages or the null page never reaches a result;
* a query with no visible key gets ``out = 0`` and ``lse = -inf`` (``lse = sink`` with sinks).

Quantized pools (:class:`paged.QuantizedPages`) are decoded one page block at a time in
float32 inside the walk; their NaN / inf scales in unreadable slots are removed like any
garbage.

``paged_attention(impl="pallas")`` runs the Pallas decode kernel of
:mod:`paged._pallas_decode` instead of the XLA page walk (same semantics and safety; no
quantized pools or page mass); ``impl="auto"`` is the XLA walk on every backend for now.

:func:`paged.validate_page_table` checks a table eagerly and more strictly (every id in range,
no page twice in one sequence).

Jit with options bound: ``jax.jit(functools.partial(paged_attention, window=128))``. The loops
have dynamic trip counts, so these functions are forward-only (inference): reverse-mode
differentiation raises. Oracles: :func:`paged.paged_attention_reference` and
:func:`paged.ragged_paged_attention_reference`.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

import ringattn
from paged._checks import (
    check_array,
    check_heads,
    check_pages,
    check_residual_rows,
    check_table,
    check_table_values,
    describe,
    int_option,
    pool_dtype,
    refuse_bias,
)
from paged._layers import LayerPools, read_layer
from paged._page_walk import attend_sequence, kernel_options, pad_table
from paged._pallas_decode import decode_config, pallas_decode
from paged._quantized import QuantizedPages, is_quantized

__all__ = ["DEFAULT_PAGES_PER_BLOCK", "PagedAttentionOutput", "paged_attention"]

# Tuned on a 2-core CPU for C = 16, K = 8, H = 128 float32 (benchmarks/bench_paged.py): 16 to
# 64 pages per block were equally fast there (one block of K is 2 MiB at 32 pages, so the
# per-block gather still streams through cache), 8 or 128 slower (loop overhead, cache).
DEFAULT_PAGES_PER_BLOCK = 32

IntScalar = int | np.integer
FloatScalar = float | int | np.floating | np.integer
Window = IntScalar | tuple[IntScalar | None, ...] | None


class PagedAttentionOutput(NamedTuple):
    """What every paged attention function returns (the same fields whatever the flags).

    Attributes:
      out: ``[B, T, N, H]`` (ragged: ``[Q, N, H]``) attention output in ``q.dtype``.
      lse: ``[B, T, N]`` (ragged: ``[Q, N]``) float32 log-sum-exp of each row's logits (sink
        included), ``-inf`` for a row that sees no key and has no sink.
      page_mass: ``[B, N, M]`` float32 softmax probability each page-table slot received,
        summed over the ``T`` queries (a sink's share goes to no slot), when
        ``return_page_mass=True``; else None.
    """

    out: Float[Array, "*B T N H"]
    lse: Float[Array, "*B T N"]
    page_mass: Float[Array, "B N M"] | None


def _python(x):
    """A numpy scalar as its Python value (tuples elementwise); anything else unchanged."""
    if isinstance(x, tuple):
        return tuple(_python(e) for e in x)
    return x.item() if isinstance(x, np.generic) else x


def resolve_mask(fn: str, mask, *, causal, window, softcap, scale) -> ringattn.MaskSpec:
    """:func:`ringattn.resolve_mask` with paged's default ``causal=True``; numpy scalars
    become Python values first (so they are static, hashable jit options)."""
    return ringattn.resolve_mask(
        fn,
        mask,
        causal=_python(causal),
        window=_python(window),
        softcap=_python(softcap),
        scale=_python(scale),
        default_causal=True,
    )


def check_sinks(fn: str, sinks, N: int) -> None:
    """``sinks``: None or a float ``[N]`` array."""
    if sinks is None:
        return
    check_array(fn, "sinks", sinks, 1, jnp.floating)
    if tuple(sinks.shape) != (N,):
        raise ValueError(
            f"{fn}: sinks: expected shape ({N},) (one per query head), got {describe(sinks)}"
        )


def default_q_positions(fn: str, q_positions, lengths, B: int, T: int):
    """``q_positions`` checked as ``[B, T]`` ints, default the last ``T`` valid positions."""
    if q_positions is None:
        return lengths.astype(jnp.int32)[:, None] - T + jnp.arange(T, dtype=jnp.int32)
    check_array(fn, "q_positions", q_positions, 2, jnp.integer)
    if tuple(q_positions.shape) != (B, T):
        raise ValueError(f"{fn}: q_positions: expected shape {(B, T)}, got {describe(q_positions)}")
    return jnp.asarray(q_positions, jnp.int32)


def forward_only(fn: str, impl, *args, **static):
    """``impl(*args, **static)`` under a ``custom_jvp`` whose rule raises: differentiating it
    (``jax.grad``, ``vjp``, ``jvp``, ``jacfwd``) is a ``NotImplementedError`` that says what to
    use instead, not an error from deep inside JAX's loops. Inputs no derivative reaches
    (constants, ``lax.stop_gradient``) never call the rule."""

    def call(*a):
        return impl(*a, **static)

    guarded = jax.custom_jvp(call)

    def reject(primals, tangents):
        raise NotImplementedError(
            f"{fn}: differentiation (jax.grad / vjp / jvp / jacfwd) is not supported: paged "
            "attention is forward only (inference over a paged cache). To train, attend over "
            "contiguous K/V with ringattn.blockwise_attention (differentiable in q, k, v; "
            "paged.gather_kv(cache, layer) gathers a layer's pages into [B, S, K, H]), or wrap "
            "the inputs in jax.lax.stop_gradient when no gradient should flow through here"
        )

    guarded.defjvp(reject)
    return guarded(*args)


@functools.partial(jax.jit, static_argnames=("opts",))
def attention_rows(q, pools, view, heads=None, *, opts):
    """``out [B, T, N, H]`` float32, ``lse [B, T, N]`` and (``opts.want_page_lse``) the page
    mass of each query row ``[B, T, N, M]`` (relative to the row's own ``lse``), no sinks.

    ``pools = (k_pages, v_pages)``; ``view = (page_table [B, M], lengths [B], q_positions
    [B, T])``: what the queries see of the cache.
    """
    (k_pages, v_pages), (page_table, lengths, q_positions) = pools, view
    M = page_table.shape[1]
    table = pad_table(page_table, opts.pages_per_block)
    lengths = lengths.astype(jnp.int32)
    q_valid = jnp.ones(q.shape[:2], bool)

    def one(args):
        q_b, pos_b, valid_b, row_b, len_b, b = args
        k_b, v_b = sequence_view(k_pages, b), sequence_view(v_pages, b)
        out, lse, mass = attend_sequence(
            (q_b, pos_b, valid_b), row_b, len_b, (k_b, v_b), opts=opts, heads=heads
        )
        mass = mass[:, :, :M].transpose(1, 0, 2) if mass is not None else None  # [T, N, M]
        return out, lse, mass

    rows = jnp.arange(q.shape[0], dtype=jnp.int32)
    return lax.map(one, (q, q_positions, q_valid, table, lengths, rows))


def sequence_view(pool, b):
    """``pool`` as sequence ``b`` reads it: a kivi2 pool's residual narrowed to row ``b``
    (``[K, B, W * C, H] -> [K, W * C, H]``, its written length ``[K, B] -> []``); any other pool as
    it is."""
    if getattr(pool, "residual", None) is None:
        return pool
    residual = lax.dynamic_index_in_dim(pool.residual, b, axis=1, keepdims=False)
    filled = lax.dynamic_index_in_dim(pool.residual_len, b, axis=1, keepdims=False)
    return dataclasses.replace(pool, residual=residual, residual_len=filled[0])


def finish(out, lse, mass_rows, sinks, dtype) -> PagedAttentionOutput:
    """Applies the sinks once and sums the rows' page mass over queries (jittable)."""
    out, lse_total = ringattn.apply_sinks(out, lse, sinks)
    mass = None
    if mass_rows is not None:
        if sinks is not None:  # the sink takes its share of every query's probability
            keep = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - lse_total))  # [B, T, N]
            mass_rows = mass_rows * keep[..., None]
        mass = jnp.sum(mass_rows, axis=1)  # [B, N, M]
    return PagedAttentionOutput(out.astype(dtype), lse_total, mass)


@functools.partial(jax.jit, static_argnames=("opts",))
def _paged_attention_impl(q, pools, view, sinks, heads=None, *, opts):
    out, lse, mass_rows = attention_rows(q, pools, view, heads, opts=opts)
    return finish(out, lse, mass_rows, sinks, q.dtype)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _paged_attention_pallas(q, pools, view, sinks, *, cfg):
    out, lse = pallas_decode(q, pools, view, cfg=cfg)
    return finish(out, lse, None, sinks, q.dtype)


def layer_pools(fn: str, k_pages, v_pages, layer):
    """``(k, v, heads)`` for reading layer ``layer`` of stacked pools ``[L, K, P, C, H]``
    without copying it: the stacks with layers and heads merged (``[L * K, P, C, H]``, a free
    reshape) and ``heads [K]``, the rows of that layer. A kivi2 pool (its residual window is per
    layer and row) is sliced instead. ``layer``: an int in ``[0, L)`` or a traced integer
    scalar (clamped into range)."""
    for name, pool in (("k_pages", k_pages), ("v_pages", v_pages)):
        if getattr(pool, "ndim", None) != 5:
            raise ValueError(
                f"{fn}: {name}: expected the stacked [L, K, P, C, H] pools of a PagedKVCache "
                f"with layer= (a per-layer [K, P, C, H] pool takes no layer), got {describe(pool)}"
            )
    L = k_pages.shape[0]
    if isinstance(layer, (bool, np.bool_)) or not (
        isinstance(layer, (int, np.integer))
        or (
            hasattr(layer, "dtype")
            and jnp.issubdtype(layer.dtype, jnp.integer)
            and jnp.ndim(layer) == 0
        )
    ):
        raise ValueError(f"{fn}: layer: expected an int or an integer scalar array, got {layer!r}")
    if isinstance(layer, (int, np.integer)) and not 0 <= layer < L:
        raise ValueError(f"{fn}: layer: expected 0 <= layer < {L} (the pools' L), got {layer}")
    if getattr(k_pages, "residual", None) is not None:
        return k_pages[layer], v_pages[layer], None
    K = k_pages.shape[1]
    heads = jnp.clip(jnp.asarray(layer, jnp.int32), 0, L - 1) * K + jnp.arange(K, dtype=jnp.int32)

    def merged(pool):
        if is_quantized(pool):
            flat = lambda a: None if a is None else a.reshape(L * K, *a.shape[2:])
            return dataclasses.replace(pool, data=flat(pool.data), scale=flat(pool.scale), zero=flat(pool.zero))  # fmt: skip
        return pool.reshape(L * K, *pool.shape[2:])

    return merged(k_pages), merged(v_pages), heads


def checked_pools(fn: str, k_pages, v_pages, layer):
    """``(k, v, heads, (K, P, C, H))``: the pools checked, per layer (``layer=None``) or as
    stacks read in place (:func:`layer_pools`), with one layer's shape."""
    heads = None
    if layer is not None:
        k_pages, v_pages, heads = layer_pools(fn, k_pages, v_pages, layer)
    K, P, C, H = check_pages(fn, k_pages, v_pages)
    return k_pages, v_pages, heads, (K if heads is None else heads.shape[0], P, C, H)


def pallas_variant(fn: str, impl, backend: str, k_pages, return_page_mass) -> tuple[str, bool]:
    """``(variant, interpret)`` of the Pallas decode kernel for ``impl`` on ``backend``, or
    ``("xla", False)``: ``"auto"`` follows :func:`ringattn.resolve_impl` (the XLA walk for
    now); ``"pallas"`` is the Triton kernel on GPU, the Mosaic one on TPU and the GPU-style
    kernel in interpret mode on CPU."""
    if impl == "pallas" and backend == "tpu":
        variant, interpret = "tpu", False
    elif ringattn.resolve_impl(fn, impl, backend) == "xla":
        return "xla", False
    else:
        variant, interpret = "gpu", backend == "cpu"
    if is_quantized(k_pages):
        raise NotImplementedError(f"{fn}: impl='pallas' does not support QuantizedPages pools")
    if return_page_mass:
        raise NotImplementedError(f"{fn}: impl='pallas' does not support return_page_mass=True")
    return variant, interpret


def paged_attention(
    q: Float[Array, "B T N H"],
    k_pages: Float[Array, "K P C H"] | QuantizedPages | LayerPools | Float[Array, "L K P C H"],
    v_pages: Float[Array, "K P C H"] | QuantizedPages | LayerPools | Float[Array, "L K P C H"],
    page_table: Int[Array | np.ndarray, "B M"],
    lengths: Int[Array | np.ndarray, " B"],
    *,
    q_positions: Int[Array | np.ndarray, "B T"] | None = None,
    mask: ringattn.MaskSpec | None = None,
    causal: bool | np.bool_ | None = None,
    window: Window = None,
    softcap: FloatScalar | None = None,
    scale: FloatScalar | None = None,
    sinks: Float[Array, " N"] | None = None,
    pages_per_block: IntScalar = DEFAULT_PAGES_PER_BLOCK,
    return_page_mass: bool | np.bool_ = False,
    impl: str = "auto",
    layer: IntScalar | Int[Array, ""] | None = None,
    bias: Float[Array, "..."] | None = None,
) -> PagedAttentionOutput:
    """Decode attention of a few query tokens per sequence over a paged KV pool.

    Walks each sequence's pages ``pages_per_block`` at a time with an online softmax, skipping
    blocks beyond its length, in every query's causal future or outside the window. Jittable
    with static shapes and options bound:
    ``jax.jit(functools.partial(paged_attention, causal=True, window=128))``; vmappable;
    forward only.

    Args:
      q: ``[B, T, N, H]`` queries, ``T`` small (a decode step, speculative tokens).
      k_pages: ``[K, P, C, H]`` key pool (heads-major), same dtype as ``q``; page 0 is null.
        Or a :class:`paged.QuantizedPages` (int8 / fp8 per-token or int4 group scales, any float
        ``q``): decoded block by block in float32 inside the page walk.
      v_pages: ``[K, P, C, H]`` value pool, of the same kind (and format) as ``k_pages``.
      page_table: ``[B, M]`` int page ids (numpy from the allocator, or jax); slot ``j`` of
        sequence ``b`` holds its tokens ``j * C ... j * C + C - 1``. Unused slots point to 0.
      lengths: ``[B]`` int number of valid tokens of each sequence (``<= M * C``).
      q_positions: ``[B, T]`` int positions of the queries, default the last ``T`` positions
        ``lengths - T ... lengths - 1`` of the valid cache.
      mask: a :class:`ringattn.MaskSpec` (then none of the four keywords below).
      causal: a query at position ``p`` sees keys at positions ``<= p`` (default True).
      window: hide keys at positions ``<= p - window``; a tuple gives one window per query
        head (``None`` entries: no window).
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``.
      sinks: ``[N]`` float per-query-head sink logit joining each softmax once, or None.
      pages_per_block: pages per loop step (a speed knob; any positive int).
      return_page_mass: also compute ``page_mass [B, N, M]`` float32, the softmax probability
        each page-table slot received, summed over the ``T`` queries (for eviction/offload
        policies).
      impl: ``"auto"`` (the XLA page walk, on every backend for now, as
        :func:`ringattn.blockwise_attention`), ``"xla"``, or ``"pallas"``: a Pallas decode
        kernel (:mod:`paged._pallas_decode`; Triton on GPU, Mosaic on TPU, interpret mode on
        CPU) with the same semantics, its ``pages_per_block`` pages per grid block.
      layer: with a cache's per-layer pools (``cache.k_pages``, ``cache.v_pages``: a
        :class:`paged.LayerPools`), the layer to read: an int in ``[0, L)`` (the same as
        passing ``cache.k_pages[layer]``: that layer's own buffer, no copy) or a traced
        integer scalar (clamped into range; ``lax.switch`` over the layers' buffers). A stacked
        ``[L, K, P, C, H]`` array is still read (its layers and heads merged), but a stack is
        one buffer: written and read in one step, XLA copies it (see
        ``benchmarks/bench_decode_scaling.py``); keep pools per layer.
      bias: must be None: this path takes no logit bias (ValueError, naming the
        single-device functions that take one: ringattn.blockwise_attention,
        ringattn.attention_reference, ringattn.dot_product_attention).

    Returns:
      :class:`PagedAttentionOutput` ``(out [B, T, N, H] in q.dtype, lse [B, T, N] float32,
      page_mass [B, N, M] or None)``. A query that sees no key gets ``out = 0``,
      ``lse = -inf`` (``sink`` with sinks).

    Raises:
      ValueError: on inconsistent ranks, shapes, dtypes or options (``paged_attention: <arg>:
        expected ..., got ...``), or an unknown ``impl``; on an eager call, a length past
        ``M * C`` or a slot inside a length without a real page (see the module docs).
      NotImplementedError: any derivative through it (``jax.grad``, ``vjp``, ``jvp``,
        ``jacfwd``): paged attention is forward only; the message names what to train with
        (:func:`ringattn.blockwise_attention` on :func:`paged.gather_kv`'s contiguous K/V).
        Also ``impl="pallas"`` with a :class:`paged.QuantizedPages` pool,
        ``return_page_mass=True``, or (compiled on GPU) a page size or head dim that is not a
        power of two >= 16.

    Example:
      >>> import jax.numpy as jnp
      >>> k_pages = v_pages = jnp.ones((1, 3, 4, 8))
      >>> out, lse, page_mass = paged_attention(jnp.ones((1, 1, 2, 8)), k_pages, v_pages,
      ...                                       jnp.array([[2, 1]]), jnp.array([6]))
      >>> out.shape, float(out[0, 0, 0, 0]), page_mass
      ((1, 1, 2, 8), 1.0, None)
    """
    fn = "paged_attention"
    if isinstance(k_pages, LayerPools) or isinstance(v_pages, LayerPools):
        options = dict(
            q_positions=q_positions, mask=mask, causal=causal, window=window, softcap=softcap,
            scale=scale, sinks=sinks, pages_per_block=pages_per_block,
            return_page_mass=return_page_mass, impl=impl, bias=bias,
        )  # fmt: skip

        def call(k, v):
            return paged_attention(q, k, v, page_table, lengths, **options)

        return read_layer(fn, k_pages, v_pages, layer, call)
    refuse_bias(fn, bias)
    check_array(fn, "q", q, 4, jnp.floating)
    B, T, N, _ = q.shape
    stacked = (k_pages, v_pages)
    k_pages, v_pages, heads, (K, P, C, H) = checked_pools(fn, k_pages, v_pages, layer)
    check_heads(fn, q, K, H, pool_dtype(k_pages))
    check_table(fn, page_table, lengths, B)
    check_table_values(fn, page_table, lengths, num_pages=P, page_size=C)
    check_residual_rows(fn, k_pages, v_pages, B)
    if T < 1:
        raise ValueError(f"{fn}: q: expected at least one query token (T >= 1), got {describe(q)}")
    spec = resolve_mask(fn, mask, causal=causal, window=window, softcap=softcap, scale=scale)
    check_sinks(fn, sinks, N)
    pages_per_block = int_option(fn, "pages_per_block", pages_per_block, minimum=1)
    q_positions = default_q_positions(fn, q_positions, lengths, B, T)
    opts = kernel_options(
        fn, spec, N, H, pages_per_block, page_table.shape[1], bool(return_page_mass)
    )
    variant, interpret = pallas_variant(
        fn, impl, jax.default_backend(), k_pages, bool(return_page_mass)
    )
    table, lengths = jnp.asarray(page_table), jnp.asarray(lengths)
    if variant != "xla":
        cfg = decode_config(fn, opts, C, H, variant, interpret)
        if heads is not None:  # the Pallas kernels take one layer's pools
            k_pages, v_pages = (pool[layer] for pool in stacked)
        args = (q, (k_pages, v_pages), (table, lengths, q_positions), sinks)
        return forward_only(fn, _paged_attention_pallas, *args, cfg=cfg)
    args = (q, (k_pages, v_pages), (table, lengths, q_positions), sinks, heads)
    return forward_only(fn, _paged_attention_impl, *args, opts=opts)
