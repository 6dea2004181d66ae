"""Quantized ring hops (``hop_format="int8"`` / ``"fp8"``) against float32 dense references.

The semantics under test: the ring computes exact attention over ``dequantize(quantize(k))``,
``dequantize(quantize(v))`` (per token and kv head absmax), forward and ``dq`` exact for that,
``dk`` / ``dv`` straight-through (the gradients with respect to the dequantized K/V). So each
case is compared tightly (float32 tolerance) with :func:`ringattn.attention_reference` on the
dequantized K/V, and with the unquantized reference within a bound computed from the actual
quantization errors. Inputs hold all-zero and constant tokens. Also: the quantizer itself
against its definition, ``hop_format=None`` leaves the program unchanged, the bytes that
really travel (from the jaxpr's ``ppermute`` operands) equal :func:`ringattn.hop_bytes`, NaN
in a key, and the errors.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ringattn import (
    HOP_FORMATS,
    BlockSizes,
    Positions,
    QuantizedHop,
    SegmentIds,
    attention_reference,
    dequantize_hop,
    from_layout,
    hop_bytes,
    quantize_hop,
    ring_attention_per_shard,
    shard_positions,
    sharded_attention,
    to_layout,
)
from tests._util import assert_close, make_test_mesh

B, H = 2, 8
LOCAL = 8  # tokens per ring shard
BLOCKS = BlockSizes(block_q=4, block_kv=4)


# ---- the quantizer ----


def _rows_with_zero_and_constant(shape, seed=0, spread=(-4.0, 4.0)):
    """Normal values with a scale per row of ``exp(uniform(*spread))``, one all-zero row
    and one constant row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.exp(rng.uniform(*spread, size=(*shape[:-1], 1))).astype(np.float32)
    x.reshape(-1, shape[-1])[1] = 0.0
    x.reshape(-1, shape[-1])[2] = -3.25
    return x


@pytest.mark.parametrize("hop_format", HOP_FORMATS)
def test_quantize_hop_matches_its_definition(hop_format):
    x = _rows_with_zero_and_constant((3, 5, 2, 16))
    hop = quantize_hop(jnp.asarray(x), hop_format=hop_format)
    data = np.asarray(hop.data.astype(jnp.float32))
    scale = np.asarray(hop.scale)
    top = {"int8": 127.0, "fp8": 448.0}[hop_format]
    assert hop.data.dtype == {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[hop_format]
    assert hop.scale.dtype == jnp.float32 and hop.scale.shape == x.shape[:-1]
    absmax = np.max(np.abs(x), axis=-1)
    np.testing.assert_allclose(scale, absmax / top, rtol=1e-6)
    nonzero = absmax > 0
    # The largest element of every nonzero row maps to the format's largest magnitude.
    np.testing.assert_allclose(np.max(np.abs(data), axis=-1)[nonzero], top, rtol=1e-6)
    back = np.asarray(dequantize_hop(hop))
    err = np.abs(back - x)
    if hop_format == "int8":
        assert np.all(data == np.round(data)) and np.all(np.abs(data) <= 127)
        # Round to nearest: at most half a step (plus float32 rounding of x / scale).
        assert np.all(err <= scale[..., None] * (0.5 + 1e-4)), float(np.max(err))
    else:
        # e4m3: 3 mantissa bits, a relative error <= 2**-4, or half a subnormal step 2**-9.
        bound = np.maximum(2.0**-4 * np.abs(x), scale[..., None] * 2.0**-10) * (1 + 1e-4)
        assert np.all(err <= bound), float(np.max(err / bound))
    flat_scale, flat_back = scale.reshape(-1), back.reshape(-1, x.shape[-1])
    assert flat_scale[1] == 0.0 and np.all(flat_back[1] == 0.0)  # an all-zero token: exact
    np.testing.assert_allclose(flat_back[2], -3.25, rtol=1e-6)  # a constant token


@pytest.mark.parametrize("shape", [(4, 8), (192, 32), (512, 64)])
def test_quantize_hop_nan_and_inf_stay_in_their_row(shape):
    """A NaN / inf row gets a NaN scale and decodes to NaN whole, also past the ~4,096 values
    where XLA:CPU's max reduction drops NaN; every other row stays finite."""
    x = _rows_with_zero_and_constant(shape)
    x[0, 3], x[3, 5] = np.nan, np.inf
    for hop_format in HOP_FORMATS:
        hop = quantize_hop(jnp.asarray(x), hop_format=hop_format)
        back = np.asarray(dequantize_hop(hop))
        assert np.isnan(np.asarray(hop.scale)[[0, 3]]).all(), hop_format
        assert np.all(np.isnan(back[0])) and np.all(np.isnan(back[3])), hop_format
        assert np.all(np.isfinite(back[1:3])) and np.all(np.isfinite(back[4:])), hop_format


def test_quantize_hop_bfloat16_and_jit():
    x = jnp.asarray(_rows_with_zero_and_constant((2, 6, 8)), jnp.bfloat16)
    hop = jax.jit(functools.partial(quantize_hop, hop_format="int8"))(x)
    eager = quantize_hop(x.astype(jnp.float32), hop_format="int8")
    assert np.array_equal(np.asarray(hop.data), np.asarray(eager.data))
    assert np.array_equal(np.asarray(hop.scale), np.asarray(eager.scale))


@pytest.mark.no_typecheck
def test_quantizer_errors():
    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match=r"quantize_hop: hop_format: expected None or one of"):
        quantize_hop(x, hop_format="int4")
    with pytest.raises(ValueError, match=r"quantize_hop: hop_format: expected one of .* None"):
        quantize_hop(x, hop_format=None)
    with pytest.raises(ValueError, match=r"quantize_hop: x: expected a floating array"):
        quantize_hop(jnp.ones((2, 4), jnp.int32), hop_format="int8")
    with pytest.raises(ValueError, match=r"dequantize_hop: hop: expected a ringattn\.QuantizedHop"):
        dequantize_hop((x, x[:, 0]))
    with pytest.raises(ValueError, match=r"dequantize_hop: hop\.scale: expected shape \(2,\)"):
        dequantize_hop(QuantizedHop(x.astype(jnp.int8), x))


# ---- the ring against the references ----


@dataclasses.dataclass(frozen=True)
class Case:
    hop_format: str
    n: int
    layout: str = "contiguous"
    causal: bool = True
    heads: tuple[int, int] = (4, 2)  # (N, K)
    window: int | tuple[int | None, ...] | None = None
    softcap: float | None = None
    segments: bool = False
    dtype: str = "float32"
    strategy: str = "ring"
    axis_type: AxisType = AxisType.Auto
    batch_axis: bool = False  # a (2, n) mesh with the batch on "data"

    def __str__(self):
        parts = [self.hop_format, self.strategy, f"n{self.n}", self.layout]
        parts += ["causal" if self.causal else "full", f"N{self.heads[0]}K{self.heads[1]}"]
        parts += [f"w{self.window}"] * (self.window is not None)
        parts += [f"cap{self.softcap}"] * (self.softcap is not None)
        parts += ["seg"] * self.segments + [self.dtype]
        parts += ["explicit"] * (self.axis_type == AxisType.Explicit)
        parts += ["data"] * self.batch_axis
        return "-".join(parts)


CASES = [
    Case("int8", 4, "contiguous", window=6, softcap=5.0),  # window hop skipping
    Case("fp8", 4, "zigzag", heads=(8, 2), segments=True),
    Case("int8", 4, "striped", causal=False, heads=(4, 1), axis_type=AxisType.Explicit),
    Case("fp8", 2, "zigzag", window=(None, 3, 5, None), segments=True, axis_type=AxisType.Explicit),
    Case("int8", 8, "contiguous", heads=(4, 4)),
    Case("fp8", 1, "striped", causal=False, window=5),
    Case("int8", 4, "zigzag", dtype="bfloat16", segments=True),
    Case("int8", 4, "zigzag", axis_type=AxisType.Explicit, batch_axis=True),
    Case("fp8", 2, "zigzag", strategy="usp"),  # Ulysses over "u" (2), ring over "seq" (2)
]


def _inputs(case: Case):
    """Global ``q, k, v`` with all-zero and constant key/value tokens, and segment ids."""
    N, K = case.heads
    L = case.n * LOCAL * (2 if case.strategy == "usp" else 1)
    rng = np.random.default_rng(len(str(case)))
    q = rng.standard_normal((B, L, N, H), dtype=np.float32)
    k, v = (_rows_with_zero_and_constant((B, L, K, H), seed, (-2.0, 1.0)) for seed in (1, 2))
    seg = None
    if case.segments:
        seg = jnp.asarray(np.cumsum(rng.random((B, L)) < 0.15, axis=1), jnp.int32)
    cast = lambda x: jnp.asarray(x, jnp.dtype(case.dtype))
    return cast(q), cast(k), cast(v), seg


def _mesh_and_axes(case: Case):
    if case.strategy == "usp":
        mesh = make_test_mesh((2, case.n), ("u", "seq"), axis_type=case.axis_type)
        return mesh, ("u", "seq"), None
    if case.batch_axis:
        mesh = make_test_mesh((2, case.n), ("data", "seq"), axis_type=case.axis_type)
        return mesh, "seq", "data"
    return make_test_mesh((case.n,), ("seq",), axis_type=case.axis_type), "seq", None


def _forward_and_grads(f):
    def run(q, k, v):
        (out, lse), vjp = jax.vjp(lambda *a: tuple(f(*a)), q, k, v)
        dout = jnp.cos(out.astype(jnp.float32)).astype(out.dtype)
        finite = jnp.isfinite(lse)
        return out, lse, vjp((dout, jnp.where(finite, 0.1 * jnp.sin(lse), 0.0)))

    return run


def _mask_kwargs(case: Case):
    return dict(causal=case.causal, window=case.window, softcap=case.softcap)


def _ring(case: Case, seg, hop_format, *, grads: bool = True):
    mesh, seq_axis, batch_axis = _mesh_and_axes(case)
    perm = lambda x: None if x is None else to_layout(x, case.layout, num_shards=case.n)

    def unperm(x):
        if case.axis_type == AxisType.Explicit:  # gather before the layout's reshapes
            x = jax.sharding.reshard(x, NamedSharding(mesh, P()))
        return from_layout(x, case.layout, num_shards=case.n)

    def f(q, k, v):
        positions = None
        if case.layout != "contiguous" and (case.causal or case.window is not None):
            # A permuted layout under a positional mask needs them (issue 29 item 2).
            natural = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])
            positions = Positions(perm(natural), perm(natural))
        out, lse = sharded_attention(
            perm(q),
            perm(k),
            perm(v),
            mesh=mesh,
            seq_axis=seq_axis,
            strategy=case.strategy,
            layout=case.layout,
            batch_axis=batch_axis,
            positions=positions,
            segment_ids=None if seg is None else SegmentIds(perm(seg), perm(seg)),
            block_sizes=BLOCKS,
            hop_format=hop_format,
            **_mask_kwargs(case),
        )
        return unperm(out), unperm(lse)

    return jax.jit(_forward_and_grads(f) if grads else f)


def _reference(case: Case, seg):
    f = functools.partial(
        attention_reference,
        segment_ids=None if seg is None else SegmentIds(seg, seg),
        **_mask_kwargs(case),
    )
    return jax.jit(_forward_and_grads(f))


def _dequantized(x, hop_format):
    return dequantize_hop(quantize_hop(x, hop_format=hop_format))


def _finite_lse(lse):
    return jnp.where(jnp.isfinite(lse), lse, 0.0)


# The heaviest cases (segments, per-head windows on Explicit axes, bf16, a batch axis) run
# with the slow tests (CI runs both); the rest cover every layout and both formats.
_SLOW_CASES = (1, 3, 4, 6, 7)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.slow, id=str(c)) if i in _SLOW_CASES else pytest.param(c, id=str(c))
        for i, c in enumerate(CASES)
    ],
)  # fmt: skip
def test_quantized_ring_is_exact_attention_over_dequantized_kv(case: Case):
    q, k, v, seg = _inputs(case)
    dtype = jnp.dtype(case.dtype)
    out, lse, grads = _ring(case, seg, case.hop_format)(q, k, v)
    kd, vd = _dequantized(k, case.hop_format), _dequantized(v, case.hop_format)
    f32 = lambda x: x.astype(jnp.float32)
    ref_out, ref_lse, ref_grads = _reference(case, seg)(f32(q), kd, vd)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert_close(out, ref_out, dtype=dtype, what=f"{case} out")
    assert_close(_finite_lse(lse), _finite_lse(ref_lse), dtype=dtype, what=f"{case} lse")
    # dq exact; dk, dv: the gradients with respect to the dequantized K/V (straight-through).
    for name, g, g_ref in zip("qkv", grads, ref_grads, strict=True):
        assert g.dtype == dtype
        assert_close(g, g_ref, dtype=dtype, grad=True, what=f"{case} d{name}")

    # Against the unquantized reference: within the bound the actual quantization errors
    # give. Logits move by at most delta = scale * max_t |q_t|_1 * max|k - kd| (softcap is
    # 1-Lipschitz), so the softmax weights by at most exp(2 delta) - 1 in l1, and
    # |out - out_ref| <= max|v - vd| + max|v| (exp(2 delta) - 1), |lse - lse_ref| <= delta.
    exact_out, exact_lse, _ = _reference(case, seg)(f32(q), f32(k), f32(v))
    k_err = float(jnp.max(jnp.abs(kd - f32(k))))
    v_err = float(jnp.max(jnp.abs(vd - f32(v))))
    delta = float(jnp.max(jnp.sum(jnp.abs(f32(q)), -1))) / np.sqrt(H) * k_err
    bound = v_err + float(jnp.max(jnp.abs(f32(v)))) * np.expm1(2 * delta)
    slack = 2e-2 if case.dtype == "bfloat16" else 1e-5
    err = float(jnp.max(jnp.abs(f32(out) - exact_out)))
    assert 0 < err <= bound + slack, f"{case}: out error {err:.3g} vs bound {bound:.3g}"
    lse_err = float(jnp.max(jnp.abs(_finite_lse(lse) - _finite_lse(exact_lse))))
    assert lse_err <= delta + slack, f"{case}: lse error {lse_err:.3g} vs bound {delta:.3g}"


def test_hop_format_none_is_the_unquantized_ring():
    """``hop_format=None`` builds the very same program as not passing it; it is exact."""
    case = Case("int8", 4, "zigzag", segments=True)
    q, k, v, seg = _inputs(case)
    mesh = make_test_mesh((4,), ("seq",))
    texts = []
    for kwargs in ({}, {"hop_format": None}):
        f = functools.partial(sharded_attention, mesh=mesh, seq_axis="seq", causal=True, **kwargs)
        texts.append(jax.jit(f).lower(q, k, v).as_text())
    assert texts[0] == texts[1]
    out, lse, grads = _ring(case, seg, None)(q, k, v)
    ref_out, ref_lse, ref_grads = _reference(case, seg)(q, k, v)
    assert_close(out, ref_out, dtype=jnp.float32, what="None out")
    for name, g, g_ref in zip("qkv", grads, ref_grads, strict=True):
        assert_close(g, g_ref, dtype=jnp.float32, grad=True, what=f"None d{name}")


def test_per_shard_entry_point_under_jit():
    """``ring_attention_per_shard(hop_format=...)`` directly inside ``shard_map``."""
    n, N, K = 4, 4, 2
    mesh = make_test_mesh((n,), ("seq",))
    q, k, v, _ = _inputs(Case("int8", n, heads=(N, K)))
    per_shard = functools.partial(
        ring_attention_per_shard, seq_axis="seq", causal=True, block_sizes=BLOCKS
    )
    outs = {}
    for fmt in (None, *HOP_FORMATS):
        f = jax.shard_map(
            lambda q, k, v, fmt=fmt: per_shard(q, k, v, hop_format=fmt).out,
            mesh=mesh,
            in_specs=P(None, "seq"),
            out_specs=P(None, "seq"),
            check_vma=True,
        )
        outs[fmt] = jax.jit(f)(q, k, v)
    for fmt in HOP_FORMATS:
        ref = attention_reference(q, _dequantized(k, fmt), _dequantized(v, fmt), causal=True)
        assert_close(outs[fmt], ref.out, dtype=jnp.float32, what=f"per shard {fmt}")
    assert_close(outs[None], attention_reference(q, k, v, causal=True).out, dtype=jnp.float32)


# ---- NaN in a key ----


@pytest.mark.parametrize("hop_format", HOP_FORMATS)
def test_nan_key_poisons_only_the_queries_that_see_it(hop_format):
    """Causal: NaN in one element of key ``p`` makes that token's whole (kv head) row NaN
    after dequantization; queries before ``p`` never see it and stay exact, queries at or
    after ``p`` get NaN (as without quantization). A masked NaN key has no effect at all."""
    case = Case(hop_format, 4, "zigzag")
    q, k, v, _ = _inputs(case)
    p = 19
    k_nan = k.at[:, p, 0, 3].set(jnp.nan)
    out, _ = _ring(case, None, hop_format, grads=False)(q, k_nan, v)
    out = np.asarray(out)
    assert np.all(np.isnan(out[:, p:, :2]))  # query heads 0, 1 read kv head 0
    kd, vd = _dequantized(k, hop_format), _dequantized(v, hop_format)
    ref = attention_reference(q, kd, vd, causal=True).out
    assert_close(out[:, :p], ref[:, :p], dtype=jnp.float32, what="queries before the NaN")
    assert_close(out[:, :, 2:], ref[:, :, 2:], dtype=jnp.float32, what="the other kv head")


@pytest.mark.parametrize("hop_format", HOP_FORMATS)
def test_nan_key_in_large_shards_poisons_the_same_rows_as_the_exact_ring(hop_format):
    """Shards of 2 * 128 * 2 * 32 key values, past the size where XLA:CPU's max reduction
    drops NaN: the quantized ring turns exactly the rows NaN that the exact ring does."""
    n, local, (N, K), Hd = 4, 128, (4, 2), 32
    rng = np.random.default_rng(3)
    q, k, v = (
        jnp.asarray(rng.standard_normal((2, n * local, heads, Hd), dtype=np.float32))
        for heads in (N, K, K)
    )
    k = k.at[1, 100, 1, 7].set(jnp.nan)
    mesh = make_test_mesh((n,), ("seq",))

    def ring(fmt):
        f = functools.partial(
            sharded_attention, mesh=mesh, seq_axis="seq", causal=True, hop_format=fmt,
            block_sizes=BlockSizes(block_q=64, block_kv=64),
        )  # fmt: skip
        return np.asarray(jax.jit(f)(q, k, v).out)

    exact, quantized = np.isnan(ring(None)), np.isnan(ring(hop_format))
    assert exact[1, 100:, 2:].all() and exact.sum() == (n * local - 100) * 2 * Hd
    np.testing.assert_array_equal(quantized, exact)


def test_masked_nan_key_has_no_effect():
    """The NaN key in a segment no query belongs to: every output and gradient is exact."""
    hop_format = "int8"
    case = Case(hop_format, 4, "zigzag")
    q, k, v, _ = _inputs(case)
    L, p = q.shape[1], 19
    k_nan = k.at[:, p, 0, 3].set(jnp.nan)
    kd, vd = _dequantized(k, hop_format), _dequantized(v, hop_format)
    seg = jnp.zeros((B, L), jnp.int32).at[:, p].set(7)
    mesh = make_test_mesh((4,), ("seq",))
    perm = lambda x: to_layout(x, "zigzag", num_shards=4)
    unperm = lambda x: from_layout(x, "zigzag", num_shards=4)
    natural = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))

    def f(q, k, v):
        out, lse = sharded_attention(
            perm(q),
            perm(k),
            perm(v),
            mesh=mesh,
            seq_axis="seq",
            layout="zigzag",
            causal=True,
            positions=Positions(perm(natural), perm(natural)),  # permuted like the data
            segment_ids=SegmentIds(perm(jnp.zeros((B, L), jnp.int32)), perm(seg)),
            block_sizes=BLOCKS,
            hop_format=hop_format,
        )
        return unperm(out), unperm(lse)

    out, lse, grads = jax.jit(_forward_and_grads(f))(q, k_nan, v)
    ref_f = functools.partial(
        attention_reference,
        causal=True,
        segment_ids=SegmentIds(jnp.zeros((B, L), jnp.int32), seg),
    )
    ref_out, _, ref_grads = jax.jit(_forward_and_grads(ref_f))(q, kd, vd)
    assert_close(out, ref_out, dtype=jnp.float32, what=f"{case} masked NaN out")
    for name, g, g_ref in zip("qkv", grads, ref_grads, strict=True):
        assert_close(g, g_ref, dtype=jnp.float32, grad=True, what=f"masked NaN d{name}")


# ---- bytes per hop ----


def _ppermute_bytes(jaxpr) -> int:
    """Bytes all executed ``ppermute``s send per device (a ``scan`` body times its length)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            total += sum(int(np.prod(x.aval.shape)) * x.aval.dtype.itemsize for x in eqn.invars)
        subs = []
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(item, "jaxpr", item)
                if hasattr(sub, "eqns"):
                    subs.append(sub)
        inner = sum(_ppermute_bytes(sub) for sub in subs)
        if eqn.primitive.name == "scan":
            inner *= eqn.params["length"]
        elif eqn.primitive.name == "cond":
            inner = max((_ppermute_bytes(sub) for sub in subs), default=0)
        else:
            assert eqn.primitive.name != "while" or inner == 0
        total += inner
    return total


@pytest.mark.parametrize(
    "hop_format,dtype,layout,segments",
    [
        (None, "float32", "contiguous", False),
        ("int8", "float32", "zigzag", True),
        ("fp8", "bfloat16", "contiguous", False),
        ("int8", "bfloat16", "striped", False),
    ],
)
def test_hop_bytes_is_what_travels(hop_format, dtype, layout, segments):
    """``hop_bytes`` equals the operand bytes of the ring's ``ppermute``s, forward (n - 1
    hops) and forward + backward (n - 1 more hops, and the dK/dV shift home)."""
    n, N, K, S = 4, 4, 2, 12  # S = 12 with blocks of 8: the kernel pads the keys to 16
    mesh = make_test_mesh((n,), ("seq",))
    sizes = BlockSizes(block_q=8, block_kv=8)
    per_shard = functools.partial(
        ring_attention_per_shard,
        seq_axis="seq",
        layout=layout,
        causal=True,
        block_sizes=sizes,
        hop_format=hop_format,
    )

    def body(q, k, v, seg):
        ids = SegmentIds(seg, seg) if segments else None
        kw = {}
        if layout != "contiguous":  # a permuted layout needs its positions (issue 29 item 2)
            mine = shard_positions(layout, jax.lax.axis_index("seq"), n, q.shape[1])
            mine = jnp.broadcast_to(mine, q.shape[:2])
            kw = dict(positions=Positions(mine, mine))
        return per_shard(q, k, v, segment_ids=ids, **kw).out

    f = jax.shard_map(
        body, mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"), check_vma=True
    )
    grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
    q = jax.ShapeDtypeStruct((B, n * S, N, H), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((B, n * S, K, H), jnp.dtype(dtype))
    seg = jax.ShapeDtypeStruct((B, n * S), jnp.int32)
    common = dict(hop_format=hop_format, layout=layout, block_sizes=sizes, segment_ids=segments)
    fwd_hop = hop_bytes(B, S, K, H, dtype, **common)
    bwd_hop = hop_bytes(B, S, K, H, dtype, backward=True, **common)
    assert _ppermute_bytes(jax.make_jaxpr(f)(q, kv, kv, seg).jaxpr) == (n - 1) * fwd_hop
    Sp = S if layout == "zigzag" else 16  # zigzag clamps the key block to S / 2 = 6
    dkv_home = B * K * Sp * 2 * H * 4
    expected = (n - 1) * (fwd_hop + bwd_hop) + dkv_home
    assert _ppermute_bytes(jax.make_jaxpr(grad)(q, kv, kv, seg).jaxpr) == expected


def test_hop_bytes_ratios():
    """At H = 128 an int8/fp8 hop's K/V are (128 + 4) / (128 * 4) of float32, / (128 * 2) of
    bfloat16 (the int32 positions travel in every format)."""
    positions = 1 * 4096 * 4
    f32, bf16 = (hop_bytes(1, 4096, 8, 128, dtype) - positions for dtype in ("float32", "bfloat16"))
    for fmt in HOP_FORMATS:
        quant = hop_bytes(1, 4096, 8, 128, "float32", hop_format=fmt) - positions
        assert quant * 128 * 4 == f32 * (128 + 4)
        assert quant * 128 * 2 == bf16 * (128 + 4)
    assert hop_bytes(0, 0, 8, 128, "float32") == 0


# ---- errors ----


@pytest.mark.no_typecheck
def test_hop_format_errors():
    q = jnp.zeros((1, 8, 4, 8))
    kv = jnp.zeros((1, 8, 2, 8))
    mesh = make_test_mesh((2,), ("seq",))
    for bad in ("int4", "INT8", 8, ("int8",)):
        with pytest.raises(ValueError, match=r"sharded_attention: hop_format: expected None or"):
            sharded_attention(q, kv, kv, mesh=mesh, seq_axis="seq", hop_format=bad)
        f = jax.shard_map(
            lambda q, k, v, bad=bad: (
                ring_attention_per_shard(q, k, v, seq_axis="seq", hop_format=bad).out
            ),
            mesh=mesh,
            in_specs=P(None, "seq"),
            out_specs=P(None, "seq"),
        )
        with pytest.raises(ValueError, match=r"ring_attention_per_shard: hop_format: expected"):
            jax.jit(f).lower(q, kv, kv)
        with pytest.raises(ValueError, match=r"hop_bytes: hop_format: expected None or one of"):
            hop_bytes(1, 8, 2, 8, "float32", hop_format=bad)
    for strategy in ("allgather", "ulysses"):
        with pytest.raises(NotImplementedError, match=r"hop_format: quantized hops are for"):
            sharded_attention(
                q, kv, kv, mesh=mesh, seq_axis="seq", strategy=strategy, hop_format="int8"
            )
    with pytest.raises(ValueError, match=r"hop_bytes: kv_len: expected an int >= 0, got -1"):
        hop_bytes(1, -1, 2, 8, "float32")
    with pytest.raises(ValueError, match=r"hop_bytes: layout: expected one of"):
        hop_bytes(1, 8, 2, 8, "float32", layout="spiral")
    with pytest.raises(ValueError, match=r"hop_bytes: block_sizes: expected a ringattn\."):
        hop_bytes(1, 8, 2, 8, "float32", block_sizes=(4, 4))
