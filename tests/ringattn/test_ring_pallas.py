"""Ring and sharded attention with ``impl="pallas"`` against the dense float32 reference.

The Pallas kernels run on CPU in Pallas's TPU interpret mode (``interpret=True``'s HLO
interpreter fails ``check_vma`` inside ``shard_map``), which costs seconds per compile: the
default run holds one tiny ring case and cheap checks (the ``impl`` switch, the traced
program, hop bytes, the Triton lowering); the matrix over layouts, masks, strategies, dtypes
and Auto / Explicit mesh axes is marked slow. Every case
builds global arrays, runs under ``jax.jit`` with ``check_vma=True``, and compares the output,
the log-sum-exp and the gradients of a loss through both with ``attention_reference``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ringattn import (
    AttentionOutput,
    BlockSizes,
    MaskSpec,
    Positions,
    SegmentIds,
    attention_reference,
    from_layout,
    hop_bytes,
    ring_attention_per_shard,
    shard_positions,
    sharded_attention,
    to_layout,
)
from tests._util import assert_close, attention_inputs, make_test_mesh, segments_from_cuts
from tests.ringattn.test_quantized_hops import _ppermute_bytes

# Small blocks, so a shard of 8 tokens has several query and key blocks of every kind.
BLOCKS = BlockSizes(block_q=4, block_kv=4, block_q_bwd=2, block_kv_bwd=4)


def _loss_and_grads(attend, dout, dlse):
    """``(out, lse, (dq, dk, dv))`` of a loss through ``out`` and the finite ``lse``."""

    def loss(q, k, v):
        out, lse = attend(q, k, v)
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(finite * dlse), (out, lse)

    def run(q, k, v):
        (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, lse, grads

    return run


def _needs_positions(layout, kw) -> bool:
    """A permuted layout under a positional mask takes explicit positions (issue 29 item 2)."""
    spec = kw.get("mask") or MaskSpec(causal=bool(kw.get("causal")), window=kw.get("window"))
    return layout != "contiguous" and (spec.causal or spec.window is not None)


def _with_shard_positions(per_shard, layout, n):
    """``per_shard`` given this shard's global positions (a permuted layout needs them)."""

    def body(q, k, v):
        mine = shard_positions(layout, jax.lax.axis_index("seq"), n, q.shape[1])
        mine = jnp.broadcast_to(mine, q.shape[:2])
        return per_shard(q, k, v, positions=Positions(mine, mine))

    return body


def _per_shard_ring(mesh, n, layout, kw, impl, block_sizes=BLOCKS):
    """Global natural-order ``(q, k, v)`` -> ring per shard (``shard_map``) -> natural order."""
    explicit = AxisType.Explicit in mesh.axis_types
    to = functools.partial(to_layout, layout=layout, num_shards=n)
    back = functools.partial(from_layout, layout=layout, num_shards=n)
    seg = kw.get("segment_ids")
    pos = kw.get("positions")
    mask_kw = {key: val for key, val in kw.items() if key not in ("segment_ids", "positions")}

    def body(q, k, v, *ids):
        extra = {}
        if seg is not None:
            extra["segment_ids"], ids = SegmentIds(ids[0], ids[1]), ids[2:]
        if pos is not None:
            extra["positions"] = Positions(ids[0], ids[1])
        elif _needs_positions(layout, mask_kw):  # this shard's, permuted like the data
            mine = shard_positions(layout, jax.lax.axis_index("seq"), n, q.shape[1])
            mine = jnp.broadcast_to(mine, q.shape[:2])
            extra["positions"] = Positions(mine, mine)
        out = ring_attention_per_shard(
            q,
            k,
            v,
            seq_axis="seq",
            layout=layout,
            block_sizes=block_sizes,
            impl=impl,
            **mask_kw,
            **extra,
        )
        return tuple(out)

    ids = () if seg is None else (seg.q, seg.kv)
    ids += () if pos is None else (pos.q, pos.kv)
    spec4, spec2 = P(None, "seq"), P(None, "seq")
    in_specs = (spec4,) * 3 + (spec2,) * len(ids)
    sharded = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=(spec4, spec4), check_vma=True
    )

    def attend(q, k, v):
        args = [to(x) for x in (q, k, v, *ids)]
        if explicit:
            args = [
                jax.sharding.reshard(x, NamedSharding(mesh, s))
                for x, s in zip(args, in_specs, strict=True)
            ]
        outs = sharded(*args)
        if explicit:
            outs = [jax.sharding.reshard(x, NamedSharding(mesh, P())) for x in outs]
        return AttentionOutput(*(back(x) for x in outs))

    return attend


def _check(attend, q, k, v, kw, *, dtype=jnp.float32, seed=1, kernels=None):
    """Runs ``attend`` and the reference in one ``jit`` and compares everything.

    ``kernels``: if given, the number of ``pallas_call`` the forward must trace.
    """
    B, T, N, H = q.shape
    if kernels is not None:
        assert str(jax.make_jaxpr(attend)(q, k, v)).count("pallas_call") == kernels
    rng = np.random.default_rng(seed)
    dout = jnp.asarray(rng.standard_normal((B, T, N, H), dtype=np.float32))
    dlse = jnp.asarray(rng.standard_normal((B, T, N), dtype=np.float32))
    reference = functools.partial(attention_reference, **kw)
    f32 = lambda x: x.astype(jnp.float32)
    fast = _loss_and_grads(attend, dout, dlse)
    ref = _loss_and_grads(reference, dout, dlse)
    both = jax.jit(lambda q, k, v: (fast(q, k, v), ref(f32(q), f32(k), f32(v))))
    (out, lse, grads), (want, want_lse, want_grads) = both(q, k, v)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert_close(out, want, dtype=dtype, what="out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(np.asarray(want_lse))
    assert_close(jnp.where(finite, lse, 0), jnp.where(finite, want_lse, 0), dtype=dtype, what="lse")
    for name, g, w in zip("qkv", grads, want_grads, strict=True):
        assert g.dtype == dtype
        assert_close(g, w, dtype=dtype, grad=True, what=f"d{name}")


def _sharded(mesh, n, strategy, seq_axis, layout, kw, impl, **axes):
    """Global natural-order ``(q, k, v)`` -> ``sharded_attention`` in layout order -> back."""
    to = functools.partial(to_layout, layout=layout, num_shards=n)
    back = functools.partial(from_layout, layout=layout, num_shards=n)
    ids = {}
    for name, pair in (("segment_ids", SegmentIds), ("positions", Positions)):
        if kw.get(name) is not None:
            ids[name] = pair(*(None if x is None else to(x) for x in kw[name]))
    mask_kw = {key: val for key, val in kw.items() if key not in ids}

    def attend(q, k, v):
        given = dict(ids)  # never stored across traces
        if "positions" not in given and _needs_positions(layout, mask_kw):
            with jax.ensure_compile_time_eval():  # concrete: the ring prunes hops from them
                natural = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])
                given["positions"] = Positions(to(natural), to(natural))  # permuted like q
        out, lse = sharded_attention(
            to(q),
            to(k),
            to(v),
            mesh=mesh,
            seq_axis=seq_axis,
            strategy=strategy,
            layout=layout,
            block_sizes=BLOCKS,
            impl=impl,
            **axes,
            **mask_kw,
            **given,
        )
        return AttentionOutput(back(out), back(lse))

    return attend


def _gapped(B, L, seed=0):
    """Increasing global positions with gaps of 1 to 3, a different set per batch row."""
    steps = np.random.default_rng(seed).integers(1, 4, size=(B, L))
    return jnp.asarray(np.cumsum(steps, axis=1), jnp.int32)


# ---------------------------------------------------------------- default run (~11 s)
# One interpret-mode ring case (Auto axes) and checks of the impl switch; Explicit axes and the
# rest of the matrix are in the slow run below.


def test_ring_pallas_causal_zigzag_gqa_segments():
    # 2 shards of 4 tokens in the zigzag layout (2-token chunks, so blocks of 2), GQA, causal
    # with packed documents: the hops hold skipped, unmasked and masked block pairs, forward
    # and backward. Tiny, as interpret mode is slow; the slow run below has larger cases.
    n, L = 2, 8
    mesh = make_test_mesh((n,), ("seq",), axis_type=AxisType.Auto)
    q, k, v = attention_inputs(1, L, L, 4, 2, 8, jnp.float32)
    seg = segments_from_cuts(1, L, (3, 6))
    kw = dict(causal=True, segment_ids=SegmentIds(seg, seg))
    _check(_per_shard_ring(mesh, n, "zigzag", kw, "pallas", block_sizes=None), q, k, v, kw)


@pytest.mark.slow
def test_ring_pallas_window_positions_explicit_axes():
    # Explicit mesh axes, contiguous shards, a causal sliding window over explicit gapped
    # global positions, MQA, the Pallas default block sizes.
    n, L = 2, 16
    mesh = make_test_mesh((n,), ("seq",), axis_type=AxisType.Explicit)
    q, k, v = attention_inputs(1, L, L, 2, 1, 8, jnp.float32, seed=3)
    pos = _gapped(1, L)
    kw = dict(causal=True, window=6, positions=Positions(pos, pos))
    _check(_per_shard_ring(mesh, n, "contiguous", kw, "pallas", block_sizes=None), q, k, v, kw)


@pytest.mark.no_typecheck
def test_impl_validation():
    q, k, v = attention_inputs(1, 8, 8, 2, 1, 8, jnp.float32)
    mesh = make_test_mesh((2,), ("seq",))
    for bad in ("triton", "", "XLA", 3, None):
        with pytest.raises(ValueError, match="impl"):
            ring_attention_per_shard(q, k, v, seq_axis="seq", impl=bad)
        with pytest.raises(ValueError, match="impl"):
            sharded_attention(q, k, v, mesh=mesh, seq_axis="seq", impl=bad)
    with pytest.raises(NotImplementedError, match="hop_format"):
        ring_attention_per_shard(q, k, v, seq_axis="seq", hop_format="int8", impl="pallas")
    with pytest.raises(ValueError, match="impl"):
        hop_bytes(1, 8, 1, 8, "float32", impl="cuda")
    with pytest.raises(NotImplementedError, match="hop_format"):
        hop_bytes(1, 8, 1, 8, "float32", hop_format="int8", impl="pallas")
    for strategy in ("ring", "usp"):
        seq_axis = "seq" if strategy == "ring" else ("seq", "seq2")
        mesh2 = make_test_mesh((2, 1), ("seq", "seq2")) if strategy == "usp" else mesh
        with pytest.raises(NotImplementedError, match="hop_format"):
            sharded_attention(
                q,
                k,
                v,
                mesh=mesh2,
                seq_axis=seq_axis,
                strategy=strategy,
                hop_format="fp8",
                impl="pallas",
            )


def test_default_and_xla_trace_the_same_program_without_pallas():
    # impl="auto" is the XLA ring on CPU: the same program as impl="xla" (and as before the
    # switch existed), with no pallas_call; impl="pallas" runs one.
    n, L = 2, 16
    mesh = make_test_mesh((n,), ("seq",))
    q, k, v = attention_inputs(1, L, L, 4, 2, 8, jnp.float32)
    kw = dict(causal=True, window=5)

    def program(impl, **extra):
        attend = _per_shard_ring(mesh, n, "zigzag", kw, impl, **extra)
        grads = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).out), argnums=(0, 1, 2))
        return str(jax.make_jaxpr(grads)(q, k, v))

    default = program("auto")
    assert default == program("xla")
    assert "pallas_call" not in default
    assert program("pallas").count("pallas_call") == 2 * 3  # two hops: forward, dq, dk/dv


def test_varying_struct_varies_like_its_operands():
    # The out_shape the kernels give pallas_call: no axes outside shard_map, the union of the
    # operands' varying axes inside (here "seq", not the replicated "data").
    from ringattn._varying import varying_axes, varying_struct

    assert varying_struct((2, 3), jnp.float32, jnp.ones(2)).manual_axis_type.varying == set()
    mesh = make_test_mesh((2, 2), ("data", "seq"))
    seen = []

    def body(x, y):
        struct = varying_struct((4,), jnp.float32, y, x)
        seen.append((struct.shape, struct.dtype, struct.manual_axis_type.varying))
        assert varying_axes(x) == {"seq"} and not varying_axes(y)
        return x

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("seq"), P()), out_specs=P("seq"), check_vma=True)
    jax.make_jaxpr(f)(jnp.ones(4), jnp.ones(3))
    assert seen == [((4,), jnp.float32, {"seq"})]


def test_hop_bytes_is_what_travels_with_pallas():
    # Under impl="pallas" the block travels unpadded, in the canonical layout: hop_bytes says
    # so and equals the ppermute operand bytes, forward and forward + backward.
    n, B, N, K, S, H = 4, 1, 4, 2, 12, 8
    mesh = make_test_mesh((n,), ("seq",))

    def body(q, k, v, seg):
        ids = SegmentIds(seg, seg)
        return ring_attention_per_shard(
            q, k, v, seq_axis="seq", causal=True, segment_ids=ids, impl="pallas"
        ).out

    f = jax.shard_map(
        body, mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"), check_vma=True
    )
    grad = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))
    q = jax.ShapeDtypeStruct((B, n * S, N, H), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, n * S, K, H), jnp.float32)
    seg = jax.ShapeDtypeStruct((B, n * S), jnp.int32)
    fwd_hop = hop_bytes(B, S, K, H, "float32", segment_ids=True, impl="pallas")
    bwd_hop = hop_bytes(B, S, K, H, "float32", segment_ids=True, backward=True, impl="pallas")
    assert fwd_hop == 2 * B * S * K * H * 4 + 2 * B * S * 4  # K/V, positions, segment ids
    assert bwd_hop == fwd_hop + B * S * K * 2 * H * 4  # and the float32 dK/dV
    assert _ppermute_bytes(jax.make_jaxpr(f)(q, kv, kv, seg).jaxpr) == (n - 1) * fwd_hop
    dkv_home = B * K * S * 2 * H * 4
    expected = (n - 1) * (fwd_hop + bwd_hop) + dkv_home
    assert _ppermute_bytes(jax.make_jaxpr(grad)(q, kv, kv, seg).jaxpr) == expected


def test_ring_kernels_lower_to_triton_for_cuda_inside_shard_map(monkeypatch):
    # The compiled path: with the backend reported as "gpu", impl="pallas" builds the Triton
    # kernels (no interpret mode), and jax.export lowers the ring's forward and backward for
    # CUDA on this CPU host, under shard_map(check_vma=True) on 4 devices. Three forward
    # kernels (the local hop, the loop body, the last hop) and three dq + three dk/dv ones.
    # Compiling the Triton IR and running it needs a GPU and is not checked here.
    from jax import export

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    mesh = make_test_mesh((4,), ("seq",))
    per_shard = functools.partial(
        ring_attention_per_shard,
        seq_axis="seq",
        layout="zigzag",
        causal=True,
        window=(64, None, 128, 32),
        softcap=30.0,
        impl="pallas",
    )
    f = jax.shard_map(
        _with_shard_positions(per_shard, "zigzag", 4),
        mesh=mesh,
        in_specs=P(None, "seq"),
        out_specs=P(None, "seq"),
        check_vma=True,
    )

    def loss(q, k, v):
        out, lse = f(q, k, v)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    B, L, N, K, H = 1, 1024, 4, 2, 64
    shapes = [jax.ShapeDtypeStruct((B, L, heads, H), jnp.bfloat16) for heads in (N, K, K)]
    triton = "__gpu$xla.gpu.triton"
    exported = export.export(
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
        platforms=("cuda",),
        disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)],
    )(*shapes)
    assert exported.mlir_module().count(f"@{triton}(") == 3 + 3 * 2


# ---------------------------------------------------------------- the matrix (slow)

RING_CASES = {
    # name: (n, layout, (N, K), options, dtype, hops after the local one)
    # A window of 6 over shards of 8: only the hop from the previous shard can be visible.
    "n4-contiguous-window-hops": (4, "contiguous", (4, 2), dict(causal=True, window=6), "f32", 1),
    "n4-striped-per-head-windows-softcap": (
        4,
        "striped",
        (4, 2),
        dict(causal=True, window=(5, None, 9, 3), softcap=4.0),
        "f32",
        3,
    ),
    "n4-contiguous-full-mqa-segments": (4, "contiguous", (4, 1), dict(segments=True), "f32", 3),
    "n4-zigzag-causal-gqa-bf16": (4, "zigzag", (8, 2), dict(causal=True), "bf16", 3),
    "n2-zigzag-window-positions": (
        2,
        "zigzag",
        (4, 2),
        dict(causal=True, window=3, gaps=True),
        "f32",
        1,
    ),
    "n8-contiguous-window-segments": (
        8,
        "contiguous",
        (4, 1),
        dict(causal=True, window=11, segments=True),
        "f32",
        2,
    ),
    "n1-contiguous-causal": (1, "contiguous", (4, 2), dict(causal=True, softcap=3.0), "f32", 0),
}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def _traced(hops: int) -> int:
    """Forward kernels in the program of a ring of ``hops`` hops: the local hop, the loop
    body over the middle hops (traced once) and the last hop."""
    return min(hops + 1, 3)


def _ring_kwargs(B, L, opts):
    opts = dict(opts)
    kw = {}
    if opts.pop("segments", False):
        seg = segments_from_cuts(B, L, (L // 3, L // 2 + 1))
        kw["segment_ids"] = SegmentIds(seg, seg)
    if opts.pop("gaps", False):
        pos = _gapped(B, L)
        kw["positions"] = Positions(pos, pos)
    kw.update(opts)
    return kw


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RING_CASES))
def test_ring_pallas_matches_reference(name):
    n, layout, (N, K), opts, dtype, hops = RING_CASES[name]
    dtype = DTYPES[dtype]
    L = 8 * n
    mesh = make_test_mesh((n,), ("seq",))
    q, k, v = attention_inputs(2, L, L, N, K, 8, dtype, seed=len(name))
    kw = _ring_kwargs(2, L, opts)
    _check(
        _per_shard_ring(mesh, n, layout, kw, "pallas"),
        q,
        k,
        v,
        kw,
        dtype=dtype,
        kernels=_traced(hops),
    )


@pytest.mark.slow
def test_ring_pallas_sinks_and_fully_masked_rows():
    # Queries of a segment no key has: out 0 and lse = sink; sinks join once after the ring.
    n, L = 2, 16
    mesh = make_test_mesh((n,), ("seq",))
    q, k, v = attention_inputs(1, L, L, 4, 2, 8, jnp.float32)
    kv_seg = segments_from_cuts(1, L, (6,))
    q_seg = kv_seg.at[:, ::5].set(7)
    sinks = jnp.asarray([0.5, -1.0, 0.0, 2.0], jnp.float32)
    kw = dict(causal=True, segment_ids=SegmentIds(q_seg, kv_seg), sinks=sinks)
    attend = _per_shard_ring(mesh, n, "zigzag", kw, "pallas")
    _check(attend, q, k, v, kw)
    out = jax.jit(attend)(q, k, v).out
    assert np.all(np.asarray(out)[:, ::5] == 0.0)


# Every strategy on Auto axes, and on Explicit axes the one the Mosaic test below does not run
# (allgather): the axis type is handled by sharded_attention before any kernel is picked, so
# ring, usp and ulysses on Explicit axes with the Pallas kernels are guarded by
# test_sharded_mosaic_strategies_explicit_axes (the same strategies, the other backend's
# kernels), and the Triton kernels on each strategy by the Auto cases here.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "axis_type"),
    [
        ("ring", AxisType.Auto),
        ("usp", AxisType.Auto),
        ("allgather", AxisType.Auto),
        ("ulysses", AxisType.Auto),
        ("allgather", AxisType.Explicit),
    ],
    ids=["ring-auto", "usp-auto", "allgather-auto", "ulysses-auto", "allgather-explicit"],
)
def test_sharded_pallas_strategies(strategy, axis_type):
    # Every strategy with impl="pallas" on a 4-device mesh: usp is Ulysses over "u" and the
    # ring over "seq"; per-head windows are sliced to each device's heads.
    L = 32
    if strategy == "usp":
        mesh = make_test_mesh((2, 2), ("u", "seq"), axis_type=axis_type)
        seq_axis, n = ("u", "seq"), 2
    else:
        mesh = make_test_mesh((4,), ("seq",), axis_type=axis_type)
        seq_axis, n = "seq", 4
    q, k, v = attention_inputs(1, L, L, 4, 2, 8, jnp.float32, seed=5)
    seg = segments_from_cuts(1, L, (9, 20))
    kw = dict(causal=True, window=(7, None, 12, 5), segment_ids=SegmentIds(seg, seg))
    attend = _sharded(mesh, n, strategy, seq_axis, "zigzag", kw, "pallas")
    # The ring strategies run the forward kernel on every hop (causal zigzag prunes none).
    _check(attend, q, k, v, kw, kernels=_traced(n - 1) if strategy in ("ring", "usp") else 1)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_sharded_pallas_batch_and_head_axes(strategy):
    # Batch on "data" for the ring, heads on "model" for Ulysses (kv heads repeated per device).
    L = 16
    if strategy == "ring":
        mesh = make_test_mesh((2, 2), ("data", "seq"))
        axes = dict(batch_axis="data")
    else:
        mesh = make_test_mesh((2, 2), ("model", "seq"))
        axes = dict(head_axis="model")
    q, k, v = attention_inputs(2, L, L, 8, 2, 8, jnp.float32, seed=7)
    kw = dict(causal=True, softcap=5.0)
    attend = _sharded(mesh, 2, strategy, "seq", "striped", kw, "pallas", **axes)
    _check(attend, q, k, v, kw, kernels=2 if strategy == "ring" else 1)


@pytest.mark.slow
def test_ring_pallas_nan_in_hidden_keys_reaches_nothing():
    # Keys no query may see hold NaN: no effect on outputs or gradients.
    n, L = 4, 32
    mesh = make_test_mesh((n,), ("seq",))
    q, k, v = attention_inputs(1, L, L, 4, 2, 8, jnp.float32)
    # Keys 0..7 belong to a segment no query has.
    seg_q = jnp.ones((1, L), jnp.int32)
    seg_kv = (jnp.arange(L) >= 8).astype(jnp.int32)[None]
    kw = dict(causal=True, segment_ids=SegmentIds(seg_q, seg_kv))
    hidden = jnp.arange(L) < 8
    poison = lambda x: jnp.where(hidden[None, :, None, None], jnp.nan, x)
    attend = _per_shard_ring(mesh, n, "contiguous", kw, "pallas")
    f = jax.jit(_loss_and_grads(attend, jnp.ones((1, L, 4, 8)), jnp.ones((1, L, 4))))
    out, lse, grads = f(q, poison(k), poison(v))
    want, want_lse, want_grads = f(q, k, v)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    for g, w in zip(grads, want_grads, strict=True):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6)


# ---------------------------------------------------------------- the Mosaic (TPU) kernels
# ``ringattn._blockwise.pallas_target`` names the kernels a backend runs; replaced here, the
# CPU host runs the Mosaic kernels (TPU interpret mode) in every ring hop and local attention.


@pytest.fixture
def mosaic(monkeypatch):
    import ringattn._blockwise as blockwise_module

    # Traces cached by jit (keyed by static options, not by this switch) would keep the
    # kernels of an earlier test: start and end with empty caches.
    jax.clear_caches()
    monkeypatch.setattr(blockwise_module, "pallas_target", lambda backend: "mosaic")
    yield
    jax.clear_caches()


def _mosaic_kernels(attend, q, k, v):
    """Names of the Mosaic kernels in the jaxpr of a loss's gradient through ``attend``."""
    grads = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).out), argnums=(0, 1, 2))
    text = str(jax.make_jaxpr(grads)(q, k, v))
    assert "ringattn_pallas_" not in text  # no Triton kernel
    return {name for name in ("mosaic_forward", "mosaic_dq", "mosaic_dkv") if name in text}


@pytest.mark.slow
def test_ring_mosaic_causal_zigzag_gqa_segments(mosaic):
    n, L = 2, 8
    mesh = make_test_mesh((n,), ("seq",), axis_type=AxisType.Auto)
    q, k, v = attention_inputs(1, L, L, 4, 2, 8, jnp.float32, seed=2)
    seg = segments_from_cuts(1, L, (3, 6))
    kw = dict(causal=True, segment_ids=SegmentIds(seg, seg))
    attend = _per_shard_ring(mesh, n, "zigzag", kw, "pallas", block_sizes=None)
    assert _mosaic_kernels(attend, q, k, v) == {"mosaic_forward", "mosaic_dq", "mosaic_dkv"}
    _check(attend, q, k, v, kw)


def test_ring_kernels_lower_to_mosaic_for_tpu_inside_shard_map(monkeypatch):
    # The compiled TPU path: with the backend reported as "tpu", impl="pallas" builds the
    # Mosaic kernels (no interpret mode) with blocks that obey the (8, 128) tiling after the
    # zigzag halving, and jax.export lowers the ring's forward and backward for TPU on this
    # CPU host under shard_map(check_vma=True) on 4 devices. Compiling the Mosaic module
    # needs a TPU and is not checked here.
    from jax import export

    from ringattn._ring_pallas import shard_pallas_config

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    cfg = shard_pallas_config(MaskSpec(causal=True), 64, 2, 512, 512, None, "zigzag")
    assert cfg.target == "mosaic" and cfg.interpret is False
    assert (cfg.block_q, cfg.block_kv) == (256, 256)  # halves of the 512-token shard
    mesh = make_test_mesh((4,), ("seq",))
    per_shard = functools.partial(
        ring_attention_per_shard,
        seq_axis="seq",
        layout="zigzag",
        causal=True,
        window=(600, None, 300, 700),
        softcap=30.0,
        impl="pallas",
    )
    f = jax.shard_map(
        _with_shard_positions(per_shard, "zigzag", 4),
        mesh=mesh,
        in_specs=P(None, "seq"),
        out_specs=P(None, "seq"),
        check_vma=True,
    )

    def loss(q, k, v):
        out, lse = f(q, k, v)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    B, L, N, K, H = 1, 2048, 4, 2, 64
    shapes = [jax.ShapeDtypeStruct((B, L, heads, H), jnp.bfloat16) for heads in (N, K, K)]
    exported = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=("tpu",))(
        *shapes
    )
    text = exported.mlir_module()
    assert text.count("tpu_custom_call") >= 3  # forward, dq and dk/dv kernels at least


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "usp", "ulysses"])
def test_sharded_mosaic_strategies_explicit_axes(mosaic, strategy):
    # sharded_attention with the Mosaic kernels on Explicit axes: the ring and usp hops and
    # Ulysses' local attention, per-head windows, segments.
    L = 32
    if strategy == "usp":
        mesh = make_test_mesh((2, 2), ("u", "seq"), axis_type=AxisType.Explicit)
        seq_axis, n = ("u", "seq"), 2
    else:
        mesh = make_test_mesh((4,), ("seq",), axis_type=AxisType.Explicit)
        seq_axis, n = "seq", 4
    q, k, v = attention_inputs(1, L, L, 4, 2, 8, jnp.float32, seed=6)
    seg = segments_from_cuts(1, L, (9, 20))
    kw = dict(causal=True, window=(7, None, 12, 5), segment_ids=SegmentIds(seg, seg))
    attend = _sharded(mesh, n, strategy, seq_axis, "zigzag", kw, "pallas")
    assert _mosaic_kernels(attend, q, k, v) == {"mosaic_forward", "mosaic_dq", "mosaic_dkv"}
    _check(attend, q, k, v, kw)
