"""Ring attention per shard against the dense float32 reference on the global sequence.

Every case builds global ``q, k, v`` (and segment ids), permutes them with ``to_layout``,
runs ``ring_attention_per_shard`` under ``jax.shard_map(check_vma=True)`` inside ``jit``,
un-permutes, and compares the output, the log-sum-exp and the gradients of a scalar loss
(which also flows through ``lse``) with ``attention_reference``. One ``jit`` per case computes
the output and all gradients, to keep compiles few.
"""

import dataclasses
import functools
import zlib

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
    ring_attention_per_shard,
    shard_positions,
    to_layout,
)
from ringattn._blocks import MaskIds, Summaries
from ringattn._heads_major import make_kernel_config
from ringattn._ring_hops import _layout_block_sizes
from tests._util import assert_close, count_executed, make_test_mesh

LOCAL = 8  # tokens per shard; blocks of 4 give several blocks per shard and per zigzag chunk
BLOCKS = BlockSizes(block_q=4, block_kv=4)


@dataclasses.dataclass(frozen=True)
class Case:
    n: int
    layout: str = "contiguous"
    causal: bool = True
    dtype: str = "float32"
    heads: tuple[int, int] = (4, 2)  # (N, K)
    segments: bool = False
    window: int | None = None
    softcap: float | None = None
    lse: bool = True
    positions: bool = False  # pass the global positions explicitly instead of the defaults
    local: int = LOCAL  # tokens per shard

    def __str__(self):
        parts = [f"n{self.n}", self.layout, "causal" if self.causal else "full", self.dtype]
        parts.append(f"N{self.heads[0]}K{self.heads[1]}")
        parts += ["seg"] * self.segments + [f"w{self.window}"] * (self.window is not None)
        parts += [f"cap{self.softcap}"] * (self.softcap is not None)
        parts += ["nolse"] * (not self.lse) + ["pos"] * self.positions
        parts += [f"local{self.local}"] * (self.local != LOCAL)
        return "-".join(parts)


CASES = [
    # Layout x causal on n = 4, each carrying some of the other options.
    Case(4, "contiguous", window=6, softcap=5.0),  # window hop skipping: 1 of 3 hops
    Case(4, "contiguous", causal=False, heads=(4, 1), segments=True),
    Case(4, "zigzag", heads=(8, 2), segments=True, dtype="bfloat16"),
    Case(4, "zigzag", causal=False, softcap=2.0, window=7),
    Case(4, "striped", heads=(4, 1), window=5, lse=False),
    Case(4, "striped", causal=False, positions=True),
    # A diagonal over the other mesh sizes.
    Case(2, "contiguous", segments=True, heads=(4, 1), softcap=3.0),
    Case(2, "striped", causal=False, dtype="bfloat16", window=9, lse=False),
    Case(2, "zigzag", window=3, positions=True),
    Case(8, "zigzag", heads=(8, 2), softcap=4.0),
    Case(8, "contiguous", window=11, heads=(4, 1), segments=True),  # 2 of 7 hops
    Case(1, "zigzag", segments=True, window=4, softcap=2.0),
    Case(1, "contiguous", causal=False, heads=(8, 2), dtype="bfloat16", lse=False),
]


def _inputs(case: Case, batch: int = 2):
    """Global ``q, k, v`` (in the case's dtype), cotangents and segment ids, from numpy."""
    N, K = case.heads
    L = case.n * case.local
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    dtype = jnp.dtype(case.dtype)
    q = jnp.asarray(normal(batch, L, N, 8), dtype)
    k = jnp.asarray(normal(batch, L, K, 8), dtype)
    v = jnp.asarray(normal(batch, L, K, 8), dtype)
    dout, dlse = jnp.asarray(normal(batch, L, N, 8)), jnp.asarray(normal(batch, L, N))
    seg = None
    if case.segments:  # packed documents: nondecreasing ids with a few random breaks per row
        breaks = rng.random((batch, L)) < 0.15
        breaks[:, 0] = False
        seg = jnp.asarray(np.cumsum(breaks, axis=1), jnp.int32)
    return q, k, v, seg, dout, dlse


def _mask_kwargs(case: Case):
    return dict(causal=bool(case.causal), window=case.window, softcap=case.softcap)


def _value_and_grad(attend, dout, dlse, with_lse: bool):
    """Outputs and gradients of a scalar loss through ``out`` (and ``lse``, empty rows out)."""

    def loss(q, k, v):
        if with_lse:
            out, lse = attend(q, k, v)
            finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
            total = jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(finite * dlse)
            return total, (out, lse)
        out = attend(q, k, v).out
        return jnp.sum(out.astype(jnp.float32) * dout), (out, None)

    def run(q, k, v):
        (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, lse, grads

    return run


def _ring_attend(case: Case, mesh, specs, seg, q_seg):
    """Global (natural order) -> to_layout -> ring per shard -> from_layout, for ``jit``."""
    n, explicit = case.n, AxisType.Explicit in mesh.axis_types
    to = functools.partial(to_layout, layout=case.layout, num_shards=n)
    back = functools.partial(from_layout, layout=case.layout, num_shards=n)
    per_shard = functools.partial(
        ring_attention_per_shard,
        seq_axis="seq",
        layout=case.layout,
        block_sizes=BLOCKS,
        **_mask_kwargs(case),
    )

    def body(q, k, v, *ids):
        kw = {}
        if seg is not None:
            kw.update(segment_ids=SegmentIds(ids[0], ids[1]))
            ids = ids[2:]
        if ids:
            kw.update(positions=Positions(ids[0], ids[1]))
        return tuple(per_shard(q, k, v, **kw))

    q_spec, kv_spec, id_spec = specs
    # A permuted layout under a positional mask needs the positions (issue 29 item 2).
    with_positions = case.positions or (
        case.layout != "contiguous" and (case.causal or case.window is not None)
    )
    n_ids = (2 if seg is not None else 0) + (2 if with_positions else 0)
    in_specs = (q_spec, kv_spec, kv_spec) + (id_spec,) * n_ids
    out_specs = (q_spec, q_spec)
    sharded = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)

    def attend(q, k, v):
        ids = () if seg is None else (q_seg, seg)
        if with_positions:
            B, L = q.shape[:2]
            pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
            ids += (pos, pos)
        args = [to(x) for x in (q, k, v, *ids)]
        if explicit:  # shard_map on Explicit axes wants inputs sharded as in_specs say
            args = [
                jax.sharding.reshard(x, NamedSharding(mesh, spec))
                for x, spec in zip(args, in_specs, strict=True)
            ]
        outs = sharded(*args)
        if explicit:
            outs = [jax.sharding.reshard(x, NamedSharding(mesh, P())) for x in outs]
        return AttentionOutput(*(back(x) for x in outs))

    return attend


def _run(case: Case, mesh, specs, q, k, v, seg, dout, dlse, *, q_seg=None):
    """``(ring, reference)``, each ``(out, lse, (dq, dk, dv))``, from one ``jit``.

    ``specs``: the ``PartitionSpec`` of ``q`` (also of ``out``, ``lse``), of ``k, v`` and
    of the ``[B, L]`` ids, or one spec for all.
    """
    specs = specs if isinstance(specs, tuple) else (specs,) * 3
    q_seg = seg if q_seg is None else q_seg
    ring = _value_and_grad(_ring_attend(case, mesh, specs, seg, q_seg), dout, dlse, case.lse)
    reference = functools.partial(
        attention_reference,
        segment_ids=None if seg is None else SegmentIds(q_seg, seg),
        **_mask_kwargs(case),
    )
    reference = _value_and_grad(reference, dout, dlse, case.lse)
    f32 = lambda x: x.astype(jnp.float32)
    both = jax.jit(lambda q, k, v: (ring(q, k, v), reference(f32(q), f32(k), f32(v))))
    return both(q, k, v)


def _compare(case: Case, ring, ref):
    (out, lse, grads), (out_r, lse_r, grads_r) = ring, ref
    dtype = jnp.dtype(case.dtype)
    assert out.dtype == dtype
    assert_close(out, out_r, dtype=dtype, what=f"{case} out")
    if case.lse:
        assert lse.dtype == jnp.float32
        assert_close(lse, lse_r, dtype=dtype, what=f"{case} lse")
    for name, g, g_r in zip("qkv", grads, grads_r, strict=True):
        assert g.dtype == dtype
        assert_close(g, g_r, dtype=dtype, grad=True, what=f"{case} d{name}")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_ring_matches_reference(case: Case):
    mesh = make_test_mesh((case.n,), ("seq",))
    _compare(case, *_run(case, mesh, P(None, "seq"), *_inputs(case)))


# 32 query blocks per shard, so the forward stacks them in pairs on every hop. With
# block_kv == block_q a key block next to the diagonal is full for one block of a pair and
# partial for the other: sharing it (`any` for `all` in the rule) fails every case here.
GROUPED_CASES = [
    (Case(4, "zigzag", local=128), AxisType.Explicit),
    (Case(4, "zigzag", window=37, local=128), AxisType.Auto),
    (Case(4, "contiguous", local=128), AxisType.Auto),
    (Case(4, "contiguous", causal=False, segments=True, local=128), AxisType.Explicit),
]


@pytest.mark.parametrize(("case", "axis_type"), GROUPED_CASES, ids=str)
def test_ring_hops_with_query_groups_match_reference(case: Case, axis_type):
    """A state carried over the hops in the query groups' row order, on either axis type."""
    from ringattn._kernels_forward import query_group

    assert query_group(case.local // BLOCKS.block_q) == 2
    mesh = make_test_mesh((case.n,), ("seq",), axis_type=axis_type)
    _compare(case, *_run(case, mesh, P(None, "seq"), *_inputs(case)))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_ring_data_and_seq_mesh(axis_type):
    """Batch sharded on 'data', sequence on 'seq': the ring only communicates over 'seq'."""
    case = Case(4, "zigzag", heads=(8, 2), segments=True, window=6, dtype="bfloat16")
    if axis_type == AxisType.Explicit:
        case = Case(4, "striped", heads=(4, 2), softcap=3.0)
    mesh = make_test_mesh((2, 4), ("data", "seq"), axis_type=axis_type)
    _compare(case, *_run(case, mesh, P("data", "seq"), *_inputs(case, batch=4)))


def test_ring_model_and_seq_mesh():
    """Query heads sharded on 'model', one kv head replicated over it (MQA): the kv gradient
    sums over 'model' and the ring runs over 'seq'."""
    case = Case(4, "zigzag", heads=(4, 1), segments=True)
    mesh = make_test_mesh((2, 4), ("model", "seq"))
    specs = (P(None, "seq", "model"), P(None, "seq"), P(None, "seq"))
    _compare(case, *_run(case, mesh, specs, *_inputs(case)))


def test_ring_fully_masked_rows_are_zero():
    """Queries whose segment id no key has: zero output, -inf lse, finite exact gradients."""
    case = Case(2, "zigzag", segments=True)
    mesh = make_test_mesh((2,), ("seq",))
    q, k, v, seg, dout, dlse = _inputs(case)
    lonely = np.zeros(seg.shape, bool)
    lonely[:, ::5] = True
    q_seg = jnp.where(lonely, 99, seg)
    ring, ref = _run(case, mesh, P(None, "seq"), q, k, v, seg, dout, dlse, q_seg=q_seg)
    out, lse, grads = ring
    assert np.all(np.asarray(out)[lonely] == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[lonely]))
    assert np.all(np.isfinite(np.asarray(lse)[~lonely]))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
    # assert_close rejects non-finite values: compare lse on the rows that see keys only.
    ring = (out, jnp.where(lonely[..., None], 0.0, lse), grads)
    ref = (ref[0], jnp.where(lonely[..., None], 0.0, ref[1]), ref[2])
    _compare(case, ring, ref)


# ---- work per device and hop ----


def _live_block_pairs(layout: str, n: int, local: int, sizes=None) -> np.ndarray:
    """``[device, hop]`` (query block, key block) pairs the kernel computes, causal mask.

    Uses the ring's block sizes for the layout and the kernel's own block classification.
    """
    sizes = _layout_block_sizes(sizes or BlockSizes(), layout, local, local)
    cfg, _, _ = make_kernel_config(
        MaskSpec(causal=True), 8, local, local, sizes.block_q, sizes.block_kv
    )
    block = cfg.block_q
    rows, cols = np.meshgrid(np.arange(local // block), np.arange(local // block))
    live = np.zeros((n, n), int)
    for i in range(n):
        for t in range(n):
            q_pos = shard_positions(layout, i, n, local)[None]
            kv_pos = shard_positions(layout, (i - t) % n, n, local)[None]
            summaries = Summaries(MaskIds(q_pos, kv_pos), block, block, None)
            live[i, t] = int(np.sum(np.asarray(summaries.kind(cfg, rows, cols)) != 0))
    return live


def test_zigzag_hops_compute_half_the_blocks():
    """Zigzag: the local hop computes 3 of 4 chunk pairs, every other hop 2 of 4, on every
    device; contiguous: device i computes i + 1 hops of its blocks, the rest are skipped."""
    n, local = 4, 16
    zigzag = _live_block_pairs("zigzag", n, local)
    assert zigzag.tolist() == [[3] + [2] * (n - 1)] * n
    contiguous = _live_block_pairs("contiguous", n, local)
    assert [int(np.sum(row > 0)) for row in contiguous] == [1, 2, 3, 4]
    striped = _live_block_pairs("striped", n, local, BLOCKS)  # 4 x 4 blocks of 4 tokens
    assert striped.tolist() == [[10] * n] * n  # the causal triangle of blocks, every hop


# ---- structure of the compiled program ----


def _program(n: int, *, grad: bool = False, **kwargs):
    """``(jaxpr, lowered StableHLO text)`` of the sharded ring (or its gradient) on ``n``."""
    mesh = make_test_mesh((n,), ("seq",))
    per_shard = functools.partial(
        ring_attention_per_shard, seq_axis="seq", block_sizes=BLOCKS, **kwargs
    )
    layout = kwargs.get("layout", "contiguous")

    def body(q, k, v):
        kw = {}
        if layout != "contiguous":  # a permuted layout needs its positions (issue 29 item 2)
            mine = shard_positions(layout, jax.lax.axis_index("seq"), n, q.shape[1])[None]
            kw = dict(positions=Positions(mine, mine))
        return per_shard(q, k, v, **kw).out

    sharded = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=P(None, "seq"),
        out_specs=P(None, "seq"),
        check_vma=True,
    )
    f = sharded
    if grad:
        f = jax.grad(lambda q, k, v: jnp.sum(sharded(q, k, v)), argnums=(0, 1, 2))
    L = n * LOCAL
    q = jax.ShapeDtypeStruct((1, L, 8, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, L, 2, 8), jnp.float32)
    return jax.make_jaxpr(f)(q, kv, kv).jaxpr, jax.jit(f).lower(q, kv, kv).as_text()


def _count(text: str, op: str) -> int:
    """Occurrences of ``op`` in the program text (a loop body counts once)."""
    return text.count(f"stablehlo.{op}")


def _transfers(n: int, **kwargs) -> int:
    return count_executed(_program(n, **kwargs)[0], "ppermute")


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_forward_ring_has_n_minus_1_permutes(n, layout):
    jaxpr, text = _program(n, causal=True, layout=layout)
    assert count_executed(jaxpr, "ppermute") == n - 1
    # Hop 0 and the last hop are peeled, the rest is one loop: at most two permutes in the
    # program whatever n, so at most two key/value blocks are live.
    assert _count(text, "collective_permute") == min(n - 1, 2)
    assert _count(text, "all_gather") == 0
    assert _count(text, "all_to_all") == 0
    # Double buffering: the first hop's send precedes the first block's compute loop.
    assert text.find("stablehlo.collective_permute") < text.find("stablehlo.while")


def test_backward_ring_permutes():
    """Forward n-1, backward n-1 key/value hops + n-1 dK/dV hops + 1 shift home."""
    n = 4
    jaxpr, text = _program(n, grad=True, causal=True)
    assert count_executed(jaxpr, "ppermute") == 3 * (n - 1) + 1
    assert _count(text, "all_gather") == 0


@pytest.mark.parametrize(
    "window,hops", [(1, 0), (2, 1), (8, 1), (9, 1), (10, 2), (17, 2), (18, 3), (1000, 7)]
)
def test_window_skips_hops(window, hops):
    """Causal + window + contiguous: hop t is needed iff (t - 1) * LOCAL + 1 < window."""
    assert _transfers(8, causal=True, window=window) == hops


def test_window_skipping_needs_default_positions_and_causal():
    n = 4
    assert _transfers(n, causal=False, window=2) == n - 1
    assert _transfers(n, causal=True, window=2, layout="zigzag") == n - 1


# ---- eager checks ----


def _call_in_shard_map(q, k, v, n: int = 2, **kwargs):
    mesh = make_test_mesh((n,), ("seq",))
    f = functools.partial(ring_attention_per_shard, **{"seq_axis": "seq", **kwargs})
    sharded = jax.shard_map(
        lambda q, k, v: f(q, k, v).out,
        mesh=mesh,
        in_specs=P(None, "seq"),
        out_specs=P(None, "seq"),
        check_vma=True,
    )
    return jax.jit(sharded).lower(q, k, v)  # the checks run at trace time


@pytest.mark.parametrize(
    "q_shape,kv_shape,kwargs,match",
    [
        ((1, 8, 4, 8), (1, 8, 3, 8), {}, "multiple of kv heads"),
        ((1, 8, 4, 8), (1, 8, 2, 4), {}, "head dim"),
        ((1, 8, 4, 8), (1, 8, 2, 8), {"layout": "diagonal"}, "layout: expected one of"),
        ((1, 6, 4, 8), (1, 6, 2, 8), {"layout": "zigzag"}, "expected even local lengths"),
        ((1, 8, 4, 8), (1, 8, 2, 8), {"block_sizes": (4, 4)}, "block_sizes: expected a"),
        ((1, 8, 4, 8), (1, 8, 2, 8), {"window": 0}, "window"),
        ((1, 8, 4, 8), (1, 8, 2, 8), {"softcap": -1.0}, "softcap"),
        ((1, 8, 4, 8), (1, 8, 2, 8), {"scale": float("nan")}, "scale"),
        ((1, 8, 4, 8), (1, 8, 2, 8), {"seq_axis": "nope"}, "seq_axis: expected a mesh axis bound"),
    ],
)
@pytest.mark.no_typecheck
def test_ring_errors(q_shape, kv_shape, kwargs, match):
    kv = jnp.zeros(kv_shape)
    with pytest.raises(ValueError, match=match):
        _call_in_shard_map(jnp.zeros(q_shape), kv, kv, **kwargs)


@pytest.mark.no_typecheck
def test_ring_errors_on_ids():
    q = jnp.zeros((1, 8, 4, 8))
    kv = jnp.zeros((1, 8, 2, 8))
    seg = jnp.zeros((1, 8), jnp.int32)
    mesh = make_test_mesh((2,), ("seq",))

    def run(body, *args):
        sharded = jax.shard_map(
            lambda *a: body(*a).out, mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq")
        )
        jax.jit(sharded).lower(q, kv, kv, *args)

    ring = functools.partial(ring_attention_per_shard, seq_axis="seq")
    with pytest.raises(ValueError, match=r"segment_ids: expected a ringattn\.SegmentIds"):
        run(lambda q, k, v, s: ring(q, k, v, segment_ids=(s, s)), seg)
    with pytest.raises(ValueError, match=r"positions.q: expected shape \(1, 4\)"):
        run(lambda q, k, v, s: ring(q, k, v, positions=Positions(s[:, :2], None)), seg)
    with pytest.raises(ValueError, match=r"positions\.kv: expected an integer array"):
        run(
            lambda q, k, v, s: ring(q, k, v, positions=Positions(None, s.astype(jnp.float32))),
            seg,
        )


def test_ring_outside_shard_map():
    q = jnp.zeros((1, 8, 4, 8))
    kv = jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match=r"seq_axis: expected a mesh axis bound by jax\.shard_map"):
        ring_attention_per_shard(q, kv, kv, seq_axis="seq")
