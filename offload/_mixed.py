"""Decode over mixed residency: device-resident pages, optionally merged with cold pages.

Residency is two page tables of the same shape ``[B, M]`` over pools ``[K, P, C, H]`` (the
device pool) and ``[K, Pc, C, H]`` (the cold pool: any number of pages): ``device_table`` points into the device pool, ``cold_table`` into the cold
pool (pages demoted to host or disk and fetched for this step); ``0`` (the null page) means
"absent from this tier". A slot must be non-zero in at most one table (:func:`split_residency`
guarantees it). Each part is an ordinary ``paged.paged_attention`` call (one mask, validated
once by :func:`ringattn.resolve_mask`) returning ``(out, lse, page_mass)``, and
:func:`ringattn.merge_attention` combines them exactly; attention sinks join the softmax once,
after the merge (:func:`ringattn.apply_sinks`), so with every evicted page fetched the result
equals full attention (sinks included); without the cold part it is the
retention policy's approximation, and the attention mass it keeps is reported:

* exactly, as ``exp(lse_device - lse_full)`` when the cold part is given
  (:func:`mass_kept_from_lse`);
* from a page-mass observation otherwise (``offload.monitoring.mass_kept_from_page_mass``).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

import ringattn
from offload._attention_mass import mass_kept_from_lse
from offload._checks import check_array, check_lengths, check_table
from offload._shared_pages import keep_shared_pages
from paged import QuantizedPages, paged_attention

__all__ = ["MixedAttention", "mixed_residency_attention", "split_residency"]


class MixedAttention(NamedTuple):
    """Result of :func:`mixed_residency_attention`.

    Attributes:
      out: ``[B, T, N, H]`` attention output in ``q.dtype``.
      lse: ``[B, T, N]`` float32 log-sum-exp over every key attended.
      mass_kept: ``[B, T, N]`` float32 fraction of the attention mass on device-resident
        pages (exact, from the lse), or None when no cold part was given.
      page_mass: ``[B, N, M]`` float32 attention probability per page-table slot summed over
        the queries, of the attention actually computed (device part alone, or device and cold
        merged), when ``return_page_mass``; else None. Feed it to
        :func:`offload.update_policy_state` (H2O, TOVA, Scissorhands).
    """

    out: Float[Array, "B T N H"]
    lse: Float[Array, "B T N"]
    mass_kept: Float[Array, "B T N"] | None
    page_mass: Float[Array, "B N M"] | None = None


def split_residency(
    page_table: Int[Array, "B M"], keep: Bool[Array, "B M"], demote: Bool[Array, "B M"]
) -> tuple[Int[Array, "B M"], Int[Array, "B M"]]:
    """Splits a page table by a selection into a device table and a cold table.

    Jittable as is: ``jax.jit(split_residency)`` (no options).

    Args:
      page_table: ``[B, M]`` int page ids (0 = null page).
      keep: ``[B, M]`` bool, slots that stay on the device (``Selection.keep``).
      demote: ``[B, M]`` bool, slots demoted to the cold tier (``Selection.demote``);
        disjoint from ``keep``. Slots in neither (dropped) are 0 in both tables. A demoted
        slot whose page id another slot keeps (a page shared through the prefix cache or a
        fork) goes to the device table: the page stays on the device for every holder
        (:func:`keep_shared_pages`), so the cold table never names a page still kept.

    Returns:
      ``(device_table, cold_table)``, both ``[B, M]`` in ``page_table``'s dtype, with 0 where
      the slot is absent from that tier.

    Raises:
      ValueError: on shapes or dtypes that disagree.

    Example:
      >>> pt = jnp.array([[3, 5, 7]])
      >>> d, c = split_residency(pt, jnp.array([[True, False, False]]),
      ...                        jnp.array([[False, True, False]]))
      >>> d.tolist(), c.tolist()
      ([[3, 0, 0]], [[0, 5, 0]])
    """
    fn = "split_residency"
    check_table(fn, "page_table", page_table)
    for name, m in (("keep", keep), ("demote", demote)):
        if m.shape != page_table.shape or m.dtype != jnp.bool_:
            raise ValueError(
                f"{fn}: {name}: expected bool {tuple(page_table.shape)}, got {m.dtype} "
                f"{tuple(m.shape)}"
            )
    zero = jnp.zeros_like(page_table)
    # A page kept by any row stays on the device for every row that holds it.
    on_device = keep | (demote & keep_shared_pages(page_table, keep))
    device = jnp.where(on_device, page_table, zero)
    cold = jnp.where(demote & ~on_device, page_table, zero)
    return device, cold


def _kind(pool) -> str:
    """A float pool's dtype, or ``quantized <kind>`` (for comparisons and messages)."""
    if isinstance(pool, QuantizedPages):
        return f"quantized {pool.format.kind!r}"
    return str(pool.dtype)


@functools.partial(jax.jit, static_argnames=("spec", "return_page_mass"))
def _tier_attention(q, pools, view, sinks, *, spec, return_page_mass):
    """One tier's part: ``pools = (k_pages, v_pages)``, ``view = (table, lengths,
    q_positions)``. Its table is traced here, so a slot absent from this tier (the null
    page inside a length, by design) is masked: ``paged.paged_attention``'s jit behaviour (an
    eager call of it raises on such a slot, which in a single-tier table is a missing page)."""
    (k_pages, v_pages), (table, lengths, q_positions) = pools, view
    return paged_attention(
        q, k_pages, v_pages, table, lengths, q_positions=q_positions, mask=spec, sinks=sinks,
        return_page_mass=return_page_mass,
    )  # fmt: skip


def mixed_residency_attention(
    q: Float[Array, "B T N H"],
    k_pages: Float[Array, "K P C H"] | QuantizedPages,
    v_pages: Float[Array, "K P C H"] | QuantizedPages,
    device_table: Int[Array | np.ndarray, "B M"],
    lengths: Int[Array | np.ndarray, " B"],
    *,
    cold_table: Int[Array | np.ndarray, "B M"] | None = None,
    cold_k_pages: Float[Array, "K Pc C H"] | QuantizedPages | None = None,
    cold_v_pages: Float[Array, "K Pc C H"] | QuantizedPages | None = None,
    q_positions: Int[Array | np.ndarray, "B T"] | None = None,
    mask: ringattn.MaskSpec | None = None,
    causal: bool | np.bool_ | None = None,
    window: int | np.integer | tuple[int | np.integer | None, ...] | None = None,
    softcap: float | int | np.floating | np.integer | None = None,
    scale: float | int | np.floating | np.integer | None = None,
    sinks: Float[Array, " N"] | None = None,
    return_page_mass: bool | np.bool_ = False,
) -> MixedAttention:
    """Attention over device-resident pages, merged with cold pages fetched for this step.

    Jittable with its options bound: ``jax.jit(functools.partial(mixed_residency_attention,
    window=128, return_page_mass=True))``; passing a flag to the jitted function instead
    makes it a tracer and fails, as for JAX's own functions.

    Token ``i`` of sequence ``b`` lives in slot ``i // C`` at offset ``i % C``, in
    ``k_pages[:, device_table[b, i // C]]`` when that entry is non-zero, else in
    ``cold_k_pages[:, cold_table[b, i // C]]`` when given and non-zero; otherwise it is absent
    and ignored (``paged.paged_attention`` masks the null page and ids outside ``[1, P)``).

    Args:
      q: ``[B, T, N, H]`` queries (``T = 1`` for decode).
      k_pages: ``[K, P, C, H]`` device key pool of one layer (heads-major; page 0 = null): a
        float array or a ``paged.QuantizedPages`` (then the cold pools are quantized in the
        same format; each part decodes per block inside ``paged.paged_attention``). A kivi2
        device pool carries its residual window (each sequence's most recent pages, one per
        row of ``device_table``); kivi2 cold pools fetched from host carry none (every cold
        page is read as stored), so each sequence's open page must stay on the device, and
        window pages read exactly only while they are on it.
      v_pages: ``[K, P, C, H]`` device value pool.
      device_table: ``[B, M]`` int, device page per slot, 0 = not on the device.
      lengths: ``[B]`` int tokens per sequence (positions ``>= lengths`` are ignored).
      cold_table: optional ``[B, M]`` int, cold page per slot, 0 = absent; disjoint from
        ``device_table`` (a slot set in both would be counted twice).
      cold_k_pages: ``[K, Pc, C, H]`` cold key pool fetched for this step (any number of
        pages ``Pc``, page 0 null: a staging pool holding just the fetched pages); defaults to
        ``k_pages`` (both tiers simulated in one pool).
      cold_v_pages: ``[K, Pc, C, H]`` cold value pool; given together with ``cold_k_pages``.
      q_positions: ``[B, T]`` int, default ``lengths - T + arange(T)`` (the last tokens).
      mask: a :class:`ringattn.MaskSpec` (then none of the four keywords below), validated
        by :func:`ringattn.resolve_mask` as in ``paged.paged_attention``.
      causal: a query at position ``p`` sees keys at positions ``<= p`` (default True).
      window: sliding window (hide keys at positions ``<= p - window``); a tuple gives one
        window per query head.
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``.
      sinks: ``[N]`` float per-query-head sink logit joining the softmax **once**, after the
        device and cold parts are merged (:func:`ringattn.apply_sinks`), or None.
      return_page_mass: also return the ``[B, N, M]`` page mass (a slot's mass comes from
        whichever tier holds it; a sink's share goes to no slot).

    Returns:
      :class:`MixedAttention` ``(out, lse, mass_kept, page_mass)``; ``lse`` includes the
      sink; ``mass_kept`` (the fraction of the keys' mass on device pages, sink excluded) is
      None without a ``cold_table``, ``page_mass`` None unless asked. Rows that see no key:
      ``out = 0``, ``lse = -inf`` (the sink with sinks), ``mass_kept = 1``. Forward only:
      ``paged.paged_attention`` has no reverse-mode derivative (decode needs none).

    Raises:
      ValueError: on inconsistent shapes or dtypes (pools in ``q``'s dtype), cold pools without
        a ``cold_table``, only one of ``cold_k_pages``/``cold_v_pages``, ``sinks`` not a
        float ``[N]``, or bad mask options (``mask`` together with the keywords included).
      NotImplementedError: ``return_page_mass`` with a cold part and ``T > 1``.

    Example:
      >>> import jax
      >>> kp = jax.random.normal(jax.random.key(0), (1, 4, 2, 8))
      >>> q = jax.random.normal(jax.random.key(1), (1, 1, 2, 8))
      >>> res = mixed_residency_attention(q, kp, kp, jnp.array([[1, 0]]), jnp.array([4]),
      ...                                 cold_table=jnp.array([[0, 3]]))
      >>> res.out.shape, bool((res.mass_kept > 0).all() & (res.mass_kept < 1).all())
      ((1, 1, 2, 8), True)
    """
    fn = "mixed_residency_attention"
    B, T, N, H = check_array(fn, "q", q, ndim=4, kind=jnp.floating, layout="[B, T, N, H]")
    if isinstance(k_pages, QuantizedPages):  # paged_attention checks data and scales
        if k_pages.ndim != 4:
            raise ValueError(f"{fn}: k_pages: expected [K, P, C, H={H}], got {k_pages.shape}")
        K, P, C, _ = k_pages.shape
    else:
        K, P, C, _ = check_array(
            fn, "k_pages", k_pages, ndim=4, kind=jnp.floating, layout=f"[K, P, C, H={H}]"
        )
    if k_pages.shape[3] != H:
        raise ValueError(f"{fn}: k_pages: expected [K, P, C, H={H}], got {tuple(k_pages.shape)}")
    if v_pages.shape != k_pages.shape or _kind(v_pages) != _kind(k_pages):
        raise ValueError(
            f"{fn}: v_pages: expected k_pages' shape {tuple(k_pages.shape)} and kind "
            f"{_kind(k_pages)}, got {tuple(v_pages.shape)} and {_kind(v_pages)}"
        )
    if H == 0 or C == 0 or P == 0:
        raise ValueError(
            f"{fn}: k_pages: expected non-zero P, C and H, got shape {tuple(k_pages.shape)}"
        )
    if K == 0 or N % K:
        raise ValueError(
            f"{fn}: k_pages: expected kv heads K >= 1 dividing q's N={N} heads, got K={K}"
        )
    check_table(fn, "device_table", device_table)
    if device_table.shape[0] != B:
        raise ValueError(
            f"{fn}: device_table: expected B={B} rows, got shape {tuple(device_table.shape)}"
        )
    check_lengths(fn, lengths, B)
    if (cold_k_pages is None) != (cold_v_pages is None):
        raise ValueError(
            f"{fn}: cold_v_pages: expected cold_k_pages and cold_v_pages given together, got "
            f"only {'cold_k_pages' if cold_v_pages is None else 'cold_v_pages'}"
        )
    if cold_table is None and cold_k_pages is not None:
        raise ValueError(
            f"{fn}: cold_table: expected a cold_table with cold_k_pages/cold_v_pages, got None"
        )
    if cold_table is not None:
        check_table(fn, "cold_table", cold_table, device_table.shape)
        if cold_k_pages is None:
            cold_k_pages, cold_v_pages = k_pages, v_pages
        K, _, C = k_pages.shape[:3]
        cold = (("cold_k_pages", cold_k_pages, k_pages), ("cold_v_pages", cold_v_pages, v_pages))
        for name, pool, like in cold:
            if pool.ndim != 4 or (pool.shape[0], *pool.shape[2:]) != (K, C, H) or pool.shape[1] < 1:
                raise ValueError(
                    f"{fn}: {name}: expected shape [K={K}, Pc >= 1, C={C}, H={H}], got "
                    f"{tuple(pool.shape)}"
                )
            if _kind(pool) != _kind(k_pages):
                raise ValueError(
                    f"{fn}: {name}: expected dtype {_kind(k_pages)}, got {_kind(pool)}"
                )
            if isinstance(pool, QuantizedPages) and pool.grouping != like.grouping:
                # kivi2: keys per channel, values per token, in both tiers alike
                raise ValueError(
                    f"{fn}: {name}: expected grouping {like.grouping!r} (the device pool's), "
                    f"got {pool.grouping!r}"
                )
        if cold_v_pages.shape != cold_k_pages.shape:
            raise ValueError(
                f"{fn}: cold_v_pages: expected cold_k_pages' shape {tuple(cold_k_pages.shape)}, "
                f"got {tuple(cold_v_pages.shape)}"
            )
    lengths = lengths.astype(jnp.int32)
    if q_positions is None:
        q_positions = lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None, :]
    elif q_positions.shape != (B, T):
        raise ValueError(
            f"{fn}: q_positions: expected shape [B={B}, T={T}], got {tuple(q_positions.shape)}"
        )
    if return_page_mass and cold_table is not None and T != 1:
        raise NotImplementedError(
            f"{fn}: return_page_mass with a cold part needs T == 1 (each query's mass is "
            f"rescaled by its own lse before the sum over queries), got T={T}"
        )

    spec = ringattn.resolve_mask(
        fn, mask, causal=causal, window=window, softcap=softcap, scale=scale, default_causal=True
    )
    if sinks is not None:
        check_array(fn, "sinks", sinks, ndim=1, kind=jnp.floating, layout=f"[N={N}]")
        if sinks.shape != (N,):
            raise ValueError(f"{fn}: sinks: expected shape ({N},), got {tuple(sinks.shape)}")
    return_page_mass = bool(return_page_mass)

    def part(kp, vp, table, part_sinks):
        return _tier_attention(
            q, (kp, vp), (table, lengths, q_positions), part_sinks,
            spec=spec, return_page_mass=return_page_mass,
        )  # fmt: skip

    if cold_table is None:  # the device part is the whole attention: paged applies the sink
        dev = part(k_pages, v_pages, device_table, sinks)
        return MixedAttention(out=dev.out, lse=dev.lse, mass_kept=None, page_mass=dev.page_mass)
    dev = part(k_pages, v_pages, device_table, None)
    cold = part(cold_k_pages, cold_v_pages, cold_table, None)
    merged = ringattn.merge_attention(dev.out, dev.lse, cold.out, cold.lse)
    kept = mass_kept_from_lse(dev.lse, merged.lse)  # [B, T, N], over the keys
    # The sink joins the softmax once, after every part is merged.
    out, lse = ringattn.apply_sinks(merged.out, merged.lse, sinks)
    mass = None
    if return_page_mass:
        # T == 1: each part's probabilities are relative to its own lse; rescale to the keys'
        # total, then (with a sink) to the total that includes the sink.
        mass = (
            dev.page_mass * kept[:, 0, :, None]
            + cold.page_mass * mass_kept_from_lse(cold.lse, merged.lse)[:, 0, :, None]
        )
        if sinks is not None:
            share = jnp.where(jnp.isneginf(merged.lse), 0.0, jnp.exp(merged.lse - lse))
            mass = mass * share[:, 0, :, None]
    return MixedAttention(out=out.astype(q.dtype), lse=lse, mass_kept=kept, page_mass=mass)
