"""The disk tier: exact round trips, another process, loud corruption, budget and LRU."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import paged
from offload import (
    CorruptCacheError,
    DiskStore,
    OffloadManager,
    make_host_page_pool,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8]


def _array(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return np.asarray(rng.integers(-128, 128, shape)).astype(dtype)
    return np.asarray(rng.standard_normal(shape)).astype(dtype)


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_bit_exact(tmp_path, dtype):
    store = DiskStore(tmp_path)
    arrays = {"k": _array((2, 3, 4, 8), dtype), "v": jnp.asarray(_array((2, 3, 4, 8), dtype, 1))}
    written = store.put("req-1", arrays)
    assert written == 2 * arrays["k"].nbytes == store.nbytes == store.entry_nbytes("req-1")
    back = store.get("req-1")
    for name, x in arrays.items():
        assert back[name].dtype == jnp.dtype(dtype) and back[name].shape == x.shape
        np.testing.assert_array_equal(_bits(back[name]), _bits(x))
    # A fresh store object on the same directory sees the entry.
    again = DiskStore(tmp_path)
    assert again.keys() == ["req-1"]
    np.testing.assert_array_equal(_bits(again.get("req-1")["k"]), _bits(arrays["k"]))


def test_written_by_one_process_read_by_another(tmp_path):
    expected = {
        "k": _array((2, 2, 3, 4, 8), jnp.bfloat16, 4),
        "v": _array((2, 2, 3, 4, 8), jnp.int8, 5),
    }
    script = textwrap.dedent(
        f"""
        import sys
        import jax.numpy as jnp
        import numpy as np
        sys.path.insert(0, {REPO!r})
        from offload import DiskStore
        rng = np.random.default_rng(4)
        k = np.asarray(rng.standard_normal((2, 2, 3, 4, 8))).astype(jnp.bfloat16)
        rng = np.random.default_rng(5)
        v = np.asarray(rng.integers(-128, 128, (2, 2, 3, 4, 8))).astype(jnp.int8)
        DiskStore({str(tmp_path)!r}).put("seq", {{"k": k, "v": v}})
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    back = DiskStore(tmp_path).get("seq")
    for name, x in expected.items():
        np.testing.assert_array_equal(_bits(back[name]), _bits(x))


def _stored(tmp_path):
    store = DiskStore(tmp_path)
    store.put("e", {"k": _array((4, 8), jnp.float32), "v": _array((4, 8), jnp.float32, 1)})
    return store, store.path("e")


def test_missing_file_fails_naming_path(tmp_path):
    store, entry = _stored(tmp_path)
    os.remove(os.path.join(entry, "v.bin"))
    with pytest.raises(CorruptCacheError, match=r"missing: .*e[/\\]v\.bin"):
        store.get("e")


def test_truncated_file_fails_naming_path(tmp_path):
    store, entry = _stored(tmp_path)
    path = os.path.join(entry, "k.bin")
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptCacheError, match=r"truncated or resized: .*k\.bin"):
        store.get("e")
    with open(path, "ab") as f:
        f.write(b"\0" * 200)  # now too long
    with pytest.raises(CorruptCacheError, match=r"k\.bin \(expected 128 bytes, got 300\)"):
        store.get("e")


def test_corrupted_file_fails_naming_path(tmp_path):
    store, entry = _stored(tmp_path)
    path = os.path.join(entry, "v.bin")
    with open(path, "r+b") as f:
        f.seek(17)
        byte = f.read(1)
        f.seek(17)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptCacheError, match=r"sha256 mismatch\): .*v\.bin"):
        store.get("e")
    assert isinstance(CorruptCacheError("x"), ValueError)


def test_bad_manifest_and_index_fail_naming_path(tmp_path):
    store, entry = _stored(tmp_path)
    manifest = os.path.join(entry, "manifest.json")
    with open(manifest, "w") as f:
        f.write("{not json")
    with pytest.raises(CorruptCacheError, match=r"unreadable: .*manifest\.json"):
        store.get("e")
    with open(manifest, "w") as f:
        json.dump({"arrays": {"k": {"dtype": "float32"}}}, f)
    with pytest.raises(CorruptCacheError, match=r"manifest malformed: .*manifest\.json"):
        store.get("e")
    with open(manifest, "w") as f:
        json.dump({"arrays": []}, f)
    with pytest.raises(CorruptCacheError, match=r"manifest malformed: .*manifest\.json"):
        store.get("e")
    os.remove(manifest)
    with pytest.raises(CorruptCacheError, match=r"missing: .*manifest\.json"):
        store.get("e")
    index = os.path.join(str(tmp_path), "index.json")
    with open(index, "w") as f:
        f.write("[")
    with pytest.raises(CorruptCacheError, match=r"unreadable: .*index\.json"):
        DiskStore(tmp_path)
    with open(index, "w") as f:
        json.dump({"entries": [["a"]]}, f)
    with pytest.raises(CorruptCacheError, match=r"index malformed: .*index\.json"):
        DiskStore(tmp_path)
    with open(index, "w") as f:
        json.dump({"version": 1, "entries": []}, f)
    with pytest.raises(CorruptCacheError, match=r"format version 1, expected 2: .*index\.json"):
        DiskStore(tmp_path)


def test_budget_evicts_least_recently_used(tmp_path):
    entry = {"k": np.zeros((8, 8), np.float32)}  # 256 bytes
    store = DiskStore(tmp_path, budget_bytes=600)
    store.put("a", entry)
    store.put("b", entry)
    store.get("a")  # a is now the most recently used
    store.put("c", entry)
    assert store.keys() == ["a", "c"] and "b" not in store and len(store) == 2
    assert not os.path.exists(store.path("b"))
    assert store.nbytes == 512
    reopened = DiskStore(tmp_path, budget_bytes=600)
    assert reopened.keys() == ["a", "c"]
    reopened.put("a", {"k": np.ones((4, 8), np.float32)})  # replace shrinks and refreshes a
    assert reopened.keys() == ["c", "a"] and reopened.nbytes == 384
    reopened.delete("c")
    assert reopened.keys() == ["a"]


@pytest.mark.no_typecheck
def test_errors(tmp_path):
    with pytest.raises(ValueError, match=r"DiskStore: budget_bytes: expected an int >= 1, got 0"):
        DiskStore(tmp_path, budget_bytes=0)
    store = DiskStore(tmp_path, budget_bytes=100)
    with pytest.raises(ValueError, match=r"DiskStore.put: key: expected 1-128 characters"):
        store.put("../x", {"k": np.zeros(2)})
    with pytest.raises(ValueError, match=r"DiskStore.put: arrays: expected 1-128 characters"):
        store.put("a", {"bad name": np.zeros(2)})
    with pytest.raises(ValueError, match=r"DiskStore.put: arrays: expected a non-empty mapping"):
        store.put("a", {})
    with pytest.raises(
        ValueError,
        match=r"DiskStore.put: arrays: expected names other than the reserved 'manifest'",
    ):
        store.put("a", {"manifest": np.zeros(2)})
    with pytest.raises(ValueError, match=r"DiskStore.put: arrays: expected at most budget_bytes"):
        store.put("a", {"k": np.zeros(100)})
    with pytest.raises(ValueError, match=r"DiskStore.get: key: expected a stored key, got 'a'"):
        store.get("a")
    with pytest.raises(ValueError, match=r"DiskStore.delete: key: expected a stored key, got 'a'"):
        store.delete("a")
    with pytest.raises(
        ValueError, match=r"DiskStore.entry_nbytes: key: expected a stored key, got 'a'"
    ):
        store.entry_nbytes("a")
    with pytest.raises(ValueError, match=r"DiskStore.path: key: expected 1-128 characters"):
        store.path("")


def _manager(tmp_path, slots=4, budget=None):
    rng = np.random.default_rng(9)
    k = jnp.asarray(rng.standard_normal((2, 2, 8, 4, 8)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, 2, 8, 4, 8)), jnp.bfloat16)
    disk = DiskStore(tmp_path, budget_bytes=budget)
    return k, v, OffloadManager(make_host_page_pool(k, v, slots), disk=disk)


def test_manager_spill_and_restore(tmp_path):
    k, v, manager = _manager(tmp_path)
    manager.wait(manager.page_out(k, v, [6, 3], request_id="r1"))
    page_bytes = manager.host_pool.page_nbytes
    written = manager.spill("r1")
    stats = manager.stats
    assert written == 2 * page_bytes and manager.free_slots == 4
    assert stats.tier_bytes("host") == 0 and stats.tier_bytes("disk", request_id="r1") == written
    assert stats.transfers("host_to_disk").nbytes == written
    # Occupy slot 0 so the restore lands in different slots.
    manager.wait(manager.page_out(k, v, [1], request_id="r2"))
    assert manager.restore("r1") == written
    assert stats.tier_bytes("disk") == 0 and "r1" not in manager.disk
    assert stats.tier_bytes("host", request_id="r1") == written
    assert stats.transfers("disk_to_host").count == 1
    slots = manager.host_slots("r1")
    assert slots.size == 2 and not set(slots) & set(manager.host_slots("r2"))
    host_k = np.asarray(manager.host_pool.k_pages)
    np.testing.assert_array_equal(_bits(host_k[:, :, slots]), _bits(np.asarray(k)[:, :, [6, 3]]))
    handle = manager.page_in(jnp.zeros_like(k), jnp.zeros_like(v), [4, 5], request_id="r1")
    back_k, back_v = manager.wait(handle)
    np.testing.assert_array_equal(_bits(back_v[:, :, [4, 5]]), _bits(v[:, :, [6, 3]]))


def test_manager_restore_of_corrupt_entry_leaves_tiers_untouched(tmp_path):
    k, v, manager = _manager(tmp_path)
    manager.wait(manager.page_out(k, v, [6, 3], request_id="r1"))
    manager.spill("r1")
    manager.wait(manager.page_out(k, v, [2], request_id="r2"))
    host_before = np.asarray(manager.host_pool.k_pages).copy()
    snapshot = manager.stats.as_dict()
    path = os.path.join(manager.disk.path("r1"), "k.bin")
    with open(path, "r+b") as f:
        f.write(b"\xff\xff")
    with pytest.raises(CorruptCacheError, match=r"r1[/\\]k\.bin"):
        manager.restore("r1")
    assert manager.free_slots == 3 and manager.host_slots("r1").size == 0
    assert manager.stats.as_dict() == snapshot and "r1" in manager.disk
    np.testing.assert_array_equal(_bits(np.asarray(manager.host_pool.k_pages)), _bits(host_before))


def test_manager_disk_budget_and_errors(tmp_path):
    page_bytes = 2 * (2 * 2 * 4 * 8) * 2  # k and v, [L, K, C, H] bfloat16
    k, v, manager = _manager(tmp_path, slots=3, budget=2 * page_bytes + page_bytes // 2)
    for request in ("a", "b"):
        manager.wait(manager.page_out(k, v, [1], request_id=request))
        manager.spill(request)
    manager.wait(manager.page_out(k, v, [2, 3, 0], request_id="c"))
    with pytest.raises(ValueError, match=r"DiskStore.put: arrays: expected at most budget_bytes"):
        manager.spill("c")
    manager.drop("c")
    # Both single-page entries fit the budget; a third evicts the least recently used.
    manager.wait(manager.page_out(k, v, [4], request_id="d"))
    manager.spill("d")
    assert manager.disk.keys() == ["b", "d"]
    assert manager.stats.tier_bytes("disk", request_id="a") == 0
    assert manager.stats.tier_bytes("disk") == manager.disk.nbytes
    with pytest.raises(ValueError, match=r"DiskStore.get: key: expected a stored key, got 'a'"):
        manager.restore("a")
    with pytest.raises(
        ValueError, match=r"spill: request_id: expected a request with host pages, got 'a'"
    ):
        manager.spill("a")
    manager.wait(manager.page_out(k, v, [5, 6, 7], request_id="e"))
    with pytest.raises(ValueError, match=r"restore: request_id: expected at most 0 pages"):
        manager.restore("b")
    manager.drop("e")
    manager.disk.put("odd", {"k": np.zeros((2, 2, 1, 4, 8), np.float32)})
    with pytest.raises(
        ValueError, match=r"restore: request_id: expected disk entry 'odd' array 'k'"
    ):
        manager.restore("odd")


@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0, 2)])
def test_degenerate_shapes_round_trip(tmp_path, shape):
    store = DiskStore(tmp_path)
    x = np.full(shape, 7, np.float32) if shape else np.asarray(np.float32(7.5))  # 0-d array
    store.put("x", {"a": x})
    back = DiskStore(tmp_path).get("x")["a"]
    assert back.shape == np.shape(x) and back.dtype == np.float32
    np.testing.assert_array_equal(back, x)
    store.put("y", {"a": jnp.float32(1.5), "b": np.int8(3)})  # jax and numpy scalars
    back = store.get("y")
    assert back["a"].shape == () and back["b"].shape == () and back["b"].dtype == np.int8


@pytest.mark.parametrize("key", ["index.json", ".lock", "entries", "staging", "manifest.json"])
def test_internal_names_are_ordinary_keys(tmp_path, key):
    """Keys live in their own namespace: no key collides with the index, lock or staging."""
    store = DiskStore(tmp_path, budget_bytes=1 << 20)
    store.put(key, {"k": np.arange(4, dtype=np.int32)})
    store.put("other", {"k": np.ones(2, np.float32)})
    reopened = DiskStore(tmp_path, budget_bytes=1 << 20)
    assert reopened.keys() == [key, "other"]
    np.testing.assert_array_equal(reopened.get(key)["k"], np.arange(4))
    reopened.delete(key)
    assert DiskStore(tmp_path).keys() == ["other"]


def _writer(directory, prefix, n, budget):
    store = DiskStore(directory, budget_bytes=budget)
    for i in range(n):
        store.put(f"{prefix}-{i}", {"k": np.full(16, i, np.float32)})  # 64 bytes


def _files_bytes(directory):
    total = 0
    entries = os.path.join(str(directory), "entries")
    for key in os.listdir(entries):
        for name in os.listdir(os.path.join(entries, key)):
            if name.endswith(".bin"):
                total += os.path.getsize(os.path.join(entries, key, name))
    return total, sorted(os.listdir(entries))


@pytest.mark.parametrize("shared_object", [False, True], ids=["two-objects", "one-object"])
def test_concurrent_threads_lose_nothing(tmp_path, shared_object):
    import threading

    n = 20
    shared = DiskStore(tmp_path)
    threads = []
    for prefix in ("a", "b", "c"):
        if shared_object:

            def work(prefix=prefix):
                for i in range(n):
                    shared.put(f"{prefix}-{i}", {"k": np.full(16, i, np.float32)})

        else:

            def work(prefix=prefix):
                _writer(tmp_path, prefix, n, None)

        threads.append(threading.Thread(target=work))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keys = DiskStore(tmp_path).keys()
    assert sorted(keys) == sorted(f"{p}-{i}" for p in "abc" for i in range(n))
    assert _files_bytes(tmp_path) == (3 * n * 64, sorted(keys))
    for key in keys:
        assert DiskStore(tmp_path).get(key)["k"][0] == int(key.split("-")[1])


def test_concurrent_threads_keep_the_budget(tmp_path):
    import threading

    budget = 10 * 64
    threads = [
        threading.Thread(target=_writer, args=(tmp_path, p, 15, budget)) for p in ("a", "b", "c")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store = DiskStore(tmp_path, budget_bytes=budget)
    assert store.nbytes == budget and len(store) == 10
    assert _files_bytes(tmp_path) == (budget, sorted(store.keys()))  # no file escapes


def test_concurrent_processes_lose_nothing_and_keep_the_budget(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        sys.path.insert(0, {REPO!r})
        from offload import DiskStore
        store = DiskStore({str(tmp_path)!r}, budget_bytes=int(sys.argv[2]))
        for i in range(12):
            store.put(f"{{sys.argv[1]}}-{{i}}", {{"k": np.full(16, i, np.float32)}})
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for budget, expect in ((1 << 20, 36), (8 * 64, 8)):
        directory = tmp_path / str(budget)
        script_b = script.replace(repr(str(tmp_path)), repr(str(directory)))
        procs = [
            subprocess.Popen([sys.executable, "-c", script_b, p, str(budget)], env=env)
            for p in ("a", "b", "c")
        ]
        assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
        store = DiskStore(directory)
        assert len(store) == expect and store.nbytes == expect * 64
        assert _files_bytes(directory) == (expect * 64, sorted(store.keys()))
        if expect == 36:
            assert sorted(store.keys()) == sorted(f"{p}-{i}" for p in "abc" for i in range(12))


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "delete", "reopen"]),
            st.sampled_from(["a", "b", "c", "index.json", ".lock"]),
            st.integers(1, 6),
        ),
        max_size=25,
    )
)
@settings(max_examples=25, deadline=None)
def test_store_matches_an_lru_model(ops):
    """Random puts, gets, deletes and reopenings: keys, order, sizes and budget as a model."""
    import tempfile

    budget = 10 * 16
    with tempfile.TemporaryDirectory() as directory:
        store = DiskStore(directory, budget_bytes=budget)
        model: dict[str, int] = {}  # least recently used first
        for op, key, n in ops:
            if op == "put":
                store.put(key, {"k": np.full(4 * n, n, np.float32)})  # 16 n bytes
                model.pop(key, None)
                model[key] = 16 * n
                while sum(model.values()) > budget:
                    del model[next(k for k in model if k != key)]
            elif op == "get" and key in model:
                assert store.get(key)["k"].shape == (model[key] // 4,)
                model[key] = model.pop(key)
            elif op == "delete" and key in model:
                store.delete(key)
                del model[key]
            elif op == "reopen":
                store = DiskStore(directory, budget_bytes=budget)
            assert store.keys() == list(model)
            assert store.nbytes == sum(model.values()) <= budget
            assert _files_bytes(directory) == (store.nbytes, sorted(model))


@pytest.mark.parametrize("kind", [None, "int8", "kivi2"])
def test_per_layer_host_pool_spills_and_restores_like_the_stacked_one(tmp_path, kind):
    """A manager over per-layer pools (a 0.3 cache's ``k_pages`` / ``v_pages``) spills the
    same disk entry as one over the stacked pools, and either restores the other's entry: the
    pages come back bit for bit, into free slots, and page back in."""
    fmt = None if kind is None else paged.KVFormat(kind)
    L, K, P, C, H = 3, 2, 9, 4, 8
    cache = paged.init_paged_cache(L, K, P, C, H, batch=1, max_pages_per_seq=P - 1, kv_format=fmt)
    rng = np.random.default_rng(4)
    tokens = 6 * C  # pages 1..6 of row 0
    k_new = jnp.asarray(rng.standard_normal((L, 1, tokens, K, H)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((L, 1, tokens, K, H)), jnp.float32)
    table = np.arange(1, P, dtype=np.int32)[None]
    cache = paged.with_page_table(cache, table, np.zeros(1, np.int32))
    for layer in range(L):
        cache = paged.write_layer(cache, layer, k_new[layer], v_new[layer], jnp.zeros(1, jnp.int32))
    per_layer = (cache.k_pages, cache.v_pages)
    assert isinstance(per_layer[0], paged.LayerPools)
    stacked = tuple(p.stacked() for p in per_layer)
    ids = np.array([5, 2, 3], np.int32)
    managers = {}
    for name, (k, v) in {"layers": per_layer, "stacked": stacked}.items():
        manager = OffloadManager(make_host_page_pool(k, v, 4), disk=DiskStore(tmp_path / name))
        manager.wait(manager.page_out(k, v, ids, request_id="r"))
        managers[name] = manager
    written = {name: m.spill("r") for name, m in managers.items()}
    assert written["layers"] == written["stacked"] > 0
    entries = {name: m.disk.get("r") for name, m in managers.items()}
    assert entries["layers"].keys() == entries["stacked"].keys()
    for key, array in entries["stacked"].items():
        np.testing.assert_array_equal(_bits(entries["layers"][key]), _bits(array), err_msg=key)
    # Cross over: each manager restores the entry the other layout wrote.
    managers["layers"].disk.put("x", entries["stacked"])
    managers["stacked"].disk.put("x", entries["layers"])
    for name, manager in managers.items():
        manager.wait(manager.page_out(*(per_layer if name == "layers" else stacked), [1], request_id="busy"))  # fmt: skip
        for request in ("r", "x"):
            tag = 0 if fmt is None else len(fmt.tag)  # the entry's format name, not read back
            assert manager.restore(request) == written[name] - tag
            slots = manager.host_slots(request)
            assert slots.size == 3 and not set(slots) & set(manager.host_slots("busy"))
            dest = np.array([6, 7, 8], np.int32)
            zeros = jax.tree.map(jnp.zeros_like, per_layer if name == "layers" else stacked)
            back_k, back_v = manager.wait(manager.page_in(*zeros, dest, request_id=request))
            for back, src in ((back_k, per_layer[0]), (back_v, per_layer[1])):
                got = [back[layer] for layer in range(L)]
                for layer in range(L):
                    for a, b in zip(
                        _page_arrays(got[layer]), _page_arrays(src[layer]), strict=True
                    ):
                        np.testing.assert_array_equal(_bits(np.asarray(a)[:, dest]), _bits(np.asarray(b)[:, ids]))  # fmt: skip


def _page_arrays(pool) -> list:
    """A layer pool's page arrays: data, scales and kivi2 zero-points, or the float array."""
    if isinstance(pool, paged.QuantizedPages):
        return [pool.data, pool.scale] + ([] if pool.zero is None else [pool.zero])
    return [pool]
