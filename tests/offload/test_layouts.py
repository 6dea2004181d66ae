"""Offload of every pool layout ``paged`` produces: per layer, stacked, replicated, split
over kv heads, split along the page axis (``sharded_paged_attention``'s layout)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import paged
from offload import OffloadManager, make_host_page_pool, page_in, page_out, prefetch_layer, wait
from tests._util import assert_close, make_test_mesh

L, K, C, H = 2, 2, 4, 8
D = 4  # devices of the page axis
PAGES = 4 * D  # P_d = 4 pages per device
SLOTS = 2 * D  # S_d = 2 slots per device


def _mesh(shape=(D,), names=("seq",), axis_type=AxisType.Auto):
    return make_test_mesh(shape, names, axis_type=axis_type)


# name -> (stacked?, mesh shape, mesh axis names, spec builder)
LAYOUTS = {
    "layer-single": (False, None, None, None),
    "stacked-single": (True, None, None, None),
    "stacked-replicated": (True, (D,), ("seq",), lambda r: P()),
    "layer-heads": (False, (2,), ("kv",), lambda r: P("kv")),
    "stacked-heads": (True, (2,), ("kv",), lambda r: P(None, "kv")),
    "layer-pages": (False, (D,), ("seq",), lambda r: P(None, "seq")),
    "stacked-pages": (True, (D,), ("seq",), lambda r: P(None, None, "seq")),
    "layer-pages-2d": (False, (2, D), ("data", "seq"), lambda r: P(None, "seq")),
    "stacked-heads-pages": (True, (2, D), ("kv", "seq"), lambda r: P(None, "kv", "seq")),
    # A 0.3 cache's per-layer pools (paged.LayerPools of L [K, P, C, H] buffers).
    "perlayer-single": ("layers", None, None, None),
    "perlayer-pages": ("layers", (D,), ("seq",), lambda r: P(None, "seq")),
}


def _pools(name, axis_type=AxisType.Auto, seed=0):
    stacked, mesh_shape, names, spec = LAYOUTS[name]
    shape = (L, K, PAGES, C, H) if stacked else (K, PAGES, C, H)
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    if stacked == "layers":  # separate per-layer buffers, each laid out as below
        k, v = (paged.LayerPools(list(x)) for x in (k, v))
    if mesh_shape is not None:
        mesh = _mesh(mesh_shape, names, axis_type)
        sharding = NamedSharding(mesh, spec(4 if stacked == "layers" else len(shape)))
        k, v = jax.device_put((k, v), sharding)
    return k, v


def _page_pairs(n_shards):
    """Page ids and host slots that never cross devices: two pages of each device block."""
    per_page, per_slot = PAGES // n_shards, SLOTS // n_shards
    rng = np.random.default_rng(1)
    ids, slots = [], []
    for d in range(n_shards):
        ids += list(d * per_page + rng.permutation(per_page)[: min(2, per_slot)])
        slots += list(d * per_slot + rng.permutation(per_slot)[: min(2, per_slot)])
    order = rng.permutation(len(ids))  # any order across devices
    return np.array(ids)[order], np.array(slots)[order]


CASES = [
    pytest.param(name, axis_type, id=f"{name}-{axis_type.name}")
    for name in LAYOUTS
    for axis_type in (
        [AxisType.Auto] if LAYOUTS[name][1] is None else [AxisType.Auto, AxisType.Explicit]
    )
]


@pytest.mark.parametrize(("name", "axis_type"), CASES)
def test_round_trip_every_layout(name, axis_type):
    k, v = _pools(name, axis_type)
    host = make_host_page_pool(k, v, SLOTS)
    assert host.k_pages.sharding.memory_kind == "pinned_host"
    split = "pages" in name
    assert host.page_shards == (D if split else 1)
    ids, slots = _page_pairs(host.page_shards)
    host = wait(page_out(k, v, ids, host, slots))
    model = np.zeros(host.k_pages.shape, np.float32)
    model[..., slots, :, :] = np.asarray(k)[..., ids, :, :]
    np.testing.assert_array_equal(np.asarray(host.k_pages), model)
    if split:  # per-device slots: the host pool is split like the device pool
        assert host.k_pages.sharding.spec == k.sharding.spec
    # Back into other device pages of the same devices (reverse the pairing per block).
    targets = ids[::-1].copy() if not split else ids
    zeros = jax.tree.map(jnp.zeros_like, (k, v))  # per-layer pools stay per-layer
    k2, v2 = wait(page_in(host, slots, *zeros, targets))
    assert k2.sharding.is_equivalent_to(k.sharding, k.ndim)
    assert k2.sharding.memory_kind == "device"
    expect_k = np.zeros(k.shape, np.float32)
    expect_v = np.zeros(v.shape, np.float32)
    expect_k[..., targets, :, :] = model[..., slots, :, :]
    expect_v[..., targets, :, :] = np.asarray(host.v_pages)[..., slots, :, :]
    np.testing.assert_array_equal(np.asarray(k2), expect_k)
    np.testing.assert_array_equal(np.asarray(v2), expect_v)
    if k.ndim == 5:
        order = np.argsort(slots // (SLOTS // host.page_shards), kind="stable")  # block order
        pk, pv = wait(prefetch_layer(host, slots[order], layer=1))
        np.testing.assert_array_equal(np.asarray(pk), np.asarray(k)[1][:, ids[order]])
        np.testing.assert_array_equal(np.asarray(pv), np.asarray(v)[1][:, ids[order]])
        if split:  # split along n like the pool along its pages
            assert tuple(pk.sharding.spec)[1] == "seq"
            assert pk.sharding.memory_kind == "device"


@pytest.mark.parametrize("name", ["layer-pages", "stacked-pages"])
def test_page_split_pools_refuse_crossing_pairs_and_prefetch(name):
    k, v = _pools(name)
    host = make_host_page_pool(k, v, SLOTS)
    # Page 0 lives on device block 0, slot SLOTS - 1 on the last block.
    with pytest.raises(ValueError, match=r"page_out: host_slots: expected each id on the same"):
        page_out(k, v, [0], host, [SLOTS - 1])
    with pytest.raises(ValueError, match=r"page_in: page_ids: expected each id on the same"):
        page_in(host, [0], k, v, [PAGES - 1])
    with pytest.raises(ValueError, match=r"make_host_page_pool: num_slots: expected a multiple"):
        make_host_page_pool(k, v, SLOTS + 1)
    if k.ndim == 5:
        with pytest.raises(ValueError, match=r"prefetch_layer: host_slots: expected n / 4 slots"):
            prefetch_layer(host, [0], layer=0)  # one slot: not n / D of each block
        with pytest.raises(ValueError, match=r"prefetch_layer: host_slots: expected n / 4 slots"):
            prefetch_layer(host, [2, 0, 4, 6], layer=0)  # blocks out of order
        staging = jnp.zeros((K, D, C, H))
        with pytest.raises(NotImplementedError, match=r"prefetch_layer: into: staging buffers"):
            prefetch_layer(host, [0, 2, 4, 6], layer=0, into=(staging, staging))


def test_page_split_pool_mismatched_host_pool():
    k, v = _pools("layer-pages")
    single = make_host_page_pool(*_pools("layer-single"), SLOTS)
    with pytest.raises(ValueError, match=r"page_out: host_pool: expected the sharding of k_pages"):
        page_out(k, v, [0], single, [0])


def test_manager_on_page_split_pool_uses_per_device_slots(tmp_path):
    k, v = _pools("stacked-pages", seed=3)
    manager = OffloadManager(make_host_page_pool(k, v, SLOTS))
    ids = np.array([13, 1, 6, 2])  # blocks 3, 0, 1, 0
    manager.wait(manager.page_out(k, v, ids, request_id="r"))
    slots = manager.host_slots("r")
    per_page, per_slot = PAGES // D, SLOTS // D
    np.testing.assert_array_equal(slots // per_slot, ids // per_page)
    k2, _ = manager.wait(manager.page_in(jnp.zeros_like(k), jnp.zeros_like(v), ids, request_id="r"))
    np.testing.assert_array_equal(np.asarray(k2)[..., ids, :, :], np.asarray(k)[..., ids, :, :])
    assert manager.free_slots == SLOTS
    with pytest.raises(
        ValueError, match=r"page_ids: expected at most 2 pages of device block 0 .* got 3"
    ):
        manager.page_out(k, v, [0, 1, 2], request_id="s")  # three pages of block 0


def test_paged_cache_and_sharded_attention_after_offload():
    """Pages of a page-split pool, offloaded and paged back in, give the same attention."""
    mesh = _mesh()
    cache = paged.init_paged_cache(1, K, PAGES, C, H, batch=1, max_pages_per_seq=2 * D)
    assert cache.k_pages.shape == (1, K, PAGES, C, H)
    rng = np.random.default_rng(4)
    k = jnp.asarray(rng.standard_normal((K, PAGES, C, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((K, PAGES, C, H)), jnp.float32)
    sharding = NamedSharding(mesh, P(None, "seq"))
    k, v = jax.device_put((k, v), (sharding, sharding))
    # Device d's columns [2d, 2d + 2) of the table hold local page ids 1, 2 (page 0 is null).
    table = jnp.asarray(np.tile([1, 2], D)[None], jnp.int32)
    lengths = jnp.array([2 * D * C - 3], jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, 1, 2 * K, H)), jnp.float32)

    def attend(kp, vp):
        return paged.sharded_paged_attention(
            q, kp, vp, table, lengths, mesh=mesh, seq_axis="seq"
        ).out

    expected = attend(k, v)
    host = make_host_page_pool(k, v, SLOTS)
    ids = np.array([d * (PAGES // D) + j for d in range(D) for j in (1, 2)])
    slots = np.array([d * (SLOTS // D) + j for d in range(D) for j in (0, 1)])
    host = wait(page_out(k, v, ids, host, slots))
    k_back, v_back = wait(page_in(host, slots, jnp.zeros_like(k), jnp.zeros_like(v), ids))
    assert_close(attend(k_back, v_back), expected, dtype=jnp.float32, what="after offload")


@pytest.mark.parametrize("name", ["stacked-pages", "perlayer-pages"])
def test_manager_spill_and_restore_page_split_pool(tmp_path, name):
    """Spilled pages of a page-split host pool come back to slots of their own devices
    (stacked pools, and a 0.3 cache's per-layer pools each split along its pages)."""
    from offload import DiskStore

    k, v = _pools(name, seed=5)
    manager = OffloadManager(make_host_page_pool(k, v, SLOTS), disk=DiskStore(tmp_path))
    ids = np.array([14, 0, 5])  # blocks 3, 0, 1
    manager.wait(manager.page_out(k, v, ids, request_id="r"))
    written = manager.spill("r")
    assert manager.free_slots == SLOTS and "r" in manager.disk
    assert manager.stats.tier_bytes("disk", request_id="r") == written
    # Occupy block 0's first slot so the restore has to pick another one of block 0.
    manager.wait(manager.page_out(k, v, [1], request_id="other"))
    assert manager.restore("r") > 0 and "r" not in manager.disk
    slots = manager.host_slots("r")
    np.testing.assert_array_equal(slots // (SLOTS // D), ids // (PAGES // D))
    assert not set(slots.tolist()) & set(manager.host_slots("other").tolist())
    host_k = np.asarray(manager.host_pool.k_pages)
    np.testing.assert_array_equal(host_k[..., slots, :, :], np.asarray(k)[..., ids, :, :])
    zeros = jax.tree.map(jnp.zeros_like, (k, v))
    back_k, back_v = manager.wait(manager.page_in(*zeros, ids, request_id="r"))
    np.testing.assert_array_equal(np.asarray(back_v)[..., ids, :, :], np.asarray(v)[..., ids, :, :])
    # Block 0 has 2 slots, both taken; pages of block 0 on disk cannot come back.
    manager.wait(manager.page_out(k, v, [2], request_id="full"))  # block 0 is now full
    manager.disk.put("crowd", {"k": np.asarray(k)[..., :3, :, :], "v": np.asarray(v)[..., :3, :, :],
                               "block": np.zeros(3, np.int32)})  # fmt: skip
    with pytest.raises(ValueError, match=r"restore: request_id: expected at most 0 pages of"):
        manager.restore("crowd")


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["out", "in", "drop"]),
            st.sampled_from("abc"),
            st.lists(st.integers(0, PAGES - 1), min_size=1, max_size=3, unique=True),
        ),
        max_size=8,
    )
)
@example([("out", "b", [0]), ("out", "b", [0]), ("out", "a", [0]), ("in", "b", [0])])
@settings(max_examples=10, deadline=None)
def test_manager_on_page_split_pool_matches_a_model(ops):
    """Random page-outs, page-ins and drops on a page-split pool: per-device slots, data kept."""
    k, v = _pools("stacked-pages", seed=6)
    manager = OffloadManager(make_host_page_pool(k, v, SLOTS))
    per_page, per_slot = PAGES // D, SLOTS // D
    owned: dict[str, list[int]] = {}
    device = (jnp.zeros_like(k), jnp.zeros_like(v))
    for op, request, ids in ops:
        blocks = np.bincount(np.array(ids) // per_page, minlength=D)
        free = np.bincount(np.array(manager_free(manager)) // per_slot, minlength=D)
        if op == "out" and np.all(blocks <= free):
            manager.page_out(k, v, ids, request_id=request)
            owned.setdefault(request, []).extend(ids)
        elif op == "out":
            with pytest.raises(ValueError, match=r"expected at most \d+ pages of device block"):
                manager.page_out(k, v, ids, request_id=request)
        elif op == "in" and request in owned:
            sources = owned.pop(request)
            if len(set(sources)) < len(sources):  # a device page paged out twice: one target each
                with pytest.raises(ValueError, match="expected distinct ids"):
                    manager.page_in(*device, sources, request_id=request)
            targets = _distinct_in_block(sources, per_page)
            device = manager.wait(manager.page_in(*device, targets, request_id=request))
            np.testing.assert_array_equal(
                np.asarray(device[0])[..., targets, :, :], np.asarray(k)[..., sources, :, :]
            )
        elif op == "drop" and request in owned:
            manager.drop(request)
            del owned[request]
        for request, pages in owned.items():
            slots = manager.host_slots(request)
            np.testing.assert_array_equal(slots // per_slot, np.array(pages) // per_page)
        held = [s for r in owned for s in manager.host_slots(r)]
        assert len(held) == len(set(held)) and manager.free_slots + len(held) == SLOTS
    manager.poll()


def _distinct_in_block(pages, per_page):
    """Distinct device pages, each in the block of its source page (itself where it is free)."""
    taken: set[int] = set()
    targets = []
    for page in pages:
        block = range(page // per_page * per_page, (page // per_page + 1) * per_page)
        target = page if page not in taken else next(p for p in block if p not in taken)
        taken.add(target)
        targets.append(target)
    return targets


def manager_free(manager):
    """The manager's free slots (all slots minus those its requests hold)."""
    held = {s for r in "abc" for s in manager.host_slots(r).tolist()}
    return [s for s in range(SLOTS) if s not in held]
