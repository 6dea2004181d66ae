"""The mask options every attention function takes, validated once, and their semantics.

A query at position ``p`` in segment ``s`` of query head ``n`` sees a key at position ``p'``
in segment ``s'`` iff

* ``s == s'`` (when :class:`SegmentIds` are given: packed documents never see each other),
* ``p' <= p`` (when ``causal``),
* ``p' > p - w_n`` (when a window is given: the ``w_n`` most recent positions, the query's
  own included; ``window`` is one int for every head, or a tuple with one entry per QUERY
  head, ``None`` for a head without a window),
* ``mask[p, p']`` is True (when a static boolean :class:`ringattn.DenseMask` is given; only
  :func:`ringattn.attention_reference` and :func:`ringattn.blockwise_attention` take one).

Positions default to ``arange`` of each sequence (the decode functions default the queries to
the last ``T`` positions of the valid cache instead). A key no query may see has no effect on
any output or gradient, even if it holds NaN or inf.

:func:`resolve_mask` is the one validator: every attention function (here and in ``paged``)
turns its ``mask=`` argument or its keyword sugar ``causal=, window=, softcap=, scale=`` into a
:class:`MaskSpec` with it.
"""

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from ringattn._checks import (
    FloatLike,
    IntLike,
    check_bool,
    check_float,
    check_ids,
    check_int,
    check_qkv,
    describe,
    fail,
)
from ringattn._dense_mask import DenseMask
from ringattn._online_softmax import check_sinks

__all__ = [
    "MaskSpec",
    "Positions",
    "SegmentIds",
    "attention_mask",
    "resolve_mask",
]


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Static mask options (frozen and hashable: usable as a ``jit`` static argument).

    Attributes:
      causal: hide keys at later positions than the query's.
      window: hide keys at positions ``<= p - window`` (``window >= 1``); a tuple gives one
        window per QUERY head (length ``N``; ``None`` entries have no window), so one call
        can mix sliding-window and global heads.
      softcap: if set, logits become ``softcap * tanh(logits / softcap)``; ``> 0``.
      scale: logit scale; ``None`` means ``1 / sqrt(H)``.
      dense: a static :class:`ringattn.DenseMask` ``[T, S]`` over query/key indices, ANDed
        with the rest (only :func:`ringattn.attention_reference` and
        :func:`ringattn.blockwise_attention` take one).

    Numpy scalars are accepted and normalised to Python types; a bad value raises
    ``ValueError("MaskSpec: <field>: expected ..., got ...")``.

    Example:
      >>> MaskSpec(causal=True, window=(None, 128, 128, None)).window
      (None, 128, 128, None)
    """

    # Annotated with what __init__ accepts; __post_init__ stores Python bool / int / float.
    causal: bool | np.bool_ = False
    window: IntLike | tuple[IntLike | None, ...] | None = None
    softcap: FloatLike | None = None
    scale: FloatLike | None = None
    dense: DenseMask | None = None

    def __post_init__(self):
        fn = "MaskSpec"
        if self.dense is not None and not isinstance(self.dense, DenseMask):
            raise fail(fn, "dense", "a ringattn.DenseMask or None", describe(self.dense))
        set_ = lambda name, value: object.__setattr__(self, name, value)
        set_("causal", check_bool(fn, "causal", self.causal))
        window = self.window
        if isinstance(window, (tuple, list)):
            if not window:
                raise fail(fn, "window", "a non-empty tuple (one entry per query head)", "()")
            window = tuple(
                None if w is None else check_int(fn, f"window[{i}]", w, minimum=1)
                for i, w in enumerate(window)
            )
        elif window is not None:
            window = check_int(fn, "window", window, minimum=1)
        set_("window", window)
        if self.softcap is not None:
            set_("softcap", check_float(fn, "softcap", self.softcap, positive=True))
        if self.scale is not None:
            set_("scale", check_float(fn, "scale", self.scale))

    @property
    def per_head(self) -> bool:
        """True when the window differs between query heads."""
        return isinstance(self.window, tuple) and len(set(self.window)) > 1

    @property
    def uniform_window(self) -> int | None:
        """The window of every head when they share one (a tuple of equal entries included)."""
        if isinstance(self.window, tuple):
            if self.per_head:
                raise ValueError("MaskSpec.uniform_window: the heads have different windows")
            return self.window[0]
        return self.window

    def windows(self, num_heads: int) -> tuple[int | None, ...]:
        """The window of each of ``num_heads`` query heads (``None``: no window)."""
        if isinstance(self.window, tuple):
            return self.window
        return (self.window,) * num_heads

    @property
    def widest_window(self) -> int | None:
        """The widest window over heads (``None`` if some head has none): decides liveness."""
        if isinstance(self.window, tuple):
            return None if None in self.window else max(self.window)
        return self.window

    @property
    def narrowest_window(self) -> int | None:
        """The narrowest window over heads: decides whether a block needs no mask."""
        if isinstance(self.window, tuple):
            return min(w for w in self.window if w is not None)
        return self.window

    def check_dense(self, fn: str, T: int, S: int) -> None:
        if self.dense is None:
            return
        if self.dense.shape != (T, S):
            raise fail(
                fn, "mask.dense", f"a DenseMask of shape (T, S) = {(T, S)}", self.dense.shape
            )

    def check_heads(self, fn: str, num_heads: int) -> None:
        if isinstance(self.window, tuple) and len(self.window) != num_heads:
            raise fail(
                fn,
                "window",
                f"a tuple of one window per query head (length N={num_heads})",
                f"length {len(self.window)}",
            )

    def scale_for(self, head_dim: int) -> float:
        """The logit scale: ``scale``, or ``1 / sqrt(head_dim)``."""
        return self.scale if self.scale is not None else 1.0 / float(np.sqrt(head_dim))


class SegmentIds(NamedTuple):
    """Segment ids of packed documents: a query sees only keys of its own segment.

    A pytree of two int arrays, so it passes through ``jit`` and ``vmap`` as arrays.

    Attributes:
      q: ``[B, T]`` int segment id of each query.
      kv: ``[B, S]`` int segment id of each key.
    """

    q: Int[Array, "B T"]
    kv: Int[Array, "B S"]


class Positions(NamedTuple):
    """Global positions of queries and keys (causal and window masks compare them).

    A pytree of two int arrays (either may be ``None``: that side keeps its default).

    Attributes:
      q: ``[B, T]`` int position of each query, or None.
      kv: ``[B, S]`` int position of each key, or None.
    """

    q: Int[Array, "B T"] | None
    kv: Int[Array, "B S"] | None


def resolve_mask(
    fn: str,
    mask: MaskSpec | None = None,
    *,
    causal: bool | np.bool_ | None = None,
    window: IntLike | tuple[IntLike | None, ...] | None = None,
    softcap: FloatLike | None = None,
    scale: FloatLike | None = None,
    default_causal: bool = False,
    dense_ok: bool = False,
) -> MaskSpec:
    """The one validator of mask options: ``mask=`` or keyword sugar, never both.

    Args:
      fn: the public function's name (for error messages).
      mask: a :class:`MaskSpec`, or None to build one from the keywords.
      causal: sugar for ``MaskSpec(causal=...)``; None means ``default_causal``.
      window: sugar for ``MaskSpec(window=...)``.
      softcap: sugar for ``MaskSpec(softcap=...)``.
      scale: sugar for ``MaskSpec(scale=...)``.
      default_causal: the function's default for ``causal`` (``paged`` defaults to True).
      dense_ok: whether the caller supports ``MaskSpec(dense=DenseMask(...))``.

    Returns:
      The validated :class:`MaskSpec`.

    Raises:
      ValueError: ``fn: mask: ...`` if both ``mask`` and a keyword are given or ``mask`` is not
        a MaskSpec; ``fn: <field>: ...`` for a bad option value.
      NotImplementedError: a DenseMask where ``dense_ok`` is False.

    Example:
      >>> resolve_mask("f", causal=True, window=8)  # doctest: +NORMALIZE_WHITESPACE
      MaskSpec(causal=True, window=8, softcap=None, scale=None, dense=None)
    """
    sugar = dict(causal=causal, window=window, softcap=softcap, scale=scale)
    given = [name for name, value in sugar.items() if value is not None]
    if mask is not None:
        if not isinstance(mask, MaskSpec):
            raise fail(fn, "mask", "a ringattn.MaskSpec or None", describe(mask))
        if given:
            raise fail(
                fn, "mask", "either mask= or the keywords causal/window/softcap/scale", given
            )
        if mask.dense is not None and not dense_ok:
            raise NotImplementedError(
                f"{fn}: mask: a DenseMask is supported by attention_reference and "
                "blockwise_attention only"
            )
        return mask
    if causal is None:
        causal = default_causal
    try:
        return MaskSpec(causal=causal, window=window, softcap=softcap, scale=scale)
    except ValueError as err:
        # The message names fn, in its advice on binding a traced option too.
        message = str(err).removeprefix("MaskSpec: ").replace("(MaskSpec,", f"({fn},")
        raise ValueError(f"{fn}: {message}") from None


def _check_pair(fn: str, arg: str, value, cls):
    if value is not None and not isinstance(value, cls):
        raise fail(fn, arg, f"a ringattn.{cls.__name__} or None", describe(value))


def resolve_ids(
    fn: str, B: int, T: int, S: int, segment_ids, positions
) -> tuple[SegmentIds | None, Positions]:
    """Validates segment ids and positions (``[B, T]`` / ``[B, S]`` ints) as int32.

    Missing positions stay None (each caller has its own default).
    """
    _check_pair(fn, "segment_ids", segment_ids, SegmentIds)
    _check_pair(fn, "positions", positions, Positions)
    if segment_ids is not None:
        segment_ids = SegmentIds(
            q=check_ids(fn, "segment_ids.q", segment_ids.q, (B, T)),
            kv=check_ids(fn, "segment_ids.kv", segment_ids.kv, (B, S)),
        )
    q_pos = kv_pos = None
    if positions is not None:
        if positions.q is not None:
            q_pos = check_ids(fn, "positions.q", positions.q, (B, T))
        if positions.kv is not None:
            kv_pos = check_ids(fn, "positions.kv", positions.kv, (B, S))
    return segment_ids, Positions(q_pos, kv_pos)


def arange_positions(B: int, length: int, start=0):
    """``[B, length]`` int32 ``start + arange(length)`` (``start`` a scalar or ``[B]``)."""
    start = jnp.asarray(start, jnp.int32)
    if start.ndim:
        start = start[:, None]
    return jnp.broadcast_to(start + jnp.arange(length, dtype=jnp.int32), (B, length))


def attention_mask(
    q_positions: Int[Array | np.ndarray, "B T"],
    kv_positions: Int[Array | np.ndarray, "B S"],
    *,
    causal: bool | np.bool_ = False,
    window: IntLike | None = None,
    segment_ids: SegmentIds | None = None,
) -> Bool[Array, "B T S"]:
    """The boolean visibility mask ``[B, T, S]`` (True = the query sees the key).

    Args:
      q_positions: ``[B, T]`` integer positions of the queries.
      kv_positions: ``[B, S]`` integer positions of the keys.
      causal: hide keys at positions after the query's.
      window: one window for every head: hide keys at positions ``<= p - window``.
      segment_ids: :class:`SegmentIds`, or None.

    Returns:
      ``[B, T, S]`` bool.

    Raises:
      ValueError: on a bad window or segment ids of the wrong type.

    Options are static: ``jax.jit(functools.partial(attention_mask, causal=True))``.

    Example:
      >>> import jax.numpy as jnp
      >>> attention_mask(jnp.array([[1]]), jnp.arange(3)[None], causal=True).tolist()
      [[[True, True, False]]]
    """
    spec = resolve_mask("attention_mask", causal=causal, window=window)
    if spec.per_head:
        raise fail("attention_mask", "window", "one int for every head", spec.window)
    _check_pair("attention_mask", "segment_ids", segment_ids, SegmentIds)
    return visibility(jnp.asarray(q_positions), jnp.asarray(kv_positions), spec, segment_ids, None)


def visibility(q_pos, kv_pos, spec: MaskSpec, segment_ids, head_windows):
    """Mask from positions: ``[B, T, S]``, or ``[B, N, T, S]`` with per-head windows.

    ``head_windows`` is ``spec.windows(N)`` when ``spec.per_head`` (else ignored).
    """
    qp = q_pos[:, :, None]
    kp = kv_pos[:, None, :]
    mask = jnp.ones(jnp.broadcast_shapes(qp.shape, kp.shape), bool)
    if spec.causal:
        mask &= kp <= qp
    if segment_ids is not None:
        mask &= segment_ids.q[:, :, None] == segment_ids.kv[:, None, :]
    if spec.dense is not None:
        mask &= jnp.asarray(spec.dense.array)[None]
    if spec.per_head:
        w = np.asarray([0 if x is None else x for x in head_windows], np.int32)
        has = np.asarray([x is not None for x in head_windows])
        in_window = kp[:, None] > qp[:, None] - w[None, :, None, None]
        return mask[:, None] & (in_window | ~has[None, :, None, None])
    if spec.uniform_window is not None:
        mask &= kp > qp - spec.uniform_window
    return mask


def prepare(
    fn: str,
    q,
    k,
    v,
    *,
    mask,
    causal,
    window,
    softcap,
    scale,
    segment_ids,
    positions,
    sinks,
    default_causal: bool = False,
    dense_ok: bool = False,
    decode: bool = False,
):
    """The checks every attention entry point runs: shapes, mask, ids, sinks.

    ``dense_ok``: whether the caller supports :class:`ringattn.DenseMask` (else
    NotImplementedError). ``decode``: the caller's default query positions are the last ``T``
    of the valid cache (the decode functions); otherwise they are ``arange(T)``, and
    :func:`check_query_placement` refuses to guess where a query block of another length
    than the keys sits.

    Returns ``((B, T, S, N, K, H), MaskSpec, SegmentIds | None, Positions)``.
    """
    dims = check_qkv(fn, q, k, v)
    B, T, S, N, K, H = dims
    spec = resolve_mask(
        fn,
        mask,
        causal=causal,
        window=window,
        softcap=softcap,
        scale=scale,
        default_causal=default_causal,
        dense_ok=dense_ok,
    )
    spec.check_heads(fn, N)
    spec.check_dense(fn, T, S)
    seg, pos = resolve_ids(fn, B, T, S, segment_ids, positions)
    check_sinks(fn, sinks, N)
    if not decode:
        check_query_placement(fn, B, T, S, spec, pos)
    return dims, spec, seg, pos


def check_query_placement(fn: str, B: int, T: int, S: int, spec: MaskSpec, pos: Positions) -> None:
    """``T != S`` queries under a causal or window mask need ``positions.q``.

    With the default positions ``arange(T)`` a query block shorter than the keys sits at the
    FIRST positions (a 1-token query sees only key 0), while ``paged`` and the decode
    functions put it at the LAST; rather than pick one in silence, the arange-default entry
    points ask. ``T == S``, an empty batch or sequence (``B``, ``T`` or ``S`` zero), a mask that does not compare positions
    (no causal, no window) and given query positions are unaffected.
    """
    windowed = spec.window is not None and (
        not isinstance(spec.window, tuple) or any(w is not None for w in spec.window)
    )
    if T == S or 0 in (B, T, S) or pos.q is not None or not (spec.causal or windowed):
        return
    what = "causal" if spec.causal else "window"
    raise ValueError(
        f"{fn}: positions: expected ringattn.Positions(q=...) for a {what} mask over T={T} "
        f"queries and S={S} keys (T != S: where the queries sit is ambiguous), got "
        f"{'None' if pos.kv is None else 'only positions.kv'}: pass positions="
        f"ringattn.Positions(q=S - T + arange(T), kv=None) for queries at the end of the "
        f"keys (decode, chunked prefill) or q=arange(T) for the first positions"
    )
