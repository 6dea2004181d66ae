"""A decode step costs what it reads: the compiled step over a donated cache holds no copy of a
layer's pool (``compiled.memory_analysis()``), whatever the pool's size, for float and quantized
pages, static and traced layers; and the per-layer pools read and write the same numbers as a
stacked reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged

L, K, C, H, N, M = 4, 2, 8, 16, 4, 8


def _cache(P, kv_format=None, batch=2):
    cache = paged.init_paged_cache(L, K, P, C, H, batch, M, kv_format=kv_format)
    table = np.zeros((batch, M), np.int32)
    for b in range(batch):  # pages at the far end of the pool: reads never touch the rest
        table[b] = np.arange(P - (b + 1) * M, P - b * M)
    return paged.with_page_table(cache, table, np.full(batch, 3 * C + 1, np.int32))


def _step(cache, q, kv, *, form):
    """One decode token through ``L`` layers: write the layer, attend over it."""
    for layer in range(L):
        cache = paged.write_layer(cache, layer, kv * (layer + 1), -kv, cache.lengths)
        if form == "slice":
            k, v = cache.k_pages[layer], cache.v_pages[layer]
            out = paged.paged_attention(q, k, v, cache.page_table, cache.lengths + 1).out
        else:
            out = paged.paged_attention(
                q, cache.k_pages, cache.v_pages, cache.page_table, cache.lengths + 1, layer=layer
            ).out
        q = q + 0.5 * out
    return paged.advance(cache, 1), q


def _traced_step(cache, q, kv):
    """The same step as a ``fori_loop`` over a traced layer index."""

    def body(layer, carry):
        cache, q = carry
        cache = paged.write_layer(cache, layer, kv * (layer + 1), -kv, cache.lengths)
        out = paged.paged_attention(
            q, cache.k_pages, cache.v_pages, cache.page_table, cache.lengths + 1, layer=layer
        ).out
        return cache, q + 0.5 * out

    cache, q = jax.lax.fori_loop(0, L, body, (cache, q))
    return paged.advance(cache, 1), q


def _layer_pool_bytes(cache) -> int:
    return cache.k_pages[0].nbytes


def _inputs(batch=2):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((batch, 1, N, H)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((batch, K, H)), jnp.float32)
    return q, kv


FORMATS = {
    "float32": None,
    "int8": paged.KVFormat("int8"),
    "fp8": paged.KVFormat("fp8"),
    "int4": paged.KVFormat("int4", group_size=8),
    "kivi2": paged.KVFormat("kivi2"),
}


# fp8, int4 and kivi2 store float8 data or bfloat16 scales: XLA:CPU has no scatter of those
# types and converts a written leaf to float32 and back, a copy of that leaf per write (GPU
# and TPU scatter them in place). docs/concepts/paged.md states it; float32 and int8 pools
# are copy-free on every backend.
@pytest.mark.parametrize("fmt", ["float32", "int8"])
@pytest.mark.parametrize("form", ["slice", "layer", "traced"])
def test_compiled_step_holds_no_copy_of_a_pool(fmt, form):
    q, kv = _inputs()
    temps = []
    for P in (64, 1024):
        cache = _cache(P, FORMATS[fmt])
        step = _traced_step if form == "traced" else functools.partial(_step, form=form)
        compiled = jax.jit(step, donate_argnums=0).lower(cache, q, kv).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        temps.append((temp, _layer_pool_bytes(cache)))
    # At 1024 pages, below one layer's pool (a copy of any layer, or of the stack, would be at
    # least that); and no more than at 64 pages (plus slack for layout).
    (small, _), (large, layer_bytes) = temps
    assert large < layer_bytes / 4, temps
    assert large <= small + 16 * 1024, temps


@pytest.mark.parametrize("fmt", ["float32", "int8", "kivi2"])
def test_step_forms_agree_and_match_the_stacked_reference(fmt):
    q, kv = _inputs()
    cache = _cache(64, FORMATS[fmt])
    results = {}
    for form in ("slice", "layer", "traced"):
        step = _traced_step if form == "traced" else functools.partial(_step, form=form)
        c, out = jax.jit(step)(cache, q, kv)
        c, out = jax.jit(step)(c, out, kv)
        results[form] = (c, out)
    for form in ("layer", "traced"):
        np.testing.assert_array_equal(np.asarray(results[form][1]), np.asarray(results["slice"][1]))
        for layer in range(L):
            for a, b in zip(
                paged.gather_kv(results[form][0], layer),
                paged.gather_kv(results["slice"][0], layer),
                strict=True,
            ):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The reference: a dense decoder over gathered KV, the same writes.
    c, out = results["slice"]
    assert c.lengths.tolist() == [3 * C + 3] * 2
    for layer in range(L):
        k, v = paged.gather_kv(c, layer)
        got_k = np.asarray(k[:, 3 * C + 1 : 3 * C + 3])
        want = np.broadcast_to(np.asarray(kv * (layer + 1))[:, None], got_k.shape)
        tol = 0 if fmt == "float32" else 0.6
        np.testing.assert_allclose(got_k, want, atol=tol)


def test_donated_cache_is_updated_in_place():
    q, kv = _inputs()
    cache = _cache(256)
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(cache.k_pages)]
    step = jax.jit(functools.partial(_step, form="slice"), donate_argnums=0)
    new, _ = step(cache, q, kv)
    jax.block_until_ready(new)
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(new.k_pages)] == pointers


def test_layer_pools_read_like_the_stack():
    cache = _cache(16)
    pools = cache.k_pages
    assert isinstance(pools, paged.LayerPools)
    assert pools.shape == (L, K, 16, C, H) and pools.ndim == 5 and len(pools) == L
    assert pools.nbytes == L * K * 16 * C * H * 4
    stacked = np.asarray(pools)
    assert stacked.shape == pools.shape
    np.testing.assert_array_equal(np.asarray(pools[1]), stacked[1])
    np.testing.assert_array_equal(np.asarray(pools[1, 0, 3]), stacked[1, 0, 3])
    np.testing.assert_array_equal(np.asarray(pools[:, :, 2]), stacked[:, :, 2])
    with pytest.raises(IndexError, match="out of range"):
        pools[L]
    # A pytree of L separate buffers.
    assert len(jax.tree.leaves(pools)) == L
    assert len({x.unsafe_buffer_pointer() for x in jax.tree.leaves(pools)}) == L


def test_layer_argument_errors():
    cache = _cache(16)
    q, _ = _inputs()
    args = (q, cache.k_pages, cache.v_pages, cache.page_table, cache.lengths)
    with pytest.raises(ValueError, match="need layer="):
        paged.paged_attention(*args)
    with pytest.raises(ValueError, match=r"layer: expected an int in \[0, 4\)"):
        paged.paged_attention(*args, layer=4)
    with pytest.raises(ValueError, match=r"both paged\.LayerPools"):
        paged.paged_attention(q, cache.k_pages, cache.v_pages[0], cache.page_table, cache.lengths, layer=0)  # fmt: skip
