"""The Pallas decode kernels (paged._pallas_decode) against paged.paged_attention_reference.

Both variants run on CPU in interpret mode: the GPU-style kernel (``interpret=True``) through
``paged_attention(impl="pallas")``, the TPU one (``pltpu.InterpretParams()``) through
``pallas_decode`` with ``variant="tpu"``. Pools come from ``make_pool``: shuffled page ids and
NaN in the null page, free pages and every unwritten slot.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged import KVFormat, paged_attention, paged_attention_reference, quantize_pages
from paged._attention import default_q_positions, pallas_variant, resolve_mask
from paged._page_walk import kernel_options
from paged._pallas_decode import decode_config, pallas_decode
from tests._util import assert_close
from tests.paged.test_attention import make_pool

MASK_KEYS = ("causal", "window", "softcap", "scale")


def run_kernel(variant, q, k_pages, v_pages, table, lengths, *, q_positions=None, ppb=2, **mask):
    """``(out, lse)`` of one variant in interpret mode: the public entry for ``"gpu"``, the
    private one (same options path) for ``"tpu"``."""
    if variant == "gpu":
        res = paged_attention(
            q,
            k_pages,
            v_pages,
            table,
            lengths,
            q_positions=q_positions,
            pages_per_block=ppb,
            impl="pallas",
            **mask,
        )
        return res.out, res.lse
    B, T, N, H = q.shape
    spec = resolve_mask("test", None, **{key: mask.get(key) for key in MASK_KEYS})
    opts = kernel_options("test", spec, N, H, ppb, table.shape[1], False)
    cfg = decode_config("test", opts, k_pages.shape[2], H, "tpu", True)
    positions = default_q_positions("test", q_positions, lengths, B, T)
    out, lse = pallas_decode(q, (k_pages, v_pages), (table, lengths, positions), cfg=cfg)
    return out.astype(q.dtype), lse


def check_against_reference(
    variant, q, k_pages, v_pages, table, lengths, *, dtype, traced=False, **options
):
    """``traced``: table and lengths traced under ``jit``, where bad ids inside a length are
    masked (an eager call raises on them)."""
    kernel = functools.partial(run_kernel, variant, q, k_pages, v_pages, **options)
    options.pop("ppb", None)
    oracle = functools.partial(paged_attention_reference, q, k_pages, v_pages, **options)
    if traced:
        kernel, oracle = jax.jit(kernel), jax.jit(oracle)
    out, lse = kernel(table, lengths)
    ref = oracle(table, lengths)
    what = f"{variant} {options}"
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_close(out, ref.out, dtype=dtype, what=what + " out")
    # Rows that see nothing must agree exactly (-inf); the rest within the tolerance.
    empty = np.isneginf(np.asarray(ref.lse))
    assert np.array_equal(np.isneginf(np.asarray(lse)), empty), what + " empty rows"
    finite = lambda x: jnp.where(jnp.asarray(empty), 0.0, x)
    assert_close(finite(lse), finite(ref.lse), dtype=dtype, what=what + " lse")
    return ref


def inputs(seed, *, K=2, G=2, C=4, H=8, T=1, lengths=(0, 1, 4, 5, 12), M=3, dtype=jnp.float32):
    """Ragged lengths 0, 1, C, C + 1 and full capacity ``M * C`` by default."""
    rng = np.random.default_rng(seed)
    k_pages, v_pages, table, lens = make_pool(
        rng, K=K, C=C, H=H, lengths=list(lengths), M=M, dtype=dtype
    )
    q = jnp.asarray(rng.standard_normal((len(lengths), T, K * G, H)), dtype)
    return q, k_pages, v_pages, table, lens


# ---------------------------------------------------------------- default run (tiny, fast)


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_decode_matches_reference_with_garbage_and_bad_ids(variant):
    q, k_pages, v_pages, table, lengths = inputs(0, T=3)
    P = k_pages.shape[1]
    # Out-of-range and null ids inside a length, and garbage ids past the lengths: masked.
    table = table.at[4, 1].set(P + 3).at[3, 0].set(-2).at[2, 2].set(P + 7).at[4, 2].set(0)
    ref = check_against_reference(
        variant, q, k_pages, v_pages, table, lengths, dtype=jnp.float32, traced=True
    )
    assert np.isneginf(np.asarray(ref.lse[0])).all()  # length 0: nothing visible
    out, _ = jax.jit(functools.partial(run_kernel, variant))(q, k_pages, v_pages, table, lengths)
    assert not np.asarray(out[0]).any()  # ... and out = 0


@pytest.mark.parametrize(
    "options",
    [
        dict(window=3, softcap=2.0, scale=0.4),
        dict(window=(2, None, 5, 1)),
        dict(causal=False, q_positions=np.array([[0, 3], [5, 1], [4, 9], [2, 2], [11, 0]])),
    ],
    ids=["window-softcap-scale", "per-head-window", "non-causal-positions"],
)
def test_masks_match_reference(options):
    q, k_pages, v_pages, table, lengths = inputs(1, T=2)
    if "q_positions" in options:
        options = dict(options, q_positions=jnp.asarray(options["q_positions"], jnp.int32))
    check_against_reference(
        "gpu", q, k_pages, v_pages, table, lengths, dtype=jnp.float32, **options
    )


def test_mqa_bfloat16_jit_and_sinks():
    q, k_pages, v_pages, table, lengths = inputs(2, K=1, G=4, C=4, T=2, dtype=jnp.bfloat16)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    step = jax.jit(functools.partial(paged_attention, impl="pallas", window=6, pages_per_block=3))
    got = step(q, k_pages, v_pages, table, lengths, sinks=sinks)
    want = paged_attention_reference(q, k_pages, v_pages, table, lengths, window=6, sinks=sinks)
    assert got.out.dtype == jnp.bfloat16
    assert_close(got.out, want.out, dtype=jnp.bfloat16, what="mqa bf16 jit sinks out")
    assert_close(got.lse, want.lse, dtype=jnp.bfloat16, what="mqa bf16 jit sinks lse")


def test_impl_default_unchanged_and_selection():
    q, k_pages, v_pages, table, lengths = inputs(3, lengths=(3, 7))
    default = paged_attention(q, k_pages, v_pages, table, lengths)
    for impl in ("auto", "xla"):
        other = paged_attention(q, k_pages, v_pages, table, lengths, impl=impl)
        assert np.array_equal(np.asarray(other.out), np.asarray(default.out))
        assert np.array_equal(np.asarray(other.lse), np.asarray(default.lse))
    fn = "paged_attention"
    assert pallas_variant(fn, "auto", "gpu", k_pages, False) == ("xla", False)
    assert pallas_variant(fn, "auto", "tpu", k_pages, False) == ("xla", False)
    assert pallas_variant(fn, "pallas", "gpu", k_pages, False) == ("gpu", False)
    assert pallas_variant(fn, "pallas", "cpu", k_pages, False) == ("gpu", True)
    assert pallas_variant(fn, "pallas", "tpu", k_pages, False) == ("tpu", False)


@pytest.mark.no_typecheck
@pytest.mark.parametrize("impl", ["triton", "", "PALLAS", 3, None])
def test_bad_impl_raises(impl):
    q, k_pages, v_pages, table, lengths = inputs(4, lengths=(3,))
    with pytest.raises(ValueError, match="impl"):
        paged_attention(q, k_pages, v_pages, table, lengths, impl=impl)


def test_unsupported_options_raise_not_implemented():
    q, k_pages, v_pages, table, lengths = inputs(5, lengths=(3, 4), H=8)
    with pytest.raises(NotImplementedError, match="return_page_mass"):
        paged_attention(q, k_pages, v_pages, table, lengths, impl="pallas", return_page_mass=True)
    finite = lambda x: jnp.nan_to_num(x)
    kq, vq = (quantize_pages(finite(x), KVFormat("int8")) for x in (k_pages, v_pages))
    with pytest.raises(NotImplementedError, match="QuantizedPages"):
        paged_attention(q, kq, vq, table, lengths, impl="pallas")
    opts = kernel_options("f", resolve_mask("f", None, **dict.fromkeys(MASK_KEYS)), 4, 8, 2, 3, 0)
    for C, H in ((8, 128), (16, 80), (24, 64)):  # compiled Triton: powers of two >= 16
        with pytest.raises(NotImplementedError, match="power of two"):
            decode_config("paged_attention", opts, C, H, "gpu", False)
    assert decode_config("f", opts, 16, 128, "gpu", False).interpret is False
    assert decode_config("f", opts, 8, 8, "tpu", False).variant == "tpu"  # Mosaic: any size


def _export(variant, platform, target, window):
    from jax import export

    B, T, N, K, H, P, C, M = 3, 2, 8, 2, 128, 40, 16, 13
    spec = resolve_mask("f", None, causal=True, window=window, softcap=30.0, scale=None)
    opts = kernel_options("f", spec, N, H, 4, M, False)
    cfg = decode_config("f", opts, C, H, variant, False)
    pool = jax.ShapeDtypeStruct((K, P, C, H), jnp.bfloat16)
    view = tuple(jax.ShapeDtypeStruct(shape, jnp.int32) for shape in ((B, M), (B,), (B, T)))
    shapes = [jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16), (pool, pool), view]
    exported = export.export(
        jax.jit(functools.partial(pallas_decode, cfg=cfg)),
        platforms=(platform,),
        disabled_checks=[export.DisabledSafetyCheck.custom_call(target)],
    )(*shapes)
    return exported.mlir_module().count(f"@{target}(")


def test_gpu_kernel_lowers_to_triton_for_cuda_without_a_gpu():
    # jax.export lowers for CUDA on any host: Pallas's Triton lowering takes the kernel (the
    # dynamic page loads, fori_loop, pl.when, per-head windows, a table width M = 13 that is
    # no multiple of the split). Compiling to PTX and running need a GPU: not checked here.
    window = (64, None, 128, 32, 64, None, 128, 32)
    assert _export("gpu", "cuda", "__gpu$xla.gpu.triton", window) == 1


def test_tpu_kernel_lowers_to_mosaic_for_tpu_without_a_tpu():
    # The Mosaic lowering (scalar prefetch, index maps reading the table, VMEM scratch) runs
    # in Python; Mosaic's own compile needs a TPU and is not checked here.
    assert _export("tpu", "tpu", "tpu_custom_call", 64) == 1


# ---------------------------------------------------------------- the full matrix (slow)

SLOW_OPTIONS = {
    "causal": dict(),
    "window": dict(window=5),
    "softcap": dict(softcap=1.5),
    "per-head-window": dict(window=(3, None, 7, 2, None, 1, 4, 9)),
    "non-causal": dict(causal=False),
}


def _matrix():
    """variant x heads x mask option, with the dtype and pages per block alternating so that
    every (dtype, heads), (dtype, option), (pages per block, option) pair occurs for each
    variant: 30 cases instead of the 120 of the full product (the CI time budget)."""
    heads = {"gqa": (2, 4), "mqa": (1, 8), "mha": (8, 1)}
    cases = []
    for v, variant in enumerate(("gpu", "tpu")):
        for h, (head_id, kg) in enumerate(heads.items()):
            for o, name in enumerate(SLOW_OPTIONS):
                dtype = (jnp.float32, jnp.bfloat16)[(h + o) % 2]
                ppb = (1, 3)[(o + v + h // 2) % 2]
                tag = f"{variant}-{head_id}-{name}-{jnp.dtype(dtype).name}-ppb{ppb}"
                cases.append(pytest.param(variant, dtype, kg, name, ppb, id=tag))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("variant, dtype, heads, name, ppb", _matrix())
def test_full_matrix_against_reference(variant, dtype, heads, name, ppb):
    K, G = heads
    C = 4
    lengths = (0, 1, C, C + 1, 2 * C + 3, 5 * C)
    q, k_pages, v_pages, table, lens = inputs(
        7, K=K, G=G, C=C, T=3, lengths=lengths, M=5, dtype=dtype
    )
    P = k_pages.shape[1]
    table = table.at[5, 4].set(P).at[4, 0].set(-1)  # out-of-range ids inside lengths
    options = dict(SLOW_OPTIONS[name], ppb=ppb)
    check_against_reference(
        variant, q, k_pages, v_pages, table, lens, dtype=dtype, traced=True, **options
    )


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_explicit_positions_past_the_length_and_jit(variant):
    q, k_pages, v_pages, table, lengths = inputs(8, T=2, lengths=(6, 12, 1))
    positions = jnp.asarray([[0, 40], [3, 11], [-5, 0]], jnp.int32)
    for causal in (True, False):
        check_against_reference(
            variant,
            q,
            k_pages,
            v_pages,
            table,
            lengths,
            dtype=jnp.float32,
            q_positions=positions,
            causal=causal,
            window=4,
        )
    run = jax.jit(functools.partial(run_kernel, variant, softcap=3.0))
    out, _ = run(q, k_pages, v_pages, table, lengths)
    ref = paged_attention_reference(q, k_pages, v_pages, table, lengths, softcap=3.0)
    assert_close(out, ref.out, dtype=jnp.float32, what=f"{variant} jit")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_window_entirely_past_a_full_table_sees_nothing(variant):
    # Queries far past the end with a window: the live page range starts at M (= the number
    # of blocks at one page per block), the edge where index maps must still stay in range.
    q, k_pages, v_pages, table, lengths = inputs(9, T=2, lengths=(12, 12), M=3)
    positions = jnp.asarray([[20, 21], [11, 30]], jnp.int32)
    ref = check_against_reference(
        variant,
        q,
        k_pages,
        v_pages,
        table,
        lengths,
        dtype=jnp.float32,
        q_positions=positions,
        window=4,
        ppb=1,
    )
    assert np.isneginf(np.asarray(ref.lse[0])).all() and np.isfinite(ref.lse[1, 0]).all()


@pytest.mark.slow
def test_vmap_over_queries():
    q, k_pages, v_pages, table, lengths = inputs(10, T=2, lengths=(3, 9))
    decode = functools.partial(paged_attention, impl="pallas", softcap=4.0)
    stacked = jnp.stack([q, 2.0 * q, -q])
    out = jax.vmap(lambda x: decode(x, k_pages, v_pages, table, lengths).out)(stacked)
    for i, x in enumerate(stacked):
        ref = paged_attention_reference(x, k_pages, v_pages, table, lengths, softcap=4.0)
        assert_close(out[i], ref.out, dtype=jnp.float32, what=f"vmap {i}")


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_inside_a_users_shard_map_with_check_vma(variant):
    # The kernel per shard of the user's own shard_map(check_vma=True): the batch (queries,
    # table, lengths) split over 2 devices, the pools replicated. Every operand is cast to
    # vary like the outputs; on CPU the GPU-style kernel runs in TPU interpret mode there.
    from jax.sharding import PartitionSpec as P

    from tests._util import make_test_mesh

    q, k_pages, v_pages, table, lengths = inputs(3, T=2)
    q, table, lengths = q[:4], jnp.asarray(table[:4]), jnp.asarray(lengths[:4])
    mesh = make_test_mesh((2,), ("data",))

    def body(q, table, lengths):
        return run_kernel(variant, q, k_pages, v_pages, table, lengths, window=5)

    spec = (P("data"), P("data"), P("data"))
    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(P("data"),) * 2, check_vma=True)
    out, lse = jax.jit(f)(q, table, lengths)
    ref = paged_attention_reference(q, k_pages, v_pages, table, lengths, window=5)
    assert_close(out, ref.out, dtype=jnp.float32, what="out")
    finite = np.isfinite(np.asarray(ref.lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    assert_close(jnp.where(finite, lse, 0), jnp.where(finite, ref.lse, 0), dtype=jnp.float32)
