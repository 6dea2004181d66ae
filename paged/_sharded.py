"""Decode over one long sequence whose pages are spread over a mesh axis (tree decode).

Layout: with ``D`` devices on ``axis_name``, device ``d`` holds the contiguous token range
``[d * M_d * C, (d + 1) * M_d * C)`` of every sequence in its own pool shard. As global arrays:

* ``k_pages, v_pages [K, D * P_d, C, H]`` sharded along the page axis: device ``d``'s pool is
  pages ``d * P_d ... (d + 1) * P_d - 1`` (its page 0, global page ``d * P_d``, is its null
  page);
* ``page_table [B, D * M_d]`` sharded along its columns; the ids in device ``d``'s columns are
  *local* to its pool shard. So column ``j`` still holds tokens ``j * C ... j * C + C - 1``;
* ``lengths [B]`` global lengths (replicated); device ``d`` sees
  ``clip(lengths - d * M_d * C, 0, M_d * C)`` of them.

Each device runs :func:`paged.paged_attention` over its shard with the queries' positions
shifted into its range (so causality and sliding windows stay exact) and ``return_lse=True``;
``ringattn.allreduce_attention`` merges the ``D`` partial ``(out, lse)`` exactly. KV never
moves: per step only ``B * T * N * (H + 1)`` floats are reduced.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

import ringattn
from paged._attention import (
    DEFAULT_PAGES_PER_BLOCK,
    _check_array,
    check_pages,
    check_table,
    paged_attention,
)

__all__ = ["sharded_paged_attention"]


def _local_partial(q, k_pages, v_pages, page_table, lengths, q_positions, *, axis_name, kwargs):
    """Inside ``shard_map``: this device's ``(out, lse)`` over its token range."""
    capacity = page_table.shape[1] * k_pages.shape[2]  # M_d * C
    offset = jax.lax.axis_index(axis_name) * capacity
    local_lengths = jnp.clip(lengths - offset, 0, capacity)
    return paged_attention(
        q,
        k_pages,
        v_pages,
        page_table,
        local_lengths,
        q_positions=q_positions - offset,
        return_lse=True,
        **kwargs,
    )


def sharded_paged_attention(
    q: Float[Array, "B T N H"],
    k_pages: Float[Array, "K P C H"],
    v_pages: Float[Array, "K P C H"],
    page_table: Int[Array, "B M"],
    lengths: Int[Array, " B"],
    *,
    mesh: Mesh,
    axis_name: str,
    q_positions: Int[Array, "B T"] | None = None,
    causal: bool = True,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    pages_per_block: int = DEFAULT_PAGES_PER_BLOCK,
    return_lse: bool = False,
):
    """Paged decode attention over a pool sharded by sequence range along ``axis_name``.

    Equal to :func:`paged.paged_attention` on the unsharded sequence (see the module docs for
    the layout). Works on meshes with ``Auto`` or ``Explicit`` axes; other mesh axes replicate.

    Args:
      q: ``[B, T, N, H]`` queries (replicated).
      k_pages: ``[K, D * P_d, C, H]`` key pools, device ``d``'s shard is its local pool.
      v_pages: ``[K, D * P_d, C, H]`` value pools.
      page_table: ``[B, D * M_d]`` int, device ``d``'s columns hold local page ids.
      lengths: ``[B]`` int global lengths (``<= D * M_d * C``).
      mesh: the device mesh.
      axis_name: mesh axis the sequence is spread over (size ``D``).
      q_positions: ``[B, T]`` int global query positions, default the last ``T`` positions.
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      window: hide keys at positions ``<= p - window``.
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``.
      pages_per_block: pages per loop step on each device.
      return_lse: also return ``lse [B, T, N]`` float32.

    Returns:
      ``out [B, T, N, H]`` (replicated) in ``q.dtype``, and ``lse`` if ``return_lse``.

    Raises:
      ValueError: on a bad axis, shapes that do not divide over it, or bad inputs.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import AxisType, Mesh
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("seq",), axis_types=(AxisType.Auto,))
      >>> pages = jnp.ones((1, 4, 2, 8))
      >>> out = sharded_paged_attention(jnp.ones((1, 1, 2, 8)), pages, pages,
      ...                               jnp.array([[1, 2]]), jnp.array([3]),
      ...                               mesh=mesh, axis_name="seq")
      >>> out.shape, float(out[0, 0, 0, 0])
      ((1, 1, 2, 8), 1.0)
    """
    fn = "sharded_paged_attention"
    if not isinstance(mesh, Mesh):
        raise ValueError(f"{fn}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"{fn}: axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}"
        )
    _check_array(fn, "q", q, 4, jnp.floating)
    K, P, C, H = check_pages(fn, k_pages, v_pages)
    B, M = check_table(fn, page_table, lengths, q.shape[0])
    D = mesh.shape[axis_name]
    if P % D or M % D:
        raise ValueError(
            f"{fn}: pages P={P} and table width M={M} must both divide by the {D} devices "
            f"of axis {axis_name!r}"
        )
    T = q.shape[1]
    if q_positions is None:
        q_positions = lengths.astype(jnp.int32)[:, None] - T + jnp.arange(T, dtype=jnp.int32)
    else:
        _check_array(fn, "q_positions", q_positions, 2, jnp.integer)
        if q_positions.shape != (B, T):
            raise ValueError(f"{fn}: q_positions must have shape {(B, T)}, got {q_positions.shape}")
    kwargs = dict(
        causal=causal, window=window, softcap=softcap, scale=scale, pages_per_block=pages_per_block
    )
    pool_spec = PartitionSpec(None, axis_name)
    replicated = PartitionSpec()

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(replicated, pool_spec, pool_spec, pool_spec, replicated, replicated),
        out_specs=(replicated, replicated),
        check_vma=True,
    )
    def run(q, k_pages, v_pages, page_table, lengths, q_positions):
        out, lse = _local_partial(
            q,
            k_pages,
            v_pages,
            page_table,
            lengths,
            q_positions,
            axis_name=axis_name,
            kwargs=kwargs,
        )
        return ringattn.allreduce_attention(out, lse, axis_name=axis_name)

    args = (q, k_pages, v_pages, page_table, lengths, q_positions.astype(jnp.int32))
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        # Explicit axes: shard_map wants its inputs already laid out as in_specs say.
        specs = (replicated, pool_spec, pool_spec, pool_spec, replicated, replicated)
        args = tuple(
            jax.sharding.reshard(x, NamedSharding(mesh, s))
            for x, s in zip(args, specs, strict=True)
        )
    out, lse = run(*args)
    return (out, lse) if return_lse else out
