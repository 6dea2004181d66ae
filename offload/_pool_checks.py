"""Checks of a pool's leaves (data, scales, kivi2 zero-points) for the host pool and the
transfers, and the helpers they share: which array carries a pool's shape and sharding, and
how many blocks its page axis is split into."""

import jax

from paged import LayerPools, QuantizedPages

__all__ = [
    "check_leaf_pair",
    "check_quantized_pair",
    "first",
    "main_leaf",
    "page_shards",
    "stat_shape",
]


def first(pool):
    """Layer 0 of per-layer pools (``paged.LayerPools``), else the pool: what carries the
    kind (float or quantized), format and sharding."""
    return pool.layers[0] if isinstance(pool, LayerPools) else pool


def main_leaf(pool) -> jax.Array:
    """The array that carries a pool's shape and sharding (``data`` of a quantized pool; layer
    0's of per-layer pools)."""
    pool = first(pool)
    return pool.data if isinstance(pool, QuantizedPages) else pool


def stat_shape(kv_format, grouping: str, data_shape) -> tuple[int, ...]:
    """The shape of the ``scale`` (and kivi2 ``zero``) leaf of a pool with ``data_shape``:
    kivi2 keys (``grouping == "channel"``) ``[*lead, H]``, else ``format.scale_shape``."""
    return kv_format.scale_shape(kv_format.float_shape(tuple(data_shape)), grouping)


def page_shards(x, axis: int | None = None) -> int:
    """How many blocks the page axis (``ndim - 3``) of a pool is split into by its sharding.

    A quantized pool answers for its ``data``; ``axis`` overrides the page axis of a leaf.
    """
    x = main_leaf(x)
    axis = x.ndim - 3 if axis is None else axis
    return x.shape[axis] // x.sharding.shard_shape(x.shape)[axis]


def check_leaf_pair(fn: str, name: str, k, v, ranks: tuple[int, int], what: str) -> None:
    for part, x in (("k", k), ("v", v)):
        if not isinstance(x, jax.Array):
            raise ValueError(
                f"{fn}: {name}: expected {part}{what} to be a jax.Array, got {type(x).__name__}"
            )
        if x.ndim not in ranks:
            if ranks == (3, 4):
                layouts = "3 or 4 [*L, K, P, C]"
            elif what == ".scale":  # int4's group scales
                layouts = "4 or 5 [*L, K, P, C, H / group_size]"
            else:
                layouts = "4 [K, P, C, H] or 5 [L, K, P, C, H]"
            raise ValueError(
                f"{fn}: {name}: expected {part}{what} of rank {layouts}, got shape {x.shape}"
            )
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(
            f"{fn}: {name}: expected k{what} and v{what} of one shape and dtype, got {k.shape} "
            f"{k.dtype} and {v.shape} {v.dtype}"
        )
    if not k.sharding.is_equivalent_to(v.sharding, k.ndim):
        raise ValueError(
            f"{fn}: {name}: expected k{what} and v{what} with one sharding, got {k.sharding} and "
            f"{v.sharding}"
        )


def _check_beside(fn: str, name: str, what: str, leaf, data, axes: int) -> None:
    """``leaf`` (scales, zero-points) is sharded like ``data`` over its first ``axes`` axes."""
    axis = data.ndim - 3
    if (
        leaf.sharding.memory_kind != data.sharding.memory_kind
        or page_shards(leaf, axis) != page_shards(data, axis)
        or leaf.sharding.shard_shape(leaf.shape)[:axes]
        != data.sharding.shard_shape(data.shape)[:axes]
    ):
        raise ValueError(
            f"{fn}: {name}: expected {what} sharded like the data over "
            f"{'[*L, K, P, C]' if axes == data.ndim - 1 else '[*L, K, P]'} (same memory kind, "
            f"same page split), got {leaf.sharding} and {data.sharding}"
        )


def _check_kivi2(fn: str, name: str, k, v) -> None:
    """kivi2: data, scales and zero-points of each of ``k`` and ``v`` against its grouping."""
    fmt = k.format
    for part, x in (("k", k), ("v", v)):
        if x.grouping not in ("channel", "token"):
            raise ValueError(
                f"{fn}: {name}: expected {part} grouped 'channel' (keys) or 'token' (values), "
                f"got {x.grouping!r}"
            )
        if x.data.dtype != fmt.storage_dtype:
            raise ValueError(
                f"{fn}: {name}: expected {part}.data in {fmt.storage_dtype} for format 'kivi2', "
                f"got {x.data.dtype}"
            )
        want = stat_shape(fmt, x.grouping, x.data.shape)
        per = "[*L, K, P, H] (per channel)" if x.grouping == "channel" else "[*L, K, P, C]"
        for leaf_name in ("scale", "zero"):
            leaf = getattr(x, leaf_name)
            if not isinstance(leaf, jax.Array):
                raise ValueError(
                    f"{fn}: {name}: expected {part}.{leaf_name} to be a jax.Array (kivi2 "
                    f"{leaf_name}s {per}), got {type(leaf).__name__}"
                )
            if leaf.shape != want or leaf.dtype != fmt.scale_dtype:
                raise ValueError(
                    f"{fn}: {name}: expected {part}.{leaf_name} {fmt.scale_dtype} {want} (kivi2 "
                    f"{per} of its data), got {leaf.shape} {leaf.dtype}"
                )
            _check_beside(fn, name, f"{part}.{leaf_name}", leaf, x.data, x.data.ndim - 2)


def check_quantized_pair(fn: str, name: str, k, v) -> None:
    if k.format != v.format:
        raise ValueError(
            f"{fn}: {name}: expected k and v in one format, got {k.format.kind!r} and "
            f"{v.format.kind!r}"
        )
    check_leaf_pair(fn, name, k.data, v.data, (4, 5), ".data")
    if k.format.kind == "kivi2":
        _check_kivi2(fn, name, k, v)
        return
    for part, x in (("k", k), ("v", v)):
        if x.zero is not None or x.residual is not None:
            raise ValueError(
                f"{fn}: {name}: expected {part} without zero-points or residual pages (only "
                f"kivi2 has them), format {x.format.kind!r}"
            )
    fmt = k.format
    grouped = len(fmt.scale_shape((1, 1))) == 2  # int4: scales [*L, K, P, C, H / g]
    check_leaf_pair(fn, name, k.scale, v.scale, (4, 5) if grouped else (3, 4), ".scale")
    data, scale = k.data, k.scale
    if data.dtype != fmt.storage_dtype or scale.dtype != fmt.scale_dtype:
        raise ValueError(
            f"{fn}: {name}: expected data in {fmt.storage_dtype} and {fmt.scale_dtype} scales "
            f"for format {fmt.kind!r}, got {data.dtype} and {scale.dtype}"
        )
    want = fmt.scale_shape(fmt.float_shape(data.shape))
    if scale.shape != want:
        raise ValueError(
            f"{fn}: {name}: expected scales shaped {want} (data's [*L, K, P, C] "
            f"{'and H / group_size' if grouped else 'without H'}), got {scale.shape}"
        )
    _check_beside(fn, name, "scales", scale, data, data.ndim - 1)
