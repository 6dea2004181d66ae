"""Pages and ring hops share one codec: quantizing the same tokens through a ring hop
(``ringattn.quantize_hop``, what the ring sends) and through a page (``paged.quantize_pages``,
what the cache stores) gives identical bytes, on > 100k values with rounding ties, all-zero,
sub-normal-scale and NaN / inf tokens; and the quantized ring computes attention over exactly
the keys and values a page of that format decodes to."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
import ringattn
from tests._util import assert_close, make_test_mesh
from tests.paged.test_codec_docs import inputs, int_ties

KINDS = ringattn.HOP_FORMATS


def _bytes(x):
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("kind", KINDS)
def test_a_ring_hop_and_a_page_store_the_same_bytes(kind):
    fmt = paged.KVFormat(kind)
    x = inputs(64, int_ties(int(fmt.qmax)), np.random.default_rng(7), n_tokens=256, rows=16)
    x = jnp.asarray(x)  # [256, 16, 64]: pages of 16 tokens
    hop = ringattn.quantize_hop(x, hop_format=fmt)
    page = paged.quantize_pages(x, fmt)
    np.testing.assert_array_equal(_bytes(hop.data), _bytes(page.data))
    np.testing.assert_array_equal(_bytes(hop.scale), _bytes(page.scale))
    # and under jit, as the ring runs it inside its program
    jitted = jax.jit(functools.partial(ringattn.quantize_hop, hop_format=fmt))(x)
    np.testing.assert_array_equal(_bytes(jitted.data), _bytes(page.data))
    np.testing.assert_array_equal(_bytes(jitted.scale), _bytes(page.scale))
    decoded = np.asarray(page.dequantize())
    np.testing.assert_array_equal(_bytes(ringattn.dequantize_hop(hop)), _bytes(decoded))


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_ring_attends_over_what_a_page_decodes(kind):
    n, local, (N, K), H = 4, 8, (4, 2), 16
    rng = np.random.default_rng(1)
    q, k, v = (
        jnp.asarray(rng.standard_normal((2, n * local, heads, H), dtype=np.float32))
        for heads in (N, K, K)
    )
    fmt = paged.KVFormat(kind)
    mesh = make_test_mesh((n,), ("seq",))
    ring = functools.partial(
        ringattn.sharded_attention, mesh=mesh, seq_axis="seq", causal=True, hop_format=fmt
    )
    out = jax.jit(ring)(q, k, v).out

    def decoded(x):  # [B, S, K, H] -> pages [B, K, S, H] -> decoded, back
        pages = paged.quantize_pages(jnp.swapaxes(x, 1, 2), fmt)
        return jnp.swapaxes(pages.dequantize(), 1, 2)

    ref = ringattn.attention_reference(q, decoded(k), decoded(v), causal=True).out
    assert_close(out, ref, dtype=jnp.float32, what=f"{kind} ring vs paged-decoded reference")
    exact = ringattn.attention_reference(q, k, v, causal=True).out
    assert float(jnp.max(jnp.abs(out - exact))) > 0  # the hops really were quantized
