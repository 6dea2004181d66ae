"""Page tables: eager, loud checks (for tests, notebooks, debugging) and the conversion from
zero-based tables (JAX's and vLLM's, where page 0 is an ordinary page).

Under ``jit`` the device functions are safe by construction on any table (bad ids are masked,
unwritable tokens dropped, lengths clipped): a traced call cannot raise on values, so it is
these functions that say *which* entry is wrong, with ``ValueError`` naming it. An eager call
of a device function (concrete arguments) already raises on what would change its answer: a
length past capacity, a slot inside a length without a real page, a write without a page.
"""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from paged._cache import PagedKVCache
from paged._checks import check_array, check_quantized, host_int_array, int_option, pool_kind
from paged._layers import LayerPools
from paged._quantized import is_quantized

__all__ = ["from_zero_based_table", "validate", "validate_page_table"]

IntScalar = int | np.integer


def validate_page_table(
    page_table: Int[Array | np.ndarray, "B M"],
    lengths: Int[Array | np.ndarray, " B"],
    *,
    num_pages: IntScalar,
    page_size: IntScalar,
) -> None:
    """Eagerly checks a page table against a pool; raises on anything unsafe or inconsistent.

    Host side: it reads values, so it cannot run under ``jit`` (call it outside). Use it on
    what a jitted step returned: there, tokens without a page were masked or dropped in
    silence (e.g. a jitted :func:`paged.append` with no page for the next token).

    Checks: ids in ``[0, num_pages)``; ``0 <= lengths <= M * page_size``; every slot holding
    a valid token (``j < ceil(lengths / C)``) names a real page (not the null page 0); no page
    appears twice among one sequence's used slots. (Sharing a page across sequences is legal:
    prefix caching and forks do it.)

    Args:
      page_table: ``[B, M]`` int page ids (concrete, not traced).
      lengths: ``[B]`` int lengths.
      num_pages: ``P``, pool size including the null page.
      page_size: ``C``.

    Raises:
      ValueError: naming the first offending sequence and slot.

    Example:
      >>> validate_page_table(jnp.array([[1, 0]]), jnp.array([2]), num_pages=4, page_size=2)
    """
    fn = "validate_page_table"
    num_pages = int_option(fn, "num_pages", num_pages, minimum=1)
    page_size = int_option(fn, "page_size", page_size, minimum=1)
    table = host_int_array(fn, "page_table", page_table, 2)
    lens = host_int_array(fn, "lengths", lengths, 1)
    if lens.shape != (table.shape[0],):
        raise ValueError(
            f"{fn}: lengths: expected page_table [B, M] and lengths [B], got {table.shape} "
            f"and {lens.shape}"
        )
    B, M = table.shape
    bad = np.argwhere((table < 0) | (table >= num_pages))
    if bad.size:
        b, j = bad[0]
        raise ValueError(
            f"{fn}: page_table[{b}, {j}]: expected an id in [0, {num_pages}), got "
            f"{table[b, j]} (page_table[{b}, {j}] = {table[b, j]} is out of range)"
        )
    for b in range(B):
        if not 0 <= lens[b] <= M * page_size:
            raise ValueError(
                f"{fn}: lengths[{b}]: expected a length in [0, {M * page_size}] (capacity), "
                f"got {lens[b]} (lengths[{b}] = {lens[b]} is outside)"
            )
        used = table[b, : -(-int(lens[b]) // page_size)]
        null = np.flatnonzero(used == 0)
        if null.size:
            raise ValueError(
                f"{fn}: page_table[{b}, {null[0]}]: expected a real page (sequence {b} has "
                f"{lens[b]} tokens), got 0: slot {null[0]} is the null page"
            )
        ids, counts = np.unique(used, return_counts=True)
        if np.any(counts > 1):
            raise ValueError(
                f"{fn}: page_table[{b}]: expected distinct pages, got sequence {b} uses page "
                f"{ids[counts > 1][0]} twice"
            )


def validate(cache: PagedKVCache) -> None:
    """Eagerly checks a cache's shapes and page table (see :func:`validate_page_table`).

    Host side: it reads values, so it cannot run under ``jit`` (call it outside). It is how
    to catch, after a jitted step, what the step masked in silence: a sequence whose length
    grew onto a slot without a page (a jitted :func:`paged.append` with no page reserved).

    A quantized cache (pools :class:`paged.QuantizedPages`) is also checked for consistent
    data, scales and formats, and for finite scales in every readable slot (a token written
    with NaN or inf stores a NaN scale and decodes to NaN: this is where it is caught).

    Raises:
      ValueError: on inconsistent shapes, out-of-range ids, lengths over capacity, a null page
        inside a sequence, a page used twice by one sequence, or (quantized) mismatched
        formats or a NaN / inf token in a readable slot.

    Example:
      >>> from paged import init_paged_cache
      >>> validate(init_paged_cache(1, 1, 4, 2, 8, batch=2, max_pages_per_seq=2))
    """
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"validate: cache: expected a PagedKVCache, got {type(cache).__name__}")
    for name in ("k_pages", "v_pages"):
        pools = getattr(cache, name)
        if isinstance(pools, LayerPools):
            _check_layers(name, pools)
    first_k, first_v = cache.k_pages[0], cache.v_pages[0]  # a layer's pool (or a stack's)
    quantized = is_quantized(first_k), is_quantized(first_v)
    if any(quantized):
        if not all(quantized) or first_k.format != first_v.format:
            raise ValueError(
                f"validate: v_pages: expected the kind of k_pages ({pool_kind(first_k)!r}),"
                f" got {pool_kind(first_v)!r}"
            )
        for name in ("k_pages", "v_pages"):
            pools = getattr(cache, name)
            if isinstance(pools, LayerPools):  # each layer's leaves, where they are
                for layer in pools:
                    check_quantized("validate", name, layer, 4)
            else:
                check_quantized("validate", name, pools, 5)
    if cache.k_pages.ndim != 5 or cache.k_pages.shape != cache.v_pages.shape:
        raise ValueError(
            f"validate: v_pages: expected k_pages and v_pages to both be [L, K, P, C, H] "
            f"(must both be one shape), got {cache.k_pages.shape} and {cache.v_pages.shape}"
        )
    if cache.page_table.ndim != 2 or cache.lengths.shape != (cache.page_table.shape[0],):
        raise ValueError(
            f"validate: lengths: expected page_table [B, M] and lengths [B], got "
            f"{cache.page_table.shape} and {cache.lengths.shape}"
        )
    validate_page_table(
        cache.page_table,
        cache.lengths,
        num_pages=cache.k_pages.shape[2],
        page_size=cache.k_pages.shape[3],
    )
    if any(quantized):
        _check_finite_tokens(cache)


def _check_layers(name: str, pools: LayerPools) -> None:
    """One shape, dtype and kind (format) in every layer of per-layer pools."""
    if not pools.layers:
        raise ValueError(f"validate: {name}: expected at least one layer, got none")
    first = pools.layers[0]
    for i, pool in enumerate(pools.layers):
        same = (
            getattr(pool, "shape", None) == first.shape
            and getattr(pool, "dtype", None) == first.dtype
            and is_quantized(pool) == is_quantized(first)
            and (not is_quantized(pool) or pool.format == first.format)
        )
        if not same:
            raise ValueError(
                f"validate: {name}: expected every layer of one shape, dtype and kind (layer "
                f"0: {pool_kind(first)!r} {first.shape} {first.dtype}), got layer {i}: "
                f"{type(pool).__name__} {getattr(pool, 'shape', None)}"
            )


def _check_finite_tokens(cache: PagedKVCache) -> None:
    """Every readable slot of a quantized cache has a finite scale (NaN / inf written).

    Reads the scales, zero-points and residual windows on the host (``LayerPools`` stacks
    those leaves), never the stored data."""
    table = np.asarray(cache.page_table)
    lengths = np.asarray(cache.lengths)
    C = cache.k_pages.shape[3]
    for name, pool in (("k_pages", cache.k_pages), ("v_pages", cache.v_pages)):
        kivi = pool.format.kind == "kivi2"
        scale = np.asarray(pool.scale, np.float32)  # [L, K, P, C] (int4: [L, K, P, C, H/g])
        if kivi:  # stats and the residual: NaN / inf in any readable token shows up there
            scale = scale + np.asarray(pool.zero, np.float32)  # keys: [L, K, P, H]
            if pool.grouping == "channel":
                scale = np.repeat(np.max(scale, axis=-1, keepdims=True), C, axis=-1)
            residual = np.asarray(pool.residual)  # [L, K, B, W * C, H]
            filled = np.asarray(pool.residual_len)  # [L, K, B]
        elif scale.ndim == 5:
            scale = np.where(np.all(np.isfinite(scale), axis=-1), 0.0, np.nan)  # per token
        for b in range(table.shape[0]):
            pos = np.arange(int(lengths[b]))
            pages, offsets = table[b, pos // C], pos % C
            tokens = scale[:, :, pages, offsets]  # [L, K, n]
            if kivi:  # positions inside the residual window (per layer) are read from it
                W = residual.shape[3] // C
                n = filled[:, :, b, None]  # [L, K, 1]
                slot = (pos // C) % W * C + pos % C
                tail = np.max(residual[:, :, b, slot], axis=-1)  # [L, K, n]
                in_tail = (pos >= (n // C - (W - 1)) * C) & (pos < n)
                tokens = np.where(in_tail, tail, tokens)
            bad = np.argwhere(~np.isfinite(tokens))  # [L, K, n] hits
            if bad.size:
                layer, head, i = bad[0]
                raise ValueError(
                    f"validate: {name}: expected finite values in every readable slot, got a "
                    f"NaN or inf token at layer {layer}, kv head {head}, sequence {b}, "
                    f"position {i} (page {pages[i]}): a quantized pool stores it as a NaN "
                    f"scale, which decodes to NaN"
                )


def from_zero_based_table(
    page_table: Int[Array | np.ndarray, "B M"],
) -> Int[Array, "B M"]:
    """Converts a JAX / vLLM page table (page 0 an ordinary page) to ours (page 0 null).

    In ``jax.experimental.pallas.ops.tpu`` paged attention and in vLLM, page 0 is an ordinary
    page; here it is the reserved null page (masked, never written). The conversion is one
    shift: ``page_table + 1``, with pools that hold ``P + 1`` pages, the null page first and
    zero-based page ``i`` at index ``i + 1``. Allocate ``P + 1`` pages from the start, or pad
    existing pools once: ``jnp.pad(pages, ((0, 0), (1, 0), (0, 0), (0, 0)))`` for ``[K, P, C,
    H]``. Table entries past a sequence's length may hold anything: they are masked by
    ``lengths``. Jittable.

    Args:
      page_table: ``[B, M]`` int zero-based page ids.

    Returns:
      ``[B, M]`` int32 ids for a pool with the null page at 0.

    Raises:
      ValueError: if ``page_table`` is not a 2-D int array.

    Example:
      >>> from_zero_based_table(np.array([[0, 2], [1, 0]])).tolist()
      [[1, 3], [2, 1]]
    """
    check_array("from_zero_based_table", "page_table", page_table, 2, jnp.integer)
    return jnp.asarray(page_table, jnp.int32) + 1
