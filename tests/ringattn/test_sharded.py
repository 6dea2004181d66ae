"""sharded_attention: every strategy against the dense reference, forward and gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ringattn import (
    BlockSizes,
    Positions,
    SegmentIds,
    attention_reference,
    from_layout,
    sharded_attention,
    to_layout,
)
from tests._util import assert_close, count_executed, make_test_mesh


@dataclasses.dataclass(frozen=True)
class Case:
    strategy: str
    mesh_shape: tuple[int, ...]
    names: tuple[str, ...]
    seq_axis: str | tuple[str, str]
    layout: str = "contiguous"
    causal: bool = False
    N: int = 4
    K: int = 2
    segments: bool = False
    window: int | None = None
    dtype: str = "float32"
    batch_axis: str | None = None
    head_axis: str | None = None
    axis_type: AxisType = AxisType.Auto
    block: int | None = None  # small blocks exercise the kernel's block skipping
    positions: bool = False  # explicit positions with gaps (2 * arange + 3)

    @property
    def layout_shards(self) -> int:
        ring = self.seq_axis[1] if self.strategy == "usp" else self.seq_axis
        return self.mesh_shape[self.names.index(ring)]


# Few compiles, everything covered: each strategy on meshes of 1, 2, 4 and 8 devices, every
# layout, causal or not, MHA / GQA / MQA, segment ids, windows, float32 and bfloat16, batch and
# head axes, Auto and Explicit axes, and the Ulysses kv-head repetition (K % n != 0).
CASES = {
    "ring-8-zigzag-causal-gqa": Case("ring", (8,), ("s",), "s", "zigzag", causal=True),
    "ring-2-segments-window-mqa-bf16": Case(
        "ring",
        (2,),
        ("s",),
        "s",
        K=1,
        segments=True,
        window=9,
        dtype="bfloat16",
        block=8,
        positions=True,
    ),
    "allgather-4-striped-causal-window-segments-mha": Case(
        "allgather",
        (4,),
        ("s",),
        "s",
        "striped",
        causal=True,
        K=4,
        segments=True,
        window=7,
        positions=True,
    ),
    "allgather-1-zigzag-causal-bf16": Case(
        "allgather", (1,), ("s",), "s", "zigzag", causal=True, dtype="bfloat16"
    ),
    "ulysses-2-zigzag-segments-bf16": Case(
        "ulysses", (2,), ("s",), "s", "zigzag", segments=True, dtype="bfloat16"
    ),
    "ulysses-4-striped-causal-window-repeat": Case(
        "ulysses", (4,), ("s",), "s", "striped", causal=True, window=5, block=8, positions=True
    ),
    "usp-2x2-zigzag-causal": Case("usp", (2, 2), ("u", "r"), ("u", "r"), "zigzag", causal=True),
    "usp-2x4-striped-segments-window-bf16": Case(
        "usp",
        (2, 4),
        ("u", "r"),
        ("u", "r"),
        "striped",
        segments=True,
        window=9,
        dtype="bfloat16",
        positions=True,
    ),
    "allgather-seq-model": Case(
        "allgather", (4, 2), ("seq", "model"), "seq", "striped", causal=True, head_axis="model"
    ),
    "ring-explicit-data-seq": Case(
        "ring",
        (2, 4),
        ("data", "seq"),
        "seq",
        "zigzag",
        causal=True,
        batch_axis="data",
        axis_type=AxisType.Explicit,
    ),
    "ulysses-explicit-seq-model-repeat": Case(
        "ulysses",
        (4, 2),
        ("seq", "model"),
        "seq",
        "zigzag",
        causal=True,
        N=8,
        K=2,
        head_axis="model",
        axis_type=AxisType.Explicit,
    ),
}

B, T, H = 2, 32, 8


def make_inputs(N, K, segments, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.standard_normal((B, T, heads, H), np.float32)) for heads in (N, K, K)
    )
    seg = None
    if segments:  # packed documents with different boundaries per row
        bounds = np.array([[9, 20], [3, 27]])
        seg = jnp.asarray(
            np.sum(np.arange(T)[None, :, None] >= bounds[:, None, :], axis=-1), jnp.int32
        )
    cast = lambda x: x.astype(jnp.dtype(dtype))
    return cast(q), cast(k), cast(v), seg


def make_positions(c: Case):
    if c.positions:
        return jnp.broadcast_to(2 * jnp.arange(T, dtype=jnp.int32) + 3, (B, T))
    if c.layout != "contiguous" and (c.causal or c.window is not None):
        # A permuted layout under a positional mask needs them (issue 29 item 2).
        return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return None


def run_case(c: Case, q, k, v, seg):
    """Forward (out, lse) and gradients of the sharded path, in the un-permuted order."""
    mesh = make_test_mesh(c.mesh_shape, c.names, axis_type=c.axis_type)
    n = c.layout_shards
    perm = lambda x: None if x is None else to_layout(x, c.layout, num_shards=n)
    unperm = lambda x: from_layout(x, c.layout, num_shards=n)
    block_sizes = None if c.block is None else BlockSizes(c.block, c.block)

    def f(q, k, v):
        out, lse = sharded_attention(
            perm(q),
            perm(k),
            perm(v),
            mesh=mesh,
            seq_axis=c.seq_axis,
            strategy=c.strategy,
            layout=c.layout,
            batch_axis=c.batch_axis,
            head_axis=c.head_axis,
            causal=c.causal,
            segment_ids=None if seg is None else SegmentIds(perm(seg), perm(seg)),
            positions=Positions(perm(make_positions(c)), perm(make_positions(c))),
            window=c.window,
            block_sizes=block_sizes,
        )
        return unperm(out), unperm(lse)

    return jax.jit(forward_and_grads(f))(q, k, v)


def forward_and_grads(f):
    def run(q, k, v):
        (out, lse), vjp = jax.vjp(lambda *a: tuple(f(*a)), q, k, v)
        # cotangents on out and lse: the lse path of the backward is checked too
        dout = jnp.cos(out.astype(jnp.float32)).astype(out.dtype)
        return out, lse, vjp((dout, 0.1 * jnp.sin(lse)))

    return run


def reference(c: Case, q, k, v, seg):
    f32 = lambda x: x.astype(jnp.float32)

    def f(q, k, v):
        return attention_reference(
            q,
            k,
            v,
            causal=c.causal,
            segment_ids=None if seg is None else SegmentIds(seg, seg),
            positions=Positions(make_positions(c), make_positions(c)),
            window=c.window,
        )

    return jax.jit(forward_and_grads(f))(f32(q), f32(k), f32(v))


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    c = CASES[name]
    q, k, v, seg = make_inputs(c.N, c.K, c.segments, c.dtype)
    out, lse, grads = run_case(c, q, k, v, seg)
    ref_out, ref_lse, ref_grads = reference(c, q, k, v, seg)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_close(out, ref_out, dtype=c.dtype, what=f"{name} out")
    assert_close(lse, ref_lse, dtype=c.dtype, what=f"{name} lse")
    for g_name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert g.dtype == q.dtype
        assert_close(g, r, dtype=c.dtype, grad=True, what=f"{name} d{g_name}")


def test_explicit_mesh_eager_with_other_sharding():
    """Explicit axes: eager call on inputs sharded along the wrong axis, and uncommitted."""
    mesh = make_test_mesh((2, 4), ("data", "seq"), axis_type=AxisType.Explicit)
    q, k, v, _ = make_inputs(4, 2, False, "float32", seed=1)
    wrong = NamedSharding(mesh, P(None, None, None, "seq"))  # head dim on the sequence axis
    qs, ks, vs = (jax.device_put(x, wrong) for x in (q, k, v))
    ref = attention_reference(q, k, v, causal=True).out
    out = sharded_attention(
        qs, ks, vs, mesh=mesh, seq_axis="seq", strategy="allgather", causal=True
    ).out
    assert out.sharding.spec == P(None, "seq", None, None)
    assert_close(out, ref, dtype=jnp.float32, what="explicit eager, resharded")
    out = sharded_attention(q, k, v, mesh=mesh, seq_axis="seq", batch_axis="data", causal=True).out
    assert out.sharding.spec == P("data", "seq", None, None)
    assert_close(out, ref, dtype=jnp.float32, what="explicit eager uncommitted")


WINDOW = 6  # 8 shards of T / 8 = 4 tokens: hops 1 and 2 reach the window, 3 .. 7 do not
WINDOW_HOPS = 2
ARANGE = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
GAPPED = 2 * ARANGE + 3


_SLOW = pytest.mark.slow  # the default suite keeps one case per axis type


@pytest.mark.parametrize(
    "axis_type", [AxisType.Explicit, pytest.param(AxisType.Auto, marks=_SLOW)]
)  # fmt: skip
@pytest.mark.parametrize(
    "kind,hops",
    [
        pytest.param("default", WINDOW_HOPS, marks=_SLOW),  # no positions: the ring prunes
        ("arange", WINDOW_HOPS),  # given (numpy), concrete and equal to the default: pruned
        pytest.param("arange-jax", WINDOW_HOPS, marks=_SLOW),  # the same as a jax.Array
        pytest.param("arange-traced", 7, marks=_SLOW),  # traced: unreadable, every hop runs
        ("gapped", 1),  # 2 p + 3: shards span 8 positions, only hop 1 reaches the window
        pytest.param("offset", WINDOW_HOPS, marks=_SLOW),  # p + 1000: the default's ranges
        pytest.param("slow-row", 3, marks=_SLOW),  # row 1 at p // 2: its window spans 3 hops
    ],
)
def test_window_prunes_hops(axis_type, kind, hops):
    """Causal + window + contiguous ring: the hops run (forward ``h``; gradient ``3 h + 1``:
    the forward again, the backward's K/V and dK/dV hops and one shift home) and the result,
    forward and gradients, against the float32 reference."""
    slow_row = ARANGE.copy()
    slow_row[1] = ARANGE[1] // 2  # two tokens per position: shards span 2 positions
    given = {
        "default": None,
        "gapped": GAPPED,
        "arange-jax": jnp.asarray(ARANGE),
        "offset": ARANGE + 1000,
        "slow-row": slow_row,
    }.get(kind, ARANGE)
    traced = kind == "arange-traced"
    mesh = make_test_mesh((8,), ("s",), axis_type=axis_type)
    q, k, v, _ = make_inputs(4, 2, False, "float32", seed=2)
    expected_pos = ARANGE if given is None else given

    def f(q, k, v, pos):
        return sharded_attention(
            q,
            k,
            v,
            mesh=mesh,
            seq_axis="s",
            causal=True,
            window=WINDOW,
            positions=None if pos is None else Positions(pos, pos),
        )

    def run(q, k, v, *pos):
        closed = lambda q, k, v: f(q, k, v, pos[0] if traced else given)
        return forward_and_grads(closed)(q, k, v)

    args = (q, k, v) + ((given,) if traced else ())
    fwd = jax.make_jaxpr(lambda *a: f(*a[:3], a[3] if traced else given))(*args).jaxpr
    full = jax.make_jaxpr(run)(*args).jaxpr
    assert count_executed(fwd, "ppermute") == hops
    assert count_executed(full, "ppermute") == 3 * hops + 1
    out, lse, grads = jax.jit(run)(*args)

    def ref(q, k, v):
        pos = Positions(expected_pos, expected_pos)
        return attention_reference(q, k, v, causal=True, window=WINDOW, positions=pos)

    ref_out, ref_lse, ref_grads = forward_and_grads(ref)(q, k, v)
    assert_close(out, ref_out, dtype=jnp.float32, what="out")
    assert_close(lse, ref_lse, dtype=jnp.float32, what="lse")
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert_close(g, r, dtype=jnp.float32, grad=True, what=f"d{name}")


def _visible_hops(q_pos, kv_pos, n, causal, window):
    """Brute force: the hops ``t`` at which some query meets a visible key of shard ``d - t``."""
    qp, kp = (np.asarray(x).reshape(x.shape[0], n, -1) for x in (q_pos, kv_pos))
    hops = set()
    for t in range(1, n):
        for d in range(n):
            qq = qp[:, d, :, None].astype(np.int64)
            kk = kp[:, (d - t) % n, None, :].astype(np.int64)
            ok = np.ones(np.broadcast_shapes(qq.shape, kk.shape), bool)
            if causal:
                ok &= kk <= qq
            if window is not None:
                ok &= kk > qq - window
            if ok.any():
                hops.add(t)
    return max(hops, default=0)


@pytest.mark.parametrize(
    "seed,strategy,causal,window",
    [
        (0, "ring", True, 5),
        pytest.param(1, "ring", False, 7, marks=_SLOW),
        pytest.param(2, "usp", True, 9, marks=_SLOW),
        pytest.param(3, "ring", True, None, marks=_SLOW),
        pytest.param(4, "usp", False, 3, marks=_SLOW),
    ],
)
def test_hops_from_random_positions(seed, strategy, causal, window):
    """Concrete random positions (random gaps, row 1 shuffled within each shard): the ring
    keeps every hop that holds a visible key (brute force over all pairs), and the result,
    forward and gradients, matches the float32 reference at those positions."""
    rng = np.random.default_rng(seed)
    n_ring = 4 if strategy == "usp" else 8
    mesh = (
        make_test_mesh((2, 4), ("u", "r"))
        if strategy == "usp"
        else make_test_mesh((8,), ("s",), axis_type=AxisType.Explicit)
    )
    seq_axis = ("u", "r") if strategy == "usp" else "s"
    q, k, v, _ = make_inputs(4, 2, False, "float32", seed=seed)
    pos = np.cumsum(rng.integers(1, 4, size=(B, T)), axis=1).astype(np.int32)
    chunks = pos[1].reshape(n_ring, -1)  # row 1: no order inside each ring shard
    pos[1] = rng.permuted(chunks, axis=1).reshape(-1)
    positions = Positions(pos, pos)
    f = lambda q, k, v: sharded_attention(
        q, k, v, mesh=mesh, seq_axis=seq_axis, strategy=strategy, causal=causal,
        window=window, positions=positions,
    )  # fmt: skip
    hops = count_executed(jax.make_jaxpr(f)(q, k, v).jaxpr, "ppermute")
    assert _visible_hops(pos, pos, n_ring, causal, window) <= hops <= n_ring - 1
    assert hops < n_ring - 1 or window is None or not causal, hops  # the window prunes
    out, lse, grads = jax.jit(forward_and_grads(f))(q, k, v)
    ref = lambda q, k, v: attention_reference(
        q, k, v, causal=causal, window=window, positions=positions
    )
    ref_out, ref_lse, ref_grads = forward_and_grads(ref)(q, k, v)
    assert_close(out, ref_out, dtype=jnp.float32, what="out")
    assert_close(lse, ref_lse, dtype=jnp.float32, what="lse")
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert_close(g, r, dtype=jnp.float32, grad=True, what=f"d{name}")


def _lowered_text(strategy):
    mesh = make_test_mesh((4,), ("s",))
    q, k, v, _ = make_inputs(4, 2, False, "float32")
    f = lambda q, k, v: sharded_attention(
        q, k, v, mesh=mesh, seq_axis="s", strategy=strategy, causal=True
    )
    return jax.jit(f).lower(q, k, v).as_text()


def test_allgather_structure():
    text = _lowered_text("allgather")
    assert "all_gather" in text
    assert "collective_permute" not in text
    assert "all_to_all" not in text


def test_ulysses_structure():
    text = _lowered_text("ulysses")
    assert "all_to_all" in text
    assert "collective_permute" not in text


# ---- errors ----


def _call(q=None, k=None, v=None, **kw):
    q0, k0, v0, _ = make_inputs(4, 2, False, "float32")
    kw.setdefault("mesh", make_test_mesh((4,), ("s",)))
    kw.setdefault("seq_axis", "s")
    return sharded_attention(
        q0 if q is None else q, k0 if k is None else k, v0 if v is None else v, **kw
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(strategy="tree"), "strategy: expected one of .* got 'tree'"),
        (dict(layout="spiral"), "layout: expected one of .* got 'spiral'"),
        (dict(seq_axis="x"), "seq_axis: expected an axis of the mesh .* got 'x'"),
        (dict(batch_axis="data"), "batch_axis: expected an axis of the mesh .* got 'data'"),
        (dict(head_axis="s"), "expected distinct mesh axes"),
        (dict(mesh="not a mesh"), r"mesh: expected a jax\.sharding\.Mesh"),
        (dict(strategy="usp"), r"seq_axis: expected \(ulysses_axis, ring_axis\)"),
        (dict(seq_axis=("s",)), "seq_axis: expected one mesh axis name"),
        (dict(block_sizes=(8, 8)), r"block_sizes: expected a ringattn\.BlockSizes"),
        (dict(window=0), "window: expected an int >= 1"),
        (dict(segment_ids=jnp.zeros((B, T), jnp.int32)), r"segment_ids: expected a ringattn\."),
        (
            dict(positions=Positions(jnp.zeros((B, T - 1), jnp.int32), None)),
            r"positions\.q: expected shape \(2, 32\)",
        ),
        (
            dict(
                segment_ids=SegmentIds(
                    jnp.zeros((B, T), jnp.float32), jnp.zeros((B, T), jnp.int32)
                ),
            ),
            r"segment_ids\.q: expected an integer array",
        ),
    ],
)
@pytest.mark.no_typecheck
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _call(**kwargs)


@pytest.mark.no_typecheck
def test_bad_shapes():
    q, k, v, _ = make_inputs(4, 2, False, "float32")
    with pytest.raises(ValueError, match="v: expected the shape of k"):
        _call(v=v[:, :16])
    with pytest.raises(ValueError, match="a positive multiple of kv heads"):
        _call(k=k[:, :, :1].repeat(3, axis=2), v=v[:, :, :1].repeat(3, axis=2))
    with pytest.raises(ValueError, match=r"q: expected a sequence length divisible by 4 .* T=30"):
        _call(q=q[:, :30])
    with pytest.raises(ValueError, match=r"k: expected .* for layout 'zigzag', got S=12"):
        _call(k=k[:, :12], v=v[:, :12], layout="zigzag")
    mesh = make_test_mesh((2, 4), ("data", "seq"))
    with pytest.raises(ValueError, match=r"q: expected a batch divisible by the size 2 .* B=3"):
        _call(
            q=q[:1].repeat(3, 0),
            k=k[:1].repeat(3, 0),
            v=v[:1].repeat(3, 0),
            mesh=mesh,
            seq_axis="seq",
            batch_axis="data",
        )
    mesh = make_test_mesh((2, 4), ("seq", "model"))
    with pytest.raises(ValueError, match=r"divisible by the size 4 of head_axis .* K=2"):
        _call(mesh=mesh, seq_axis="seq", head_axis="model")


def test_ulysses_heads_not_divisible():
    mesh = make_test_mesh((8,), ("s",))
    with pytest.raises(ValueError, match=r"divisible by the Ulysses degree 8 .* N=4"):
        _call(mesh=mesh, strategy="ulysses")
    mesh = make_test_mesh((8, 1), ("u", "r"))
    with pytest.raises(ValueError, match="Ulysses degree 8 of strategy 'usp'"):
        _call(mesh=mesh, seq_axis=("u", "r"), strategy="usp")
