"""The copy kernels behind the page transfers: in-place page writes across memory kinds.

Moving pages never allocates a fresh host buffer: a copy is a jitted call that donates the
target pool and writes each selected source page into its target slot with one
``dynamic_update_slice`` (in place), with ``out_shardings`` in the target's memory kind; a
fresh ``device_put`` of the same bytes was 3-5x slower on CPU and a gather + scatter 3-4x
slower. The prefetch kernels (host to device, one layer) are in
:mod:`offload._prefetch_kernels`; pages to and from numpy (the disk tier) in
:mod:`offload._page_numpy`.

XLA:CPU runs programs of under 1000 flops inline on the caller's thread; each kernel carries
a tiny flop-counted marker output so that copies dispatch asynchronously there too, and
handles poll the markers, which are never donated.

On CPU the leaves' copies (keys and values, data and scales) are dispatched by a shared pool
of worker threads, each waiting for its own copy, so they run side by side (see
``_dispatch_side_by_side``); a call still returns once the copies are dispatched, unless all
8 workers are waiting on earlier copies.

Compiles: a list of ``n`` ids runs in one call, padded to the next power of two (the loop
reads the first ``n``), so each kernel compiles at most ``log2(P) + 1`` times per pool shape.

Pools split along the page axis are copied shard by shard: each device runs the kernel on its
own shards (local page ids, local slots) and the global arrays are reassembled from the new
shards, so nothing crosses devices.

Quantized pools (``paged.QuantizedPages``) are copied leaf by leaf: the kernel runs on the
``data`` and on the ``scale`` leaf with the same ids (both have their page axis at the pool's
``ndim - 3``), each leaf in place in its own donated buffer, and the pool is rebuilt.
"""

import concurrent.futures
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from offload._host_pool import as_named, device_kind, leaves, page_axis, rebuild, replicated
from offload._pool_checks import page_shards
from offload._tiers import PINNED_HOST

__all__ = ["bucket", "check_same_shards", "copy_pages"]


# A tiny flop-counted side output (a dot of the ids' sum with a 1024-vector, discarded) makes
# the copy dispatch asynchronously on XLA:CPU, as it does on GPU/TPU: about 2048 flops
# whatever the number of ids (a marker that grew with the ids, 128 per id, fell under the
# inline threshold for copies of up to 3 pages, which then ran synchronously).
_ASYNC_MARKER_WIDTH = 1024


def _async_marker(ids):
    weights = jnp.arange(_ASYNC_MARKER_WIDTH, dtype=jnp.float32)
    return (ids.astype(jnp.float32).sum() * weights).sum()


def _slice_page(pool, index, axis):
    return lax.dynamic_slice_in_dim(pool, index, 1, axis=axis)  # [*L, K, 1, C, H]


def _write_page(pool, page, index, axis):
    return lax.dynamic_update_slice_in_dim(pool, page, index, axis=axis)


def bucket(n: int) -> int:
    """The id-array length a copy of ``n`` pages runs at: the next power of two (>= 1).

    A kernel compiles once per length, so a pool sees at most ``log2(P) + 1`` compiles per
    kernel; the ids past ``n`` are padding that the loop never reads.
    """
    return 1 << max(n - 1, 0).bit_length()


def _padded(ids: np.ndarray, length: int) -> np.ndarray:
    out = np.zeros(length, np.int32)
    out[: ids.size] = ids
    return out


@functools.lru_cache(maxsize=256)
def _copy_pages_fn(source_sharding, target_sharding, axis: int | None = None):
    """``target[..., dst[i], :, :] = source[..., src[i], :, :]`` for ``i < count``, across
    memory kinds.

    A ``fori_loop`` with one ``dynamic_update_slice`` per page into the donated target, so XLA
    writes in place; measured 1.5x the throughput of the same writes unrolled (which also
    compiled in time linear in the number of pages: 24 s for 256 pages on 8 devices).
    """
    source_index = replicated(source_sharding, source_sharding.memory_kind)
    target_index = replicated(target_sharding, target_sharding.memory_kind)
    device_index = replicated(source_sharding, device_kind(source_sharding))
    crossing = source_sharding.memory_kind != target_sharding.memory_kind

    def fn(source, target, src, dst, count):
        marker = _async_marker(src)
        page_axis = source.ndim - 3 if axis is None else axis
        # Explicit placement of the indices: an operation needs all its operands in one
        # memory space.
        src, dst = jax.device_put(src, source_index), jax.device_put(dst, target_index)

        def step(i, target):
            page = _slice_page(source, src[i], page_axis)
            if crossing:
                page = jax.device_put(page, target_sharding)
            return _write_page(target, page, dst[i], page_axis)

        return lax.fori_loop(0, count, step, target), marker

    return jax.jit(
        fn,
        donate_argnums=1,
        in_shardings=(source_sharding, target_sharding, device_index, device_index, device_index),
        out_shardings=(target_sharding, device_index),
    )


def _copy_leaves(sources: list, targets: list, axis: int, src: np.ndarray, dst: np.ndarray):
    """The page copy on flat lists of leaf arrays (page axis ``axis``); returns new targets."""
    fns = [
        _copy_pages_fn(as_named(s.sharding), as_named(t.sharding), axis)
        for s, t in zip(sources, targets, strict=True)
    ]
    length = bucket(src.size)
    src, dst, count = _padded(src, length), _padded(dst, length), np.int32(src.size)
    # Keys and values (and data and scales) are separate programs (one program holding both
    # measured about 2x slower).
    calls = [
        functools.partial(fn, source, target, src, dst, count)
        for fn, source, target in zip(fns, sources, targets, strict=True)
    ]
    if len(calls) > 1 and _on_cpu(targets[0]):
        results = _dispatch_side_by_side(calls)
    else:
        results = [call() for call in calls]
    return [r[0] for r in results], [r[1] for r in results]


def _on_cpu(x) -> bool:
    return all(d.platform == "cpu" for d in x.sharding.device_set)


# XLA:CPU copies a page with one thread (an in-place dynamic_update_slice is never split over
# threads), and programs dispatched asynchronously from one Python thread ran one after the
# other (process CPU time = wall time). Each leaf's copy is therefore dispatched by a worker
# thread that then waits for its own program: the copies run side by side, about 1.6x the
# throughput for keys and values (benchmarks/bench_host_copy.py). The caller waits only for
# the dispatches, so a transfer still returns before its copies finish. A worker can only
# wait on programs already dispatched, whose inputs were dispatched before them, so waiting
# workers cannot starve a queued dispatch into a deadlock.
_WORKERS = 8
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _worker_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(_WORKERS, "offload-page-copy")
        return _pool


def _dispatch_side_by_side(calls: list) -> list:
    """``[call() for call in calls]``, each dispatched (then waited for) on a worker thread;
    returns once every call has returned its arrays (the copies may still be running)."""
    dispatched = [concurrent.futures.Future() for _ in calls]

    def run(call, out: concurrent.futures.Future):
        try:
            result = call()
        except BaseException as err:  # re-raised in the caller's thread
            out.set_exception(err)
            return
        out.set_result(result)
        jax.block_until_ready(result[1])  # the marker: never donated, ready with the copy

    pool = _worker_pool()
    for call, out in zip(calls, dispatched, strict=True):
        pool.submit(run, call, out)
    return [out.result() for out in dispatched]


def _flat(pair) -> list:
    return leaves(pair[0]) + leaves(pair[1])


def _unflat(like_pair, arrays: list):
    n = len(leaves(like_pair[0]))
    return rebuild(like_pair[0], arrays[:n]), rebuild(like_pair[1], arrays[n:])


def _copy_global(source, target, src: np.ndarray, dst: np.ndarray):
    arrays, markers = _copy_leaves(_flat(source), _flat(target), page_axis(target[0]), src, dst)
    target_k, target_v = _unflat(target, arrays)
    return target_k, target_v, markers


def check_same_shards(fn: str, name: str, src: np.ndarray, dst: np.ndarray, source, target):
    """For pools split along the page axis: page ``src[i]`` and slot ``dst[i]`` share a device.

    Raises:
      ValueError: naming ``name`` (the destination ids) on the first pair that would cross.
    """
    shards = page_shards(target)
    if shards == 1:
        return
    per_source = source.shape[-3] // shards
    per_target = target.shape[-3] // shards
    crossing = np.flatnonzero(src // per_source != dst // per_target)
    if crossing.size:
        i = int(crossing[0])
        raise ValueError(
            f"{fn}: {name}: expected each id on the same device as its partner (pools split "
            f"along the page axis over {shards} devices keep {per_source} source and "
            f"{per_target} destination ids per device), got {int(src[i])} (device block "
            f"{int(src[i]) // per_source}) paired with {int(dst[i])} (device block "
            f"{int(dst[i]) // per_target})"
        )


def _named_shard(shard):
    """A shard's buffer as a one-device array with a named sharding (no copy).

    ``jit`` tracks the memory space of an argument in its type only for named shardings.
    """
    data = shard.data
    return jax.make_array_from_single_device_arrays(data.shape, as_named(data.sharding), [data])


_SPACES = {PINNED_HOST: jax.memory.Space.Host}


def _full_spec(sharding, ndim: int) -> tuple:
    return tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))


def _spmd_able(source, target, axis: int) -> bool:
    """Whether one ``shard_map`` program can copy every leaf pair: named shardings over one
    mesh, one partition spec per pair, the page axis split, a target kind it can address."""
    for s, t in zip(_flat(source), _flat(target), strict=True):
        ss, ts = s.sharding, t.sharding
        if not (isinstance(ss, NamedSharding) and isinstance(ts, NamedSharding)):
            return False
        if ss.mesh != ts.mesh or _full_spec(ss, s.ndim) != _full_spec(ts, t.ndim):
            return False
        if _full_spec(ss, s.ndim)[axis] is None:
            return False
        if ss.memory_kind != ts.memory_kind and ts.memory_kind not in (
            *_SPACES,
            device_kind(ts),
        ):
            return False
    return True


@functools.lru_cache(maxsize=256)
def _copy_shards_fn(source_sharding, target_sharding, ndim: int, axis: int):
    """Every device copies its own pages: ``target[dst[d, i]] = source[src[d, i]]`` for
    ``i < count[d]`` in local ids, one program over the mesh (compiled once, not per device)."""
    mesh = source_sharding.mesh
    spec = P(*_full_spec(source_sharding, ndim))
    ids_spec = P(spec[axis], None)
    ids = NamedSharding(mesh, ids_spec, memory_kind=device_kind(source_sharding))
    kind = target_sharding.memory_kind
    space = None
    if source_sharding.memory_kind != kind:
        space = _SPACES.get(kind, jax.memory.Space.Device)

    def local(source, target, src, dst, count):
        def step(i, target):
            page = _slice_page(source, src[0, i], axis)
            if space is not None:
                page = jax.device_put(page, space)
            return _write_page(target, page, dst[0, i], axis)

        return lax.fori_loop(0, count[0, 0], step, target), _async_marker(src)[None]

    copy = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec, spec, ids_spec, ids_spec, ids_spec),
        out_specs=(spec, P(spec[axis])),
    )
    marker = NamedSharding(mesh, P(spec[axis]), memory_kind=ids.memory_kind)
    fn = jax.jit(
        copy,
        donate_argnums=1,
        in_shardings=(source_sharding, target_sharding, ids, ids, ids),
        out_shardings=(target_sharding, marker),
    )

    def run(source, target, src, dst, count):
        # Explicit mesh axes: shard_map wants its inputs already laid out as in_specs say.
        return fn(source, target, *jax.device_put((src, dst, count), (ids,) * 3))

    return run


def _copy_spmd(source, target, src: np.ndarray, dst: np.ndarray):
    """:func:`_copy_per_shard` as one program per leaf over the whole mesh."""
    axis = page_axis(target[0])
    shards = page_shards(target[0])
    per_source = source[0].shape[-3] // shards
    per_target = target[0].shape[-3] // shards
    block = src // per_source  # == dst // per_target (check_same_shards)
    counts = np.bincount(block, minlength=shards).astype(np.int32)
    length = bucket(int(counts.max(initial=0)))
    local_src = np.zeros((shards, length), np.int32)
    local_dst = np.zeros((shards, length), np.int32)
    for b in range(shards):
        mine = block == b
        local_src[b, : counts[b]] = src[mine] - b * per_source
        local_dst[b, : counts[b]] = dst[mine] - b * per_target
    arrays, markers = [], []
    for s, t in zip(_flat(source), _flat(target), strict=True):
        fn = _copy_shards_fn(s.sharding, t.sharding, t.ndim, axis)
        new, marker = fn(s, t, local_src, local_dst, counts[:, None])
        arrays.append(new)
        markers.append(marker)
    k, v = _unflat(target, arrays)
    return k, v, markers


def _copy_per_shard(source, target, src: np.ndarray, dst: np.ndarray):
    """The copy run by each device on its own shards (pools split along the page axis)."""
    axis = page_axis(target[0])
    sources, targets = _flat(source), _flat(target)
    source_maps = [{s.device: s for s in x.addressable_shards} for x in sources]
    target_maps = [{s.device: s for s in x.addressable_shards} for x in targets]
    new = [[] for _ in targets]
    markers = []
    for device, first in target_maps[0].items():
        lo_src = source_maps[0][device].index[axis].start or 0
        hi_src = lo_src + source_maps[0][device].data.shape[axis]
        lo_dst = first.index[axis].start or 0
        mine = (src >= lo_src) & (src < hi_src)
        if not mine.any():
            for i, m in enumerate(target_maps):
                new[i].append(m[device].data)
            continue
        arrays, done = _copy_leaves(
            [_named_shard(m[device]) for m in source_maps],
            [_named_shard(m[device]) for m in target_maps],
            axis,
            src[mine] - lo_src,
            dst[mine] - lo_dst,
        )
        for i, a in enumerate(arrays):
            new[i].append(a)
        markers += done
    arrays = [
        jax.make_array_from_single_device_arrays(t.shape, t.sharding, parts)
        for t, parts in zip(targets, new, strict=True)
    ]
    k, v = _unflat(target, arrays)
    return k, v, markers


def copy_pages(source, target, src: np.ndarray, dst: np.ndarray):
    """Copies pages ``src`` of the ``(k, v)`` pair ``source`` into slots ``dst`` of ``target``.

    ``target`` is donated. Pools split along the page axis are copied device by device (the
    pairs must not cross devices: :func:`check_same_shards`).

    Returns:
      ``(target_k, target_v, markers)``: the new target pair and the completion markers
      (never donated, so a handle can poll them after the pools move on).
    """
    if page_shards(target[0]) > 1 or page_shards(source[0]) > 1:
        axis = page_axis(target[0])
        if page_shards(target[0]) == page_shards(source[0]) and _spmd_able(source, target, axis):
            k, v, markers = _copy_spmd(source, target, src, dst)
        else:
            k, v, markers = _copy_per_shard(source, target, src, dst)
    else:
        k, v, markers = _copy_global(source, target, src, dst)
    return k, v, tuple(markers)
