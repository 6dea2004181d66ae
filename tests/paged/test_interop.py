"""Conversions to and from JAX's own quantized paged-attention conventions: each direction
against JAX's reference (ragged: ``ref_ragged_paged_attention``; GPU: the Pallas kernel in
interpret mode and ``paged_attention_reference``; TPU paged attention has no pure reference:
its Pallas kernel in TPU interpret mode), exactness of the round trips, the requantization
bound of the per-tensor convention, jit, errors.

Setup of every JAX-side case (zero-based pages): GQA (N = 4 query heads over K = 2), lengths
0, 1, C + 1 and full capacity, distinct random pages per sequence, unused table slots on a
finite padding page (JAX's kernels read whole compute blocks and mask by adding a large
negative, so a NaN there would reach their result), finite garbage past each length inside a
partial page, NaN garbage in pages no table names.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_tpu_attention
from jax.experimental.pallas.ops.tpu.paged_attention import quantization_utils
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as jax_ragged

import paged
from paged import (
    KVFormat,
    QuantizedPages,
    from_jax_gpu_scale_pages,
    from_jax_ragged_kv_pages,
    from_jax_tpu_quantized,
    from_zero_based_table,
    paged_attention,
    quantize_pages,
    ragged_paged_attention,
    to_jax_gpu_scale_pages,
    to_jax_ragged_kv_pages,
    to_jax_tpu_quantized,
    to_zero_based_table,
)
from tests._util import assert_close

KINDS = ["int8", "fp8"]
STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
K, N, C, H, M = 2, 4, 4, 16, 3
P = 12  # zero-based pages: 6 used, 1 padding page, 5 never named (NaN garbage)
LENGTHS = np.array([0, 1, C + 1, M * C], np.int32)


def zero_based_setup(seed):
    """``table [B, M]`` zero-based, the padding page, the pages no table names, and a mask
    ``tail [P, C]`` of the slots past a length inside a used page."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(P)
    used = -(-LENGTHS // C)
    pad, spare = int(ids[0]), ids[1 + used.sum() :]
    table = np.full((len(LENGTHS), M), pad, np.int32)
    tail = np.zeros((P, C), bool)
    start = 1
    for b, (n, length) in enumerate(zip(used, LENGTHS, strict=True)):
        table[b, :n] = ids[start : start + n]
        start += n
        if n and length % C:
            tail[table[b, n - 1], length % C :] = True
    return rng, table, pad, spare, tail


def stored_values(rng, shape, kind):
    """Random stored values of the kind: int8 over [-128, 127], fp8 over +-448."""
    if kind == "int8":
        return jnp.asarray(rng.integers(-128, 128, shape), jnp.int8)
    return jnp.asarray(rng.uniform(-448, 448, shape), jnp.float32).astype(jnp.float8_e4m3fn)


# --- TPU ragged paged attention: fused kv_pages, per-tensor k_scale / v_scale ------------


def ragged_case(kind, seed=0, heads=(N, K)):
    n_heads, kv_heads = heads
    rng, table, pad, spare, tail = zero_based_setup(seed)
    kv = np.array(stored_values(rng, (P, C, 2 * kv_heads, H), kind).astype(jnp.float32))
    if kind == "fp8":  # garbage: NaN past each length and in the pages nobody names
        kv[np.broadcast_to(tail[:, :, None, None], kv.shape)] = np.nan
        kv[spare] = np.nan
    kv_pages = jnp.asarray(kv).astype(STORAGE[kind])
    q_lens = np.array([0, 1, 3, 4])
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(cu[-1]) + 2, n_heads, H)), jnp.float32)
    return q, kv_pages, table, cu


WINDOW_CAP = {"window": 3, "softcap": 5.0}


# Each kind with GQA and MQA, each with and without a window and softcap (4 of the 8).
@pytest.mark.parametrize(
    "kind, heads, options",
    [
        ("int8", (N, K), {}),
        ("fp8", (N, K), WINDOW_CAP),
        ("int8", (N, 1), WINDOW_CAP),
        ("fp8", (N, 1), {}),
    ],
    ids=["int8-gqa-plain", "fp8-gqa-window_cap", "int8-mqa-window_cap", "fp8-mqa-plain"],
)
def test_ragged_from_jax_matches_jax_reference(kind, heads, options):
    q, kv_pages, table, cu = ragged_case(kind, heads=heads)
    k_scale, v_scale = (0.01, 0.02) if kind == "int8" else (3e-3, 4e-3)
    expected = jax_ragged.ref_ragged_paged_attention(
        q,
        kv_pages,
        jnp.asarray(LENGTHS),
        jnp.asarray(table),
        jnp.asarray(cu),
        jnp.array([len(LENGTHS)], jnp.int32),
        sm_scale=0.3,
        sliding_window=options.get("window"),
        soft_cap=options.get("softcap"),
        k_scale=k_scale,
        v_scale=v_scale,
    )
    k_pages, v_pages = from_jax_ragged_kv_pages(kv_pages, k_scale=k_scale, v_scale=v_scale)
    assert k_pages.format == KVFormat(kind) and k_pages.shape == (heads[1], P + 1, C, H)
    got = ragged_paged_attention(
        q,
        k_pages,
        v_pages,
        from_zero_based_table(table),
        jnp.asarray(LENGTHS),
        jnp.asarray(cu),
        jnp.array([len(LENGTHS)], jnp.int32),
        scale=0.3,
        **options,
    ).out
    total = int(cu[-1])
    assert_close(got[:total], expected, dtype=jnp.float32, what="ragged from JAX")
    assert np.all(np.asarray(got[total:]) == 0)  # rows owned by no sequence


@pytest.mark.parametrize("kind", KINDS)
def test_ragged_from_jax_decodes_bitwise_and_round_trips_exactly(kind):
    _, kv_pages, table, _ = ragged_case(kind, seed=1)
    k_pages, v_pages = from_jax_ragged_kv_pages(kv_pages, k_scale=0.125, v_scale=3e-3)
    raw = np.asarray(kv_pages.astype(jnp.float32))  # [P, C, 2K, H]
    for pages, side, scale in ((k_pages, 0, 0.125), (v_pages, 1, 3e-3)):
        theirs = raw[:, :, side::2] * np.float32(scale)  # JAX's decoding, float32
        ours = np.asarray(pages.dequantize())
        np.testing.assert_array_equal(ours[:, 1:], theirs.transpose(2, 0, 1, 3))
        assert np.all(ours[:, 0] == 0) and np.all(np.asarray(pages.scale[:, 0]) == 0)
    jitted = jax.jit(
        lambda kv: from_jax_ragged_kv_pages(kv, k_scale=0.125, v_scale=3e-3)  # static scales
    )(kv_pages)
    for a, b in zip(jitted, (k_pages, v_pages), strict=True):
        np.testing.assert_array_equal(np.asarray(a.dequantize()), np.asarray(b.dequantize()))
    back = to_jax_ragged_kv_pages(k_pages, v_pages)  # default scales: the common ones
    assert (back.k_scale, back.v_scale) == (float(np.float32(0.125)), float(np.float32(3e-3)))
    assert back.kv_pages.dtype == kv_pages.dtype
    np.testing.assert_array_equal(np.asarray(back.kv_pages.astype(jnp.float32)), raw)
    if kind == "int8":
        assert int(jnp.min(kv_pages)) == -128  # JAX's int8 may store -128: kept
    # ours (uniform scales) -> theirs -> ours: bitwise
    again = from_jax_ragged_kv_pages(back.kv_pages, k_scale=back.k_scale, v_scale=back.v_scale)
    for a, b in zip(again, (k_pages, v_pages), strict=True):
        np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
        np.testing.assert_array_equal(
            np.asarray(a.data.astype(jnp.float32)), np.asarray(b.data.astype(jnp.float32))
        )


def requant_bound(x, t, kind):
    """The documented bound of re-encoding decoded values ``x`` over one scale ``t``."""
    if kind == "int8":
        return t / 2 + np.abs(x) * 2e-7
    return np.abs(x) / 16 + t * 2.0**-10 + np.abs(x) * 2e-7


@pytest.mark.parametrize("kind", KINDS)
def test_ragged_to_jax_is_a_bounded_requantization_and_agrees_with_jax(kind):
    rng, table, _, spare, _ = zero_based_setup(2)
    fmt = KVFormat(kind)
    # per-token magnitudes over three decades: per-tensor scales must requantize
    mag = 10.0 ** rng.uniform(-2, 1, (K, P + 1, C, 1))
    k_pages = quantize_pages(jnp.asarray(rng.standard_normal((K, P + 1, C, H)) * mag), fmt)
    v_pages = quantize_pages(jnp.asarray(rng.standard_normal((K, P + 1, C, H)) * mag), fmt)
    theirs = to_jax_ragged_kv_pages(k_pages, v_pages)
    assert theirs.kv_pages.shape == (P, C, 2 * K, H) and isinstance(theirs.k_scale, float)
    assert theirs.k_scale == float(jnp.max(k_pages.scale[:, 1:]))
    raw = np.asarray(theirs.kv_pages.astype(jnp.float32))
    for pages, side, t in ((k_pages, 0, theirs.k_scale), (v_pages, 1, theirs.v_scale)):
        x = np.asarray(pages.dequantize())[:, 1:].transpose(1, 2, 0, 3)  # [P, C, K, H]
        err = np.abs(raw[:, :, side::2] * np.float32(t) - x)
        assert np.all(err <= requant_bound(x, t, kind)), f"max excess {np.max(err - t / 2)}"
        assert np.max(err) > 0  # a real requantization (per-token scales differ)
    cu = np.array([0, 0, 1, 4, 8], np.int32)
    q = jnp.asarray(rng.standard_normal((8, N, H)), jnp.float32)
    expected = jax_ragged.ref_ragged_paged_attention(
        q,
        theirs.kv_pages,
        jnp.asarray(LENGTHS),
        jnp.asarray(table),
        jnp.asarray(cu),
        jnp.array([4], jnp.int32),
        sm_scale=0.25,
        k_scale=theirs.k_scale,
        v_scale=theirs.v_scale,
    )
    ours = from_jax_ragged_kv_pages(theirs.kv_pages, k_scale=theirs.k_scale, v_scale=theirs.v_scale)
    got = ragged_paged_attention(
        q,
        *ours,
        from_zero_based_table(table),
        jnp.asarray(LENGTHS),
        jnp.asarray(cu),
        4,
        scale=0.25,
    ).out
    assert_close(got, expected, dtype=jnp.float32, what="ragged to JAX and back")


@pytest.mark.parametrize("kind", KINDS)
def test_ragged_to_jax_with_given_scales_under_jit(kind):
    rng = np.random.default_rng(3)
    fmt = KVFormat(kind)
    k_pages = quantize_pages(jnp.asarray(rng.standard_normal((K, 5, C, H))), fmt)
    v_pages = quantize_pages(jnp.asarray(rng.standard_normal((K, 5, C, H))), fmt)
    k_pages = QuantizedPages(k_pages.data, k_pages.scale.at[:, 0].set(jnp.nan), fmt)  # null page
    t_k, t_v = 2 * float(jnp.max(k_pages.scale[:, 1:])), 0.5
    eager = to_jax_ragged_kv_pages(k_pages, v_pages, k_scale=t_k, v_scale=t_v)
    jitted = jax.jit(lambda k, v: to_jax_ragged_kv_pages(k, v, k_scale=t_k, v_scale=t_v))(
        k_pages, v_pages
    )
    assert (jitted.k_scale, jitted.v_scale) == (t_k, t_v) == (eager.k_scale, eager.v_scale)
    np.testing.assert_array_equal(
        np.asarray(jitted.kv_pages.astype(jnp.float32)),
        np.asarray(eager.kv_pages.astype(jnp.float32)),
    )
    # v_scale 0.5 * 127 (or 448) is far above |v|: nothing clips, and k_scale twice the
    # largest halves the resolution: both still within the bound of their own t
    for side, pages, t in ((0, k_pages, t_k), (1, v_pages, t_v)):
        x = np.asarray(pages.dequantize())[:, 1:].transpose(1, 2, 0, 3)
        err = np.abs(np.asarray(eager.kv_pages[:, :, side::2].astype(jnp.float32)) * t - x)
        assert np.all(err <= requant_bound(x, t, kind))
    with pytest.raises(ValueError, match="to_jax_ragged_kv_pages: k_scale: expected a Python"):
        jax.jit(to_jax_ragged_kv_pages)(k_pages, v_pages)
    nan_pool = QuantizedPages(k_pages.data, k_pages.scale.at[:, 2, 1].set(jnp.nan), fmt)
    default = to_jax_ragged_kv_pages(nan_pool, v_pages)  # NaN scales ignored by the default
    assert default.k_scale == float(jnp.max(k_pages.scale[:, 1:]))
    token = np.asarray(default.kv_pages[1, 1, 0::2][0].astype(jnp.float32))
    assert np.all(np.isnan(token)) if kind == "fp8" else np.all(token == 0)


# --- TPU paged attention: int8 QuantizedTensor, per-token absmax scales -------------------


def tpu_case(seed=4):
    rng, table, pad, spare, tail = zero_based_setup(seed)
    pools = []
    for _ in range(2):
        x = rng.standard_normal((K, P, C, H)) * 10.0 ** rng.uniform(-1, 1, (K, P, C, 1))
        x[:, tail] *= 50.0  # finite garbage past the lengths
        t = quantization_utils.quantize_to_int8(jnp.asarray(x, jnp.float32))
        scales = t.scales.at[:, spare].set(jnp.nan)  # pages nobody names
        pools.append(quantization_utils.QuantizedTensor(t.weight, scales))
    q = jnp.asarray(rng.standard_normal((len(LENGTHS), N, H)) * 0.3, jnp.float32)
    return q, pools, table


def jax_tpu(q, k, v, table, lengths=LENGTHS):
    with pltpu.force_tpu_interpret_mode():
        return jax_tpu_attention(
            q, k, v, jnp.asarray(lengths), jnp.asarray(table), pages_per_compute_block=1
        )


def ours_decode(q, k_pages, v_pages, table, lengths=LENGTHS):
    """Our decode step for JAX's ``q [B, N, H]`` (logit scale 1, as JAX's paged kernels)."""
    res = paged_attention(q[:, None], k_pages, v_pages, table, jnp.asarray(lengths), scale=1.0)
    return res.out[:, 0]


def test_tpu_from_jax_matches_jax_kernel():
    q, (k, v), table = tpu_case()
    expected = jax_tpu(q, k, v, table)
    got = ours_decode(q, from_jax_tpu_quantized(k), from_jax_tpu_quantized(v), table + 1)
    assert_close(got, expected, dtype=jnp.float32, what="TPU int8 from JAX")
    assert np.all(np.asarray(got[0]) == 0) and np.all(np.asarray(expected[0]) == 0)  # length 0


def test_tpu_conversions_are_exact():
    _, (k, _), _ = tpu_case(5)
    assert paged.JAX_TPU_MAX_INT8 == quantization_utils.MAX_INT8
    ours = from_jax_tpu_quantized(k)
    assert ours.format == KVFormat("int8") and ours.shape == (K, P + 1, C, H)
    np.testing.assert_array_equal(np.asarray(ours.data[:, 1:]), np.asarray(k.weight))
    assert int(jnp.min(k.weight)) == -128  # the 127.5 convention stores -128: kept
    # decoded: w * (h / 127.5) vs JAX's w * h / 127.5, within 2**-22 relative
    theirs = np.asarray(quantization_utils.unquantize_from_int8(k, jnp.float32))
    mine = np.asarray(ours.dequantize()[:, 1:])
    finite = np.isfinite(theirs)
    assert np.all(np.abs(mine - theirs)[finite] <= 2.0**-22 * np.abs(theirs)[finite])
    back = to_jax_tpu_quantized(ours)
    assert isinstance(back, quantization_utils.QuantizedTensor)
    np.testing.assert_array_equal(np.asarray(back.weight), np.asarray(k.weight))
    assert back.scales.shape == k.scales.shape and back.scales.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(back.scales), np.asarray(k.scales), rtol=2.0**-22)
    assert np.all(np.isnan(np.asarray(back.scales)[:, spare_pages(k)]))
    again = from_jax_tpu_quantized(back)
    np.testing.assert_array_equal(np.asarray(again.data), np.asarray(ours.data))
    # the scales over random float32 scales of the normal range, both orders, eager and jit
    rng = np.random.default_rng(6)
    exponents = rng.integers(-118, 118, 200_000)  # the documented range
    s = (rng.uniform(1, 2, 200_000) * 2.0**exponents).astype(np.float32)
    s = jnp.asarray(s.reshape(1, 2, 100_000))
    pool = QuantizedPages(jnp.zeros((1, 2, 100_000, 1), jnp.int8), s, KVFormat("int8"))
    tensor = quantization_utils.QuantizedTensor(pool.data, s[..., None])
    for use_jit in (False, True):
        to_jax = jax.jit(to_jax_tpu_quantized) if use_jit else to_jax_tpu_quantized
        from_jax = jax.jit(from_jax_tpu_quantized) if use_jit else from_jax_tpu_quantized
        ours_back = np.asarray(from_jax(to_jax(pool)).scale[:, 1:])
        theirs_back = np.asarray(to_jax(from_jax(tensor)).scales[..., 0])
        np.testing.assert_allclose(ours_back, np.asarray(s[:, 1:]), rtol=2.0**-22, atol=0)
        np.testing.assert_allclose(theirs_back, np.asarray(s), rtol=2.0**-22, atol=0)
        exact = np.mean(ours_back == np.asarray(s[:, 1:]))
        assert exact > 0.99, f"ours -> theirs -> ours: only {exact:.4f} of the scales exact"


def spare_pages(tensor):
    """Zero-based pages whose scales are all NaN (the garbage of :func:`tpu_case`)."""
    return np.flatnonzero(np.all(np.isnan(np.asarray(tensor.scales)), axis=(0, 2, 3)))


def test_tpu_to_jax_matches_ours_on_jax_kernel():
    rng, table, _, spare, _ = zero_based_setup(7)
    fmt = KVFormat("int8")
    pools = []
    for _ in range(2):
        x = rng.standard_normal((K, P + 1, C, H)) * 10.0 ** rng.uniform(-1, 1, (K, P + 1, C, 1))
        pages = quantize_pages(jnp.asarray(x, jnp.float32), fmt)
        pools.append(QuantizedPages(pages.data, pages.scale.at[:, spare + 1].set(jnp.nan), fmt))
    ours_table = from_zero_based_table(table)
    np.testing.assert_array_equal(np.asarray(to_zero_based_table(ours_table)), table)
    q = jnp.asarray(rng.standard_normal((len(LENGTHS), N, H)) * 0.3, jnp.float32)
    expected = ours_decode(q, *pools, ours_table)
    k, v = (to_jax_tpu_quantized(p) for p in pools)
    got = jax_tpu(q, k, v, to_zero_based_table(ours_table))
    assert_close(got, expected, dtype=jnp.float32, what="TPU int8 to JAX")
    jitted = jax.jit(to_jax_tpu_quantized)(pools[0])
    np.testing.assert_array_equal(np.asarray(jitted.scales), np.asarray(k.scales))


# --- GPU paged attention: values and per-token scale pages [K, P, C] ----------------------


def gpu_case(kind, seed=8):
    rng, table, pad, spare, tail = zero_based_setup(seed)
    pools = []
    for _ in range(2):
        data = stored_values(rng, (K, P, C, H), kind)
        scales = np.asarray(10.0 ** rng.uniform(-4, -2, (K, P, C)), np.float32)
        scales[:, tail] *= 50.0  # finite garbage past the lengths
        scales[:, spare] = np.nan
        pools.append((data, jnp.asarray(scales)))
    q = jnp.asarray(rng.standard_normal((len(LENGTHS), N, H)), jnp.float32)
    return q, pools, table


def jax_gpu_kernel(q, k, v, table):
    return jax_gpu.paged_attention(
        q,
        k.pages,
        v.pages,
        jnp.asarray(table),
        jnp.asarray(LENGTHS),
        k.scales_pages,
        v.scales_pages,
        k_splits=1,
        pages_per_compute_block=1,
        interpret=True,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_gpu_from_jax_matches_jax_kernel_and_reference(kind):
    q, ((kd, ks), (vd, vs)), table = gpu_case(kind)
    k, v = paged.JaxScalePages(kd, ks), paged.JaxScalePages(vd, vs)
    kernel = jax_gpu_kernel(q, k, v, table)
    # the reference takes dense decoded KV [B, S, K, H]: decode w * s and gather the table
    dense = [
        (d.astype(jnp.float32) * s[..., None])[:, table].reshape(K, len(LENGTHS), M * C, H)
        for d, s in ((kd, ks), (vd, vs))
    ]
    reference = jax_gpu.paged_attention_reference(
        q, *(x.transpose(1, 2, 0, 3) for x in dense), jnp.asarray(LENGTHS)
    )
    got = ours_decode(
        q, from_jax_gpu_scale_pages(kd, ks), from_jax_gpu_scale_pages(vd, vs), table + 1
    )
    assert_close(got, kernel, dtype=jnp.float32, what="GPU from JAX vs kernel")
    # JAX's reference averages v for a length-0 row (all masked); its kernel and ours give 0
    assert_close(got[1:], reference[1:], dtype=jnp.float32, what="GPU from JAX vs reference")
    assert np.all(np.asarray(got[0]) == 0) and np.all(np.asarray(kernel[0]) == 0)


@pytest.mark.parametrize("kind", KINDS)
def test_gpu_conversions_are_exact_both_ways(kind):
    q, ((kd, ks), (vd, vs)), table = gpu_case(kind, seed=9)
    ours = from_jax_gpu_scale_pages(kd, ks)
    jitted = jax.jit(from_jax_gpu_scale_pages)(kd, ks)
    np.testing.assert_array_equal(np.asarray(jitted.scale), np.asarray(ours.scale))
    assert ours.format == KVFormat(kind) and ours.shape == (K, P + 1, C, H)
    assert np.all(np.asarray(ours.scale[:, 0]) == 0)
    back = to_jax_gpu_scale_pages(ours)
    np.testing.assert_array_equal(
        np.asarray(back.pages.astype(jnp.float32)), np.asarray(kd.astype(jnp.float32))
    )
    np.testing.assert_array_equal(np.asarray(back.scales_pages), np.asarray(ks))
    # ours -> theirs -> ours, and the GPU kernel on our own pools
    rng = np.random.default_rng(10)
    fmt = KVFormat(kind)
    pools = [quantize_pages(jnp.asarray(rng.standard_normal((K, P + 1, C, H))), fmt) for _ in "kv"]
    for pool in pools:
        again = from_jax_gpu_scale_pages(*jax.jit(to_jax_gpu_scale_pages)(pool))
        np.testing.assert_array_equal(np.asarray(again.scale[:, 1:]), np.asarray(pool.scale[:, 1:]))
        np.testing.assert_array_equal(
            np.asarray(again.data.astype(jnp.float32))[:, 1:],
            np.asarray(pool.data.astype(jnp.float32))[:, 1:],
        )
    ours_table = from_zero_based_table(table)
    expected = ours_decode(q * 0.3, *pools, ours_table)
    got = jax_gpu_kernel(q * 0.3, *(to_jax_gpu_scale_pages(p) for p in pools), table)
    assert_close(got, expected, dtype=jnp.float32, what="GPU to JAX")


# --- errors ------------------------------------------------------------------------------


def _pool(kind="int8", pages=3):
    return quantize_pages(jnp.ones((1, pages, 4, 8)), KVFormat(kind))


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: from_jax_ragged_kv_pages(jnp.ones((2, 4, 2, 8))),
            r"from_jax_ragged_kv_pages: kv_pages: expected dtype int8 or float8_e4m3fn",
        ),
        (
            lambda: from_jax_ragged_kv_pages(jnp.ones((2, 4, 3, 8), jnp.int8)),
            r"from_jax_ragged_kv_pages: kv_pages: expected \[P, C, 2K, H\]",
        ),
        (
            lambda: from_jax_ragged_kv_pages(jnp.ones((4, 2, 8), jnp.int8)),
            r"from_jax_ragged_kv_pages: kv_pages: expected a rank-4 array",
        ),
        (
            lambda: from_jax_ragged_kv_pages(jnp.ones((0, 4, 2, 8), jnp.int8)),
            r"from_jax_ragged_kv_pages: kv_pages: expected non-empty dims",
        ),
        (
            lambda: from_jax_ragged_kv_pages(jnp.ones((2, 4, 2, 8), jnp.int8), k_scale=-1.0),
            r"from_jax_ragged_kv_pages: k_scale: expected None or a finite positive",
        ),
        (
            lambda: from_jax_ragged_kv_pages(jnp.ones((2, 4, 2, 8), jnp.int8), v_scale=np.nan),
            r"from_jax_ragged_kv_pages: v_scale: expected None or a finite positive",
        ),
        (
            lambda: from_jax_ragged_kv_pages(jnp.ones((2, 4, 2, 8), jnp.int8), k_scale=True),
            r"from_jax_ragged_kv_pages: k_scale: expected None or a finite positive",
        ),
        (
            lambda: to_jax_ragged_kv_pages(jnp.ones((1, 3, 4, 8)), _pool()),
            r"to_jax_ragged_kv_pages: k_pages: expected a paged.QuantizedPages",
        ),
        (
            lambda: to_jax_ragged_kv_pages(_pool(), _pool("fp8")),
            r"to_jax_ragged_kv_pages: v_pages: expected the shape and format of k_pages",
        ),
        (
            lambda: to_jax_ragged_kv_pages(_pool(), _pool(pages=4)),
            r"to_jax_ragged_kv_pages: v_pages: expected the shape and format of k_pages",
        ),
        (
            lambda: to_jax_ragged_kv_pages(_pool(pages=1), _pool(pages=1)),
            r"to_jax_ragged_kv_pages: k_pages: expected \[K, P, C, H\] with P >= 2",
        ),
        (
            lambda: to_jax_ragged_kv_pages(_pool(), _pool(), v_scale=0.0),
            r"to_jax_ragged_kv_pages: v_scale: expected None or a finite positive",
        ),
        (
            lambda: to_jax_ragged_kv_pages(_pool()[None], _pool()[None]),
            r"to_jax_ragged_kv_pages: k_pages.data: expected rank 4",
        ),
        (
            lambda: to_jax_ragged_kv_pages(
                QuantizedPages(_pool().data, _pool().scale[..., :2], KVFormat("int8")), _pool()
            ),
            r"to_jax_ragged_kv_pages: k_pages.scale: expected float32 scales",
        ),
        (
            lambda: from_jax_tpu_quantized(jnp.ones((1, 2, 4, 8), jnp.int8)),
            r"from_jax_tpu_quantized: pages: expected a QuantizedTensor",
        ),
        (
            lambda: from_jax_tpu_quantized(
                quantization_utils.QuantizedTensor(jnp.ones((1, 2, 4, 8)), jnp.ones((1, 2, 4, 1)))
            ),
            r"from_jax_tpu_quantized: pages.weight: expected dtype int8 or float8",
        ),
        (
            lambda: from_jax_tpu_quantized(
                quantization_utils.QuantizedTensor(
                    jnp.ones((1, 2, 4, 8), jnp.float8_e4m3fn), jnp.ones((1, 2, 4, 1))
                )
            ),
            r"from_jax_tpu_quantized: pages.weight: expected dtype int8, got",
        ),
        (
            lambda: from_jax_tpu_quantized(
                quantization_utils.QuantizedTensor(
                    jnp.ones((1, 2, 4, 8), jnp.int8), jnp.ones((1, 2, 4, 8))
                )
            ),
            r"from_jax_tpu_quantized: pages.scales: expected shape \(1, 2, 4, 1\)",
        ),
        (
            lambda: from_jax_tpu_quantized(
                quantization_utils.QuantizedTensor(
                    jnp.ones((1, 2, 4, 8), jnp.int8), jnp.ones((1, 2, 4, 1), jnp.int32)
                )
            ),
            r"from_jax_tpu_quantized: pages.scales: expected a floating point array",
        ),
        (
            lambda: to_jax_tpu_quantized(_pool("fp8")),
            r"to_jax_tpu_quantized: pages: expected a format in \['int8'\]",
        ),
        (
            lambda: to_jax_tpu_quantized(jnp.ones((1, 3, 4, 8))),
            r"to_jax_tpu_quantized: pages: expected a paged.QuantizedPages",
        ),
        (
            lambda: from_jax_gpu_scale_pages(jnp.ones((1, 2, 4, 8), jnp.int8), jnp.ones((1, 2, 3))),
            r"from_jax_gpu_scale_pages: scales_pages: expected shape \(1, 2, 4\)",
        ),
        (
            lambda: from_jax_gpu_scale_pages(
                jnp.ones((1, 2, 4, 8), jnp.int8), jnp.ones((1, 2, 4), jnp.int32)
            ),
            r"from_jax_gpu_scale_pages: scales_pages: expected a floating point array",
        ),
        (
            lambda: from_jax_gpu_scale_pages(
                jnp.ones((1, 2, 4, 8), jnp.bfloat16), jnp.ones((1, 2, 4))
            ),
            r"from_jax_gpu_scale_pages: pages: expected dtype int8 or float8_e4m3fn",
        ),
        (
            lambda: to_jax_gpu_scale_pages(_pool(pages=1)),
            r"to_jax_gpu_scale_pages: pages: expected \[K, P, C, H\] with P >= 2",
        ),
        (
            lambda: to_zero_based_table(jnp.ones((2, 3))),
            r"to_zero_based_table: page_table: expected an integer array",
        ),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.no_typecheck
def test_formats_without_a_counterpart_are_not_implemented():
    # A format kind outside int8 / fp8 (int4 and KIVI are planned): built around the
    # constructor's check, which rejects planned kinds today.
    fmt = object.__new__(KVFormat)
    object.__setattr__(fmt, "kind", "int4")
    pool = QuantizedPages(jnp.zeros((1, 3, 4, 8), jnp.int8), jnp.zeros((1, 3, 4)), fmt)
    with pytest.raises(NotImplementedError, match="to_jax_gpu_scale_pages: pages: format 'int4'"):
        to_jax_gpu_scale_pages(pool)
    with pytest.raises(NotImplementedError, match="to_jax_ragged_kv_pages: k_pages: format"):
        to_jax_ragged_kv_pages(pool, pool)


def test_to_zero_based_table_inverts_from_zero_based_table():
    table = np.array([[0, 5, 2], [3, 0, 0]], np.int32)
    np.testing.assert_array_equal(
        np.asarray(to_zero_based_table(from_zero_based_table(table))), table
    )
    np.testing.assert_array_equal(
        np.asarray(to_zero_based_table(np.array([[1, 0, -4]]))), [[0, 0, 0]]
    )
    assert to_zero_based_table(np.array([[2]], np.int64)).dtype == jnp.int32
