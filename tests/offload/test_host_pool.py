"""The in-place host page pool: page-out, page-in, layer prefetch and the offload manager."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from offload import (
    HostPagePool,
    OffloadManager,
    make_host_page_pool,
    page_in,
    page_out,
    prefetch_layer,
    wait,
)
from offload._host_pool import as_named
from offload._page_copy import _copy_pages_fn, bucket
from offload._prefetch_kernels import prefetch_fn
from ringattn import attention_reference
from tests._util import assert_close, make_test_mesh

L, K, PAGES, C, H = 2, 2, 8, 4, 8
DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8]


def _pools(dtype=jnp.float32, shape=(L, K, PAGES, C, H), seed=0, sharding=None):
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        k, v = (rng.integers(-128, 128, shape) for _ in range(2))
    else:
        k, v = (rng.standard_normal(shape) for _ in range(2))
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    if sharding is not None:
        k, v = jax.device_put((k, v), (sharding, sharding))
    return k, v


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _page(x, i):
    return _bits(x)[..., i, :, :]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_bit_exact(dtype):
    k, v = _pools(dtype)
    host = make_host_page_pool(k, v, 6)
    assert host.k_pages.shape == (L, K, 6, C, H) and host.k_pages.dtype == dtype
    assert host.k_pages.sharding.memory_kind == "pinned_host"
    ids, slots = np.array([5, 7]), np.array([4, 2])
    handle = page_out(k, v, ids, host, slots, request_id="r")
    host = handle.value
    assert isinstance(host, HostPagePool)
    assert handle.direction == "device_to_host" and handle.request_id == "r"
    assert handle.nbytes == 2 * 2 * L * K * C * H * jnp.dtype(dtype).itemsize
    wait(handle)
    for i, s in zip(ids, slots, strict=True):
        np.testing.assert_array_equal(_page(host.k_pages, s), _page(k, i))
        np.testing.assert_array_equal(_page(host.v_pages, s), _page(v, i))
    handle = page_in(host, slots, jnp.zeros_like(k), jnp.zeros_like(v), [3, 6])
    assert handle.direction == "host_to_device"
    k2, v2 = wait(handle)
    assert k2.sharding.memory_kind == "device"
    for i, j in zip(ids, [3, 6], strict=True):
        np.testing.assert_array_equal(_page(k2, j), _page(k, i))
        np.testing.assert_array_equal(_page(v2, j), _page(v, i))
    untouched = [p for p in range(PAGES) if p not in (3, 6)]
    assert not np.any(_bits(k2)[..., untouched, :, :])


def test_per_layer_pools():
    k, v = _pools(shape=(K, PAGES, C, H))
    host = make_host_page_pool(k, v, 4)
    host = page_out(k, v, [2, 3], host, [3, 1]).value
    k2, v2 = wait(page_in(host, [1, 3], jnp.zeros_like(k), jnp.zeros_like(v), [0, 5]))
    np.testing.assert_array_equal(np.asarray(k2)[:, 0], np.asarray(host.k_pages)[:, 1])
    np.testing.assert_array_equal(np.asarray(v2)[:, 5], np.asarray(host.v_pages)[:, 3])


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_sharded_pools_keep_sharding(axis_type):
    mesh = make_test_mesh((2, 4), ("data", "kv"), axis_type=axis_type)
    sharding = NamedSharding(mesh, P(None, "kv"))
    k, v = _pools(shape=(L, 4, PAGES, C, H), sharding=sharding)
    host = make_host_page_pool(k, v, 4)
    assert host.k_pages.sharding == sharding.with_memory_kind("pinned_host")
    host = page_out(k, v, [6, 2], host, [1, 3]).value
    handle = page_in(host, [3, 1], jnp.zeros_like(k), jnp.zeros_like(v), [0, 7])
    pk, pv = wait(prefetch_layer(host, [1, 3], layer=1))
    k2, v2 = wait(handle)
    assert host.k_pages.sharding == sharding.with_memory_kind("pinned_host")
    assert k2.sharding.is_equivalent_to(sharding, 5) and v2.sharding.memory_kind == "device"
    assert pk.sharding.spec[0] == "kv" and pk.sharding.memory_kind == "device"
    ref_k, ref_v = np.asarray(k), np.asarray(v)
    np.testing.assert_array_equal(np.asarray(k2)[:, :, 0], ref_k[:, :, 2])
    np.testing.assert_array_equal(np.asarray(v2)[:, :, 7], ref_v[:, :, 6])
    np.testing.assert_array_equal(np.asarray(pk), ref_k[1][:, [6, 2]])
    np.testing.assert_array_equal(np.asarray(pv), ref_v[1][:, [6, 2]])


def test_many_transfers_in_flight():
    """Chained page-outs and page-ins issued without waiting match a numpy model."""
    k, v = _pools(seed=3)
    host = make_host_page_pool(k, v, 16)
    model = np.zeros(host.k_pages.shape, np.float32)
    rng = np.random.default_rng(0)
    handles = []
    for step in range(12):
        ids = rng.permutation(PAGES)[: 1 + step % 4]
        slots = rng.permutation(16)[: ids.size]
        handle = page_out(k, v, ids, host, slots)
        host = handle.value
        handles.append(handle)
        model[:, :, slots] = np.asarray(k)[:, :, ids]
    device = (jnp.zeros_like(k), jnp.zeros_like(v))
    device_model = np.zeros(k.shape, np.float32)
    for step in range(6):
        slots = rng.permutation(16)[: 1 + step % 3]
        ids = rng.permutation(PAGES)[: slots.size]
        handle = page_in(host, slots, *device, ids)
        device = handle.value
        handles.append(handle)
        device_model[:, :, ids] = model[:, :, slots]
    for handle in handles:
        assert wait(handle) is handle.value
    np.testing.assert_array_equal(np.asarray(host.k_pages), model)
    np.testing.assert_array_equal(np.asarray(device[0]), device_model)


@functools.partial(jax.jit, static_argnums=3)
def _decode_layer(q, pages_k, pages_v, length):
    """One decode step of attention over ``[K, n, C, H]`` pages holding ``length`` tokens."""
    k = pages_k.transpose(1, 2, 0, 3).reshape(1, -1, K, H)[:, :length]  # [1, S, K, H]
    v = pages_v.transpose(1, 2, 0, 3).reshape(1, -1, K, H)[:, :length]
    return attention_reference(q, k, v).out


def test_prefetch_decode_loop_matches_all_on_device():
    """Layer l + 1's pages are on their way while layer l computes; results match."""
    k, v = _pools(seed=5)
    table = np.array([6, 2])  # the sequence's pages, in order
    length = C + 1
    host = make_host_page_pool(k, v, 8)
    slots = np.array([7, 3])
    host = page_out(k, v, table, host, slots).value
    q = jnp.asarray(np.random.default_rng(1).standard_normal((1, 1, 2 * K, H)), jnp.float32)
    expected = [
        _decode_layer(q, k[layer][:, table], v[layer][:, table], length) for layer in range(L)
    ]
    pending = prefetch_layer(host, slots, layer=0)
    outputs = []
    for layer in range(L):
        current = pending
        if layer + 1 < L:
            pending = prefetch_layer(host, slots, layer=layer + 1)  # in flight during this layer
        pages_k, pages_v = wait(current)
        assert pages_k.shape == (K, 2, C, H)
        outputs.append(_decode_layer(q, pages_k, pages_v, length))
    for layer in range(L):
        assert_close(outputs[layer], expected[layer], dtype=jnp.float32, what=f"layer {layer}")


@given(st.integers(0, 300))
@settings(max_examples=50, deadline=None)
def test_bucket_is_the_next_power_of_two(n):
    b = bucket(n)
    assert b & (b - 1) == 0 and b >= max(n, 1)
    assert b == 1 or b // 2 < n  # the smallest such power


@pytest.mark.parametrize("dtype", DTYPES)
def test_runs_and_single_pages_bit_exact(dtype):
    """Contiguous runs of ids mixed with single pages, both directions; slots and pages
    outside the ids keep their (garbage) contents."""
    k, v = _pools(dtype, shape=(L, K, 12, C, H))
    garbage_k, garbage_v = _pools(dtype, shape=(L, K, 10, C, H), seed=1)
    host = make_host_page_pool(k, v, 10)
    host = wait(page_out(garbage_k, garbage_v, np.arange(10), host, np.arange(10)))
    ids = np.array([1, 2, 3, 4, 5, 6, 7, 9, 10, 11])  # runs of 7, 2, 1
    slots = np.array([2, 3, 4, 5, 6, 7, 8, 0, 1, 9])
    host = wait(page_out(k, v, ids, host, slots))
    expect_k, expect_v = _bits(garbage_k).copy(), _bits(garbage_v).copy()
    expect_k[..., slots, :, :], expect_v[..., slots, :, :] = _page(k, ids), _page(v, ids)
    np.testing.assert_array_equal(_bits(host.k_pages), expect_k)
    np.testing.assert_array_equal(_bits(host.v_pages), expect_v)
    back = np.array([9, 10, 11, 0, 1, 2, 5])  # runs of 3, 3, 1
    from_slots = np.array([2, 3, 4, 6, 7, 8, 0])
    dk, dv = _pools(dtype, shape=(L, K, 12, C, H), seed=2)
    expect_k, expect_v = _bits(dk).copy(), _bits(dv).copy()
    k2, v2 = wait(page_in(host, from_slots, dk, dv, back))
    expect_k[..., back, :, :] = _page(host.k_pages, from_slots)
    expect_v[..., back, :, :] = _page(host.v_pages, from_slots)
    np.testing.assert_array_equal(_bits(k2), expect_k)
    np.testing.assert_array_equal(_bits(v2), expect_v)


@pytest.mark.parametrize("size", [1, 3])
def test_kernels_carry_enough_flops_to_dispatch_asynchronously(size):
    """XLA:CPU runs programs of under 1000 flops inline (synchronously) on the caller's
    thread; every copy kernel, even of one page, carries a marker above that."""
    k, v = _pools()
    host = make_host_page_pool(k, v, 4)
    copy = _copy_pages_fn(as_named(k.sharding), as_named(host.k_pages.sharding), 2)
    fetch = prefetch_fn(as_named(host.k_pages.sharding), size > 1, False, 5)
    compiled = [
        copy.lower(k, host.k_pages, *(np.zeros(size, np.int32),) * 2, np.int32(size)).compile(),
        fetch.lower(host.k_pages, np.int32(0), np.zeros(size, np.int32)).compile(),
    ]
    for program in compiled:
        assert program.cost_analysis()["flops"] >= 1000


def test_concurrent_callers_of_page_out_and_page_in_each_get_their_own_pages():
    # Each leaf's copy is dispatched (and waited for) by a shared pool of worker threads on
    # CPU: several user threads moving pages at once, each a round trip of its own pools
    # (more calls in flight than workers), all exact.
    import concurrent.futures

    def round_trip(seed):
        k, v = _pools(seed=seed)
        host = make_host_page_pool(k, v, 6)
        rng = np.random.default_rng(seed)
        ids = rng.choice(np.arange(1, PAGES), size=5, replace=False)
        slots = rng.choice(6, size=5, replace=False)
        host = wait(page_out(k, v, ids, host, slots))
        zeros = jnp.zeros_like(k), jnp.zeros_like(v)
        back_k, back_v = wait(page_in(host, slots, *zeros, ids[::-1]))
        for got, pool in ((host.k_pages, k), (host.v_pages, v)):
            np.testing.assert_array_equal(np.asarray(got)[:, :, slots], np.asarray(pool)[:, :, ids])
        for got, pool in ((back_k, k), (back_v, v)):
            np.testing.assert_array_equal(
                np.asarray(got)[:, :, ids[::-1]], np.asarray(pool)[:, :, ids]
            )
        return seed

    with concurrent.futures.ThreadPoolExecutor(6) as users:
        assert sorted(users.map(round_trip, range(12))) == list(range(12))


def test_a_copy_that_fails_to_dispatch_raises_in_the_caller():
    from offload import _page_copy

    def boom():
        raise RuntimeError("dispatch failed")

    def fine():
        return jnp.ones(2), jnp.zeros(())

    with pytest.raises(RuntimeError, match="dispatch failed"):
        _page_copy._dispatch_side_by_side([fine, boom])
    arrays = _page_copy._dispatch_side_by_side([fine, fine])  # the workers are still usable
    assert [a.shape for a, _ in arrays] == [(2,), (2,)]


@pytest.mark.no_typecheck
def test_errors():
    k, v = _pools()
    host = make_host_page_pool(k, v, 4)
    with pytest.raises(ValueError, match=r"make_host_page_pool: num_slots: expected an int >= 1"):
        make_host_page_pool(k, v, 0)
    with pytest.raises(
        ValueError, match=r"make_host_page_pool: k_pages/v_pages: expected k of rank"
    ):
        make_host_page_pool(k[0, 0], v[0, 0], 4)
    with pytest.raises(
        ValueError, match=r"k_pages/v_pages: expected k to be a jax.Array, got ndarray"
    ):
        make_host_page_pool(np.asarray(k), v, 4)
    with pytest.raises(ValueError, match=r"expected k and v of one shape and dtype"):
        make_host_page_pool(k, v[:1], 4)
    with pytest.raises(
        ValueError, match=r"make_host_page_pool: k_pages: expected arrays in device"
    ):
        make_host_page_pool(host.k_pages, host.v_pages, 4)
    with pytest.raises(
        ValueError, match=r"page_out: host_pool: expected a HostPagePool, got tuple"
    ):
        page_out(k, v, [1], (host.k_pages, host.v_pages), [0])
    with pytest.raises(ValueError, match=r"page_out: host_pool: expected arrays in 'pinned_host'"):
        page_out(k, v, [1], HostPagePool(k, v), [0])
    other = make_host_page_pool(k[:, :1], v[:, :1], 4)
    with pytest.raises(ValueError, match=r"page_out: host_pool: expected pages shaped like"):
        page_out(k, v, [1], other, [0])
    with pytest.raises(ValueError, match=r"page_out: page_ids: expected ids in \[0, 8\)"):
        page_out(k, v, [8], host, [0])
    with pytest.raises(ValueError, match=r"page_out: host_slots: expected ids in \[0, 4\)"):
        page_out(k, v, [1], host, [-1])
    with pytest.raises(ValueError, match=r"page_out: page_ids: expected a 1-D integer sequence"):
        page_out(k, v, [[1]], host, [0])
    with pytest.raises(ValueError, match=r"page_out: page_ids: expected a 1-D integer sequence"):
        page_out(k, v, [1.0], host, [0])
    with pytest.raises(
        ValueError, match=r"page_out: host_slots: expected as many ids as the source ids"
    ):
        page_out(k, v, [1, 2], host, [0])
    with pytest.raises(ValueError, match=r"page_out: host_slots: expected distinct ids"):
        page_out(k, v, [1, 2], host, [0, 0])
    with pytest.raises(ValueError, match=r"page_in: page_ids: expected distinct ids"):
        page_in(host, [0, 1], k, v, [3, 3])
    with pytest.raises(
        ValueError, match=r"page_in: page_ids: expected as many ids as the source ids \(2\), got 1"
    ):
        page_in(host, [0, 1], k, v, [3])
    with pytest.raises(ValueError, match=r"page_in: k_pages: expected arrays in device memory"):
        page_in(host, [0], host.k_pages, host.v_pages, [1])
    with pytest.raises(ValueError, match=r"prefetch_layer: layer: expected an int in \[0, 2\)"):
        prefetch_layer(host, [0], layer=2)
    with pytest.raises(
        ValueError, match=r"prefetch_layer: layer: expected an int in \[0, 2\), got bool"
    ):
        prefetch_layer(host, [0], layer=True)
    with pytest.raises(
        ValueError, match=r"prefetch_layer: layer: expected an int in \[0, 2\), got float"
    ):
        prefetch_layer(host, [0], layer=1.0)  # never truncated
    with pytest.raises(ValueError, match=r"prefetch_layer: host_slots: expected at least one"):
        prefetch_layer(host, np.zeros(0, np.int32), layer=0)
    with pytest.raises(ValueError, match=r"prefetch_layer: host_slots: expected ids in \[0, 4\)"):
        prefetch_layer(host, [4], layer=0)
    flat = make_host_page_pool(k[0], v[0], 4)
    with pytest.raises(ValueError, match=r"prefetch_layer: host_pool: expected pools \[L, K"):
        prefetch_layer(flat, [0], layer=0)


def test_prefetch_rejects_layer_sharded_pools():
    mesh = make_test_mesh((2,), ("layers",))
    k, v = _pools(sharding=NamedSharding(mesh, P("layers")))
    host = make_host_page_pool(k, v, 2)
    with pytest.raises(NotImplementedError, match=r"sharded over the layer axis"):
        prefetch_layer(host, [0], layer=0)


def test_manager_routes_and_accounts():
    k, v = _pools(seed=7)
    manager = OffloadManager(make_host_page_pool(k, v, 6))
    page_bytes = 2 * L * K * C * H * 4
    a = manager.page_out(k, v, [3, 1], request_id="a")
    b = manager.page_out(k, v, [5, 6, 7], request_id="b")
    assert manager.free_slots == 1
    pending = manager.poll()  # what has landed is recorded; the rest stays in flight
    assert 0 <= pending <= 2
    assert manager.stats.transfers("device_to_host").in_flight == pending
    manager.wait(a)
    manager.wait(b)
    manager.poll()
    out = manager.stats.transfers("device_to_host")
    assert (out.count, out.nbytes, out.in_flight) == (2, 5 * page_bytes, 0)
    assert manager.stats.tier_bytes("host") == 5 * page_bytes
    assert manager.stats.tier_bytes("host", request_id="b") == 3 * page_bytes
    np.testing.assert_array_equal(manager.host_slots("b"), [2, 3, 4])
    pk, pv = manager.wait(manager.prefetch(layer=1, request_id="b"))
    np.testing.assert_array_equal(np.asarray(pk), np.asarray(k)[1][:, [5, 6, 7]])
    handle = manager.page_in(jnp.zeros_like(k), jnp.zeros_like(v), [0, 2], request_id="a")
    k2, v2 = manager.wait(handle)
    np.testing.assert_array_equal(np.asarray(k2)[:, :, [0, 2]], np.asarray(k)[:, :, [3, 1]])
    np.testing.assert_array_equal(np.asarray(v2)[:, :, [0, 2]], np.asarray(v)[:, :, [3, 1]])
    assert manager.free_slots == 3 and manager.stats.tier_bytes("host", request_id="a") == 0
    back = manager.stats.transfers("host_to_device")
    assert back.count == 2 and back.nbytes == 2 * page_bytes + 3 * page_bytes // L
    manager.drop("b")
    assert manager.free_slots == 6 and manager.stats.tier_bytes("host") == 0


@pytest.mark.no_typecheck
def test_manager_errors():
    k, v = _pools()
    manager = OffloadManager(make_host_page_pool(k, v, 2))
    with pytest.raises(ValueError, match=r"OffloadManager: host_pool: expected a HostPagePool"):
        OffloadManager((k, v))
    with pytest.raises(ValueError, match=r"OffloadManager: disk: expected a DiskStore, got str"):
        OffloadManager(manager.host_pool, disk="/tmp")
    with pytest.raises(ValueError, match=r"page_out: page_ids: expected at most 2 pages"):
        manager.page_out(k, v, [1, 2, 3], request_id="a")
    with pytest.raises(
        ValueError, match=r"page_in: request_id: expected a request with host pages, got 'a'"
    ):
        manager.page_in(k, v, [1], request_id="a")
    with pytest.raises(
        ValueError, match=r"prefetch: request_id: expected a request with host pages, got 'a'"
    ):
        manager.prefetch(layer=0, request_id="a")
    with pytest.raises(
        ValueError, match=r"drop: request_id: expected a request with host pages, got 'a'"
    ):
        manager.drop("a")
    with pytest.raises(ValueError, match=r"wait: handle: expected a TransferHandle, got int"):
        manager.wait(1)
    with pytest.raises(ValueError, match=r"spill: disk: expected the manager to have a DiskStore"):
        manager.spill("a")
    with pytest.raises(ValueError, match=r"restore: disk: expected the manager to have"):
        manager.restore("a")
    assert manager.free_slots == 2


def test_pool_checks_need_matching_shardings_and_pinned_memory(monkeypatch):
    mesh = make_test_mesh((2,), ("kv",))
    k, v = _pools()
    v_split = jax.device_put(v, NamedSharding(mesh, P(None, "kv")))
    with pytest.raises(ValueError, match=r"k_pages/v_pages: expected k and v with one sharding"):
        make_host_page_pool(k, v_split, 4)
    import offload._host_pool as host_pool_module

    monkeypatch.setattr(host_pool_module, "host_memory_kind", lambda devices: "unpinned_host")
    with pytest.raises(ValueError, match=r"expected devices with 'pinned_host' memory .* got only"):
        make_host_page_pool(k, v, 4)


@pytest.mark.parametrize("slots", [[2, 3], [3, 0]], ids=["contiguous", "scattered"])
def test_prefetch_into_staging_buffers(slots):
    k, v = _pools(seed=11)
    host = make_host_page_pool(k, v, 4)
    host = page_out(k, v, [5, 6, 1, 2], host, [0, 1, 2, 3]).value
    ids = np.array([5, 6, 1, 2])[slots]  # device page held by each host slot
    staging = (jnp.zeros((K, 2, C, H)), jnp.zeros((K, 2, C, H)))
    for layer in range(L):
        fetched = wait(prefetch_layer(host, slots, layer=layer, into=staging))
        np.testing.assert_array_equal(np.asarray(fetched[0]), np.asarray(k)[layer][:, ids])
        np.testing.assert_array_equal(np.asarray(fetched[1]), np.asarray(v)[layer][:, ids])
        staging = fetched  # the buffers are donated: reuse what came back
    with pytest.raises(ValueError, match=r"prefetch_layer: into: expected a pair of device arrays"):
        prefetch_layer(
            host, slots, layer=0, into=(jnp.zeros((K, 3, C, H)), jnp.zeros((K, 3, C, H)))
        )


@pytest.mark.no_typecheck
def test_prefetch_rejects_host_staging_buffers():
    k, v = _pools(seed=11)
    host = make_host_page_pool(k, v, 4)
    with pytest.raises(ValueError, match=r"prefetch_layer: into: expected a pair"):
        prefetch_layer(
            host, [2, 3], layer=0, into=(np.zeros((K, 2, C, H)), jnp.zeros((K, 2, C, H)))
        )


def test_numpy_scalars_accepted():
    k, v = _pools(seed=2)
    host = make_host_page_pool(k, v, np.int64(4))
    assert host.num_slots == 4
    host = page_out(k, v, np.array([1, 2]), host, np.array([0, 3], np.int64)).value
    pk, _ = wait(prefetch_layer(host, [3], layer=np.int32(1)))
    np.testing.assert_array_equal(np.asarray(pk), np.asarray(k)[1][:, [2]])


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["out", "in", "drop"]), st.sampled_from("abc"), st.integers(1, 3)
        ),
        max_size=8,
    )
)
@settings(max_examples=15, deadline=None)
def test_manager_bookkeeping_matches_a_model(ops):
    """Random page-outs, page-ins and drops: slots stay disjoint and data stays with requests."""
    k, v = _pools(seed=13)
    manager = OffloadManager(make_host_page_pool(k, v, 5))
    owned: dict[str, list[int]] = {}  # request -> device page ids paged out, in order
    device = (jnp.zeros_like(k), jnp.zeros_like(v))
    for op, request, n in ops:
        if op == "out" and n <= manager.free_slots:
            ids = list(range(n, 2 * n))
            manager.page_out(k, v, ids, request_id=request)
            owned.setdefault(request, []).extend(ids)
        elif op == "in" and request in owned:
            targets = np.arange(len(owned[request]))
            device = manager.wait(manager.page_in(*device, targets, request_id=request))
            expect = np.asarray(k)[:, :, owned.pop(request)]
            np.testing.assert_array_equal(np.asarray(device[0])[:, :, targets], expect)
        elif op == "drop" and request in owned:
            manager.drop(request)
            del owned[request]
        slots = [s for r in owned for s in manager.host_slots(r)]
        assert len(slots) == len(set(slots)) == sum(len(p) for p in owned.values())
        assert manager.free_slots + len(slots) == 5
        page_bytes = manager.host_pool.page_nbytes
        assert manager.stats.tier_bytes("host") == len(slots) * page_bytes
    manager.poll()
