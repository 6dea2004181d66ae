"""Sequence layouts: round trips, shard positions against a numpy construction, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ringattn._layout import LAYOUTS, from_layout, shard_positions, to_layout
from tests._util import make_test_mesh


def _positions_numpy(layout: str, i: int, n: int, local: int) -> np.ndarray:
    """Global positions of shard ``i`` written out token by token."""
    if layout == "contiguous":
        return np.array([i * local + t for t in range(local)])
    if layout == "striped":
        return np.array([i + n * t for t in range(local)])
    chunk = local // 2
    first = [i * chunk + t for t in range(chunk)]
    second = [(2 * n - 1 - i) * chunk + t for t in range(chunk)]
    return np.array(first + second)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_shard_positions_match_numpy(layout, n):
    local = 4
    for i in range(n):
        got = shard_positions(layout, i, n, local)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, _positions_numpy(layout, i, n, local))
    everything = np.concatenate([shard_positions(layout, i, n, local) for i in range(n)])
    np.testing.assert_array_equal(np.sort(everything), np.arange(n * local))  # a partition


def test_shard_positions_traced_index():
    traced = jax.jit(lambda i: shard_positions("zigzag", i, 4, 6))
    for i in range(4):
        np.testing.assert_array_equal(traced(jnp.int32(i)), _positions_numpy("zigzag", i, 4, 6))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("axis", [1, 0, -1])
def test_to_layout_gives_each_shard_its_positions(layout, n, axis):
    local = 4
    L = n * local
    x = np.arange(2 * L * 3, dtype=np.int32).reshape(2, L, 3)  # sequence on axis 1
    x = np.moveaxis(x, 1, axis)
    y = to_layout(x, layout, num_shards=n, axis=axis)
    assert y.shape == x.shape and y.dtype == x.dtype
    order = np.concatenate([_positions_numpy(layout, i, n, local) for i in range(n)])
    np.testing.assert_array_equal(y, np.take(x, order, axis=axis))
    np.testing.assert_array_equal(from_layout(y, layout, num_shards=n, axis=axis), x)


def test_round_trip_under_jit_and_bfloat16():
    x = jax.random.normal(jax.random.key(0), (2, 24, 3, 4)).astype(jnp.bfloat16)

    @jax.jit
    def round_trips(x):
        return [from_layout(to_layout(x, lay, num_shards=3), lay, num_shards=3) for lay in LAYOUTS]

    for y in round_trips(x):
        assert y.dtype == jnp.bfloat16
        np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_layouts_of_sharded_sequences(axis_type):
    """Sequences already split over a mesh (batch and sequence axes): each layout gives the
    numpy permutation, eagerly and under jit, round trips, and over Explicit axes keeps the
    input's sharding (the permutation crosses shards, so it runs on the gathered axis)."""
    mesh = make_test_mesh((2, 4), ("b", "s"), axis_type=axis_type)
    x = np.arange(2 * 32 * 3, dtype=np.float32).reshape(2, 32, 3)
    xs = jax.device_put(x, NamedSharding(mesh, P("b", "s", None)))
    for layout in ("zigzag", "striped"):
        order = np.concatenate([_positions_numpy(layout, i, 4, 8) for i in range(4)])
        for fn in (to_layout, jax.jit(to_layout, static_argnames=("layout", "num_shards"))):
            y = fn(xs, layout=layout, num_shards=4)
            np.testing.assert_array_equal(np.asarray(y), x[:, order])
            back = from_layout(y, layout, num_shards=4)
            np.testing.assert_array_equal(np.asarray(back), x)
            if axis_type == AxisType.Explicit:
                assert y.sharding.spec == back.sharding.spec == P("b", "s", None)


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_balanced_layouts_share_causal_work(layout):
    """Causal (query, key) pairs per shard: equal for zigzag; for striped shard ``i``
    does ``i * L`` more than shard 0 (one diagonal token per key row).

    With ``contiguous`` the last shard does more than ``n`` times the work of the first.
    """
    n, local = 4, 8
    work = []
    for i in range(n):
        q = _positions_numpy(layout, i, n, local)
        work.append(int(np.sum(q + 1)))  # keys at positions <= q
    if layout == "zigzag":
        assert len(set(work)) == 1
    else:
        assert [w - work[0] for w in work] == [i * local for i in range(n)]
    contiguous = [int(np.sum(_positions_numpy("contiguous", i, n, local) + 1)) for i in range(n)]
    assert contiguous[-1] > n * contiguous[0]


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((np.zeros((1, 8)), "diagonal"), {"num_shards": 2}, "layout: expected one of"),
        ((np.zeros((1, 9)), "contiguous"), {"num_shards": 2}, "divisible by num_shards = 2"),
        ((np.zeros((1, 6)), "striped"), {"num_shards": 4}, "divisible by num_shards = 4"),
        ((np.zeros((1, 6)), "zigzag"), {"num_shards": 2}, r"divisible by 2 × num_shards = 4"),
        ((np.zeros((1, 8)), "zigzag"), {"num_shards": 0}, "num_shards: expected an int >= 1"),
        ((np.zeros((1, 8)), "zigzag"), {"num_shards": 2.0}, "num_shards: expected an int >= 1"),
        ((np.zeros((1, 8)), "striped"), {"num_shards": 2, "axis": 2}, r"axis: expected an int in"),
        (([0, 1], "striped"), {"num_shards": 2}, "x: expected an array"),
    ],
)
@pytest.mark.parametrize("fn", [to_layout, from_layout])
@pytest.mark.no_typecheck
def test_layout_errors(fn, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


@pytest.mark.parametrize(
    "args,match",
    [
        (("diagonal", 0, 2, 4), "layout: expected one of"),
        (("zigzag", 0, 2, 3), "local_len: expected an even int"),
        (("striped", 2, 2, 4), r"shard_index: expected an int in \[0, 2\)"),
        (("striped", -1, 2, 4), r"shard_index: expected an int >= 0"),
        (("contiguous", 0, 0, 4), "num_shards: expected an int >= 1"),
        (("contiguous", 0, 2, 0), "local_len: expected an int >= 1"),
        (("contiguous", 0, 2, 4.0), "local_len: expected an int >= 1"),
    ],
)
@pytest.mark.no_typecheck
def test_shard_positions_errors(args, match):
    with pytest.raises(ValueError, match=match):
        shard_positions(*args)


def _natural_inputs(T=16):
    ks = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(ks[0], (1, T, 4, 8))
    k, v = (jax.random.normal(key, (1, T, 2, 8)) for key in ks[1:])
    return q, k, v


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window=3)], ids=["causal", "window"])
def test_a_permuted_layout_needs_positions_never_guesses(layout, mask):
    """Issue 29 item 2: natural-order inputs with layout='zigzag' and no positions used to
    return errors of order 1; now the positions are required and make any order right."""
    from ringattn import Positions, attention_reference, sharded_attention

    n, T = 2, 16
    q, k, v = _natural_inputs(T)
    mesh = make_test_mesh((n,), ("seq",))
    attend = lambda *args, **kw: sharded_attention(
        *args, mesh=mesh, seq_axis="seq", layout=layout, **mask, **kw
    )
    want = attention_reference(q, k, v, **mask)
    match = rf"sharded_attention: positions: expected ringattn.Positions\(q=..., kv=...\) for layout '{layout}'"
    with pytest.raises(ValueError, match=match):
        attend(q, k, v)  # the forgotten to_layout: an error, not a wrong answer
    arange = jnp.arange(T, dtype=jnp.int32)[None]
    with pytest.raises(ValueError, match=r"got positions.kv None"):
        attend(q, k, v, positions=Positions(arange, None))
    # Natural order with natural positions: right (only the balance is lost).
    got = attend(q, k, v, positions=Positions(arange, arange))
    np.testing.assert_allclose(np.asarray(got.out), np.asarray(want.out), atol=1e-5)
    # Permuted data with permuted positions, undone once: right.
    to = lambda x: to_layout(x, layout, num_shards=n)
    pos = to(arange)
    got = attend(to(q), to(k), to(v), positions=Positions(pos, pos))
    out = from_layout(got.out, layout, num_shards=n)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want.out), atol=1e-5)
    # A mask that compares no positions needs none; contiguous keeps its default.
    sharded_attention(q, k, v, mesh=mesh, seq_axis="seq", layout=layout, softcap=2.0)
    sharded_attention(q, k, v, mesh=mesh, seq_axis="seq", layout="contiguous", **mask)


def test_ring_per_shard_with_a_permuted_layout_needs_positions():
    from ringattn import Positions, attention_reference, ring_attention_per_shard

    n, T = 2, 16
    q, k, v = _natural_inputs(T)
    mesh = make_test_mesh((n,), ("seq",))
    spec = P(None, "seq")

    def run(with_positions):
        def body(q, k, v):
            kw = {}
            if with_positions:  # this shard's global positions, permuted like the data
                mine = shard_positions("zigzag", jax.lax.axis_index("seq"), n, T // n)[None]
                kw = dict(positions=Positions(mine, mine))
            return ring_attention_per_shard(
                q, k, v, seq_axis="seq", layout="zigzag", causal=True, **kw
            ).out

        f = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        to = lambda x: to_layout(x, "zigzag", num_shards=n)
        return from_layout(f(to(q), to(k), to(v)), "zigzag", num_shards=n)

    with pytest.raises(ValueError, match=r"ring_attention_per_shard: positions: .*shard_positions"):
        run(False)
    want = attention_reference(q, k, v, causal=True).out
    np.testing.assert_allclose(np.asarray(run(True)), np.asarray(want), atol=1e-5)
