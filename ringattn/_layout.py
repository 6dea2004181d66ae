"""Sequence layouts over a ring of shards: which global tokens each shard holds.

Causal ring attention on the plain ``"contiguous"`` layout is unbalanced: shard ``i`` holds
tokens ``[i T, (i + 1) T)`` (``T`` tokens per shard) and its queries see ``i + 1`` of the ``n`` key blocks, so the last
shard works ``n`` times as hard as the first and the ring runs at the speed of the slowest.
Two permutations of the global sequence, applied once to the inputs (and undone on the
output), give every shard the same causal work:

* ``"zigzag"`` (dual-chunk swap): the sequence is cut in ``2n`` equal chunks and shard ``i``
  holds chunks ``i`` and ``2n - 1 - i``, an early and a late one.
* ``"striped"``: shard ``i`` holds tokens ``i, i + n, i + 2n, ...``.

The attention functions take *global* positions, which :func:`shard_positions` computes for
a shard (also from a traced ``jax.lax.axis_index``), so masks keep the meaning they have on
the un-permuted sequence.

A permutation is invisible in the data: tokens in natural order handed to a function told
``layout="zigzag"`` look the same as permuted ones. So under a causal or window mask the
attention functions do not derive positions from a permuted layout: they ask for
``positions=Positions(q, kv)`` (:func:`check_layout_positions`), permuted together with the
data (``to_layout(arange(T))``, or :func:`shard_positions` per shard). The positions then
say where each token truly is, and the result is right whatever order the tokens are in,
as long as data and positions are permuted alike (a ``to_layout`` forgotten on both costs
balance, never correctness). :func:`from_layout` cannot tell either whether its input is in layout order
(see its docstring).

References:
  Brandon et al., "Striped Attention: Faster Ring Attention for Causal Transformers", 2023;
  zhuzilin/ring-flash-attention (zigzag); Liu et al., "Ring Attention with Blockwise
  Transformers for Near-Infinite Context", 2023.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int, Shaped

from ringattn._checks import IntLike, check_int, fail

__all__ = ["LAYOUTS", "from_layout", "shard_positions", "to_layout"]

LAYOUTS = ("contiguous", "zigzag", "striped")


def _check_layout(fn: str, layout) -> None:
    if layout not in LAYOUTS:
        raise fail(fn, "layout", f"one of {LAYOUTS}", repr(layout))


def check_layout_positions(fn: str, layout: str, spec, positions, *, per_shard: bool) -> None:
    """A permuted layout under a causal or window mask needs both positions (module docs).

    ``positions``: the validated :class:`ringattn.Positions` (either side None if not given).
    ``"contiguous"`` and masks that compare no positions are unaffected.
    """
    windowed = spec.window is not None and (
        not isinstance(spec.window, tuple) or any(w is not None for w in spec.window)
    )
    if layout == "contiguous" or not (spec.causal or windowed):
        return
    missing = [side for side in ("q", "kv") if getattr(positions, side) is None]
    if not missing:
        return
    what = "causal" if spec.causal else "window"
    how = (
        f"ringattn.shard_positions({layout!r}, jax.lax.axis_index(seq_axis), n, T) "
        f"broadcast to [B, T]"
        if per_shard
        else f"ringattn.to_layout(arange(T) broadcast to [B, T], {layout!r}, num_shards=n)"
    )
    raise ValueError(
        f"{fn}: positions: expected ringattn.Positions(q=..., kv=...) for layout {layout!r} "
        f"with a {what} mask (the order of the tokens is not visible in the data; the "
        f"positions say where each one truly is), got positions.{' and .'.join(missing)} "
        f"None: pass {how} for data permuted with to_layout, or arange(T) for data in "
        f"natural order"
    )


def _check_sequence(fn: str, x, layout: str, num_shards, axis) -> tuple[int, int, int]:
    """Validates ``x``; returns ``(normalised axis, sequence length, num_shards)``."""
    _check_layout(fn, layout)
    num_shards = check_int(fn, "num_shards", num_shards, minimum=1)
    if not hasattr(x, "shape") or not hasattr(x, "ndim"):
        raise fail(fn, "x", "an array", type(x).__name__)
    axis = check_int(fn, "axis", axis)
    if not -x.ndim <= axis < x.ndim:
        raise fail(fn, "axis", f"an int in [{-x.ndim}, {x.ndim})", axis)
    axis %= x.ndim
    length = x.shape[axis]
    chunks = 2 * num_shards if layout == "zigzag" else num_shards
    if length % chunks != 0:
        what = "2 × num_shards" if layout == "zigzag" else "num_shards"
        raise fail(
            fn,
            "x",
            f"a sequence length (axis {axis}) divisible by {what} = {chunks} for layout {layout!r}",
            length,
        )
    return axis, length, num_shards


def _along_replicated(x, axis: int):
    """``x`` with ``axis`` gathered if it is split over Explicit mesh axes, and the function
    that splits a result of the same shape back the same way (identity otherwise).

    The layout permutations move tokens across shards, so on an explicitly sharded sequence
    they need the sequence whole: reshaping it in place is ambiguous to JAX's sharding types.
    """
    sharding = jax.typeof(x).sharding
    spec = getattr(sharding, "spec", None)
    if spec is None or len(spec) <= axis or spec[axis] is None:
        return x, lambda y: y
    whole = sharding.update(spec=P(*(None if i == axis else s for i, s in enumerate(spec))))
    return jax.sharding.reshard(x, whole), lambda y: jax.sharding.reshard(y, sharding)


def to_layout(
    x: Shaped[Array | np.ndarray, "..."], layout: str, *, num_shards: IntLike, axis: IntLike = 1
) -> Shaped[Array, "..."]:
    """Permutes a global sequence so that ``n`` equal contiguous shards get ``layout``.

    After ``to_layout``, sharding axis ``axis`` evenly over ``n`` devices (for example with
    ``PartitionSpec(None, "seq")``) hands shard ``i`` exactly the tokens
    ``shard_positions(layout, i, n, S // n)``. Pure reshapes, flips and transposes.

    Args:
      x: any array with the global sequence of length ``S`` on ``axis`` (``q [B, T, N, H]``,
        ``k [B, S, K, H]``, segment ids ``[B, S]``, ...).
      layout: one of :data:`LAYOUTS`.
      num_shards: ``n``, the number of shards the sequence will be split into.
      axis: the sequence axis (negative counts from the end).

    Returns:
      An array of ``x``'s shape and dtype with the sequence permuted.

    ``layout``, ``num_shards`` and ``axis`` are static:
    ``jax.jit(functools.partial(to_layout, layout="zigzag", num_shards=8))``.

    Raises:
      ValueError: for an unknown layout, a non-positive ``num_shards``, a bad ``axis``, or
        ``S`` not divisible by ``n`` (by ``2 n`` for ``"zigzag"``).

    Example:
      >>> import jax.numpy as jnp
      >>> to_layout(jnp.arange(8)[None], "zigzag", num_shards=2)
      Array([[0, 1, 6, 7, 2, 3, 4, 5]], dtype=int32)
    """
    axis, length, num_shards = _check_sequence("to_layout", x, layout, num_shards, axis)
    x = jnp.asarray(x)
    n = num_shards
    if layout == "contiguous" or n == 1:
        return x
    x, restore = _along_replicated(x, axis)
    return restore(_to_layout(x, layout, n, axis, length))


def _to_layout(x, layout: str, n: int, axis: int, length: int):
    before, after = x.shape[:axis], x.shape[axis + 1 :]
    a = len(before)
    if layout == "striped":
        x = x.reshape(*before, length // n, n, *after)  # token = row * n + shard
        return jnp.swapaxes(x, a, a + 1).reshape(*before, length, *after)
    c = length // (2 * n)
    x = x.reshape(*before, 2, n, c, *after)  # chunk = half * n + index
    early = jnp.take(x, 0, axis=a)  # chunks 0 .. n-1: [..., n, c, ...]
    late = jnp.flip(jnp.take(x, 1, axis=a), axis=a)  # chunks 2n-1 .. n
    return jnp.stack([early, late], axis=a + 1).reshape(*before, length, *after)


def from_layout(
    x: Shaped[Array | np.ndarray, "..."], layout: str, *, num_shards: IntLike, axis: IntLike = 1
) -> Shaped[Array, "..."]:
    """The inverse of :func:`to_layout`: restores the global token order.

    It cannot check that ``x`` is in ``layout`` order (a permutation leaves no trace in the
    values): applied to natural-order data, twice, or with another layout or shard count
    than :func:`to_layout` used, it permutes wrongly without an error. Apply it exactly once
    per :func:`to_layout`, with the same arguments. The attention functions return their
    outputs in the order of their inputs: an output needs ``from_layout`` exactly when its
    inputs went through ``to_layout``. To check a pipeline, carry positions through it:
    ``from_layout`` of the permuted ``to_layout(arange(T))`` is ``arange(T)``.

    Args:
      x: an array whose ``axis`` holds a sequence in ``layout`` order (the concatenation of
        the ``n`` shards).
      layout: one of :data:`LAYOUTS`.
      num_shards: ``n``.
      axis: the sequence axis.

    Returns:
      ``x`` with the sequence in global order.

    Options are static, as for :func:`to_layout`.

    Raises:
      ValueError: as :func:`to_layout`.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.arange(12)[None]
      >>> bool((from_layout(to_layout(x, "striped", num_shards=3), "striped",
      ...                   num_shards=3) == x).all())
      True
    """
    axis, length, num_shards = _check_sequence("from_layout", x, layout, num_shards, axis)
    x = jnp.asarray(x)
    n = num_shards
    if layout == "contiguous" or n == 1:
        return x
    x, restore = _along_replicated(x, axis)
    return restore(_from_layout(x, layout, n, axis, length))


def _from_layout(x, layout: str, n: int, axis: int, length: int):
    before, after = x.shape[:axis], x.shape[axis + 1 :]
    a = len(before)
    if layout == "striped":
        x = x.reshape(*before, n, length // n, *after)  # [shard, row]
        return jnp.swapaxes(x, a, a + 1).reshape(*before, length, *after)
    c = length // (2 * n)
    x = x.reshape(*before, n, 2, c, *after)  # [shard, early|late, c]
    early = jnp.take(x, 0, axis=a + 1)
    late = jnp.flip(jnp.take(x, 1, axis=a + 1), axis=a)
    return jnp.concatenate([early, late], axis=a).reshape(*before, length, *after)


def shard_positions(
    layout: str,
    shard_index: IntLike | Int[Array, ""],
    num_shards: IntLike,
    local_len: IntLike,
) -> Int[Array, " T"]:
    """Global positions of the ``local_len`` tokens (``T``) that shard ``shard_index`` holds.

    * ``"contiguous"``: ``[i T, (i + 1) T)``;
    * ``"zigzag"``: chunks ``i`` and ``2n - 1 - i`` of ``T / 2`` tokens each;
    * ``"striped"``: ``i, i + n, ..., i + (T - 1) n``.

    Args:
      layout: one of :data:`LAYOUTS`.
      shard_index: ``i``, a Python int in ``[0, n)`` or an int32 scalar (a traced
        ``jax.lax.axis_index(...)`` inside ``shard_map``).
      num_shards: ``n``.
      local_len: ``T``, tokens per shard (even for ``"zigzag"``).

    Returns:
      ``[T]`` int32 global positions, increasing.

    Only ``shard_index`` may be traced (``jax.lax.axis_index``); bind the rest with
    ``functools.partial`` to jit it.

    Raises:
      ValueError: for an unknown layout, non-positive ``num_shards`` or ``local_len``, an odd
        ``local_len`` with ``"zigzag"``, or a Python ``shard_index`` outside ``[0, n)``.

    Example:
      >>> shard_positions("zigzag", 1, 2, 4).tolist()
      [2, 3, 4, 5]
    """
    fn = "shard_positions"
    _check_layout(fn, layout)
    num_shards = check_int(fn, "num_shards", num_shards, minimum=1)
    local_len = check_int(fn, "local_len", local_len, minimum=1)
    if not hasattr(shard_index, "shape") or isinstance(shard_index, np.integer):
        shard_index = check_int(fn, "shard_index", shard_index, minimum=0)
        if shard_index >= num_shards:
            raise fail(fn, "shard_index", f"an int in [0, {num_shards})", shard_index)
    if layout == "zigzag" and local_len % 2:
        raise fail(fn, "local_len", "an even int for layout 'zigzag'", local_len)
    i = jnp.asarray(shard_index, jnp.int32)
    n, T = num_shards, local_len
    if layout == "contiguous":
        return i * T + jnp.arange(T, dtype=jnp.int32)
    if layout == "striped":
        return i + n * jnp.arange(T, dtype=jnp.int32)
    c = T // 2
    offsets = jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([i * c + offsets, (2 * n - 1 - i) * c + offsets])
