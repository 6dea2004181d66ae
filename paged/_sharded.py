"""Decode over one long sequence whose pages are spread over a mesh axis (tree decode).

Layout: with ``D`` devices on ``seq_axis``, device ``d`` holds the contiguous token range
``[d * M_d * C, (d + 1) * M_d * C)`` of every sequence in its own pool shard. As global arrays:

* ``k_pages, v_pages [K, D * P_d, C, H]`` sharded along the page axis: device ``d``'s pool is
  pages ``d * P_d ... (d + 1) * P_d - 1`` (its page 0, global page ``d * P_d``, is its null
  page);
* ``page_table [B, D * M_d]`` sharded along its columns; the ids in device ``d``'s columns are
  *local* to its pool shard. So column ``j`` still holds tokens ``j * C ... j * C + C - 1``;
* ``lengths [B]`` global lengths (replicated); device ``d`` sees
  ``clip(lengths - d * M_d * C, 0, M_d * C)`` of them.

Each device runs :func:`paged.paged_attention` over its shard with the queries' positions
shifted into its range (so causality and sliding windows stay exact);
``ringattn.allreduce_attention_per_shard`` merges the ``D`` partial ``(out, lse)`` exactly and
sinks join once, after the merge (:func:`ringattn.apply_sinks`). KV never moves: per step only
``B * T * N * (H + 1)`` floats are reduced. The default query positions are the last ``T``
positions of the valid (global) cache, as in :func:`paged.paged_attention`.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

import ringattn
from paged._attention import (
    DEFAULT_PAGES_PER_BLOCK,
    FloatScalar,
    IntScalar,
    PagedAttentionOutput,
    Window,
    attention_rows,
    check_sinks,
    default_q_positions,
    finish,
    forward_only,
    resolve_mask,
)
from paged._checks import (
    check_array,
    check_heads,
    check_pages,
    check_residual_rows,
    check_table,
    check_table_values,
    int_option,
    pool_dtype,
)
from paged._page_walk import kernel_options
from paged._quantized import QuantizedPages

__all__ = ["sharded_paged_attention"]


def local_partial(q, pools, view, *, seq_axis, mask, ppb, page_mass=False):
    """Inside ``shard_map``: this device's ``(out, lse, mass_rows)`` over its token range.

    ``pools = (k_pages, v_pages)`` (this device's pages); ``view = (page_table [B, M_d],
    lengths [B], q_positions [B, T])``. ``out`` float32, no sinks; ``mass_rows [B, T, N,
    M_d]`` relative to the local ``lse`` (or None without ``page_mass``).
    """
    (k_pages, v_pages), (page_table, lengths, q_positions) = pools, view
    N, H = q.shape[2], q.shape[3]
    capacity = page_table.shape[1] * k_pages.shape[2]  # M_d * C
    offset = jax.lax.axis_index(seq_axis) * capacity
    local_lengths = jnp.clip(lengths - offset, 0, capacity)
    # A kivi2 residual window (replicated) counts in this device's token range, like lengths.
    k_pages, v_pages = (_local_residual(pool, offset) for pool in (k_pages, v_pages))
    opts = kernel_options(
        "sharded_paged_attention", mask, N, H, ppb, page_table.shape[1], page_mass
    )
    return attention_rows(
        q, (k_pages, v_pages), (page_table, local_lengths, q_positions - offset), opts=opts
    )


def _pool_specs(pool, pool_spec):
    """The ``shard_map`` spec of a pool: split along pages; a kivi2 residual replicated."""
    if getattr(pool, "residual", None) is None:
        return pool_spec
    return dataclasses.replace(
        jax.tree.map(lambda _: pool_spec, dataclasses.replace(pool, residual=None)),
        residual=PartitionSpec(),
        residual_len=PartitionSpec(),
    )


def _local_residual(pool, offset):
    """A kivi2 pool's window in this device's local positions: the written length shifted
    by ``offset`` (left unclipped, so a window straddling two devices is read by both), the
    ring of ``W`` page slots rotated so local page ``j`` is in slot ``j % W``."""
    if getattr(pool, "residual", None) is None:
        return pool
    *lead, WC, H = pool.residual.shape
    C = pool.shape[-2]
    W = WC // C
    shift = (offset // C) % W  # global page j = local page + offset // C
    ring = pool.residual.reshape(*lead, W, C, H)
    ring = jnp.roll(ring, -shift, axis=len(lead))  # local slot s <- global slot s + shift
    return dataclasses.replace(
        pool, residual=ring.reshape(*lead, WC, H), residual_len=pool.residual_len - offset
    )


def sharded_paged_attention(
    q: Float[Array, "B T N H"],
    k_pages: Float[Array, "K P C H"] | QuantizedPages,
    v_pages: Float[Array, "K P C H"] | QuantizedPages,
    page_table: Int[Array | np.ndarray, "B M"],
    lengths: Int[Array | np.ndarray, " B"],
    *,
    mesh: Mesh,
    seq_axis: str,
    q_positions: Int[Array | np.ndarray, "B T"] | None = None,
    mask: ringattn.MaskSpec | None = None,
    causal: bool | np.bool_ | None = None,
    window: Window = None,
    softcap: FloatScalar | None = None,
    scale: FloatScalar | None = None,
    sinks: Float[Array, " N"] | None = None,
    pages_per_block: IntScalar = DEFAULT_PAGES_PER_BLOCK,
    return_page_mass: bool | np.bool_ = False,
) -> PagedAttentionOutput:
    """Paged decode attention over a pool sharded by sequence range along ``seq_axis``.

    Takes GLOBAL arrays (it calls ``jax.shard_map`` itself). Equal to
    :func:`paged.paged_attention` on the unsharded sequence (see the module docs for the
    layout), with the same defaults: ``causal=True`` and queries at the last ``T`` positions
    of the valid cache. Works on meshes with ``Auto`` or ``Explicit`` axes; other mesh axes
    replicate. Jit with the mesh and options bound:
    ``jax.jit(functools.partial(sharded_paged_attention, mesh=mesh, seq_axis="seq"))``.

    Args:
      q: ``[B, T, N, H]`` queries (replicated).
      k_pages: ``[K, D * P_d, C, H]`` key pools, device ``d``'s shard is its local pool; a
        :class:`paged.QuantizedPages` (its data and scales split along the page axis alike).
      v_pages: ``[K, D * P_d, C, H]`` value pools.
      page_table: ``[B, D * M_d]`` int, device ``d``'s columns hold local page ids.
      lengths: ``[B]`` int global lengths (``<= D * M_d * C``).
      mesh: the device mesh.
      seq_axis: mesh axis the sequence is spread over (size ``D``).
      q_positions: ``[B, T]`` int global query positions, default the last ``T`` positions.
      mask: a :class:`ringattn.MaskSpec` (then none of the four keywords below).
      causal: a query at position ``p`` sees keys at positions ``<= p`` (default True).
      window: hide keys at positions ``<= p - window``; a tuple: one per query head.
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``.
      sinks: ``[N]`` per-query-head sink logits, applied once after the merge, or None.
      pages_per_block: pages per loop step on each device.
      return_page_mass: also compute ``page_mass [B, N, D * M_d]``, the probability each
        global page-table column received (summed over queries), sharded like the table's
        columns.

    Returns:
      :class:`paged.PagedAttentionOutput` ``(out [B, T, N, H] in q.dtype, lse [B, T, N],
      page_mass or None)``; ``out`` and ``lse`` replicated.

    Raises:
      ValueError: on a bad axis, shapes that do not divide over it, or bad inputs; on an
        eager call, a length past ``D * M_d * C`` or a slot inside a length without a real
        local page (an id in ``[1, P_d)``).
      NotImplementedError: any derivative through it (``jax.grad``, ``vjp``, ``jvp``,
        ``jacfwd``): forward only, as :func:`paged.paged_attention`.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import AxisType, Mesh
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("seq",), axis_types=(AxisType.Auto,))
      >>> pages = jnp.ones((1, 4, 2, 8))
      >>> res = sharded_paged_attention(jnp.ones((1, 1, 2, 8)), pages, pages,
      ...                               jnp.array([[1, 2]]), jnp.array([3]),
      ...                               mesh=mesh, seq_axis="seq")
      >>> res.out.shape, float(res.out[0, 0, 0, 0])
      ((1, 1, 2, 8), 1.0)
    """
    fn = "sharded_paged_attention"
    if not isinstance(mesh, Mesh):
        raise ValueError(f"{fn}: mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if seq_axis not in mesh.axis_names:
        raise ValueError(
            f"{fn}: seq_axis: expected an axis of the mesh {mesh.axis_names}, got {seq_axis!r}"
        )
    check_array(fn, "q", q, 4, jnp.floating)
    B, T, N, _ = q.shape
    K, P, C, H = check_pages(fn, k_pages, v_pages)
    check_heads(fn, q, K, H, pool_dtype(k_pages))
    _, M = check_table(fn, page_table, lengths, B)
    check_residual_rows(fn, k_pages, v_pages, B)
    if T < 1:
        raise ValueError(f"{fn}: q: expected at least one query token (T >= 1), got {q.shape}")
    D = mesh.shape[seq_axis]
    if P % D or M % D:
        raise ValueError(
            f"{fn}: k_pages: expected pages P={P} and table width M={M} that both divide by "
            f"the {D} devices of axis {seq_axis!r} (must both divide), got P % D = {P % D}, "
            f"M % D = {M % D}"
        )
    # Device d's columns hold ids local to its pool shard of P / D pages.
    check_table_values(fn, page_table, lengths, num_pages=P // D, page_size=C)
    spec = resolve_mask(fn, mask, causal=causal, window=window, softcap=softcap, scale=scale)
    check_sinks(fn, sinks, N)
    ppb = int_option(fn, "pages_per_block", pages_per_block, minimum=1)
    lengths = jnp.asarray(lengths)
    q_positions = default_q_positions(fn, q_positions, lengths, B, T)
    pool_spec = PartitionSpec(None, seq_axis)
    replicated = PartitionSpec()
    # A kivi2 pool's residual pages (per sequence, not per page) are replicated.
    k_spec, v_spec = (_pool_specs(pool, pool_spec) for pool in (k_pages, v_pages))
    specs = (replicated, k_spec, v_spec, pool_spec, replicated, replicated)
    want_mass = bool(return_page_mass)
    kernel_options(fn, spec, N, H, ppb, M // D, want_mass)  # eager checks (window tuple...)
    mass_spec = PartitionSpec(None, None, None, seq_axis)  # [B, T, N, M] by columns

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=specs,
        out_specs=(replicated, replicated, mass_spec if want_mass else replicated),
        check_vma=True,
    )
    def run(q, k_pages, v_pages, page_table, lengths, q_positions):
        out, lse, mass_rows = local_partial(
            q,
            (k_pages, v_pages),
            (page_table, lengths, q_positions),
            seq_axis=seq_axis,
            mask=spec,
            ppb=ppb,
            page_mass=want_mass,
        )
        out_all, lse_all = ringattn.allreduce_attention_per_shard(out, lse, seq_axis=seq_axis)
        if not want_mass:
            return out_all, lse_all, jnp.zeros((), jnp.float32)
        # Each device's row mass is relative to its own lse: rescale it to the merged one.
        lse_v, lse_all_v = ringattn.match_varying(lse, lse_all)
        share = jnp.where(jnp.isneginf(lse_v), 0.0, jnp.exp(lse_v - lse_all_v))
        return out_all, lse_all, mass_rows * share[..., None]

    args = (q, k_pages, v_pages, jnp.asarray(page_table), lengths, q_positions)
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        # Explicit axes: shard_map wants its inputs already laid out as in_specs say.
        def reshard(x, s):
            if isinstance(s, PartitionSpec):  # one spec for every leaf
                s = jax.tree.map(lambda _, s=s: s, x)
            return jax.tree.map(
                lambda leaf, sp: jax.sharding.reshard(leaf, NamedSharding(mesh, sp)), x, s
            )

        args = tuple(reshard(x, s) for x, s in zip(args, specs, strict=True))
    out, lse, mass_rows = forward_only(fn, run, *args)
    # Sinks join once, after the merge (and take their share of the page mass).
    return finish(out, lse, mass_rows if want_mass else None, sinks, q.dtype)
