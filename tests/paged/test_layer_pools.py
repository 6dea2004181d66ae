"""``layer=``: paged attention over one layer of a ``PagedKVCache``'s stacked pools, read in
place: the same numbers as the sliced layer, for every pool kind, traced or static layer; and
no copy of the layer's pool in the compiled program (which made a decode step grow with the
whole pool)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
from paged._attention import layer_pools

L, K, P, C, H, N = 3, 2, 9, 4, 8, 4


def stacked(kind, seed=0):
    rng = np.random.default_rng(seed)
    k, v = (jnp.asarray(rng.standard_normal((L, K, P, C, H)), jnp.float32) for _ in range(2))
    if kind == "float32":
        return k, v
    fmt = paged.KVFormat(kind) if kind != "int4" else paged.KVFormat("int4", group_size=4)
    return paged.quantize_pages(k, fmt), paged.quantize_pages(v, fmt)


TABLE = jnp.asarray([[3, 1, 7, 0], [5, 2, 0, 0]], jnp.int32)
LENGTHS = jnp.asarray([11, 6], jnp.int32)


@pytest.mark.parametrize("kind", ["float32", "int8", "fp8", "int4"])
def test_layer_reads_what_the_sliced_layer_reads(kind):
    k, v = stacked(kind)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((2, 2, N, H)), jnp.float32)
    for layer in range(L):
        want = paged.paged_attention(q, k[layer], v[layer], TABLE, LENGTHS, return_page_mass=True)
        got = paged.paged_attention(q, k, v, TABLE, LENGTHS, layer=layer, return_page_mass=True)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        traced = jax.jit(lambda q, k, v, l: paged.paged_attention(q, k, v, TABLE, LENGTHS, layer=l).out)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(traced(q, k, v, jnp.int32(layer))), np.asarray(want.out))  # fmt: skip
        # ragged: two sequences of 3 and 1 query rows
        qr = q.reshape(4, N, H)
        cu = jnp.asarray([0, 3, 4], jnp.int32)
        want = paged.ragged_paged_attention(qr, k[layer], v[layer], TABLE, LENGTHS, cu, 2)
        got = paged.ragged_paged_attention(qr, k, v, TABLE, LENGTHS, cu, 2, layer=layer)
        np.testing.assert_array_equal(np.asarray(got.out), np.asarray(want.out))


def test_kivi2_stacks_are_sliced_and_read_the_same():
    cache = paged.init_paged_cache(L, K, P, C, H, batch=2, max_pages_per_seq=4, kv_format=paged.KVFormat("kivi2"))  # fmt: skip
    cache = paged.with_page_table(cache, TABLE, jnp.zeros(2, jnp.int32))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 11, K, H)), jnp.float32)
    for layer in range(L):
        cache = paged.write_layer(cache, layer, x * (layer + 1), -x, 0, count=LENGTHS)
    cache = paged.with_page_table(cache, TABLE, LENGTHS)
    q = jnp.ones((2, 1, N, H), jnp.float32)
    for layer in range(L):
        want = paged.paged_attention(q, cache.k_pages[layer], cache.v_pages[layer], TABLE, LENGTHS)  # fmt: skip
        got = paged.paged_attention(q, cache.k_pages, cache.v_pages, TABLE, LENGTHS, layer=layer)
        np.testing.assert_array_equal(np.asarray(got.out), np.asarray(want.out))


def test_the_layer_is_not_copied():
    """The compiled step's temporaries stay far below one layer's pool with layer=; slicing
    first copies the layer (the test can fail: that is what it measured before)."""
    big = jnp.zeros((4, K, 4096, C, H), jnp.float32)  # one layer's pool: 1 MiB
    q = jnp.ones((2, 1, N, H), jnp.float32)
    layer_bytes = big[0].nbytes

    def temp(fn):
        return jax.jit(fn).lower(q, big, jnp.int32(2)).compile().memory_analysis().temp_size_in_bytes  # fmt: skip

    in_place = temp(lambda q, p, l: paged.paged_attention(q, p, p, TABLE, LENGTHS, layer=l).out)
    sliced = temp(lambda q, p, l: paged.paged_attention(q, p[l], p[l], TABLE, LENGTHS).out)
    assert in_place < layer_bytes / 4 <= sliced, (in_place, sliced, layer_bytes)


@pytest.mark.no_typecheck
def test_layer_errors():
    k, v = stacked("float32")
    q = jnp.ones((2, 1, N, H), jnp.float32)
    with pytest.raises(ValueError, match=r"layer: expected 0 <= layer < 3"):
        paged.paged_attention(q, k, v, TABLE, LENGTHS, layer=3)
    with pytest.raises(ValueError, match="layer: expected an int"):
        paged.paged_attention(q, k, v, TABLE, LENGTHS, layer=1.0)
    with pytest.raises(ValueError, match=r"k_pages: expected the stacked \[L, K, P, C, H\]"):
        paged.paged_attention(q, k[0], v[0], TABLE, LENGTHS, layer=0)
    with pytest.raises(ValueError, match="layer: expected an int"):
        layer_pools("f", k, v, True)
