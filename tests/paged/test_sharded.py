"""Sequence-sharded paged decode equals single-device paged attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from paged import (
    PagedAttentionOutput,
    paged_attention,
    paged_attention_reference,
    sharded_paged_attention,
)
from paged._sharded import local_partial
from ringattn import MaskSpec, merge_attention
from tests._util import assert_close, make_test_mesh

K, C, H, N = 2, 4, 8, 4


def sharded_inputs(rng, D, *, pages_per_device=None, slots_per_device=None, lengths=(45, 13, 0)):
    """Per-device pools with permuted local ids, plus the same data as one global pool.

    By default each device has ``max(3, ceil(12 / D))`` table slots (capacity ``>= 48 >=
    45`` tokens: a length past capacity is an error of eager calls) and two spare pages.
    """
    B = len(lengths)
    Md = max(3, -(-12 // D)) if slots_per_device is None else slots_per_device
    Pd = Md + 2 if pages_per_device is None else pages_per_device
    k = rng.standard_normal((K, D * Pd, C, H)).astype(np.float32)
    v = rng.standard_normal((K, D * Pd, C, H)).astype(np.float32)
    k[:, ::Pd] = np.nan  # every device's local null page
    v[:, ::Pd] = np.nan
    lengths = np.asarray(lengths, np.int32)
    local = np.zeros((B, D * Md), np.int32)
    for d in range(D):
        for b in range(B):
            local[b, d * Md : (d + 1) * Md] = rng.permutation(np.arange(1, Pd))[:Md]
    used = np.arange(D * Md)[None] * C < lengths[:, None]
    local = np.where(used, local, 0)
    global_table = np.where(used, local + (np.arange(D * Md) // Md)[None] * Pd, 0)
    q = rng.standard_normal((B, 1, N, H)).astype(np.float32)
    return [jnp.asarray(x) for x in (q, k, v, local, lengths, global_table)]


@pytest.mark.parametrize("D, window", [(4, 20)])
def test_local_partials_merge_to_single_device_result(D, window):
    rng = np.random.default_rng(D)
    q, k, v, local, lengths, global_table = sharded_inputs(rng, D)
    mesh = make_test_mesh((D,), ("seq",))
    pool = P(None, "seq")

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), pool, pool, pool, P(), P()),
        out_specs=(P("seq"), P("seq")),
        check_vma=True,
    )
    def partials(q, k, v, table, lengths, q_positions):
        out, lse, _ = local_partial(
            q,
            (k, v),
            (table, lengths, q_positions),
            seq_axis="seq",
            mask=MaskSpec(causal=True, window=window),
            ppb=32,
        )
        return out[None], lse[None]

    outs, lses = jax.jit(partials)(q, k, v, local, lengths, lengths[:, None] - 1)
    out, lse = outs[0], lses[0]
    for d in range(1, D):
        out, lse = merge_attention(out, lse, outs[d], lses[d])
    expected = paged_attention(q, k, v, global_table, lengths, window=window).out
    assert_close(out, expected, dtype=jnp.float32, what=f"D={D}")


@pytest.mark.parametrize(
    "D, axis_type, window",
    [(2, AxisType.Auto, None), (4, AxisType.Explicit, 9), (8, AxisType.Auto, None)],
)
def test_sharded_paged_attention_matches_single_device(D, axis_type, window):
    rng = np.random.default_rng(10 + D)
    q, k, v, local, lengths, global_table = sharded_inputs(rng, D, lengths=(45, 13, 0))
    mesh = make_test_mesh((D,), ("seq",), axis_type=axis_type)
    res = jax.jit(
        functools.partial(sharded_paged_attention, mesh=mesh, seq_axis="seq", window=window)
    )(q, k, v, local, lengths)
    assert isinstance(res, PagedAttentionOutput) and res.page_mass is None
    out, lse, _ = res
    expected, expected_lse, _ = paged_attention(q, k, v, global_table, lengths, window=window)
    assert_close(out, expected, dtype=jnp.float32, what=f"D={D} {axis_type}")
    seen = np.isfinite(np.asarray(expected_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
    assert_close(np.where(seen, lse, 0), np.where(seen, expected_lse, 0), dtype=jnp.float32)


@pytest.mark.no_typecheck
def test_sharded_errors():
    rng = np.random.default_rng(0)
    q, k, v, local, lengths, _ = sharded_inputs(rng, 2)
    mesh = make_test_mesh((2,), ("seq",))
    with pytest.raises(ValueError, match="seq_axis: expected an axis of the mesh"):
        sharded_paged_attention(q, k, v, local, lengths, mesh=mesh, seq_axis="x")
    with pytest.raises(ValueError, match="must both divide"):
        sharded_paged_attention(q, k[:, :9], v[:, :9], local, lengths, mesh=mesh, seq_axis="seq")
    with pytest.raises(ValueError, match="mesh: expected a jax"):
        sharded_paged_attention(q, k, v, local, lengths, mesh=None, seq_axis="seq")
    with pytest.raises(ValueError, match="q_positions: expected"):
        sharded_paged_attention(
            q, k, v, local, lengths, mesh=mesh, seq_axis="seq", q_positions=lengths
        )
    with pytest.raises(ValueError, match="sinks: expected shape"):
        sharded_paged_attention(
            q, k, v, local, lengths, mesh=mesh, seq_axis="seq", sinks=jnp.zeros(3)
        )


def test_sharded_decode_default_queries_are_the_last_positions():
    """Issue 8 trap 1: with causal (the default) and no positions, a decode token sits at the
    end of the valid cache, as in paged_attention: it sees every valid key, not just one."""
    rng = np.random.default_rng(3)
    q, k, v, local, lengths, global_table = sharded_inputs(rng, 2, lengths=(21, 5, 1))
    mesh = make_test_mesh((2,), ("seq",))
    res = sharded_paged_attention(q, k, v, local, lengths, mesh=mesh, seq_axis="seq")
    explicit = sharded_paged_attention(
        q, k, v, local, lengths, mesh=mesh, seq_axis="seq", q_positions=lengths[:, None] - 1
    )
    np.testing.assert_array_equal(np.asarray(res.out), np.asarray(explicit.out))
    ref = paged_attention_reference(q, k, v, global_table, lengths)
    assert_close(res.out, ref.out, dtype=jnp.float32, what="default positions")
    # Against the queries at position 0 (the old trap): a different answer when S > 1.
    first = sharded_paged_attention(
        q, k, v, local, lengths, mesh=mesh, seq_axis="seq", q_positions=jnp.zeros((3, 1), jnp.int32)
    )
    assert not np.allclose(np.asarray(first.out[0]), np.asarray(res.out[0]))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_sharded_sinks_join_once_after_the_merge(axis_type):
    rng = np.random.default_rng(4)
    D = 4
    q, k, v, local, lengths, global_table = sharded_inputs(rng, D, lengths=(40, 9, 0))
    mesh = make_test_mesh((D,), ("seq",), axis_type=axis_type)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    window = (None, 7, 3, None)  # per query head
    res = jax.jit(
        functools.partial(
            sharded_paged_attention,
            mesh=mesh,
            seq_axis="seq",
            window=window,
            return_page_mass=True,
        )
    )(q, k, v, local, lengths, sinks=sinks)
    ref = paged_attention_reference(
        q, k, v, global_table, lengths, window=window, sinks=sinks, return_page_mass=True
    )
    assert_close(res.out, ref.out, dtype=jnp.float32, what="sharded sinks")
    assert_close(res.lse, ref.lse, dtype=jnp.float32, what="sharded sinks lse")
    assert res.page_mass.shape == ref.page_mass.shape == (3, N, local.shape[1])
    assert_close(res.page_mass, ref.page_mass, dtype=jnp.float32, what="sharded page mass")
    without = sharded_paged_attention(q, k, v, local, lengths, mesh=mesh, seq_axis="seq")
    assert without.page_mass is None
    # The empty sequence: out 0, lse = sink (once, not D times).
    np.testing.assert_array_equal(np.asarray(res.out[2]), 0.0)
    np.testing.assert_allclose(np.asarray(res.lse[2, 0]), np.asarray(sinks), rtol=1e-6)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_sharded_paged_attention_under_vmap_and_jit(axis_type):
    rng = np.random.default_rng(5)
    q, k, v, local, lengths, global_table = sharded_inputs(rng, 2)
    mesh = make_test_mesh((2,), ("seq",), axis_type=axis_type)
    fn = functools.partial(sharded_paged_attention, mesh=mesh, seq_axis="seq", window=5)
    qs = jnp.stack([q, -q])
    res = jax.jit(jax.vmap(fn, in_axes=(0, None, None, None, None)))(qs, k, v, local, lengths)
    for i in range(2):
        ref = paged_attention_reference(qs[i], k, v, global_table, lengths, window=5)
        assert_close(res.out[i], ref.out, dtype=jnp.float32, what=f"vmap {i}")
