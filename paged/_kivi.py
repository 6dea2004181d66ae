"""KIVI-style 2-bit KV pages: keys per channel over a page, values per token, and a float32
residual page per sequence.

After KIVI (Liu et al., 2024): keys have outlier *channels*, so a key is quantized per channel
over a group of tokens; values have no such structure and are quantized per token. Here the
group of tokens is the page (``C`` tokens), and the most recent tokens of each sequence stay in
full precision in a float32 *window* of ``W = format.residual_pages(C)`` pages: the page that
is still filling plus the ``W - 1`` most recent full pages (``KVFormat("kivi2", residual=R)``:
``W = ceil(R / C) + 1``, so at least ``R`` and fewer than ``R + C`` recent tokens are exact;
``R = 0``: the open page only). A page is encoded and stored the moment it fills (so every
stored key page has seen all of its tokens before its per-channel statistics are fixed, and
the stored pool is complete for offload), and is read from the window until it slides out.

Layout of a ``kivi2`` pool (:class:`paged.QuantizedPages` with ``format.kind == "kivi2"``),
for a cache (``[L, K, P, C, H]`` float shape; a layer drops ``L``):

* ``data [L, K, P, C, H // 4]`` uint8: four 2-bit codes per byte, ``h = 4 * i + j`` in bits
  ``2j .. 2j + 1`` of byte ``i``;
* keys (``grouping == "channel"``): ``scale``, ``zero`` ``[L, K, P, H]`` bfloat16, one pair
  per channel per page; values (``grouping == "token"``): ``[L, K, P, C]`` bfloat16, one
  pair per token;
* ``residual [L, K, B, W * C, H]`` float32: each sequence's window, a ring of ``W`` page
  slots: token ``p`` lives in slot ``(p // C) % W`` at offset ``p % C``; with ``n`` tokens
  written (``residual_len [L, K, B]``) the window holds positions
  ``C * (n // C - W + 1) ... n - 1``, and reads of those positions take it (the stored pages
  under it are not read; the open page's is not even written).

Asymmetric codes: ``x' = zero + q * scale`` with ``q in {0, 1, 2, 3}``; over the group, in
float32, each step rounded to nearest even: ``zero = bfloat16(min)``, ``scale =
bfloat16((max - min) * float32(1 / 3))`` (stored: 2 bytes each); ``q = clip(round((x - z) *
float32(1 / s)), 0, 3)`` (the reciprocal first, round half to even, then the clip) computed
from the rounded pair ``z = float32(zero)``, ``s = float32(scale)``, and ``q = 0`` where
``s == 0`` (a constant group). ``tests/paged/test_codec_docs.py`` checks these words,
rewritten in numpy, bit for bit; values below float32's smallest normal follow the backend
(XLA:CPU flushes them). Per element
``|x - x'| <= (max - min) / 6 + (|min| + |max|) * 2**-8`` (half a step plus the two
bfloat16 roundings). A constant group decodes to ``bf16(min)``; a group holding NaN or inf
stores ``scale = zero = NaN`` and codes 0, and decodes to NaN (``paged.validate`` rejects
such a token).

Bytes per token per kv head at ``H = 128``: keys ``H / 4 + 4 H / C``, values ``H / 4 + 4``;
with ``C = 64``: 76 bytes for both against bf16's 512 (0.148x), ``C = 16``: 100 (0.195x).
The window adds ``2 * L * K * W * C * H * 4`` bytes per sequence, independent of its length.

Writes (:func:`paged.write`, :func:`paged.append`, :func:`paged.write_layer`) go through a
float staging window of the pages the chunk touches: it starts from the decoded stored pages
and the residual window, takes the new tokens, then every page of it that lies wholly below
the new length is encoded and stored, and the residual window slides to the new length
(pages it keeps come from the staging window or the old window; a page that slides out is
simply no longer read from it). Rewriting tokens of a stored page inside the window
re-encodes it from the exact values; one below the window, from its decoded values (lossy
again); appends never do.
"""

import jax.numpy as jnp

from paged._kivi_codec import decode, encode
from paged._quantized import QuantizedPages

__all__ = ["reseat", "substitute_residual", "window_slot", "write_tokens"]


def window_slot(pos, filled, page_size: int, slots: int):
    """``(inside, index)`` for positions ``pos`` of a row with ``filled`` tokens written:
    whether the residual window holds each (``C * (filled // C - W + 1) <= pos < filled``)
    and where (``((pos // C) % W) * C + pos % C``), for a window of ``W = slots`` pages.
    ``filled`` may lie outside ``[0, capacity)`` (a device's share of a longer sequence)."""
    C, W = page_size, slots
    base = (filled // C - (W - 1)) * C
    inside = (pos >= base) & (pos < filled)
    index = jnp.mod(pos // C, W) * C + jnp.mod(pos, C)
    return inside, index


def substitute_residual(block, residual, kv_pos, filled, page_size: int):
    """``block [K, S, H]`` keys or values at positions ``kv_pos [S]`` with those inside the
    residual window (see :func:`window_slot`) taken from ``residual [K, W * C, H]``;
    ``filled`` is the row's written length (``residual_len``), whatever length the query
    reads to."""
    slots = residual.shape[-2] // page_size
    inside, idx = window_slot(kv_pos, filled, page_size, slots)
    return jnp.where(inside[None, :, None], jnp.take(residual, idx, axis=1), block)


def _slot_pages(filled, page_size: int, slots: int):
    """``[..., W]``: the page index each window slot holds for rows of ``filled`` tokens
    (``j`` in ``[n // C - W + 1, n // C]`` with ``j % W`` = the slot; negative: none)."""
    top = filled // page_size
    first = top - (slots - 1)
    s = jnp.arange(slots, dtype=jnp.int32)
    return first[..., None] + jnp.mod(s - first[..., None], slots)


def write_tokens(pool, table, x, start, count, layers, capacity: int):
    """Writes the first ``count [B]`` tokens of ``x [Lw, B, T, K, H]`` at ``start [B]`` into
    layers ``layers [Lw]`` of a kivi2 cache pool ``[L, K, P, C, H]`` (see the module docs);
    the rest of each row is dropped. A layer id ``>= L`` drops its rows. Returns the pool."""
    L, K, P, C, H = pool.shape
    Lw, B, T = x.shape[:3]
    M = table.shape[1]
    W = pool.residual.shape[-2] // C
    grouping = pool.grouping
    n_pg = (C - 1 + T + C - 1) // C  # pages a chunk of T tokens starting anywhere spans
    span = n_pg * C
    lay = jnp.clip(layers, 0, L - 1)
    start = start.astype(jnp.int32)
    count = jnp.clip(count.astype(jnp.int32), 0, T)
    lengths = pool.residual_len[lay, 0]  # [Lw, B]: tokens written so far, per layer
    base = (start // C) * C  # [B]
    page_idx = base[:, None] // C + jnp.arange(n_pg, dtype=jnp.int32)  # [B, n_pg]
    ids = jnp.take_along_axis(table.astype(jnp.int32), jnp.clip(page_idx, 0, M - 1), axis=1)
    page_ok = (page_idx >= 0) & (page_idx < M) & (ids > 0) & (ids < P)
    ids = jnp.where(page_ok, ids, 0)

    # The current contents of the staging window: [Lw, B, K, span, H], from the residual
    # window where it holds the position, else the decoded stored page below it, else zero.
    index = (lay[:, None, None], slice(None), ids[None])
    scale = pool.scale[index]
    zero = pool.zero[index]
    cur = decode(pool.data[index], scale, zero, grouping).reshape(Lw, B, n_pg, K, C, H)
    cur = cur.transpose(0, 1, 3, 2, 4, 5).reshape(Lw, B, K, span, H)  # token-major window
    pos = base[:, None] + jnp.arange(span, dtype=jnp.int32)  # [B, span]
    residual = pool.residual[lay]  # [Lw, K, B, W * C, H]
    res_b = residual.transpose(0, 2, 1, 3, 4)  # [Lw, B, K, W * C, H]
    inside, slot = window_slot(pos[None], lengths[..., None], C, W)  # [Lw, B, span]
    held = jnp.take_along_axis(res_b, slot[:, :, None, :, None], axis=3)
    win_base = (lengths // C - (W - 1)) * C  # [Lw, B]
    stored = (pos[None] < win_base[..., None]) & jnp.repeat(page_ok, C, axis=1)[None]
    cur = jnp.where(inside[:, :, None, :, None], held, cur)
    cur = jnp.where((inside | stored)[:, :, None, :, None], cur, 0.0)

    # The new tokens at their offsets in the window.
    offset = (start - base)[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    offset = jnp.where(jnp.arange(T)[None, :] < count[:, None], offset, span)  # span: dropped
    new = x.astype(jnp.float32).transpose(0, 1, 3, 2, 4)  # [Lw, B, K, T, H]
    b_idx = jnp.arange(B)[:, None]
    window = cur.transpose(0, 1, 3, 2, 4)  # [Lw, B, span, K, H]
    window = window.at[:, b_idx, offset].set(new.transpose(0, 1, 3, 2, 4), mode="drop")
    window = window.transpose(0, 1, 3, 2, 4)  # [Lw, B, K, span, H]

    end = jnp.where(count > 0, start + count, 0)
    new_len = jnp.clip(jnp.maximum(lengths, end[None]), 0, capacity)  # [Lw, B]
    page_end = base[:, None] + (jnp.arange(n_pg, dtype=jnp.int32) + 1) * C  # [B, n_pg]
    # Stored: pages wholly below the new length that this write touched (count > 0).
    full = page_ok[None] & (page_end[None] <= new_len[..., None]) & (count > 0)[None, :, None]
    pages = window.reshape(Lw, B, K, n_pg, C, H).transpose(0, 1, 3, 2, 4, 5)  # [Lw,B,n_pg,K,C,H]
    data, scale, zero = encode(pages, grouping)
    drop_layer = layers >= L
    target = jnp.where(full & ~drop_layer[:, None, None], ids[None], P)  # P: dropped
    put = (lay[:, None, None], slice(None), target)
    out_data = pool.data.at[put].set(data, mode="drop")
    out_scale = pool.scale.at[put].set(scale, mode="drop")
    out_zero = pool.zero.at[put].set(zero, mode="drop")

    # The residual window slides to new_len: slot s holds page j_new[s]; it comes from the
    # staging window when this write touched it, else from the old window (same page in the
    # same slot), else it is empty. Positions at or past new_len are zero.
    j_new = _slot_pages(new_len, C, W)  # [Lw, B, W]
    rel = j_new - (base // C)[None, :, None]  # the page's index in the staging window
    from_stage = (rel >= 0) & (rel < n_pg) & (count > 0)[None, :, None]
    from_old = j_new == _slot_pages(lengths, C, W)
    staged = jnp.take_along_axis(
        window.reshape(Lw, B, K, n_pg, C, H),
        jnp.clip(rel, 0, n_pg - 1)[:, :, None, :, None, None],
        axis=3,
    )  # [Lw, B, K, W, C, H]
    old = res_b.reshape(Lw, B, K, W, C, H)
    res_new = jnp.where(
        from_stage[:, :, None, :, None, None],
        staged,
        jnp.where(from_old[:, :, None, :, None, None], old, 0.0),
    )
    tok = j_new[..., None] * C + jnp.arange(C, dtype=jnp.int32)  # [Lw, B, W, C]
    keep = (tok >= 0) & (tok < new_len[..., None, None])
    res_new = jnp.where(keep[:, :, None, :, :, None], res_new, 0.0).reshape(Lw, B, K, W * C, H)
    layer_put = jnp.where(drop_layer, L, layers)
    out_res = pool.residual.at[layer_put].set(res_new.transpose(0, 2, 1, 3, 4), mode="drop")
    new_len = jnp.broadcast_to(new_len[:, None, :], (Lw, K, B))
    out_len = pool.residual_len.at[layer_put].set(new_len, mode="drop")
    return QuantizedPages(
        out_data,
        out_scale,
        pool.format,
        zero=out_zero,
        residual=out_res,
        residual_len=out_len,
        grouping=grouping,
    )


def reseat(pool, old_table, table, lengths):
    """A kivi2 cache pool whose rows now hold ``lengths [B]`` tokens on ``table [B, M]``
    (the rows held ``pool.residual_len`` tokens on ``old_table [B, M]``).

    Each slot of a row's new residual window keeps the old window's tokens where the slot
    still holds the same page index on the same page id (cut at both lengths); any other
    position inside the new window is taken from the decoded page stored there (zeros where
    no page). ``residual_len`` becomes ``lengths`` on every layer.
    """
    L, K, P, C, H = pool.shape
    B, M = table.shape
    W = pool.residual.shape[-2] // C
    lengths = lengths.astype(jnp.int32)
    old = pool.residual_len[:, 0]  # [L, B]
    j_new = _slot_pages(lengths, C, W)  # [B, W]
    j_at = jnp.clip(j_new, 0, M - 1)
    ids = jnp.take_along_axis(table.astype(jnp.int32), j_at, axis=1)  # [B, W]
    old_ids = jnp.take_along_axis(old_table.astype(jnp.int32), j_at, axis=1)
    ok = (j_new >= 0) & (j_new < M) & (ids > 0) & (ids < P)
    ids = jnp.where(ok, ids, 0)
    part = QuantizedPages(
        pool.data[:, :, ids], pool.scale[:, :, ids], pool.format, pool.zero[:, :, ids],
        grouping=pool.grouping,
    )  # fmt: skip
    stored = decode(part.data, part.scale, part.zero, pool.grouping)  # [L, K, B, W, C, H]
    stored = jnp.where(ok[None, None, :, :, None, None], stored, 0.0)
    tok = j_new[..., None] * C + jnp.arange(C, dtype=jnp.int32)  # [B, W, C]
    same = (_slot_pages(old, C, W) == j_new[None]) & (old_ids == ids)[None]  # [L, B, W]
    same = same[..., None] & (tok[None] < old[:, :, None, None])  # [L, B, W, C]
    keep = (tok >= 0) & (tok < lengths[:, None, None])  # [B, W, C]
    res_old = pool.residual.reshape(L, K, B, W, C, H)
    residual = jnp.where(same[:, None, ..., None], res_old, stored)
    residual = jnp.where(keep[None, None, ..., None], residual, 0.0).reshape(L, K, B, W * C, H)
    filled = jnp.broadcast_to(lengths[None, None], (L, K, B))
    return QuantizedPages(
        pool.data,
        pool.scale,
        pool.format,
        zero=pool.zero,
        residual=residual,
        residual_len=filled,
        grouping=pool.grouping,
    )
