"""Sequence layouts over a ring of shards: which global tokens each shard holds.

Causal ring attention on the plain ``"contiguous"`` layout is unbalanced: shard ``i`` holds
tokens ``[i L, (i + 1) L)`` and its queries see ``i + 1`` of the ``n`` key blocks, so the last
shard works ``n`` times as hard as the first and the ring runs at the speed of the slowest.
Two permutations of the global sequence, applied once to the inputs (and undone on the
output), give every shard the same causal work:

* ``"zigzag"`` (dual-chunk swap): the sequence is cut in ``2n`` equal chunks and shard ``i``
  holds chunks ``i`` and ``2n - 1 - i``, an early and a late one.
* ``"striped"``: shard ``i`` holds tokens ``i, i + n, i + 2n, ...``.

The attention functions take *global* positions, which :func:`shard_positions` computes for
a shard (also from a traced ``jax.lax.axis_index``), so masks keep the meaning they have on
the un-permuted sequence.

References:
  Brandon et al., "Striped Attention: Faster Ring Attention for Causal Transformers", 2023;
  zhuzilin/ring-flash-attention (zigzag); Liu et al., "Ring Attention with Blockwise
  Transformers for Near-Infinite Context", 2023.
"""

import jax.numpy as jnp
from jaxtyping import Array, Int, Shaped

__all__ = ["LAYOUTS", "from_layout", "shard_positions", "to_layout"]

LAYOUTS = ("contiguous", "zigzag", "striped")


def _check_layout(fn: str, layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {LAYOUTS}, got {layout!r}")


def _check_positive_int(fn: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{fn}: {name} must be a positive int, got {value!r}")


def _check_sequence(fn: str, x, layout: str, num_shards: int, axis: int) -> tuple[int, int]:
    """Validates ``x`` and returns ``(normalised axis, sequence length)``."""
    _check_layout(fn, layout)
    _check_positive_int(fn, "num_shards", num_shards)
    if not hasattr(x, "shape") or not hasattr(x, "ndim"):
        raise ValueError(f"{fn}: x must be an array, got {type(x).__name__}")
    if isinstance(axis, bool) or not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{fn}: axis must be an int in [{-x.ndim}, {x.ndim}), got {axis!r}")
    axis %= x.ndim
    length = x.shape[axis]
    chunks = 2 * num_shards if layout == "zigzag" else num_shards
    if length % chunks != 0:
        raise ValueError(
            f"{fn}: sequence length {length} (axis {axis}) must be divisible by "
            f"{'2 × num_shards' if layout == 'zigzag' else 'num_shards'} = {chunks} "
            f"for layout {layout!r}"
        )
    return axis, length


def to_layout(
    x: Shaped[Array, "..."], layout: str, *, num_shards: int, axis: int = 1
) -> Shaped[Array, "..."]:
    """Permutes a global sequence so that ``n`` equal contiguous shards get ``layout``.

    After ``to_layout``, sharding axis ``axis`` evenly over ``n`` devices (for example with
    ``PartitionSpec(None, "seq")``) hands shard ``i`` exactly the tokens
    ``shard_positions(layout, i, n, L // n)``. Pure reshapes, flips and transposes.

    Args:
      x: any array with the global sequence of length ``L`` on ``axis`` (``q [B, L, N, H]``,
        ``k [B, L, K, H]``, segment ids ``[B, L]``, ...).
      layout: one of :data:`LAYOUTS`.
      num_shards: ``n``, the number of shards the sequence will be split into.
      axis: the sequence axis (negative counts from the end).

    Returns:
      An array of ``x``'s shape and dtype with the sequence permuted.

    Raises:
      ValueError: for an unknown layout, a non-positive ``num_shards``, a bad ``axis``, or
        ``L`` not divisible by ``n`` (by ``2 n`` for ``"zigzag"``).

    Example:
      >>> import jax.numpy as jnp
      >>> to_layout(jnp.arange(8)[None], "zigzag", num_shards=2)
      Array([[0, 1, 6, 7, 2, 3, 4, 5]], dtype=int32)
    """
    axis, length = _check_sequence("to_layout", x, layout, num_shards, axis)
    x = jnp.asarray(x)
    n = num_shards
    if layout == "contiguous" or n == 1:
        return x
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
    x: Shaped[Array, "..."], layout: str, *, num_shards: int, axis: int = 1
) -> Shaped[Array, "..."]:
    """The inverse of :func:`to_layout`: restores the global token order.

    Args:
      x: an array whose ``axis`` holds a sequence in ``layout`` order (the concatenation of
        the ``n`` shards).
      layout: one of :data:`LAYOUTS`.
      num_shards: ``n``.
      axis: the sequence axis.

    Returns:
      ``x`` with the sequence in global order.

    Raises:
      ValueError: as :func:`to_layout`.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.arange(12)[None]
      >>> bool((from_layout(to_layout(x, "striped", num_shards=3), "striped",
      ...                   num_shards=3) == x).all())
      True
    """
    axis, length = _check_sequence("from_layout", x, layout, num_shards, axis)
    x = jnp.asarray(x)
    n = num_shards
    if layout == "contiguous" or n == 1:
        return x
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


def shard_positions(layout: str, shard_index, num_shards: int, local_len: int) -> Int[Array, " L"]:
    """Global positions of the ``local_len`` tokens that shard ``shard_index`` holds.

    * ``"contiguous"``: ``[i L, (i + 1) L)``;
    * ``"zigzag"``: chunks ``i`` and ``2n - 1 - i`` of ``L / 2`` tokens each;
    * ``"striped"``: ``i, i + n, ..., i + (L - 1) n``.

    Args:
      layout: one of :data:`LAYOUTS`.
      shard_index: ``i``, a Python int in ``[0, n)`` or an int32 scalar (a traced
        ``jax.lax.axis_index(...)`` inside ``shard_map``).
      num_shards: ``n``.
      local_len: ``L``, tokens per shard (even for ``"zigzag"``).

    Returns:
      ``[L]`` int32 global positions, increasing.

    Raises:
      ValueError: for an unknown layout, non-positive ``num_shards`` or ``local_len``, an odd
        ``local_len`` with ``"zigzag"``, or a Python ``shard_index`` outside ``[0, n)``.

    Example:
      >>> shard_positions("zigzag", 1, 2, 4).tolist()
      [2, 3, 4, 5]
    """
    fn = "shard_positions"
    _check_layout(fn, layout)
    _check_positive_int(fn, "num_shards", num_shards)
    _check_positive_int(fn, "local_len", local_len)
    if isinstance(shard_index, int) and not 0 <= shard_index < num_shards:
        raise ValueError(f"{fn}: shard_index must be in [0, {num_shards}), got {shard_index}")
    if layout == "zigzag" and local_len % 2:
        raise ValueError(f"{fn}: local_len must be even for layout 'zigzag', got {local_len}")
    i = jnp.asarray(shard_index, jnp.int32)
    n, L = num_shards, local_len
    if layout == "contiguous":
        return i * L + jnp.arange(L, dtype=jnp.int32)
    if layout == "striped":
        return i + n * jnp.arange(L, dtype=jnp.int32)
    c = L // 2
    offsets = jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([i * c + offsets, (2 * n - 1 - i) * c + offsets])
