"""Quantized pools (``paged.QuantizedPages``, int8 / fp8 / int4 / kivi2) through the offload tiers:
data and scales (kivi2: and zero-points) move together, as stored, in every layout; bytes shrink
in proportion; a kivi2 pool's residual pages stay on the device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import paged
from offload import (
    CorruptCacheError,
    DiskStore,
    HostPagePool,
    OffloadManager,
    make_host_page_pool,
    mixed_residency_attention,
    page_in,
    page_out,
    prefetch_layer,
    wait,
)
from tests._util import assert_close
from tests.offload.test_layouts import CASES, LAYOUTS, PAGES, SLOTS, C, H, K, L, _mesh
from tests.offload.test_layouts import _page_pairs as page_pairs

# int4 with two groups per token at H = 8 (data [..., C, 4] uint8, scales [..., C, 2] bf16).
FORMATS = {
    "int8": paged.KVFormat("int8"),
    "fp8": paged.KVFormat("fp8"),
    "int4": paged.KVFormat("int4", group_size=4),
    "kivi2": paged.KVFormat("kivi2"),
}
# kivi2 pools come from a cache written with paged.write: KIVI_B rows of KIVI_M pages each
# (pages 1 .. PAGES - 1), every row's last page open (its tokens in the residual).
KIVI_B, KIVI_M = 3, 5
KIVI_LENGTHS = (18, 19, 17)


def _bits(x) -> np.ndarray:
    """The raw bytes of an array (bit-exact comparison for int8, fp8 and NaN scales)."""
    x = np.ascontiguousarray(np.asarray(x))
    return x.view(np.uint8).reshape(*x.shape, x.dtype.itemsize)


def _stored(pool) -> list:
    """The stored leaves of a quantized pool: data, scale (and kivi2 zero-points)."""
    return [pool.data, pool.scale] + ([] if pool.zero is None else [pool.zero])


def _with_stored(pool, arrays):
    """``pool`` (residual, grouping and format kept) with its stored leaves replaced."""
    data, scale, *zero = arrays
    return dataclasses.replace(pool, data=data, scale=scale, zero=zero[0] if zero else None)


def _assert_same(a, b):
    assert (a.zero is None) == (b.zero is None) and a.grouping == b.grouping
    for x, y in zip(_stored(a), _stored(b), strict=True):
        np.testing.assert_array_equal(_bits(x), _bits(y))
    assert a.format == b.format


def _kivi_cache(seed=0, lengths=KIVI_LENGTHS, num_pages=PAGES, batch=KIVI_B, pages=KIVI_M):
    """A kivi2 cache ``[L, K, num_pages, C, H]`` whose rows hold ``lengths`` random tokens on
    pages ``1 + b * pages ...`` (written with paged.write: stored pages and residuals)."""
    fmt = FORMATS["kivi2"]
    cache = paged.init_paged_cache(
        L, K, num_pages, C, H, batch=batch, max_pages_per_seq=pages, kv_format=fmt
    )
    table = jnp.asarray(1 + np.arange(batch * pages).reshape(batch, pages), jnp.int32)
    cache = paged.with_page_table(cache, table)
    rng = np.random.default_rng(seed)
    k, v = (
        jnp.asarray(rng.standard_normal((L, batch, pages * C, K, H)), jnp.float32) for _ in "kv"
    )
    return paged.write(cache, k, v, 0, count=jnp.asarray(lengths, jnp.int32))


def _qpools(name, kind="int8", axis_type=AxisType.Auto, seed=0):
    stacked, mesh_shape, names, spec = LAYOUTS[name]
    shape = (L, K, PAGES, C, H) if stacked else (K, PAGES, C, H)
    rng = np.random.default_rng(seed)
    fmt = FORMATS[kind]
    if kind == "kivi2":
        cache = _kivi_cache(seed)
        k, v = (cache.k_pages.stacked(), cache.v_pages.stacked()) if stacked else (cache.k_pages[0], cache.v_pages[0])  # fmt: skip
        assert k.grouping == "channel" and v.grouping == "token" and k.residual is not None
    else:
        k, v = (paged.quantize_pages(jnp.asarray(rng.standard_normal(shape)), fmt) for _ in "kv")
    if mesh_shape is not None:
        mesh = _mesh(mesh_shape, names, axis_type)
        # Per-layer pools are built stacked, laid out like each layer, then split.
        layout = P(None, *spec(4)) if stacked == "layers" else spec(len(shape))
        sharding = NamedSharding(mesh, layout)
        # The residual ([*L, K, B, C, H]: per sequence row) is no page pool: replicated.
        rest = NamedSharding(mesh, jax.sharding.PartitionSpec())
        k, v = (
            dataclasses.replace(
                _with_stored(x, jax.device_put(_stored(x), sharding)),
                residual=None if x.residual is None else jax.device_put(x.residual, rest),
                residual_len=None if x.residual is None else jax.device_put(x.residual_len, rest),
            )
            for x in (k, v)
        )
    if stacked == "layers":  # a 0.3 cache's per-layer pools: L separate QuantizedPages
        k, v = (paged.LayerPools([jax.tree.map(lambda a, i=i: a[i], x) for i in range(L)]) for x in (k, v))  # fmt: skip
    return k, v


def _zeros(pool):
    """A device pool like ``pool`` (same shardings, residual kept) with zero stored leaves."""
    return _with_stored(
        pool, [jax.device_put(jnp.zeros_like(x), x.sharding) for x in _stored(pool)]
    )


def _model(like, slots, source, ids):
    """numpy leaves of a zero pool like ``like`` with ``source`` pages ``ids`` at ``slots``."""
    out = []
    for zero, src in zip(_stored(like), _stored(source), strict=True):
        axis = like.ndim - 3
        model = np.zeros(zero.shape, zero.dtype)
        index = (slice(None),) * axis
        model[(*index, slots)] = np.take(np.asarray(src), ids, axis)
        out.append(model)
    return _with_stored(dataclasses.replace(like, residual=None, residual_len=None), out)


FP8_CASES = [
    pytest.param("fp8", "stacked-heads-pages", AxisType.Auto, id="fp8-stacked-heads-pages"),
    pytest.param("fp8", "layer-pages", AxisType.Explicit, id="fp8-layer-pages-Explicit"),
    pytest.param("fp8", "stacked-single", AxisType.Auto, id="fp8-stacked-single"),
]


# Per-layer pools (paged.LayerPools) have their own test below.
STACK_CASES = [c for c in CASES if not c.values[0].startswith("perlayer")]


@pytest.mark.parametrize(
    ("kind", "name", "axis_type"),
    [pytest.param("int8", *c.values, id=f"int8-{c.id}") for c in STACK_CASES]
    + FP8_CASES
    + [
        # int4 and kivi2 in one layout each by default; every other layout with the slow tests
        pytest.param(
            kind,
            *c.values,
            id=f"{kind}-{c.id}",
            marks=() if c.values[0] == "layer-single" else pytest.mark.slow,
        )
        for kind in ("int4", "kivi2")
        for c in STACK_CASES
        if c.values[1] == AxisType.Auto or c.values[0] == "stacked-heads-pages"
    ],
)
def test_quantized_round_trip_every_layout(kind, name, axis_type):
    k, v = _qpools(name, kind, axis_type=axis_type)
    residuals = (
        [(np.asarray(x.residual), np.asarray(x.residual_len)) for x in (k, v)]
        if (kind == "kivi2")
        else None
    )
    host = make_host_page_pool(k, v, SLOTS)
    assert isinstance(host.k_pages, paged.QuantizedPages) and host.k_pages.format == k.format
    assert host.k_pages.residual is None and host.v_pages.residual is None
    assert (host.k_pages.grouping, host.v_pages.grouping) == (k.grouping, v.grouping)
    for leaf in _stored(host.k_pages) + _stored(host.v_pages):
        assert leaf.sharding.memory_kind == "pinned_host"
    layers = L if k.ndim == 5 else 1
    if kind == "kivi2":  # keys H / 4 + 4 H / C (10), values H / 4 + 4 (6): averaged, 8
        assert host.page_nbytes == 2 * layers * K * C * k.format.bytes_per_token(H, C)
        assert host.page_nbytes == layers * K * C * ((2 + 4 * 8 // C) + (2 + 4))
    else:
        assert host.page_nbytes == 2 * layers * K * C * k.format.bytes_per_token(H)
    if kind in ("int8", "fp8"):
        assert host.page_nbytes == 2 * layers * K * C * (H * 1 + 4)
    elif kind == "int4":  # 4 packed bytes + two bfloat16 group scales per token per kv head
        assert host.page_nbytes == 2 * layers * K * C * (4 + 2 * 2)
    split = "pages" in name
    assert host.page_shards == (LAYOUTS[name][1][-1] if split else 1)
    ids, slots = page_pairs(host.page_shards)
    handle = page_out(k, v, ids, host, slots)
    assert handle.nbytes == ids.size * host.page_nbytes
    host = wait(handle)
    _assert_same(host.k_pages, _model(host.k_pages, slots, k, ids))
    _assert_same(host.v_pages, _model(host.v_pages, slots, v, ids))
    if split:
        for a, b in zip(_stored(host.k_pages), _stored(k), strict=True):
            assert a.sharding.spec == b.sharding.spec
    # Back into other device pages of the same devices, over a zero quantized pool.
    targets = ids[::-1].copy() if not split else ids
    k2, v2 = wait(page_in(host, slots, _zeros(k), _zeros(v), targets))
    assert k2.data.sharding.is_equivalent_to(k.data.sharding, k.ndim)
    assert k2.scale.sharding.memory_kind == "device"
    _assert_same(k2, _model(k, targets, host.k_pages, slots))
    _assert_same(v2, _model(v, targets, host.v_pages, slots))
    if residuals is not None:  # the device pools' residual pages, untouched
        for x, (res, filled) in zip((k2, v2), residuals, strict=True):
            np.testing.assert_array_equal(np.asarray(x.residual), res)
            np.testing.assert_array_equal(np.asarray(x.residual_len), filled)
    if k.ndim == 5:
        order = np.argsort(slots // (SLOTS // host.page_shards), kind="stable")
        handle = prefetch_layer(host, slots[order], layer=1)
        assert handle.nbytes == ids.size * host.page_nbytes // L
        pk, pv = wait(handle)
        _assert_same(pk, _take(k, ids[order])[1])
        _assert_same(pv, _take(v, ids[order])[1])
        assert pk.residual is None and pv.residual is None
        if LAYOUTS[name][1] is None:  # into: donated quantized staging buffers
            into = tuple(
                _with_stored(
                    x,
                    [jnp.zeros((K, ids.size, *a.shape[3:]), a.dtype) for a in _stored(x)],
                )
                for x in (host.k_pages, host.v_pages)
            )
            qk, qv = wait(prefetch_layer(host, slots, layer=0, into=into))
            _assert_same(qk, _take(k, ids)[0])
            _assert_same(qv, _take(v, ids)[0])


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4", "kivi2"])
def test_fp8_and_int8_round_trip_bit_exact_with_nan_scales(kind):
    k, v = _qpools("stacked-single", kind, seed=1)
    # A NaN scale (a token that held NaN; kivi2: a channel of a page) moves as it is.
    k = dataclasses.replace(k, scale=k.scale.at[0, 1, 3, 2].set(jnp.nan))
    host = make_host_page_pool(k, v, 6)
    ids = np.array([3, 1, 7, 2])
    host = wait(page_out(k, v, ids, host, [0, 5, 2, 3]))
    want_k, want_v = _take(k, ids), _take(v, ids)
    k2, v2 = wait(page_in(host, [0, 5, 2, 3], k, v, [9, 10, 11, 12]))  # k, v donated
    _assert_same(_take(k2, [9, 10, 11, 12]), want_k)
    _assert_same(_take(v2, [9, 10, 11, 12]), want_v)
    assert np.all(np.isnan(np.asarray(k2.scale, np.float32)[0, 1, 9, 2]))


def test_bytes_shrink_in_proportion():
    """int8 / fp8 transfers carry (H + 4) / (2 H) of the bf16 bytes: 0.516 at H = 128; int4
    (group 32, bfloat16 scales) (H / 2 + H / 16) / (2 H): 0.281; kivi2 at C = 4 (keys H / 4 +
    4 H / C, values H / 4 + 4: pages this small pay for their per-channel key statistics)."""
    shape, n = (2, 2, 8, 4, 128), 3
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    nbytes = {}
    for label in ("float32", "bfloat16", "int8", "fp8", "int4", "kivi2"):
        if label == "kivi2":
            pool, vpool = (
                paged.quantize_pages(x, paged.KVFormat(label), role=r) for r in ("keys", "values")
            )
        elif label in ("int8", "fp8", "int4"):
            pool = vpool = paged.quantize_pages(x, paged.KVFormat(label))
        else:
            pool = vpool = x.astype(label)
        host = make_host_page_pool(pool, vpool, 4)
        handle = page_out(pool, vpool, [1, 4, 6], host, [0, 1, 2])
        wait(handle)
        manager = OffloadManager(make_host_page_pool(pool, vpool, 4))
        manager.wait(manager.page_out(pool, vpool, [1, 4, 6], request_id="r"))
        assert manager.stats.tier_bytes("host", request_id="r") == handle.nbytes
        nbytes[label] = handle.nbytes
    tokens = n * 2 * 2 * 4  # pages * layers * kv heads * C, for keys and again for values
    assert nbytes["float32"] == 2 * tokens * 128 * 4 == 49152
    assert nbytes["bfloat16"] == 2 * tokens * 128 * 2 == 24576
    assert nbytes["int8"] == nbytes["fp8"] == 2 * tokens * (128 + 4) == 12672
    assert nbytes["int8"] / nbytes["bfloat16"] == pytest.approx(132 / 256)  # 0.516
    assert nbytes["int8"] / nbytes["float32"] == pytest.approx(132 / 512)  # 0.258
    assert nbytes["int4"] == 2 * tokens * (64 + 4 * 2) == 6912
    assert nbytes["int4"] / nbytes["bfloat16"] == 72 / 256 == 0.28125
    assert nbytes["kivi2"] == tokens * ((32 + 4 * 128 // 4) + (32 + 4)) == 9408


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("stacked-single", "int8"),
        ("layer-heads", "fp8"),
        ("stacked-pages", "int8"),
        pytest.param("stacked-pages", "int4", marks=pytest.mark.slow),
        ("layer-single", "int4"),
        pytest.param("stacked-pages", "kivi2", marks=pytest.mark.slow),
        ("layer-single", "kivi2"),
    ],
)
def test_manager_stats_and_disk_round_trip(tmp_path, name, kind):
    k, v = _qpools(name, kind, seed=3)
    store = DiskStore(tmp_path / "disk")
    manager = OffloadManager(make_host_page_pool(k, v, SLOTS), disk=store)
    shards = manager.host_pool.page_shards
    ids, _ = page_pairs(shards)
    ids = ids[np.argsort(ids // (PAGES // shards), kind="stable")]  # block order (prefetch)
    page_bytes = manager.host_pool.page_nbytes
    handle = manager.page_out(k, v, ids, request_id="r")
    manager.wait(handle)
    assert manager.stats.tier_bytes("host", request_id="r") == ids.size * page_bytes
    assert manager.stats.transfers("device_to_host").nbytes == ids.size * page_bytes
    slots = manager.host_slots("r")
    if k.ndim == 5:
        pk, _ = manager.wait(manager.prefetch(layer=1, request_id="r"))
        _assert_same(pk, _take(k, ids)[1])
    pools = (manager.host_pool.k_pages, manager.host_pool.v_pages)
    before = [_take(x, slots) for x in pools]  # the host pool is donated by restore
    data_bytes = ids.size * page_bytes
    written = manager.spill("r")
    block_bytes = 4 * ids.size if shards > 1 else 0  # each page's device block, int32
    assert written == data_bytes + len(k.format.tag) + block_bytes  # + the format's name
    assert manager.stats.tier_bytes("host", request_id="r") == 0
    assert manager.stats.tier_bytes("disk", request_id="r") == written
    assert manager.stats.transfers("host_to_disk").nbytes == written
    entry = store.get("r")
    assert entry["k"].dtype == k.dtype and entry["k_scale"].dtype == k.format.scale_dtype
    assert entry["format"].tobytes().decode() == k.format.tag  # "int4-g4" for int4
    if kind == "kivi2":  # zero-points beside the scales, each shaped by its grouping
        keys = (*entry["k"].shape[:-2], H)  # [*L, K, n, H]: per channel of each page
        assert entry["k_zero"].shape == entry["k_scale"].shape == keys
        assert entry["v_zero"].shape == entry["v_scale"].shape == entry["v"].shape[:-1]
    else:
        assert "k_zero" not in entry and "v_zero" not in entry
    read = manager.restore("r")
    assert read == data_bytes
    assert manager.stats.tier_bytes("disk", request_id="r") == 0
    assert manager.stats.tier_bytes("host", request_id="r") == data_bytes
    new_slots = manager.host_slots("r")
    for a, b in zip(before, (manager.host_pool.k_pages, manager.host_pool.v_pages), strict=True):
        _assert_same(_take(b, new_slots), a)
    k2, v2 = manager.wait(manager.page_in(_zeros(k), _zeros(v), ids, request_id="r"))
    _assert_same(_take(k2, ids), _take(k, ids))
    _assert_same(_take(v2, ids), _take(v, ids))
    assert manager.stats.tier_bytes("host") == 0
    assert manager.stats.transfers("host_to_device").nbytes == ids.size * page_bytes + (
        ids.size * page_bytes // L if k.ndim == 5 else 0
    )


def _take(pool, ids):
    """numpy ``QuantizedPages`` of pages ``ids`` (page axis ``ndim - 3``; no residual)."""
    axis = pool.ndim - 3
    pool = dataclasses.replace(pool, residual=None, residual_len=None)
    return _with_stored(pool, [np.take(np.asarray(x), ids, axis) for x in _stored(pool)])


@pytest.mark.no_typecheck
def test_disk_entry_of_another_kind_is_corrupt(tmp_path):
    store = DiskStore(tmp_path / "disk")
    k8, v8 = _qpools("stacked-single", "int8")
    kf, vf = _qpools("stacked-single", "fp8")
    floats = jnp.zeros(k8.shape)
    int8 = OffloadManager(make_host_page_pool(k8, v8, 4), disk=store)
    fp8 = OffloadManager(make_host_page_pool(kf, vf, 4), disk=store)
    flt = OffloadManager(make_host_page_pool(floats, floats, 4), disk=store)
    for manager, (k, v), request in ((int8, (k8, v8), "q"), (flt, (floats, floats), "f")):
        manager.wait(manager.page_out(k, v, [1, 2], request_id=request))
        manager.spill(request)
    with pytest.raises(
        CorruptCacheError,
        match=r"restore: request_id: .*quantized 'fp8' pages.*got quantized 'int8'",
    ):
        fp8.restore("q")
    with pytest.raises(
        CorruptCacheError, match=r"restore: .*float pages like the host pool, got quantized 'int8'"
    ):
        flt.restore("q")
    with pytest.raises(
        CorruptCacheError, match=r"restore: .*quantized 'int8' pages .*got float pages"
    ):
        int8.restore("f")
    entry = store.get("q")
    store.put("bad", {**entry, "k_scale": entry["k_scale"][..., :2]})
    with pytest.raises(CorruptCacheError, match=r"array 'k_scale' float32"):
        int8.restore("bad")
    assert int8.free_slots == fp8.free_slots == flt.free_slots == 4  # nothing was written
    int8.restore("q")  # the entry is intact
    # int4 entries carry their group: another group size is another format.
    k4, v4 = _qpools("stacked-single", "int4")
    other = paged.KVFormat("int4", group_size=8)
    k4b, v4b = (paged.QuantizedPages(x.data, x.scale[..., :1], other) for x in (k4, v4))
    int4 = OffloadManager(make_host_page_pool(k4, v4, 4), disk=store)
    int4b = OffloadManager(make_host_page_pool(k4b, v4b, 4), disk=store)
    int4.wait(int4.page_out(k4, v4, [1, 2], request_id="g4"))
    int4.spill("g4")
    with pytest.raises(
        CorruptCacheError, match=r"restore: .*quantized 'int4-g8' pages.*got quantized 'int4-g4'"
    ):
        int4b.restore("g4")
    entry = store.get("g4")
    store.put("bad4", {**entry, "v_scale": entry["v_scale"].astype(np.float32)})
    with pytest.raises(CorruptCacheError, match=r"array 'v_scale' bfloat16 \(2, 2, 2, 4, 2\)"):
        int4.restore("bad4")
    int4.restore("g4")


@pytest.mark.no_typecheck
def test_float_and_quantized_pools_do_not_mix():
    kq, vq = _qpools("stacked-single", "int8")
    kf, vf = _qpools("stacked-single", "fp8")
    floats = jnp.zeros(kq.shape)
    with pytest.raises(ValueError, match=r"make_host_page_pool: .*both float or both quantized"):
        make_host_page_pool(kq, floats, 4)
    with pytest.raises(
        ValueError, match=r"make_host_page_pool: .*one format, got 'int8' and 'fp8'"
    ):
        make_host_page_pool(kq, vf, 4)
    float_host = make_host_page_pool(floats, floats, 4)
    quant_host = make_host_page_pool(kq, vq, 4)
    with pytest.raises(
        ValueError, match=r"page_out: host_pool: .*float and quantized pools do not mix"
    ):
        page_out(kq, vq, [1], float_host, [0])
    with pytest.raises(
        ValueError, match=r"page_out: host_pool: .*float and quantized pools do not mix"
    ):
        page_out(floats, floats, [1], quant_host, [0])
    with pytest.raises(
        ValueError, match=r"page_in: host_pool: .*float and quantized pools do not mix"
    ):
        page_in(quant_host, [0], floats, floats, [1])
    with pytest.raises(ValueError, match=r"page_in: host_pool: expected format 'fp8'"):
        page_in(quant_host, [0], kf, vf, [1])
    with pytest.raises(
        ValueError, match=r"prefetch_layer: into: expected a pair of device quantized int8"
    ):
        prefetch_layer(quant_host, [0], layer=0, into=(floats[0, :, :1], floats[0, :, :1]))
    bad = paged.QuantizedPages(kq.data, kq.scale.astype(jnp.bfloat16), kq.format)
    with pytest.raises(ValueError, match=r"expected data in int8 and float32 scales"):
        make_host_page_pool(bad, bad, 4)
    k4, _ = _qpools("stacked-single", "int4")
    bad = paged.QuantizedPages(k4.data, k4.scale.astype(jnp.float32), k4.format)
    with pytest.raises(ValueError, match=r"expected data in uint8 and bfloat16 scales"):
        make_host_page_pool(bad, bad, 4)
    bad = paged.QuantizedPages(k4.data, k4.scale[..., :1], k4.format)
    with pytest.raises(ValueError, match=r"expected scales shaped \(2, 2, 16, 4, 2\)"):
        make_host_page_pool(bad, bad, 4)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_mixed_residency_with_quantized_cold_pages_from_host(kind):
    """Device pool + cold pages paged in from the host equal attention over the full pool; NaN
    scales in unreadable slots (demoted device pages, staging slots, tails) have no effect."""
    B, M, N, HD = 2, 4, 4, 16
    P = 1 + B * M
    rng = np.random.default_rng(5)
    fmt = FORMATS[kind]
    full_k, full_v = (
        paged.quantize_pages(jnp.asarray(rng.standard_normal((K, P, C, HD))), fmt) for _ in "kv"
    )
    table = jnp.asarray(1 + np.arange(B * M).reshape(B, M), jnp.int32)
    lengths = jnp.asarray([14, 9], jnp.int32)
    # Tails past lengths hold NaN scales in every pool (never readable).
    tail = np.zeros((K, P, C), bool)
    for b in range(B):
        for t in range(int(lengths[b]), M * C):
            tail[:, int(table[b, t // C]), t % C] = True
    on_scale = (lambda m: m[..., None]) if kind == "int4" else (lambda m: m)  # group axis
    full_k, full_v = (
        paged.QuantizedPages(x.data, jnp.where(on_scale(tail), jnp.nan, x.scale), fmt)
        for x in (full_k, full_v)
    )
    keep = np.array([[True, False, True, False], [False, True, False, True]])
    demoted = np.asarray(table)[~keep]
    # The cold pages go through the host tier and come back into a staging pool.
    host = wait(
        page_out(full_k, full_v, demoted, make_host_page_pool(full_k, full_v, 8), [7, 0, 3, 5])
    )
    staging = [
        paged.QuantizedPages(
            jnp.zeros(fmt.data_shape((K, 1 + demoted.size, C, HD)), fmt.storage_dtype),
            jnp.full(fmt.scale_shape((K, 1 + demoted.size, C, HD)), jnp.nan, fmt.scale_dtype),
            fmt,
        )  # unwritten (null page): NaN scales
        for _ in "kv"
    ]
    cold_k, cold_v = wait(page_in(host, [7, 0, 3, 5], *staging, 1 + np.arange(demoted.size)))
    cold_table = np.zeros((B, M), np.int32)
    cold_table[~keep] = 1 + np.arange(demoted.size)
    # The device pool: demoted pages' scales are NaN (they left the device).
    gone = np.zeros((K, P, C), bool)
    gone[:, demoted] = True
    dev_k, dev_v = (
        paged.QuantizedPages(x.data, jnp.where(on_scale(gone), jnp.nan, x.scale), fmt)
        for x in (full_k, full_v)
    )
    q = jnp.asarray(rng.standard_normal((B, 1, N, HD)), jnp.float32)
    res = mixed_residency_attention(
        q,
        dev_k,
        dev_v,
        jnp.where(jnp.asarray(keep), table, 0),
        lengths,
        cold_table=jnp.asarray(cold_table),
        cold_k_pages=cold_k,
        cold_v_pages=cold_v,
    )
    ref = paged.paged_attention(q, full_k, full_v, table, lengths)
    assert np.all(np.isfinite(np.asarray(res.out)))
    assert_close(res.out, ref.out, dtype=jnp.float32, what="mixed vs full quantized pool")
    assert_close(res.lse, ref.lse, dtype=jnp.float32, what="lse")


def test_kivi2_residual_stays_on_device_and_bytes_are_the_stored_leaves():
    """page_out copies the stored leaves of any page id (open pages included) and leaves the
    device pool alone; page_in / prefetch keep the device pool's residual pages bit for bit;
    every byte count is exactly data + scales + zero-points of the pages moved."""
    k, v = _qpools("stacked-single", "kivi2", seed=4)
    residuals = [(np.asarray(x.residual), np.asarray(x.residual_len)) for x in (k, v)]
    before = [[np.asarray(a) for a in _stored(x)] for x in (k, v)]
    opens = [1 + b * KIVI_M + n // C for b, n in enumerate(KIVI_LENGTHS)]  # [5, 10, 15]
    ids = np.array([opens[0], 2, opens[1], 7])
    stored_bytes = sum(
        np.take(np.asarray(a), ids, axis=2).nbytes for x in (k, v) for a in _stored(x)
    )
    # keys: data 8 B + scale and zero 2 * 8 H-channels * 2 B = 40 B per layer and kv head;
    # values: 8 B + 2 * 4 tokens * 2 B = 24 B.
    assert stored_bytes == ids.size * L * K * (40 + 24) == 1024
    host = make_host_page_pool(k, v, 6)
    handle = page_out(k, v, ids, host, [0, 1, 2, 3])
    assert handle.nbytes == stored_bytes
    host = wait(handle)
    assert host.k_pages.residual is None and host.v_pages.residual is None
    _assert_same(host.k_pages, _model(host.k_pages, [0, 1, 2, 3], k, ids))
    _assert_same(host.v_pages, _model(host.v_pages, [0, 1, 2, 3], v, ids))
    for x, (res, filled), leaves in zip((k, v), residuals, before, strict=True):  # only read
        np.testing.assert_array_equal(np.asarray(x.residual), res)
        np.testing.assert_array_equal(np.asarray(x.residual_len), filled)
        for a, b in zip(_stored(x), leaves, strict=True):
            np.testing.assert_array_equal(_bits(a), _bits(b))
    pk, pv = wait(handle := prefetch_layer(host, [2, 0], layer=1))
    assert handle.nbytes == stored_bytes // 2 // L
    assert pk.residual is None and (pk.grouping, pv.grouping) == ("channel", "token")
    _assert_same(pk, _take(k, ids[[2, 0]])[1])
    # Into the device pool (donated), over other pages and over the open page of row 1.
    targets = np.array([3, 8, opens[1], 12])
    handle = page_in(host, [0, 1, 2, 3], k, v, targets)
    assert handle.nbytes == stored_bytes
    k2, v2 = wait(handle)
    for x, y, (res, filled), leaves in zip((k2, v2), (k, v), residuals, before, strict=True):
        np.testing.assert_array_equal(np.asarray(x.residual), res)
        np.testing.assert_array_equal(np.asarray(x.residual_len), filled)
        model = [np.array(a) for a in leaves]
        for m, a in zip(model, _stored(host.k_pages if y is k else host.v_pages), strict=True):
            m[:, :, targets] = np.asarray(a)[:, :, :4]
        for a, b in zip(_stored(x), model, strict=True):
            np.testing.assert_array_equal(_bits(a), _bits(b))
    # The manager counts the same bytes.
    manager = OffloadManager(make_host_page_pool(k2, v2, 6))
    manager.wait(manager.page_out(k2, v2, ids, request_id="r"))
    assert manager.stats.tier_bytes("host", request_id="r") == stored_bytes
    assert manager.stats.transfers("device_to_host").nbytes == stored_bytes


@pytest.mark.no_typecheck
def test_kivi2_pools_are_checked_leaf_by_leaf():
    k, v = _qpools("stacked-single", "kivi2")
    k8, v8 = _qpools("stacked-single", "int8")
    with pytest.raises(ValueError, match=r"make_host_page_pool: .*one format, got 'kivi2'"):
        make_host_page_pool(k, v8, 4)
    bad = dataclasses.replace(k, zero=v.zero)  # per-token zero-points on a keys pool
    with pytest.raises(ValueError, match=r"expected k\.zero bfloat16 \(2, 2, 16, 8\)"):
        make_host_page_pool(bad, v, 4)
    bad = dataclasses.replace(v, scale=v.scale.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"expected v\.scale bfloat16 \(2, 2, 16, 4\)"):
        make_host_page_pool(k, bad, 4)
    with pytest.raises(ValueError, match=r"expected k\.zero to be a jax\.Array"):
        make_host_page_pool(dataclasses.replace(k, zero=None), v, 4)
    host = make_host_page_pool(k, v, 4)
    with_residual = HostPagePool(
        dataclasses.replace(host.k_pages, residual=k.residual, residual_len=k.residual_len),
        host.v_pages,
    )
    with pytest.raises(ValueError, match=r"page_out: host_pool: .*without residual pages"):
        page_out(k, v, [1], with_residual, [0])
    # Keys and values swapped in the host pool: each is consistent, but grouped otherwise.
    swapped = HostPagePool(dataclasses.replace(host.v_pages, data=host.k_pages.data), host.v_pages)
    with pytest.raises(
        ValueError, match=r"page_out: host_pool: expected k pages grouped 'channel'"
    ):
        page_out(k, v, [1], swapped, [0])
    with pytest.raises(
        ValueError, match=r"prefetch_layer: into: expected a pair of device quantized kivi2"
    ):
        staging = _take(k, [1, 2])[0]  # numpy leaves
        prefetch_layer(host, [0, 1], layer=0, into=(staging, staging))


@pytest.mark.no_typecheck
def test_kivi2_disk_entries_carry_zero_points_and_the_format(tmp_path):
    store = DiskStore(tmp_path / "disk")
    k, v = _qpools("stacked-single", "kivi2")
    k8, v8 = _qpools("stacked-single", "int8")
    kivi = OffloadManager(make_host_page_pool(k, v, 4), disk=store)
    int8 = OffloadManager(make_host_page_pool(k8, v8, 4), disk=store)
    for manager, (a, b), request in ((kivi, (k, v), "kivi"), (int8, (k8, v8), "q")):
        manager.wait(manager.page_out(a, b, [1, 5], request_id=request))
        manager.spill(request)
    entry = store.get("kivi")
    assert sorted(entry) == ["format", "k", "k_scale", "k_zero", "v", "v_scale", "v_zero"]
    assert entry["format"].tobytes().decode() == "kivi2"
    with pytest.raises(
        CorruptCacheError, match=r"restore: .*quantized 'int8' pages.*got quantized 'kivi2'"
    ):
        int8.restore("kivi")
    with pytest.raises(
        CorruptCacheError, match=r"restore: .*quantized 'kivi2' pages.*got quantized 'int8'"
    ):
        kivi.restore("q")
    store.put("no-zero", {n: a for n, a in entry.items() if n != "k_zero"})
    with pytest.raises(CorruptCacheError, match=r"array 'k_zero' bfloat16 \(2, 2, 2, 8\)"):
        kivi.restore("no-zero")
    store.put("swapped", {**entry, "v_zero": entry["k_zero"]})
    with pytest.raises(CorruptCacheError, match=r"array 'v_zero' bfloat16 \(2, 2, 2, 4\)"):
        kivi.restore("swapped")
    assert kivi.free_slots == int8.free_slots == 4  # nothing was written
    kivi.restore("kivi")  # the entry is intact
    k2, v2 = kivi.wait(kivi.page_in(_zeros(k), _zeros(v), [1, 5], request_id="kivi"))
    _assert_same(_take(k2, [1, 5]), _take(k, [1, 5]))
    _assert_same(_take(v2, [1, 5]), _take(v, [1, 5]))


@pytest.mark.slow  # ~16 s; the int8 / fp8 / int4 mixed-residency cases run by default
def test_mixed_residency_with_kivi2_cold_pages_from_host():
    """A kivi2 device pool (with its residual pages) + cold pages paged in from the host (no
    residual) equal paged_attention_reference over the full pool; NaN scales in unreadable
    slots (demoted device pages, the staging pool's null page) have no effect."""
    B, M, N, HD = 2, 4, 4, 16
    P = 1 + B * M
    fmt = FORMATS["kivi2"]
    rng = np.random.default_rng(6)
    table = jnp.asarray(1 + np.arange(B * M).reshape(B, M), jnp.int32)
    lengths = jnp.asarray([14, 9], jnp.int32)
    cache = paged.init_paged_cache(1, K, P, C, HD, batch=B, max_pages_per_seq=M, kv_format=fmt)
    cache = paged.with_page_table(cache, table)
    kv = [jnp.asarray(rng.standard_normal((1, B, M * C, K, HD)), jnp.float32) for _ in "kv"]
    cache = paged.write(cache, *kv, 0, count=lengths)
    full_k, full_v = cache.k_pages[0], cache.v_pages[0]
    assert full_k.residual.shape == (K, B, C, HD)
    # Each row's open page (slot lengths // C) stays on the device.
    keep = np.array([[True, False, False, True], [False, True, True, False]])
    demoted = np.asarray(table)[~keep]
    host = wait(
        page_out(full_k, full_v, demoted, make_host_page_pool(full_k, full_v, 8), [7, 0, 3, 5])
    )
    staging = [
        dataclasses.replace(x, scale=jnp.full_like(x.scale, jnp.nan))  # unwritten: NaN scales
        for x in (
            paged.quantize_pages(jnp.zeros((K, 1 + demoted.size, C, HD)), fmt, role=role)
            for role in ("keys", "values")
        )
    ]
    cold_k, cold_v = wait(page_in(host, [7, 0, 3, 5], *staging, 1 + np.arange(demoted.size)))
    assert cold_k.residual is None
    cold_table = np.zeros((B, M), np.int32)
    cold_table[~keep] = 1 + np.arange(demoted.size)
    dev_k, dev_v = (  # demoted pages left the device: NaN scales there
        dataclasses.replace(x, scale=x.scale.at[:, demoted].set(jnp.nan)) for x in (full_k, full_v)
    )
    q = jnp.asarray(rng.standard_normal((B, 1, N, HD)), jnp.float32)
    res = mixed_residency_attention(
        q,
        dev_k,
        dev_v,
        jnp.where(jnp.asarray(keep), table, 0),
        lengths,
        cold_table=jnp.asarray(cold_table),
        cold_k_pages=cold_k,
        cold_v_pages=cold_v,
    )
    ref = paged.paged_attention_reference(q, full_k, full_v, table, lengths)
    assert np.all(np.isfinite(np.asarray(res.out)))
    assert_close(res.out, ref.out, dtype=jnp.float32, what="mixed vs full kivi2 pool")
    assert_close(res.lse, ref.lse, dtype=jnp.float32, what="lse")
    with pytest.raises(ValueError, match=r"cold_k_pages: expected grouping 'channel'"):
        mixed_residency_attention(
            q, dev_k, dev_v, table, lengths, cold_table=jnp.asarray(cold_table),
            cold_k_pages=cold_v, cold_v_pages=cold_v,
        )  # fmt: skip


@pytest.mark.parametrize("kind", ["int8", "int4", "kivi2"])
@pytest.mark.parametrize("name", ["perlayer-single", "perlayer-pages"])
def test_per_layer_quantized_pools_move_like_the_stacked_ones(kind, name):
    """Per-layer quantized pools (a 0.3 cache's, each layer split along its pages or not):
    page_out, page_in and prefetch_layer give, layer by layer, exactly what the stacked pools
    give."""
    layers = _qpools(name, kind)
    stacked = _qpools(name.replace("perlayer", "stacked"), kind)
    assert isinstance(layers[0], paged.LayerPools)
    results = {}
    for label, (k, v) in (("layers", layers), ("stacked", stacked)):
        host = make_host_page_pool(k, v, SLOTS)
        ids, slots = page_pairs(host.page_shards)
        host = wait(page_out(k, v, ids, host, slots))
        zeros = jax.tree.map(jnp.zeros_like, (k, v))
        back = wait(page_in(host, slots, *zeros, ids))
        order = np.argsort(slots // (SLOTS // host.page_shards), kind="stable")
        fetched = wait(prefetch_layer(host, slots[order], layer=1))
        results[label] = (host, back, fetched, ids, order)
    host_l, back_l, fetched_l, ids, order = results["layers"]
    host_s, back_s, fetched_s, _, _ = results["stacked"]
    assert host_l.page_shards == host_s.page_shards == (4 if "pages" in name else 1)
    for layer in range(L):  # numpy first: a host array cannot be indexed on the device
        for got, want in ((host_l.k_pages.layers[layer], host_s.k_pages),
                          (back_l[1].layers[layer], back_s[1])):  # fmt: skip
            for a, b in zip(_stored(got), _stored(want), strict=True):
                np.testing.assert_array_equal(_bits(np.asarray(a)), _bits(np.asarray(b)[layer]))
    for got, want in zip(fetched_l, fetched_s, strict=True):
        _assert_same(got, want)
        if "pages" in name:  # split along n like the pool along its pages
            assert tuple(got.data.sharding.spec)[1] == "seq"
