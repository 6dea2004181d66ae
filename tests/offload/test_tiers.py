"""Memory kinds, pytree moves between device and host, transfer handles, and the stats object."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from offload import (
    OffloadStats,
    TransferHandle,
    host_memory_kind,
    ready,
    to_device,
    to_host,
    wait,
)
from tests._util import make_test_mesh

DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8]


def _random(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-128, 128, shape), dtype)
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


class _FakeMemory:
    def __init__(self, kind):
        self.kind = kind


class _FakeDevice:
    def __init__(self, *kinds):
        self._kinds = kinds

    def addressable_memories(self):
        return [_FakeMemory(k) for k in self._kinds]

    def __repr__(self):
        return f"FakeDevice{self._kinds}"


def test_host_memory_kind_prefers_pinned():
    assert host_memory_kind(jax.devices()[0]) == "pinned_host"
    assert host_memory_kind(jax.devices()[:4]) == "pinned_host"
    assert host_memory_kind(_FakeDevice("device", "unpinned_host", "pinned_host")) == "pinned_host"


def test_host_memory_kind_falls_back_to_unpinned():
    assert host_memory_kind(_FakeDevice("device", "unpinned_host")) == "unpinned_host"
    # One device without pinned memory makes the whole set fall back.
    mixed = [_FakeDevice("device", "pinned_host", "unpinned_host"), _FakeDevice("unpinned_host")]
    assert host_memory_kind(mixed) == "unpinned_host"


def test_host_memory_kind_errors():
    with pytest.raises(ValueError, match=r"host_memory_kind: device: expected a device exposing"):
        host_memory_kind(_FakeDevice("device"))
    with pytest.raises(ValueError, match=r"FakeDevice\('device',\) offers \['device'\]"):
        host_memory_kind([_FakeDevice("pinned_host"), _FakeDevice("device")])
    with pytest.raises(ValueError, match=r"host_memory_kind: device: expected at least one"):
        host_memory_kind([])


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_bit_exact(dtype):
    tree = {"k": _random((2, 3, 4, 8), dtype), "v": [_random((5,), dtype, seed=1)]}
    handle = to_host(tree)
    assert isinstance(handle, TransferHandle) and handle.direction == "device_to_host"
    assert handle.nbytes == sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))
    host = wait(handle)
    for leaf in jax.tree_util.tree_leaves(host):
        assert leaf.sharding.memory_kind == "pinned_host"
    back_handle = to_device(host, request_id="r")
    assert back_handle.direction == "host_to_device" and back_handle.request_id == "r"
    back = wait(back_handle)
    for leaf, orig in zip(
        jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(tree), strict=True
    ):
        assert leaf.sharding.memory_kind == "device"
        assert leaf.dtype == orig.dtype and leaf.shape == orig.shape
        np.testing.assert_array_equal(_bits(leaf), _bits(orig))


def test_unpinned_host_kind():
    x = _random((4, 8), jnp.bfloat16)
    host = wait(to_host(x, memory_kind="unpinned_host"))
    assert host.sharding.memory_kind == "unpinned_host"
    np.testing.assert_array_equal(_bits(wait(to_device(host))), _bits(x))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_shardings_preserved_on_8_device_mesh(axis_type):
    mesh = make_test_mesh((2, 4), ("data", "model"), axis_type=axis_type)
    specs = [P("data", "model"), P(None, "model"), P()]
    tree = [
        jax.device_put(_random((4, 8, 2), jnp.float32, seed=i), NamedSharding(mesh, s))
        for i, s in enumerate(specs)
    ]
    host = wait(to_host(tree))
    back = wait(to_device(host))
    for orig, h, b in zip(tree, host, back, strict=True):
        assert h.sharding.memory_kind == "pinned_host"
        assert b.sharding.memory_kind == "device"
        assert h.sharding == orig.sharding.with_memory_kind("pinned_host")
        assert b.sharding == orig.sharding
        assert {s.device for s in h.addressable_shards} == set(mesh.devices.flat)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(orig))


@pytest.mark.no_typecheck
def test_tree_errors():
    with pytest.raises(ValueError, match=r"to_host: tree: expected every leaf .* got ndarray"):
        to_host({"k": np.ones(3)})
    with pytest.raises(ValueError, match=r"to_device: tree: expected every leaf .* got int"):
        to_device([jnp.ones(2), 3])
    with pytest.raises(ValueError, match=r"to_host: memory_kind: expected one of"):
        to_host(jnp.ones(2), memory_kind="device")


class _Event:
    """A completion event whose readiness the test controls."""

    def __init__(self, landed):
        self.landed = landed

    def is_ready(self):
        return self.landed


def test_ready_polls_every_event():
    value = jnp.arange(6.0)
    pending = TransferHandle(value, "device_to_host", 24, done=(_Event(True), _Event(False)))
    assert not ready(pending)  # one event still in flight
    landed = TransferHandle(value, "device_to_host", 24, done=(_Event(True), _Event(True)))
    assert ready(landed)
    # Without done, the value's own arrays are the events.
    handle = to_host(jnp.arange(6.0))
    value = wait(handle)
    assert value is handle.value
    np.testing.assert_array_equal(np.asarray(value), np.arange(6.0))


@pytest.mark.no_typecheck
def test_handle_errors():
    with pytest.raises(ValueError, match=r"ready: handle: expected a TransferHandle, got int"):
        ready(3)
    with pytest.raises(ValueError, match=r"wait: handle: expected a TransferHandle, got str"):
        wait("x")


def test_many_transfers_in_flight():
    arrays = [_random((16, 32), jnp.float32, seed=i) for i in range(24)]
    handles = [to_host(a) for a in arrays]
    back = [to_device(h.value) for h in handles]  # chained without waiting
    for a, h in zip(arrays, back, strict=True):
        np.testing.assert_array_equal(np.asarray(wait(h)), np.asarray(a))
        assert h.nbytes == a.nbytes


def test_stats_accounting():
    stats = OffloadStats()
    stats.record_issue("device_to_host", 100)
    assert stats.transfers("device_to_host").in_flight == 1
    stats.record_transfer("device_to_host", 100, 0.5, request_id="r1", issued=True)
    stats.record_transfer("host_to_disk", 50, 0.25)
    t = stats.transfers("device_to_host")
    assert (t.count, t.nbytes, t.in_flight, t.in_flight_bytes) == (1, 100, 0, 0)
    assert t.gib_per_second == pytest.approx(200 / 2**30)
    assert stats.request_transfer_bytes("device_to_host", "r1") == 100
    stats.add_tier_bytes("host", 64, request_id="r1")
    stats.add_tier_bytes("host", 32, request_id="r2")
    stats.add_tier_bytes("device", 10)
    assert stats.tier_bytes("host") == 96
    assert stats.tier_bytes("host", request_id="r1") == 64
    assert stats.requests() == ["r1", "r2"]
    snapshot = stats.as_dict()
    assert snapshot["requests"]["r2"]["host"] == 32
    assert set(snapshot["transfers"]) == set(OffloadStats.DIRECTIONS)
    assert "| host_to_disk | 1 | 50 |" in stats.to_markdown()
    assert stats.transfers("disk_to_host").gib_per_second == 0.0
    stats.record_transfer("disk_to_host", np.int64(8), np.float32(0.5))  # numpy scalars
    assert stats.transfers("disk_to_host").nbytes == 8


@pytest.mark.no_typecheck
def test_stats_errors():
    stats = OffloadStats()
    with pytest.raises(ValueError, match=r"record_transfer: direction: expected one of"):
        stats.record_transfer("up", 1, 1.0)
    with pytest.raises(ValueError, match=r"record_transfer: nbytes: expected an int >= 0"):
        stats.record_transfer("host_to_device", -1, 1.0)
    with pytest.raises(
        ValueError, match=r"record_transfer: seconds: expected a float in \[0.0, inf\]"
    ):
        stats.record_transfer("host_to_device", 1, -1.0)
    with pytest.raises(
        ValueError, match=r"record_transfer: nbytes: expected an int >= 0, got float"
    ):
        stats.record_transfer("host_to_device", 1.5, 1.0)
    with pytest.raises(ValueError, match=r"record_issue: direction: expected one of"):
        stats.record_issue("down", 1)
    with pytest.raises(ValueError, match=r"record_issue: nbytes: expected an int >= 0"):
        stats.record_issue("host_to_device", -5)
    with pytest.raises(ValueError, match=r"add_tier_bytes: tier: expected one of"):
        stats.add_tier_bytes("tape", 1)
    with pytest.raises(ValueError, match=r"add_tier_bytes: delta: expected the host bytes of all"):
        stats.add_tier_bytes("host", -1)
    stats.add_tier_bytes("host", 5, request_id="r2")
    with pytest.raises(ValueError, match=r"add_tier_bytes: delta: expected the host bytes of r1"):
        stats.add_tier_bytes("host", -1, request_id="r1")
    assert stats.tier_bytes("host") == 5  # a rejected change leaves every figure as it was
    with pytest.raises(ValueError, match=r"tier_bytes: tier: expected one of"):
        stats.tier_bytes("tape")
    with pytest.raises(ValueError, match=r"transfers: direction: expected one of"):
        stats.transfers("sideways")
    with pytest.raises(ValueError, match=r"request_transfer_bytes: direction: expected one of"):
        stats.request_transfer_bytes("sideways", "r1")
