"""One entry point for attention over a sequence-sharded device mesh, four strategies.

:func:`sharded_attention` takes GLOBAL arrays whose sequence axis is (or is to be) sharded over
a mesh axis, builds the ``jax.shard_map`` and runs one of:

* ``"ring"``: K/V blocks travel a ring of devices (:func:`ringattn.ring_attention_per_shard`); memory per
  device stays linear in the local shard; ``n - 1`` hops of ``2 * B * S/n * K * H`` elements
  (int8 / fp8 values plus a float32 scale per token and kv head with ``hop_format``).
* ``"allgather"``: K/V (with positions and segment ids) are all-gathered, queries stay local
  (the Llama-3 context-parallel form). One collective of the whole K/V; the gradient of the
  all-gather is a reduce-scatter of dK/dV.
* ``"ulysses"``: two all-to-alls trade the sequence sharding for a head sharding, each device
  runs full-sequence attention on ``N/n`` query heads, and the output goes back the same way
  (DeepSpeed-Ulysses). The degree is limited by the number of heads.
* ``"usp"``: Ulysses over one mesh axis and ring over another (2D, "unified sequence
  parallelism", yunchang).

All four give the result of :func:`ringattn.attention_reference` on the un-permuted global
sequence. Local compute is :func:`ringattn.blockwise_attention` (memory-linear, custom VJP);
with ``impl="pallas"`` the Pallas kernels of :mod:`ringattn._pallas` (per ring hop for
``"ring"`` and ``"usp"``, once per shard for ``"allgather"`` and ``"ulysses"``).
Sinks join the softmax once, at the end of each shard's computation; keys no query may see
have no effect in any strategy, even if they hold NaN or inf.
"""

import dataclasses
import functools
import math

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from ringattn._blocks import MaskIds
from ringattn._blockwise import BlockSizes, empty_attention, resolve_impl
from ringattn._checks import FloatLike, IntLike, fail, fold_traced_scale, refuse_bias
from ringattn._formats import KVFormat
from ringattn._hop_format import check_hop_format
from ringattn._layout import LAYOUTS, check_layout_positions, to_layout
from ringattn._online_softmax import AttentionOutput, apply_sinks
from ringattn._options import MaskSpec, Positions, SegmentIds, prepare
from ringattn._ring import check_pallas_options
from ringattn._strategies import Plan, body, default_positions

__all__ = ["STRATEGIES", "sharded_attention"]

STRATEGIES = ("ring", "allgather", "ulysses", "usp")


_FN = "sharded_attention"


def _check_axis(mesh, name, what: str) -> int:
    if not isinstance(name, str):
        raise fail(_FN, what, "a mesh axis name (str)", repr(name))
    if name not in mesh.axis_names:
        raise fail(_FN, what, f"an axis of the mesh {mesh.axis_names}", repr(name))
    return int(mesh.shape[name])


def _ulysses_repeat(N: int, K: int, n: int, what: str) -> int:
    """How often each kv head is repeated so that ``n`` devices can split the heads."""
    if N % n != 0:
        raise fail(
            _FN,
            "q",
            f"query heads per device N divisible by the Ulysses degree {n} of {what} "
            "(the all-to-all splits heads across devices)",
            f"N={N}",
        )
    # K' = lcm(K, n) divides N because K | N and n | N; each query head keeps its kv head.
    return n // math.gcd(K, n)


@functools.partial(jax.jit, static_argnums=(5,))
def _sharded(q, k, v, ids: MaskIds, sinks, plan: Plan):
    """``ids``: the global positions (None: defaults) and segment ids, no windows."""
    B, T = q.shape[:2]
    S = k.shape[1]
    # Ring and USP let the ring derive default positions from the layout (and the shard index);
    # the other strategies gather positions, so they get explicit ones.
    if plan.strategy in ("allgather", "ulysses"):
        if ids.q_pos is None:
            ids = ids._replace(q_pos=default_positions(B, T, plan))
        if ids.kv_pos is None:
            ids = ids._replace(kv_pos=default_positions(B, S, plan))
    args = (q, k, v, ids, sinks)
    sharded = lambda x: plan.spec(x.ndim)
    sinks_spec = None if sinks is None else P(plan.head_axis)
    specs = (*(jax.tree.map(sharded, x) for x in args[:-1]), sinks_spec)
    if any(t == AxisType.Explicit for t in plan.mesh.axis_types):
        # Explicit axes: shard_map wants the inputs already laid out as in_specs say.
        reshard = lambda x, s: jax.sharding.reshard(x, NamedSharding(plan.mesh, s))
        args = tuple(jax.tree.map(reshard, x, s) for x, s in zip(args, specs, strict=True))
    fn = jax.shard_map(
        functools.partial(body, plan=plan),
        mesh=plan.mesh,
        in_specs=specs,
        out_specs=AttentionOutput(plan.spec(4), plan.spec(3)),
        check_vma=True,
    )
    return fn(*args)


def _concrete(x) -> np.ndarray | None:
    """``x`` as a host array if it can be read here (not traced, all shards addressable)."""
    if isinstance(x, jax.core.Tracer) or not getattr(x, "is_fully_addressable", True):
        return None
    return np.asarray(x)


def _shard_ranges(pos: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``[B, n]`` min and max position of each row's chunk on each ring shard (``[B, L]``)."""
    chunks = pos.reshape(pos.shape[0], n, -1).astype(np.int64)
    return chunks.min(axis=2), chunks.max(axis=2)


def _ring_hops(given: Positions | None, plan: Plan, B: int, T: int, S: int) -> int | None:
    """The ring hops that can reach a visible key, from concrete positions; None: every hop.

    At hop ``t`` ring member ``d`` holds the keys of member ``(d - t) % n``. A hop is live if
    for some row and some ``d`` the ranges of the row's query positions ``[qmin, qmax]`` on
    ``d`` and of its arriving key positions ``[kmin, kmax]`` allow a visible pair: ``kmin <=
    qmax`` when causal, and ``kmax > qmin - w`` for the widest window ``w``. Ranges only
    over-approximate the visible pairs, so a hop this drops holds no visible key; the ring
    runs hops ``1 .. t_max``, where ``t_max`` is the last live one. Positions left to the
    layout's defaults are computed here; traced positions (an outer ``jit``) cannot be
    read, and every hop runs.
    """
    n = plan.layout_shards
    mask = plan.mask
    if plan.strategy not in ("ring", "usp") or n == 1:
        return None
    if not mask.causal and mask.widest_window is None:
        return None  # every key is visible to some query on every hop
    read = []
    for x, L in ((None if given is None else given.q, T), (None if given is None else given.kv, S)):
        if x is None:  # the layout's default positions
            with jax.ensure_compile_time_eval():  # host values even under an outer trace
                x = to_layout(np.arange(L, dtype=np.int32)[None], plan.layout, num_shards=n)
        x = _concrete(x)
        if x is None:
            return None
        read.append(_shard_ranges(np.broadcast_to(x, (B, L)), n))
    (qmin, qmax), (kmin, kmax) = read
    live = 0
    for t in range(1, n):
        src = (np.arange(n) - t) % n  # whose keys each member holds at hop t
        ok = np.ones(qmin.shape, dtype=bool)
        if mask.causal:
            ok &= kmin[:, src] <= qmax
        if mask.widest_window is not None:
            ok &= kmax[:, src] > qmin - mask.widest_window
        if ok.any():
            live = t
    return live


def sharded_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    mesh: jax.sharding.Mesh,
    seq_axis: str | tuple[str, str],
    strategy: str = "ring",
    layout: str = "contiguous",
    batch_axis: str | None = None,
    head_axis: str | None = None,
    mask: MaskSpec | None = None,
    causal: bool | np.bool_ | None = None,
    window: IntLike | tuple[IntLike | None, ...] | None = None,
    softcap: FloatLike | None = None,
    scale: FloatLike | Float[Array, ""] | None = None,
    segment_ids: SegmentIds | None = None,
    positions: Positions | None = None,
    sinks: Float[Array, " N"] | None = None,
    block_sizes: BlockSizes | None = None,
    hop_format: KVFormat | str | None = None,
    impl: str = "auto",
    bias: Float[Array, "..."] | None = None,
) -> AttentionOutput:
    """Exact attention on global arrays whose sequence is sharded over a mesh axis.

    The inputs are GLOBAL arrays already in ``layout`` order along the sequence (call
    :func:`ringattn.to_layout` once at the data boundary on the data and on their positions,
    which a permuted layout under a causal or window mask requires, and
    :func:`ringattn.from_layout` on the result). The function builds a ``jax.shard_map`` (``check_vma=True``) that shards the
    batch over ``batch_axis``, the sequence over ``seq_axis`` and the heads (``N`` and ``K``
    together) over ``head_axis``, and works on meshes with ``Auto`` or ``Explicit`` axes (with
    Explicit axes, inputs laid out differently are resharded first). Every strategy gives the
    result of :func:`ringattn.attention_reference` on the un-permuted sequence, forward and
    gradients. Sinks join each row's softmax once. Keys no query may see have no effect,
    even if they hold NaN or inf. To ``jit`` with options (the mesh included), bind them:
    ``jax.jit(functools.partial(sharded_attention, mesh=mesh, seq_axis="seq", causal=True))``.

    Strategies:
      * ``"ring"``: :func:`ringattn.ring_attention_per_shard` on each shard (only K/V heads travel).
      * ``"allgather"``: all-gather K/V, positions and segment ids over ``seq_axis``, then
        local blockwise attention of the local queries against the whole sequence.
      * ``"ulysses"``: all-to-all from sequence- to head-sharding, local full-sequence
        attention, all-to-all back. Query heads per device ``N' = N / size(head_axis)`` must
        be divisible by the Ulysses degree ``n``. If kv heads ``K'`` are not, each kv head is
        repeated ``r = n / gcd(K', n)`` times (``K' * r = lcm(K', n)``; copies stay adjacent,
        so every query head keeps its kv head), at ``r`` times the K/V traffic.
      * ``"usp"``: ``seq_axis = (ulysses_axis, ring_axis)``: the sequence is sharded over both
        (ring axis major), Ulysses over the first, ring over the second. ``layout`` is the
        ring's, over ``size(ring_axis)`` shards.

    Args:
      q: ``[B, T, N, H]`` global queries in layout order.
      k: ``[B, S, K, H]`` global keys in layout order; ``N % K == 0``.
      v: ``[B, S, K, H]`` global values.
      mesh: the device mesh.
      seq_axis: mesh axis the sequence is sharded over; for ``"usp"`` a pair
        ``(ulysses_axis, ring_axis)``.
      strategy: one of ``"ring"``, ``"allgather"``, ``"ulysses"``, ``"usp"``.
      layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"`` (see :func:`ringattn.to_layout`).
      batch_axis: mesh axis the batch is sharded over, or None.
      head_axis: mesh axis the heads are sharded over, or None.
      mask: a :class:`ringattn.MaskSpec`, or its fields as the keywords below (not both).
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      window: sliding window (``>= 1``): hide keys at positions ``<= p - window``; a tuple
        gives one window per query head.
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``. A float, or a float JAX scalar that
        may be traced (a temperature trained with the model, under ``jit`` / ``grad``): it
        then multiplies ``q`` (in ``q``'s dtype) and the kernel runs at scale 1, so the
        logits are ``scale * q k^T`` up to rounding (softcap applies after, as always) and
        ``jax.grad`` reaches ``scale``. Only this keyword takes one: a ``MaskSpec`` is
        static.
      segment_ids: :class:`ringattn.SegmentIds` ``(q [B, T], kv [B, S])`` in layout order.
      positions: :class:`ringattn.Positions` (global positions, in the order of the
        inputs). Required (both sides) for ``"zigzag"`` / ``"striped"`` under a causal or
        window mask: a permutation is not visible in the data, so the positions say where
        each token truly is and any order then gives the right result (pass
        ``to_layout(arange(T))`` with permuted inputs; computed outside ``jit`` or bound
        with ``functools.partial`` they stay concrete, and the hop pruning below works as
        with the old defaults). Otherwise default ``arange``; with ``T != S`` under a causal
        or window mask ``positions.q`` is required. Strategies
        ``"ring"`` and ``"usp"`` with ``causal`` and / or a ``window`` stop the ring after
        the last hop that can bring a visible key, read off each row's per-shard position
        ranges (any layout; default or concrete positions). Traced positions (an argument of an outer
        ``jit``) cannot be read: every hop runs (same result, more transfers).
      sinks: ``[N]`` per-head sink logit, or None.
      block_sizes: :class:`ringattn.BlockSizes` of the local kernel.
      hop_format: ``"ring"`` and ``"usp"`` only: None (exact), or ``KVFormat("int8")`` /
        ``KVFormat("fp8")`` (or the shorthand ``"int8"`` / ``"fp8"``) ring hops carrying per-token, per-kv-head quantized K/V (see
        :func:`ringattn.ring_attention_per_shard`: the result is exact attention over the
        dequantized K/V, ``dk``/``dv`` straight-through).
      impl: ``"auto"`` (the XLA kernels for now, on every backend), ``"xla"`` or
        ``"pallas"``: the Pallas kernels (Triton on GPU, Mosaic on TPU; Pallas's TPU
        interpret mode on CPU, slow, not under ``jax.checkpoint``) for every ring hop (``"ring"``, ``"usp"``, forward and backward) and for
        the local attention of ``"allgather"`` and ``"ulysses"``. ``block_sizes`` None then
        takes the Pallas defaults. Not with ``hop_format``.
      bias: must be None: this path takes no logit bias (ValueError, naming the
        single-device functions that take one: ringattn.blockwise_attention,
        ringattn.attention_reference, ringattn.dot_product_attention).

    Returns:
      :class:`ringattn.AttentionOutput`: ``out [B, T, N, H]`` in ``q.dtype`` and layout
      order, sharded like ``q``, and ``lse [B, T, N]`` float32. Rows that see no key give
      zeros.

    Raises:
      ValueError: on an unknown strategy or layout; an axis name missing from the mesh or used
        twice; a ``seq_axis`` of the wrong form; inconsistent q/k/v shapes or dtypes; ``T`` or
        ``S`` not divisible by the number of sequence shards (by twice the layout shards for
        ``"zigzag"``); batch or heads not divisible by their axis sizes; query heads not
        divisible by the Ulysses degree; ``T != S`` under a causal or window mask without
        ``positions.q``, or ``"zigzag"`` / ``"striped"`` under one without both positions;
        bad segment ids, positions, window, softcap, scale,
        block sizes or ``hop_format``; an unknown ``impl``.
      NotImplementedError: a ``hop_format`` with strategy ``"allgather"`` or ``"ulysses"``
        (no ring hops to quantize) or with ``impl="pallas"``; a ``hop_format`` KVFormat of a
        kind hops do not carry (int4, kivi2); ``impl="pallas"`` on a TPU or
        with block sizes the compiled kernel cannot take.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import AxisType, Mesh
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("seq",), axis_types=(AxisType.Auto,))
      >>> q = jax.random.normal(jax.random.key(0), (1, 64, 4, 16))
      >>> kv = jax.random.normal(jax.random.key(1), (1, 64, 2, 16))
      >>> out, lse = sharded_attention(q, kv, kv, mesh=mesh, seq_axis="seq",
      ...                              strategy="allgather", causal=True)
      >>> out.shape
      (1, 64, 4, 16)

    References:
      Liu et al., "Ring Attention with Blockwise Transformers", 2023; Jacobs et al.,
      "DeepSpeed Ulysses", 2023; Fang & Zhao, "USP: A Unified Sequence Parallelism Approach",
      2024; Llama 3 team, "The Llama 3 Herd of Models" (context parallelism), 2024.
    """
    refuse_bias(_FN, bias)
    q, scale = fold_traced_scale(_FN, q, scale)
    (B, T, S, N, K, H), spec, seg, pos = prepare(
        _FN,
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
    )
    if not isinstance(mesh, jax.sharding.Mesh):
        raise fail(_FN, "mesh", "a jax.sharding.Mesh", type(mesh).__name__)
    if strategy not in STRATEGIES:
        raise fail(_FN, "strategy", f"one of {STRATEGIES}", repr(strategy))
    if layout not in LAYOUTS:
        raise fail(_FN, "layout", f"one of {LAYOUTS}", repr(layout))
    check_layout_positions(_FN, layout, spec, pos, per_shard=False)
    hop_format = check_hop_format(_FN, hop_format)
    impl = resolve_impl(_FN, impl, jax.default_backend())
    check_pallas_options(_FN, impl, hop_format)
    if hop_format is not None and strategy not in ("ring", "usp"):
        raise NotImplementedError(
            f"{_FN}: hop_format: quantized hops are for strategies 'ring' and 'usp', "
            f"got strategy {strategy!r}"
        )

    ulysses_axis = None
    if strategy == "usp":
        if not (isinstance(seq_axis, (tuple, list)) and len(seq_axis) == 2):
            raise fail(
                _FN, "seq_axis", "(ulysses_axis, ring_axis) for strategy 'usp'", repr(seq_axis)
            )
        ulysses_axis, ring_axis = seq_axis
        n_ulysses = _check_axis(mesh, ulysses_axis, "seq_axis[0] (ulysses axis)")
        n_ring = _check_axis(mesh, ring_axis, "seq_axis[1] (ring axis)")
        seq_axis = ring_axis
    else:
        if not isinstance(seq_axis, str):
            raise fail(
                _FN, "seq_axis", f"one mesh axis name for strategy {strategy!r}", repr(seq_axis)
            )
        n_ring = _check_axis(mesh, seq_axis, "seq_axis")
        n_ulysses = 1
    n_batch = 1 if batch_axis is None else _check_axis(mesh, batch_axis, "batch_axis")
    n_head = 1 if head_axis is None else _check_axis(mesh, head_axis, "head_axis")
    used = [a for a in (seq_axis, ulysses_axis, batch_axis, head_axis) if a is not None]
    if len(set(used)) != len(used):
        raise fail(_FN, "seq_axis, batch_axis, head_axis", "distinct mesh axes", used)

    n_seq = n_ring * n_ulysses
    for arg, name, length in (("q", "T", T), ("k", "S", S)):
        if length % n_seq != 0:
            raise fail(
                _FN,
                arg,
                f"a sequence length divisible by {n_seq} sequence shards",
                f"{name}={length}",
            )
        if layout == "zigzag" and length % (2 * n_ring) != 0:
            raise fail(
                _FN,
                arg,
                f"a sequence length divisible by 2 x {n_ring} shards = {2 * n_ring} "
                "for layout 'zigzag'",
                f"{name}={length}",
            )
    if B % n_batch != 0:
        raise fail(
            _FN,
            "q",
            f"a batch divisible by the size {n_batch} of batch_axis {batch_axis!r}",
            f"B={B}",
        )
    if N % n_head != 0 or K % n_head != 0:
        raise fail(
            _FN,
            "q, k",
            f"query and kv heads divisible by the size {n_head} of head_axis {head_axis!r}",
            f"N={N}, K={K}",
        )
    kv_repeat = 1
    if strategy == "ulysses":
        kv_repeat = _ulysses_repeat(N // n_head, K // n_head, n_ring, "strategy 'ulysses'")
    elif strategy == "usp":
        kv_repeat = _ulysses_repeat(N // n_head, K // n_head, n_ulysses, "strategy 'usp'")

    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise fail(_FN, "block_sizes", "a ringattn.BlockSizes or None", type(block_sizes).__name__)
    if block_sizes is None and strategy == "allgather" and layout == "zigzag" and impl == "xla":
        # The local queries are two chunks far apart: query blocks no longer than a chunk keep
        # each block's positions narrow, so causal block skipping still works.
        default = BlockSizes()
        block_sizes = BlockSizes(block_q=min(default.block_q, T // n_ring // 2))
    if B == 0 or T == 0 or S == 0:
        return apply_sinks(*empty_attention(q, k, v), sinks)

    plan = Plan(
        mesh=mesh,
        strategy=strategy,
        layout=layout,
        seq_axis=seq_axis,
        ulysses_axis=ulysses_axis,
        batch_axis=batch_axis,
        head_axis=head_axis,
        layout_shards=n_ring,
        kv_repeat=kv_repeat,
        mask=spec,
        block_sizes=block_sizes,
        num_heads=N,
        hop_format=hop_format,
        impl=impl,
    )
    plan = dataclasses.replace(plan, ring_hops=_ring_hops(positions, plan, B, T, S))
    qs, ks = (None, None) if seg is None else seg
    return _sharded(q, k, v, MaskIds(pos.q, pos.kv, qs, ks), sinks, plan)
