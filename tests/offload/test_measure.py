"""Bytes per tier measured from the arrays that hold them; staging pools sized to the fetch."""

import jax
import numpy as np
import pytest

import paged
from offload import (
    OffloadManager,
    make_host_page_pool,
    make_staging_pool,
    measure_bytes,
    page_nbytes,
)

L, K, P, C, H = 2, 2, 12, 4, 8


def _pools(kind=None):
    k = jax.random.normal(jax.random.key(0), (L, K, P, C, H))
    v = jax.random.normal(jax.random.key(1), (L, K, P, C, H))
    if kind is None:
        return k, v
    fmt = paged.KVFormat(kind)
    if kind == "kivi2":
        return (paged.quantize_pages(k, fmt, role="keys"),
                paged.quantize_pages(v, fmt, role="values"))  # fmt: skip
    return paged.quantize_pages(k, fmt), paged.quantize_pages(v, fmt)


@pytest.mark.parametrize("kind", [None, "int8", "kivi2"])
def test_page_nbytes_and_measure_bytes_count_every_leaf(kind):
    k, v = _pools(kind)
    leaves = jax.tree.leaves((k, v))
    total = sum(x.nbytes for x in leaves)
    assert measure_bytes((k, v)) == {"device": total}
    assert page_nbytes(k, v) * P == total
    host = make_host_page_pool(k, v, 5)
    assert measure_bytes(host) == {"pinned_host": 5 * page_nbytes(k, v)}
    assert host.page_nbytes == page_nbytes(k, v)
    both = measure_bytes({"device": (k, v), "host": host, "n": np.zeros(3, np.int8), "x": 1})
    assert both == {"device": total, "pinned_host": 5 * page_nbytes(k, v), "numpy": 3}


@pytest.mark.parametrize("kind", [None, "int8", "kivi2"])
def test_staging_pool_holds_only_the_fetched_pages(kind):
    k, v = _pools(kind)
    ids = np.array([3, 7, 9], np.int32)
    manager = OffloadManager(make_host_page_pool(k, v, 4))
    manager.wait(manager.page_out(k, v, ids, request_id="r"))
    stage_k, stage_v = make_staging_pool(k, v, ids.size)
    assert stage_k.shape == (L, K, ids.size + 1, C, H) and type(stage_k) is type(k)
    assert measure_bytes((stage_k, stage_v)) == {"device": (ids.size + 1) * page_nbytes(k, v)}
    stage_k, stage_v = manager.wait(
        manager.page_in(stage_k, stage_v, np.arange(1, ids.size + 1), request_id="r")
    )
    for got, want in ((stage_k, k), (stage_v, v)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a)[:, :, 1:], np.asarray(b)[:, :, ids])
    empty_k, _ = make_staging_pool(k, v, 0)  # nothing fetched: the null page alone
    assert empty_k.shape[2] == 1
    assert make_staging_pool(k, v, 5, bucket=4)[0].shape[2] == 8


def test_record_device_pages_measures_the_device_tier():
    k, v = _pools()
    manager = OffloadManager(make_host_page_pool(k, v, 4))
    assert manager.record_device_pages(k, v, 7) == 7 * page_nbytes(k, v)
    assert manager.stats.tier_bytes("device") == 7 * page_nbytes(k, v)
    manager.record_device_pages(k, v, 3)  # sets, does not add
    assert manager.stats.tier_bytes("device") == 3 * page_nbytes(k, v)
    with pytest.raises(ValueError, match="record_device_pages: num_pages: expected"):
        manager.record_device_pages(k, v, P + 1)


@pytest.mark.no_typecheck
def test_errors():
    k, v = _pools()
    with pytest.raises(ValueError, match="make_staging_pool: num_pages: expected"):
        make_staging_pool(k, v, -1)
    with pytest.raises(ValueError, match="make_staging_pool: bucket: expected"):
        make_staging_pool(k, v, 2, bucket=0)
    host = make_host_page_pool(k, v, 4)
    with pytest.raises(ValueError, match="make_staging_pool: k_pages: expected arrays in device"):
        make_staging_pool(host.k_pages, host.v_pages, 2)
    with pytest.raises(ValueError, match="page_nbytes: k_pages/v_pages: expected"):
        page_nbytes(k, v[:, :, :3])
