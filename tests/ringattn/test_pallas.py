"""blockwise_attention(impl="pallas") in Pallas interpret mode against the dense reference.

Interpret mode compiles every kernel into a CPU program, which costs seconds per shape and
option set: the default run holds one forward-and-gradient case that combines most options,
plus cheap checks of the ``impl`` switch; the full matrix is marked slow.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringattn import (
    BlockSizes,
    DenseMask,
    MaskSpec,
    Positions,
    SegmentIds,
    attention_reference,
    blockwise_attention,
)
from ringattn._blockwise import resolve_impl
from ringattn._pallas_common import next_pow2
from ringattn._pallas_triton import pallas_blocks
from tests._util import assert_close, attention_inputs, segments_from_cuts

BLOCKS = BlockSizes(block_q=4, block_kv=8, block_q_bwd=8, block_kv_bwd=4)


def _gapped_positions(B, L, seed):
    """Increasing positions with random gaps (a different set per batch row)."""
    rng = np.random.default_rng(seed)
    steps = rng.integers(1, 4, size=(B, L))
    return jnp.asarray(np.cumsum(steps, axis=1) - 1, jnp.int32)


def _options(B, T, S, opts):
    opts = dict(opts)
    kw = {}
    if opts.pop("offset", False):
        q_pos = jnp.broadcast_to(jnp.arange(S - T, S, dtype=jnp.int32), (B, T))
        kw["positions"] = Positions(q_pos, None)
    if opts.pop("gaps", False):
        kv_pos = _gapped_positions(B, S, 1)
        # Queries at a subset of the key positions, so causal rows see varied prefixes.
        q_pos = kv_pos[:, S - T :]
        kw["positions"] = Positions(q_pos, kv_pos)
    segs = opts.pop("segments", None)
    if segs is not None:
        kw["segment_ids"] = SegmentIds(
            segments_from_cuts(B, T, segs[0]), segments_from_cuts(B, S, segs[1])
        )
    kw.update(opts)
    if T != S and "positions" not in kw and (kw.get("causal") or kw.get("window") is not None):
        # T != S under a causal or window mask needs query positions: the old default, the
        # queries at the first positions.
        kw["positions"] = Positions(jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), None)
    return kw


def _loss(fn, q, k, v, kw):
    out, lse = fn(q, k, v, **kw)
    weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * 0.25)
    return jnp.sum(out.astype(jnp.float32) * weights) + lse_term


def _check(case, dtype, *, use_jit=True, blocks=BLOCKS, grads=True):
    B, T, S, N, K, H, opts = case
    q, k, v = attention_inputs(B, T, S, N, K, H, dtype)
    kw = _options(B, T, S, opts)
    fast = functools.partial(blockwise_attention, block_sizes=blocks, impl="pallas", **kw)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    want, want_lse = attention_reference(q32, k32, v32, **kw)

    def forward_and_grads(q, k, v):
        # One forward serves both the outputs and the gradients (one interpret-mode compile).
        result, pullback = jax.vjp(fast, q, k, v)
        out, lse = result
        weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        dlse = jnp.where(jnp.isfinite(lse), 0.25, 0.0)
        return out, lse, pullback(type(result)(weights.astype(out.dtype), dlse)) if grads else None

    out, lse, got_grads = (jax.jit(forward_and_grads) if use_jit else forward_and_grads)(q, k, v)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert_close(out, want, dtype=dtype, what="out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(np.asarray(want_lse))
    assert_close(jnp.where(finite, lse, 0), jnp.where(finite, want_lse, 0), dtype=dtype, what="lse")
    if not grads:
        return
    ref = functools.partial(attention_reference, **kw)
    want_grads = jax.grad(functools.partial(_loss, ref, kw={}), argnums=(0, 1, 2))(q32, k32, v32)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        assert g.dtype == dtype
        assert_close(g, w, dtype=dtype, grad=True, what=f"d{name}")


# ---------------------------------------------------------------- default run (~15 s)


def test_combined_masks_gqa_forward_and_gradients():
    # GQA, T != S, lengths not multiples of the blocks, causal + per-head windows + softcap +
    # packed segments with a query offset (a suffix chunk), in one compile. The block pairs
    # include all three kinds (skipped, unmasked and masked) forward and backward.
    case = (
        1,
        11,
        19,
        4,
        2,
        8,
        dict(
            causal=True,
            offset=True,
            window=(16, None, 12, 24),
            softcap=4.0,
            segments=((8,), (16,)),
        ),
    )
    _check(case, jnp.float32)


@pytest.mark.no_typecheck
def test_impl_switch_validation_and_auto_on_cpu_is_the_xla_path():
    q, k, v = attention_inputs(1, 9, 9, 2, 1, 4, jnp.float32)
    auto = blockwise_attention(q, k, v, causal=True)
    xla = blockwise_attention(q, k, v, causal=True, impl="xla")
    np.testing.assert_array_equal(np.asarray(auto.out), np.asarray(xla.out))
    np.testing.assert_array_equal(np.asarray(auto.lse), np.asarray(xla.lse))
    for bad in ("triton", "", "XLA", 3, None):
        with pytest.raises(ValueError, match="impl"):
            blockwise_attention(q, k, v, impl=bad)
    dense = DenseMask(np.tril(np.ones((9, 9), bool)))
    with pytest.raises(NotImplementedError, match="dense"):
        blockwise_attention(q, k, v, mask=MaskSpec(dense=dense), impl="pallas")


def test_resolve_impl_per_backend():
    assert resolve_impl("f", "auto", "cpu") == "xla"
    assert resolve_impl("f", "auto", "gpu") == "xla"  # until the kernels have run on a GPU
    assert resolve_impl("f", "auto", "tpu") == "xla"
    assert resolve_impl("f", "pallas", "cpu") == "pallas"
    assert resolve_impl("f", "pallas", "gpu") == "pallas"
    assert resolve_impl("f", "xla", "gpu") == "xla"
    assert resolve_impl("f", "pallas", "tpu") == "pallas"  # the Mosaic kernels
    with pytest.raises(NotImplementedError, match="metal"):
        resolve_impl("f", "pallas", "metal")


def test_block_sizes_defaults_clamping_and_power_of_two_rule():
    assert [next_pow2(n) for n in (1, 2, 3, 16, 17, 100)] == [1, 2, 4, 16, 32, 128]
    # Defaults: 128 rows by 64 keys forward, 64 rows backward, clamped to the lengths.
    assert pallas_blocks(None, 4, 4096, 4096, False) == ((32, 64), (16, 64))
    assert pallas_blocks(None, 1, 5, 37, True) == ((8, 64), (8, 64))
    assert pallas_blocks(BlockSizes(3, 5), 2, 100, 100, True) == ((3, 5), (3, 5))
    with pytest.raises(NotImplementedError, match="power of two"):
        pallas_blocks(BlockSizes(3, 8), 2, 100, 100, False)
    with pytest.raises(NotImplementedError, match="power of two"):
        pallas_blocks(None, 3, 4096, 4096, False)  # G = 3: 126 rows


def test_kernels_lower_to_triton_for_cuda_without_a_gpu():
    # jax.export lowers for CUDA on any host: this checks that Pallas's Triton lowering takes
    # the three kernels (block shapes, loads, loops, conds) with every option on, GQA, a head
    # dim that is padded (80 -> 128) and lengths that are not powers of two. Compiling the
    # Triton IR to PTX and running it needs a GPU and is not checked here.
    from jax import export

    from ringattn._blocks import MaskIds, window_table
    from ringattn._pallas import pallas_attention
    from ringattn._pallas_common import PallasConfig

    B, T, S, N, K, H = 2, 200, 300, 8, 2, 80
    spec = MaskSpec(causal=True, window=(64, None, 128, 32, 64, None, 128, 32), softcap=30.0)
    fwd, bwd = pallas_blocks(None, N // K, T, S, interpret=False)
    cfg = PallasConfig(spec, spec.scale_for(H), *fwd, *bwd, interpret=False)
    table = window_table(np.asarray([64, 0, 128, 32, 64, 0, 128, 32], np.int32), B, K)

    def loss(q, k, v, q_pos, kv_pos, q_seg, kv_seg):
        out, lse = pallas_attention(q, k, v, MaskIds(q_pos, kv_pos, q_seg, kv_seg, table), cfg)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    shapes = [
        jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16),
        *(jax.ShapeDtypeStruct((B, L), jnp.int32) for L in (T, S, T, S)),
    ]
    triton = "__gpu$xla.gpu.triton"
    exported = export.export(
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
        platforms=("cuda",),
        disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)],
    )(*shapes)
    assert exported.mlir_module().count(f"@{triton}(") == 3  # forward, dq, dk/dv


# ---------------------------------------------------------------- the full matrix (slow)

CASES = {
    "mha": (2, 13, 13, 2, 2, 8, dict()),
    "mha-causal": (1, 21, 21, 2, 2, 8, dict(causal=True)),
    "gqa-causal-window": (2, 13, 17, 4, 2, 8, dict(causal=True, window=5)),
    "per-head-windows": (1, 17, 17, 4, 2, 8, dict(causal=True, window=(3, None, 6, 2))),
    "mqa-softcap": (1, 9, 23, 4, 1, 8, dict(softcap=3.0)),
    "segments": (2, 16, 16, 4, 2, 8, dict(causal=True, segments=((5, 11), (5, 11)))),
    "suffix-window-softcap": (
        1,
        7,
        20,
        2,
        1,
        8,
        dict(causal=True, offset=True, window=6, softcap=5.0),
    ),
    "gapped-positions": (2, 10, 22, 4, 2, 8, dict(causal=True, gaps=True, window=7)),
    "scale": (1, 9, 9, 2, 2, 8, dict(causal=True, scale=-0.4)),
}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_gradients_match_reference(name, dtype):
    _check(CASES[name], dtype)


@pytest.mark.slow
def test_eager_and_default_block_sizes():
    _check((1, 40, 70, 4, 2, 16, dict(causal=True)), jnp.float32, use_jit=False, blocks=None)


@pytest.mark.slow
def test_nan_in_unreachable_keys_reaches_nothing():
    B, T, S, N, K, H = 1, 8, 24, 4, 2, 8
    q, k, v = attention_inputs(B, T, S, N, K, H, jnp.float32)
    # Queries at positions 8..15 with a window of 4 (causal): keys 0..4 and 16.. are hidden.
    kw = dict(
        causal=True,
        window=4,
        positions=Positions(jnp.arange(8, 16, dtype=jnp.int32)[None], None),
    )
    hidden = (jnp.arange(S) < 5) | (jnp.arange(S) >= 16)
    poison = lambda x: jnp.where(hidden[None, :, None, None], jnp.nan, x)
    fast = functools.partial(blockwise_attention, block_sizes=BLOCKS, impl="pallas", **kw)
    out_clean, lse_clean = fast(q, k, v)
    out, lse = fast(q, poison(k), poison(v))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_clean))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_clean))
    assert_close(out, attention_reference(q, k, v, **kw).out, dtype=jnp.float32)

    def loss(q, k, v):
        return _loss(fast, q, k, v, {})

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, poison(k), poison(v))
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, want, strict=True):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6)
    assert float(jnp.max(jnp.abs(grads[1] * hidden[None, :, None, None]))) == 0.0


@pytest.mark.slow
def test_fully_masked_rows_give_zeros_minus_inf_and_finite_gradients():
    q, k, v = attention_inputs(1, 12, 12, 4, 2, 8, jnp.float32)
    # Queries of segment 2 have no key of their segment.
    q_seg = jnp.asarray([[0] * 4 + [1] * 4 + [2] * 4], jnp.int32)
    kv_seg = jnp.asarray([[0] * 6 + [1] * 6], jnp.int32)
    kw = dict(causal=True, segment_ids=SegmentIds(q_seg, kv_seg))
    out, lse = blockwise_attention(q, k, v, block_sizes=BLOCKS, impl="pallas", **kw)
    assert np.all(np.asarray(out[:, 8:]) == 0.0)
    assert np.all(np.isneginf(np.asarray(lse[:, 8:])))
    want = attention_reference(q, k, v, **kw)
    assert_close(out, want.out, dtype=jnp.float32)
    fast = functools.partial(blockwise_attention, block_sizes=BLOCKS, impl="pallas")
    grads = jax.grad(functools.partial(_loss, fast, kw=kw), argnums=(0, 1, 2))(q, k, v)
    want_grads = jax.grad(functools.partial(_loss, attention_reference, kw=kw), argnums=(0, 1, 2))(
        q, k, v
    )
    for g, w in zip(grads, want_grads, strict=True):
        assert_close(g, w, dtype=jnp.float32, grad=True)


@pytest.mark.slow
def test_vmap_over_a_leading_axis_and_sinks():
    q, k, v = attention_inputs(3, 9, 9, 4, 2, 8, jnp.float32)  # the leading axis is vmapped
    sinks = jnp.asarray([0.5, -1.0, 0.0, 2.0], jnp.float32)
    kw = dict(causal=True, window=4, sinks=sinks)

    def one(q, k, v, fn, **extra):
        return fn(q[None], k[None], v[None], **kw, **extra)

    fast = functools.partial(one, fn=blockwise_attention, block_sizes=BLOCKS, impl="pallas")
    ref = functools.partial(one, fn=attention_reference)
    out, lse = jax.jit(jax.vmap(fast))(q, k, v)
    want, want_lse = jax.vmap(ref)(q, k, v)
    assert_close(out, want, dtype=jnp.float32)
    assert_close(lse, want_lse, dtype=jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jax.vmap(fn)(q, k, v).out * jnp.cos(jnp.arange(8)))

    grads = jax.grad(loss(fast), argnums=(0, 1, 2))(q, k, v)
    want_grads = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, want_grads, strict=True):
        assert_close(g, w, dtype=jnp.float32, grad=True)


@pytest.mark.slow
def test_under_checkpoint_forward_and_gradients():
    # jax.checkpoint (remat) around the kernels: the backward recomputes the forward kernel
    # from the saved inputs. (The TPU interpret mode is not remat-able: its callbacks are
    # effects, which checkpoint refuses; see docs/concepts/kernels.md.)
    q, k, v = attention_inputs(2, 10, 13, 4, 2, 8, jnp.float32, seed=7)
    kw = dict(causal=True, positions=Positions(jnp.broadcast_to(jnp.arange(3, 13), (2, 10)), None))
    fast = functools.partial(blockwise_attention, block_sizes=BLOCKS, impl="pallas", **kw)
    ref = functools.partial(attention_reference, **kw)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v).out)) + jnp.sum(fn(q, k, v).lse)

    got = jax.jit(jax.value_and_grad(loss(jax.checkpoint(fast)), argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    assert_close(got[0], want[0], dtype=jnp.float32, what="loss")
    for name, g, w in zip("qkv", got[1], want[1], strict=True):
        assert_close(g, w, dtype=jnp.float32, grad=True, what=f"d{name}")


@pytest.mark.slow
def test_empty_inputs():
    q, k, v = attention_inputs(1, 0, 5, 2, 1, 8, jnp.float32)
    out, lse = blockwise_attention(q, k, v, impl="pallas")
    assert out.shape == (1, 0, 2, 8) and lse.shape == (1, 0, 2)
    q, k, v = attention_inputs(1, 4, 0, 2, 1, 8, jnp.float32)
    out, lse = blockwise_attention(q, k, v, impl="pallas")
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


@pytest.mark.parametrize(
    "axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit], ids=str
)
def test_inside_a_users_shard_map_with_check_vma(axis_type):
    # blockwise_attention(impl="pallas") called per shard in the user's own shard_map
    # (check_vma=True), batch split over 2 devices, segments and a window as given per shard:
    # operands are cast to vary together and, on CPU, the kernels run in TPU interpret mode
    # (the HLO interpreter fails the vma check). Forward and gradients against the reference.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests._util import make_test_mesh

    mesh = make_test_mesh((2,), ("data",), axis_type=axis_type)
    q, k, v = attention_inputs(2, 8, 8, 4, 2, 8, jnp.float32, seed=4)
    seg = segments_from_cuts(2, 8, (5,))
    kw = dict(causal=True, window=4)

    def body(q, k, v, seg):
        ids = SegmentIds(seg, seg)
        return tuple(blockwise_attention(q, k, v, segment_ids=ids, impl="pallas", **kw))

    f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=True)
    if axis_type == jax.sharding.AxisType.Explicit:
        q, k, v, seg = (
            jax.sharding.reshard(x, NamedSharding(mesh, P("data"))) for x in (q, k, v, seg)
        )

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    ref = lambda q, k, v: attention_reference(q, k, v, segment_ids=SegmentIds(seg, seg), **kw)
    fast = lambda q, k, v: f(q, k, v, seg)
    got = jax.jit(
        lambda q, k, v: (fast(q, k, v), jax.grad(functools.partial(loss, fast), (0, 1, 2))(q, k, v))
    )
    want = jax.jit(
        lambda q, k, v: (ref(q, k, v), jax.grad(functools.partial(loss, ref), (0, 1, 2))(q, k, v))
    )
    (out, lse), grads = got(q, k, v)
    (want_out, want_lse), want_grads = want(q, k, v)
    assert_close(out, want_out, dtype=jnp.float32, what="out")
    assert_close(lse, want_lse, dtype=jnp.float32, what="lse")
    for g, w in zip(grads, want_grads, strict=True):
        assert_close(g, w, dtype=jnp.float32, grad=True)
