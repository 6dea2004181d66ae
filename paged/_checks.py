"""Input checks shared by every public entry of ``paged`` (one error format everywhere).

Every check raises ``ValueError(f"{fn}: {arg}: expected {X}, got {Y}")``. Scalar options:
an int option accepts Python ``int`` and numpy integer scalars and returns a Python ``int``;
``bool``, floats (``3.0`` included: never truncated) and everything else are rejected. Float
mask options (``scale``, ``softcap``) are checked by :func:`ringattn.resolve_mask`.
"""

import jax
import jax.numpy as jnp
import numpy as np

from paged._kv_format import KVFormat
from paged._quantized import is_quantized

__all__ = [
    "check_array",
    "check_heads",
    "check_pages",
    "check_quantized",
    "pool_dtype",
    "pool_kind",
    "check_table",
    "check_table_values",
    "check_write_values",
    "concrete_values",
    "describe",
    "host_int_array",
    "int_option",
    "is_int",
    "layer_index",
]


def is_int(x) -> bool:
    """A Python or numpy integer scalar, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def describe(x) -> str:
    """``shape (..) dtype ..`` of an array, or the repr of anything else."""
    if is_quantized(x):
        data = tuple(x.data.shape)
        if tuple(x.shape) == data:
            return f"QuantizedPages {x.format.kind!r} shape {data}"
        return f"QuantizedPages {x.format.kind!r} shape {tuple(x.shape)} (data {data})"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"shape {tuple(x.shape)} dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"


def int_option(fn: str, name: str, value, *, minimum: int | None = None) -> int:
    """Checks an int option (``int`` or numpy integer, ``>= minimum``); returns ``int``."""
    if not is_int(value) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{fn}: {name}: expected an int{bound}, got {value!r}")
    return int(value)


def layer_index(fn: str, value, num_layers: int, *, traced_ok: bool):
    """A layer index: an int in ``[0, L)``, or (``traced_ok``) an integer 0-d array.

    A float (Python, numpy or a float array) is a ``ValueError``, never truncated.
    """
    if is_int(value):
        if not 0 <= value < num_layers:
            raise ValueError(f"{fn}: layer: expected an int in [0, {num_layers}), got {value!r}")
        return int(value)
    if (
        traced_ok
        and hasattr(value, "dtype")
        and hasattr(value, "shape")
        and tuple(value.shape) == ()
        and jnp.issubdtype(value.dtype, jnp.integer)
    ):
        return value
    want = "an int or an integer 0-d array" if traced_ok else f"an int in [0, {num_layers})"
    raise ValueError(f"{fn}: layer: expected {want}, got {describe(value)}")


def check_array(fn: str, name: str, x, ndim: int, kind) -> None:
    """An array of rank ``ndim`` and dtype kind ``jnp.floating`` / ``jnp.integer``."""
    what = "floating point" if kind is jnp.floating else "integer"
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{fn}: {name}: expected a rank-{ndim} {what} array, got {describe(x)}")
    if x.ndim != ndim:
        raise ValueError(f"{fn}: {name}: expected rank {ndim}, got {describe(x)}")
    if not jnp.issubdtype(x.dtype, kind):
        article = "a" if kind is jnp.floating else "an"
        raise ValueError(f"{fn}: {name}: expected {article} {what} array, got {describe(x)}")


def check_quantized(fn: str, name: str, pages, ndim: int) -> None:
    """A :class:`paged.QuantizedPages` of rank ``ndim`` with consistent data and scales."""
    data, scale, kv_format = pages.data, pages.scale, pages.format
    if not isinstance(kv_format, KVFormat):
        raise ValueError(f"{fn}: {name}: expected format a paged.KVFormat, got {kv_format!r}")
    for part, x in (("data", data), ("scale", scale)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{fn}: {name}.{part}: expected an array, got {describe(x)}")
    if data.ndim != ndim:
        raise ValueError(f"{fn}: {name}.data: expected rank {ndim}, got {describe(data)}")
    if data.dtype != kv_format.storage_dtype:
        raise ValueError(
            f"{fn}: {name}.data: expected dtype {kv_format.storage_dtype} (format "
            f"{kv_format.kind!r}), got {describe(data)}"
        )
    if kv_format.kind == "kivi2":
        _check_kivi(fn, name, pages)
        return
    H = kv_format.float_shape(data.shape)[-1]
    want = kv_format.scale_shape(kv_format.float_shape(data.shape))
    if tuple(scale.shape) != want or scale.dtype != kv_format.scale_dtype:
        groups = "per group along H" if len(want) == ndim else "data's shape without H"
        raise ValueError(
            f"{fn}: {name}.scale: expected {kv_format.scale_dtype} scales of shape {want} "
            f"({groups}), got {describe(scale)}"
        )
    kv_format.check_head_dim(fn, f"{name}.data", H)


def _check_kivi(fn: str, name: str, pages) -> None:
    data, grouping = pages.data, pages.grouping
    shape = tuple(pages.shape)  # [*lead, P, C, H]
    if grouping not in ("channel", "token"):
        raise ValueError(
            f"{fn}: {name}.grouping: expected 'channel' (keys) or 'token' (values), got "
            f"{grouping!r}"
        )
    want = pages.format.scale_shape(shape, grouping)
    for part in ("scale", "zero"):
        x = getattr(pages, part)
        if not hasattr(x, "shape") or tuple(x.shape) != want or x.dtype != jnp.bfloat16:
            raise ValueError(
                f"{fn}: {name}.{part}: expected bfloat16 of shape {want} (kivi2, grouping "
                f"{grouping!r}), got {describe(x)}"
            )
    res = pages.residual
    if (res is None) != (pages.residual_len is None):
        raise ValueError(f"{fn}: {name}: expected residual and residual_len both set or both None")
    if res is not None:
        window = pages.format.residual_pages(shape[-2]) * shape[-2]  # W * C
        ok = hasattr(res, "shape") and res.ndim == data.ndim
        ok = ok and tuple(res.shape[:-3]) == shape[:-3]
        ok = ok and tuple(res.shape[-2:]) == (window, shape[-1])
        if not ok or res.dtype != jnp.float32:
            raise ValueError(
                f"{fn}: {name}.residual: expected float32 [{', '.join(map(str, shape[:-3]))}"
                f"{', ' if shape[:-3] else ''}B, {window}, {shape[-1]}] (W * C = {window}: "
                f"{pages.format}), got {describe(res)}"
            )
        filled = pages.residual_len
        if tuple(filled.shape) != tuple(res.shape[:-2]) or filled.dtype != jnp.int32:
            raise ValueError(
                f"{fn}: {name}.residual_len: expected int32 of shape {tuple(res.shape[:-2])}, "
                f"got {describe(filled)}"
            )


def check_residual_rows(fn: str, k_pages, v_pages, B: int) -> None:
    """A kivi2 pool's residual has one row per sequence of the page table."""
    for name, pool in (("k_pages", k_pages), ("v_pages", v_pages)):
        res = getattr(pool, "residual", None)
        if res is not None and res.shape[-3] != B:
            raise ValueError(
                f"{fn}: {name}.residual: expected one residual page per sequence (B={B} "
                f"rows of page_table), got {res.shape[-3]}"
            )


def pool_kind(pages) -> str:
    """``"float"`` or the quantized format's kind (for messages)."""
    return pages.format.kind if is_quantized(pages) else "float"


def check_pages(fn: str, k_pages, v_pages) -> tuple[int, int, int, int]:
    """Checks ``k_pages, v_pages [K, P, C, H]`` (float arrays, or both
    :class:`paged.QuantizedPages` of one format); returns ``(K, P, C, H)``."""
    if is_quantized(k_pages) or is_quantized(v_pages):
        if not (is_quantized(k_pages) and is_quantized(v_pages)):
            if is_quantized(k_pages):
                name, pool, other = "v_pages", v_pages, k_pages
            else:
                name, pool, other = "k_pages", k_pages, v_pages
            raise ValueError(
                f"{fn}: {name}: expected a pool of the same kind as the other one "
                f"(quantized {pool_kind(other)!r}: both paged.QuantizedPages of one format, "
                f"or both float arrays), got {describe(pool)}"
            )
        check_quantized(fn, "k_pages", k_pages, 4)
        check_quantized(fn, "v_pages", v_pages, 4)
        if k_pages.format != v_pages.format or k_pages.shape != v_pages.shape:
            raise ValueError(
                f"{fn}: v_pages: expected the shape and format of k_pages ({k_pages.shape}, "
                f"{k_pages.format.kind!r}), got {v_pages.shape}, {v_pages.format.kind!r}"
            )
    else:
        check_array(fn, "k_pages", k_pages, 4, jnp.floating)
        check_array(fn, "v_pages", v_pages, 4, jnp.floating)
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(
            f"{fn}: v_pages: expected the shape and dtype of k_pages ({describe(k_pages)}), "
            f"got {describe(v_pages)}"
        )
    K, P, C, H = k_pages.shape
    for letter, size in zip("KPCH", (K, P, C, H), strict=True):
        if size < 1:
            raise ValueError(
                f"{fn}: k_pages: expected non-empty dims [K, P, C, H], got {k_pages.shape} "
                f"({letter} = 0)"
            )
    return K, P, C, H


def check_table(fn: str, page_table, lengths, B: int | None) -> tuple[int, int]:
    """Checks ``page_table [B, M]`` and ``lengths [B]`` (integers); returns ``(B, M)``."""
    check_array(fn, "page_table", page_table, 2, jnp.integer)
    check_array(fn, "lengths", lengths, 1, jnp.integer)
    Bt, M = page_table.shape
    if B is not None and Bt != B:
        raise ValueError(
            f"{fn}: page_table: expected {B} rows (the batch), got shape {page_table.shape}"
        )
    if lengths.shape != (Bt,):
        raise ValueError(f"{fn}: lengths: expected shape ({Bt},), got {describe(lengths)}")
    if M < 1:
        raise ValueError(
            f"{fn}: page_table: expected at least one column (M >= 1), got {page_table.shape}"
        )
    return Bt, M


def concrete_values(*arrays) -> tuple[np.ndarray, ...] | None:
    """The values of ``arrays`` as numpy arrays on an eager call, else None.

    Eager means every array is concrete: not a ``jax.core.Tracer`` (under ``jit``, ``vmap``,
    ``shard_map`` or a ``grad`` it is one, and reading it would fail or add a host sync to the
    traced program) and, for a ``jax.Array``, fully addressable. This is the one test every
    public entry of ``paged`` uses before checking values: traced calls keep the documented
    masking; eager calls pay one device-to-host copy of these small int arrays.
    """
    for x in arrays:
        if isinstance(x, jax.core.Tracer):
            return None
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return None
    return tuple(np.asarray(x) for x in arrays)


_RESERVE = (
    "reserve pages first (PageAllocator.allocate / extend, then with_page_table; on device "
    "paged.ensure_next_page)"
)


def check_table_values(
    fn: str,
    page_table,
    lengths,
    *,
    num_pages: int,
    page_size: int,
    table_name: str = "page_table",
    lengths_name: str = "lengths",
    allow_null: bool = False,
) -> None:
    """On an eager call (:func:`concrete_values`): every ``lengths[b]`` in ``[0, M * C]`` and
    every slot holding one of its tokens (``j < ceil(lengths[b] / C)``) a real page, an id in
    ``[1, num_pages)`` (``allow_null``: or the null page, a page absent on purpose: released
    by ``PageAllocator.release_pages``, dropped or demoted by a retention policy). Slots past
    a length are never read and may hold anything. Under ``jit`` nothing is checked: such
    tokens are masked (see :mod:`paged._attention`).
    """
    values = concrete_values(page_table, lengths)
    if values is None:
        return
    table, lens = values
    M = table.shape[1]
    capacity = M * page_size
    bad = np.flatnonzero((lens < 0) | (lens > capacity))
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"{fn}: {lengths_name}[{b}]: expected a length in [0, {capacity}] (capacity M * C = "
            f"{M} * {page_size}), got {lens[b]}: a sequence cannot hold more tokens than its "
            f"table slots"
        )
    used = np.arange(M)[None, :] * page_size < lens[:, None]  # [B, M] slots holding a token
    bad = np.argwhere(used & ((table < (0 if allow_null else 1)) | (table >= num_pages)))
    if bad.size:
        b, j = (int(i) for i in bad[0])
        page = int(table[b, j])
        if page == 0:
            raise ValueError(
                f"{fn}: {table_name}[{b}, {j}]: expected a real page for tokens "
                f"{j * page_size}..{(j + 1) * page_size - 1} of sequence {b} "
                f"({lengths_name}[{b}] = {lens[b]}), got the null page 0: {_RESERVE}"
            )
        raise ValueError(
            f"{fn}: {table_name}[{b}, {j}]: expected a page id in [1, {num_pages}) (sequence "
            f"{b} has {lens[b]} tokens), got {page}"
        )


def check_write_values(
    fn: str,
    page_table,
    start,
    count,
    *,
    num_pages: int,
    page_size: int,
    start_name: str = "start",
    table_name: str = "page_table",
) -> None:
    """On an eager call (:func:`concrete_values`): every token a write stores (positions
    ``start[b] ... start[b] + count[b] - 1``) has a real page: a position ``>= 0``, a slot
    inside the table, an id in ``[1, num_pages)``. Under ``jit`` such tokens are dropped.
    """
    values = concrete_values(page_table, start, count)
    if values is None:
        return
    table, first, count = values
    M = table.shape[1]
    capacity = M * page_size
    for b in np.flatnonzero(count > 0):
        b = int(b)
        lo, hi = int(first[b]), int(first[b]) + int(count[b])  # positions lo .. hi - 1
        if lo < 0:
            raise ValueError(
                f"{fn}: {start_name}[{b}]: expected a position >= 0 for the first token "
                f"written, got {lo}"
            )
        if hi > capacity:
            raise ValueError(
                f"{fn}: {start_name}[{b}]: expected the {hi - lo} token(s) written at "
                f"{lo}..{hi - 1} to fit the capacity M * C = {capacity} of sequence {b}, got "
                f"position {hi - 1}: the sequence is full (stop it, or write fewer with count=)"
            )
        slots = np.arange(lo // page_size, (hi - 1) // page_size + 1)
        ids = table[b, slots]
        bad = np.flatnonzero((ids <= 0) | (ids >= num_pages))
        if bad.size:
            j = int(slots[bad[0]])
            page = int(ids[bad[0]])
            what = "the null page 0" if page == 0 else f"id {page}, outside [1, {num_pages})"
            raise ValueError(
                f"{fn}: {table_name}[{b}, {j}]: expected a real page for the token(s) of "
                f"sequence {b} written at {max(lo, j * page_size)}.."
                f"{min(hi, (j + 1) * page_size) - 1}, got {what}: {_RESERVE} (a traced write "
                f"drops them while lengths count them)"
            )


def check_heads(fn: str, q, K: int, H: int, pool_dtype) -> None:
    """Query heads ``N`` (``q.shape[-2]``) a positive multiple of ``K``, same ``H`` and dtype
    (``pool_dtype=None``, a quantized pool: any float ``q``)."""
    N, Hq = q.shape[-2], q.shape[-1]
    if Hq != H:
        raise ValueError(f"{fn}: q: expected head dim {H} (that of k_pages), got {q.shape}")
    if N >= 1 and K > N:  # more kv heads than query heads: the pool is laid out otherwise
        raise ValueError(
            f"{fn}: k_pages: expected [K, P, C, H] with K kv heads dividing the N={N} query "
            f"heads of q (MHA, GQA, MQA), got K={K}: a pool laid out [P, C, K, H] needs "
            f".transpose(2, 0, 1, 3) first"
        )
    if N < 1 or N % K != 0:
        raise ValueError(
            f"{fn}: q: expected query heads N a positive multiple of kv heads K={K} "
            f"(MHA, GQA, MQA; K is k_pages' first axis, [K, P, C, H]), got N={N}"
        )
    if pool_dtype is not None and q.dtype != pool_dtype:
        raise ValueError(f"{fn}: q: expected dtype {pool_dtype} (the pages' dtype), got {q.dtype}")


def host_int_array(fn: str, name: str, x, ndim: int) -> np.ndarray:
    """A concrete numpy integer array of rank ``ndim`` (empty lists become int64)."""
    try:
        array = np.asarray(x)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: {name}: expected a {ndim}-D integer array, got {x!r}") from None
    if array.size == 0 and array.dtype.kind not in "iu":
        array = array.astype(np.int64)
    if array.ndim != ndim or array.dtype.kind not in "iu":
        raise ValueError(
            f"{fn}: {name}: expected a {ndim}-D integer array, got shape {array.shape} "
            f"dtype {array.dtype}"
        )
    return array


def pool_dtype(pages):
    """The dtype ``q`` must have for this pool: the float pool's, None (any) if quantized."""
    return None if is_quantized(pages) else pages.dtype


def refuse_bias(fn: str, bias) -> None:
    """The error for a logit ``bias`` (not None): the paged kernels take none."""
    if bias is not None:
        raise ValueError(
            f"{fn}: bias: expected None (the paged kernels take no logit bias; "
            f"ringattn.blockwise_attention with impl='xla', ringattn.attention_reference and "
            f"ringattn.dot_product_attention, on contiguous K/V, take one), got {describe(bias)}"
        )
