"""KIVI-style 2-bit KV pages: keys per channel over a page, values per token, and a float32
residual page per sequence.

After KIVI (Liu et al., 2024): keys have outlier *channels*, so a key is quantized per channel
over a group of tokens; values have no such structure and are quantized per token. Here the
group of tokens is the page (``C`` tokens), and the most recent tokens of each sequence (the
page that is still filling, ``lengths % C`` tokens) stay in full precision in a *residual*
page, which is quantized as a whole the moment the page fills. So every stored key page has
seen all of its tokens before its per-channel statistics are fixed.

Layout of a ``kivi2`` pool (:class:`paged.QuantizedPages` with ``format.kind == "kivi2"``),
for a cache (``[L, K, P, C, H]`` float shape; a layer drops ``L``):

* ``data [L, K, P, C, H // 4]`` uint8: four 2-bit codes per byte, ``h = 4 * i + j`` in bits
  ``2j .. 2j + 1`` of byte ``i``;
* keys (``grouping == "channel"``): ``scale``, ``zero`` ``[L, K, P, H]`` bfloat16, one pair
  per channel per page; values (``grouping == "token"``): ``[L, K, P, C]`` bfloat16, one
  pair per token;
* ``residual [L, K, B, C, H]`` float32: each sequence's open page (tokens
  ``C * (lengths // C) ... lengths - 1``); the stored page under it is not read.

Asymmetric codes: ``x' = zero + q * scale`` with ``q in {0, 1, 2, 3}``, ``zero = min``,
``scale = (max - min) / 3`` over the group, both rounded to bfloat16 (stated: 2 bytes each);
``q = clip(round((x - zero) / scale), 0, 3)`` is computed from the rounded pair. Per element
``|x - x'| <= (max - min) / 6 + (|min| + |max|) * 2**-8`` (half a step plus the two
bfloat16 roundings). A constant group decodes to ``bf16(min)``; a group holding NaN or inf
decodes to NaN (``paged.validate`` rejects such a token).

Bytes per token per kv head at ``H = 128``: keys ``H / 4 + 4 H / C``, values ``H / 4 + 4``;
with ``C = 64``: 76 bytes for both against bf16's 512 (0.148x), ``C = 16``: 100 (0.195x).
The residual adds ``2 * L * K * C * H * 4`` bytes per sequence, independent of its length.

Writes (:func:`paged.write`, :func:`paged.append`, :func:`paged.write_layer`) go through a
float staging window of the pages the chunk touches: the window starts from the decoded
stored pages and the residual, takes the new tokens, then every page of it that lies wholly
below the new length is encoded and stored, and the page holding the new length (if partial)
becomes the residual. Rewriting tokens of a page that is already stored re-encodes that page
from its decoded values (lossy again); appends never do.
"""

import jax.numpy as jnp

__all__ = [
    "decode",
    "encode",
    "pack2",
    "unpack2",
    "substitute_residual",
    "write_tokens",
]

_LEVELS = 3.0  # codes 0 .. 3


def pack2(q):
    """``[..., H]`` codes in ``0..3`` -> ``[..., H // 4]`` uint8 (4 codes per byte)."""
    q = q.astype(jnp.uint8).reshape(*q.shape[:-1], q.shape[-1] // 4, 4)
    shifts = jnp.arange(4, dtype=jnp.uint8) * 2
    return jnp.sum(q << shifts, axis=-1, dtype=jnp.uint8)


def unpack2(data):
    """``[..., H // 4]`` uint8 -> ``[..., H]`` float32 codes in ``0..3``."""
    shifts = jnp.arange(4, dtype=jnp.uint8) * 2
    q = (data[..., None] >> shifts) & jnp.uint8(3)
    return q.reshape(*data.shape[:-1], data.shape[-1] * 4).astype(jnp.float32)


def encode(x, grouping: str):
    """``x [..., C, H]`` float -> ``(data [..., C, H // 4], scale, zero)`` bfloat16 stats
    ``[..., H]`` (``"channel"``: over the ``C`` tokens) or ``[..., C]`` (``"token"``)."""
    x = x.astype(jnp.float32)
    axis = -2 if grouping == "channel" else -1
    lo = jnp.min(x, axis=axis)
    hi = jnp.max(x, axis=axis)
    zero = lo.astype(jnp.bfloat16)
    scale = ((hi - lo) / _LEVELS).astype(jnp.bfloat16)
    z = jnp.expand_dims(zero.astype(jnp.float32), axis)
    s = jnp.expand_dims(scale.astype(jnp.float32), axis)
    positive = s > 0
    q = jnp.round((x - z) / jnp.where(positive, s, 1.0))
    q = jnp.where(positive, jnp.clip(q, 0.0, _LEVELS), 0.0)
    q = jnp.where(jnp.isnan(q), 0.0, q)  # a NaN group: its stats carry the NaN
    bad = ~jnp.isfinite(hi - lo)
    scale = jnp.where(bad, jnp.nan, scale).astype(jnp.bfloat16)
    return pack2(q), scale, zero


def decode(data, scale, zero, grouping: str):
    """The inverse of :func:`encode`: float32 ``[..., C, H]``."""
    q = unpack2(data)
    axis = -2 if grouping == "channel" else -1
    s = jnp.expand_dims(scale.astype(jnp.float32), axis)
    z = jnp.expand_dims(zero.astype(jnp.float32), axis)
    return z + q * s


def substitute_residual(block, residual, kv_pos, filled, page_size: int):
    """``block [K, S, H]`` keys or values at positions ``kv_pos [S]`` with those of the open
    page (``[C * (filled // C), filled)``) taken from ``residual [K, C, H]``; ``filled`` is
    the row's written length (``residual_len``), whatever length the query reads to."""
    base = (filled // page_size) * page_size
    in_tail = (kv_pos >= base) & (kv_pos < filled)
    idx = jnp.clip(kv_pos - base, 0, page_size - 1)
    return jnp.where(in_tail[None, :, None], jnp.take(residual, idx, axis=1), block)


def write_tokens(pool, table, x, start, count, layers, capacity: int):
    """Writes the first ``count [B]`` tokens of ``x [Lw, B, T, K, H]`` at ``start [B]`` into
    layers ``layers [Lw]`` of a kivi2 cache pool ``[L, K, P, C, H]`` (see the module docs);
    the rest of each row is dropped. A layer id ``>= L`` drops its rows. Returns the pool."""
    from paged._quantized import QuantizedPages

    L, K, P, C, H = pool.shape
    Lw, B, T = x.shape[:3]
    M = table.shape[1]
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

    # The current contents of the window, decoded: [Lw, B, n_pg, K, C, H].
    index = (lay[:, None, None], slice(None), ids[None])
    scale = pool.scale[index]
    zero = pool.zero[index]
    cur = decode(pool.data[index], scale, zero, grouping).reshape(Lw, B, n_pg, K, C, H)
    cur = cur.transpose(0, 1, 3, 2, 4, 5).reshape(Lw, B, K, span, H)  # token-major window
    pos = base[:, None] + jnp.arange(span, dtype=jnp.int32)  # [B, span]
    residual = pool.residual[lay]  # [Lw, K, B, C, H]
    res_b = residual.transpose(0, 2, 1, 3, 4)  # [Lw, B, K, C, H]
    open_base = (lengths // C) * C  # [Lw, B]
    in_tail = (pos[None] >= open_base[..., None]) & (pos[None] < lengths[..., None])
    tail_idx = jnp.clip(pos[None] - open_base[..., None], 0, C - 1)  # [Lw, B, span]
    tail_vals = jnp.take_along_axis(res_b, tail_idx[:, :, None, :, None], axis=3)
    stored = (pos[None] < open_base[..., None]) & jnp.repeat(page_ok, C, axis=1)[None]
    cur = jnp.where(in_tail[:, :, None, :, None], tail_vals, cur)
    cur = jnp.where((in_tail | stored)[:, :, None, :, None], cur, 0.0)

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

    # The residual: the page holding new_len when it is partial and inside the window; an
    # exactly full length leaves no residual (zeros); otherwise the old residual stays.
    j_tail = new_len // C - base[None] // C  # [Lw, B]
    tail_in = (new_len % C != 0) & (j_tail >= 0) & (j_tail < n_pg) & (count > 0)[None]
    empty = new_len % C == 0
    win_pages = window.reshape(Lw, B, K, n_pg, C, H)
    new_tail = jnp.take_along_axis(
        win_pages, jnp.clip(j_tail, 0, n_pg - 1)[:, :, None, None, None, None], axis=3
    )[:, :, :, 0]  # [Lw, B, K, C, H]
    tail_pos = (new_len // C * C)[..., None] + jnp.arange(C, dtype=jnp.int32)  # [Lw, B, C]
    new_tail = jnp.where((tail_pos < new_len[..., None])[:, :, None, :, None], new_tail, 0.0)
    res_new = jnp.where(
        tail_in[:, :, None, None, None],
        new_tail,
        jnp.where(empty[:, :, None, None, None], 0.0, res_b),
    )
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


def reseat(pool, table, lengths):
    """A kivi2 cache pool whose rows now hold ``lengths [B]`` tokens on ``table [B, M]``.

    A row whose open page is unchanged keeps its residual (cut at the new length); any other
    row takes its residual from the decoded page stored at its new open page (zeros where no
    page or nothing stored). ``residual_len`` becomes ``lengths`` on every layer.
    """
    from paged._quantized import QuantizedPages

    L, K, P, C, H = pool.shape
    B, M = table.shape
    lengths = lengths.astype(jnp.int32)
    old = pool.residual_len[:, 0]  # [L, B]
    slot = lengths // C
    ids = jnp.take_along_axis(table.astype(jnp.int32), jnp.clip(slot, 0, M - 1)[:, None], 1)[:, 0]
    ok = (slot < M) & (ids > 0) & (ids < P)
    ids = jnp.where(ok, ids, 0)
    part = QuantizedPages(
        pool.data[:, :, ids], pool.scale[:, :, ids], pool.format, pool.zero[:, :, ids],
        grouping=pool.grouping,
    )  # fmt: skip
    stored = decode(part.data, part.scale, part.zero, pool.grouping)  # [L, K, B, C, H]
    stored = jnp.where(ok[None, None, :, None, None], stored, 0.0)
    same = (old // C == slot[None])[:, None, :, None, None]  # [L, 1, B, 1, 1]
    keep = (jnp.arange(C)[None, :] < (lengths % C)[:, None])[None, None, :, :, None]
    residual = jnp.where(keep, jnp.where(same, pool.residual, stored), 0.0)
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
