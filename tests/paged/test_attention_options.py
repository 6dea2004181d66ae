"""Options and hardening of the paged attention functions: sinks, per-head windows, mask=,
jit/vmap with options bound, masked keys holding NaN/inf, numpy scalars, degenerate shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged import (
    PagedAttentionOutput,
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from ringattn import MaskSpec
from tests._util import assert_close
from tests.paged.test_attention import make_pool, ragged_inputs

N, K, H, C, M = 4, 2, 8, 4, 3


def pool(seed, lengths=(0, 1, C, C + 1, M * C), **kwargs):
    rng = np.random.default_rng(seed)
    k, v, table, lens = make_pool(rng, K=K, C=C, H=H, lengths=list(lengths), M=M, **kwargs)
    return rng, k, v, table, lens


def check_against_reference(res, ref, dtype=jnp.float32, what=""):
    assert isinstance(res, PagedAttentionOutput)
    assert_close(res.out, ref.out, dtype=dtype, what=f"{what} out")
    seen = np.isfinite(np.asarray(ref.lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(res.lse)), seen)
    assert_close(
        np.where(seen, res.lse, 0), np.where(seen, ref.lse, 0), dtype=dtype, what=f"{what} lse"
    )
    if ref.page_mass is not None:
        assert_close(res.page_mass, ref.page_mass, dtype=dtype, what=f"{what} page_mass")


@pytest.mark.parametrize(
    "window, sinks",
    [
        ((None, 3, 6, None), None),
        ((2, 2, 2, 2), [0.3, -2.0, 1.0, 0.0]),
        (None, [0.3, -2.0, 1.0, 0.0]),
        ((1, None, 5, 9), [5.0, -1.0, 0.0, 1.0]),
    ],
)
def test_per_head_windows_and_sinks_match_the_reference(window, sinks):
    rng, k, v, table, lengths = pool(0, dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((5, 2, N, H)), jnp.float32)
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    run = jax.jit(
        functools.partial(paged_attention, window=window, pages_per_block=1, return_page_mass=True)
    )
    res = run(q, k, v, table, lengths, sinks=sinks)
    ref = paged_attention_reference(
        q, k, v, table, lengths, window=window, sinks=sinks, return_page_mass=True
    )
    check_against_reference(res, ref, what=f"window={window} sinks={sinks is not None}")
    if sinks is not None:  # the empty sequence: out 0 and lse = sink
        np.testing.assert_array_equal(np.asarray(res.out[0]), 0.0)
        np.testing.assert_allclose(np.asarray(res.lse[0, 0]), np.asarray(sinks), rtol=1e-6)
        # A sink takes probability: the mass on pages sums to less than one per query.
        assert float(res.page_mass[1:].sum(-1).max()) < 2.0


def test_per_head_windows_equal_separate_calls():
    """A tuple of windows is the same as one call per head with that head's window."""
    rng, k, v, table, lengths = pool(1, dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((5, 1, N, H)), jnp.float32)
    windows = (None, 2, 5, 1)
    mixed = paged_attention(q, k, v, table, lengths, window=windows).out
    for n, w in enumerate(windows):
        alone = paged_attention(q, k, v, table, lengths, window=w).out
        np.testing.assert_allclose(
            np.asarray(mixed[:, :, n]), np.asarray(alone[:, :, n]), atol=1e-6
        )


def test_mask_spec_equals_keyword_sugar_and_not_both():
    rng, k, v, table, lengths = pool(2, dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((5, 1, N, H)), jnp.float32)
    spec = MaskSpec(causal=True, window=3, softcap=4.0, scale=0.5)
    a = paged_attention(q, k, v, table, lengths, mask=spec)
    b = paged_attention(q, k, v, table, lengths, causal=True, window=3, softcap=4.0, scale=0.5)
    np.testing.assert_array_equal(np.asarray(a.out), np.asarray(b.out))
    jitted = jax.jit(functools.partial(paged_attention, mask=spec))(q, k, v, table, lengths)
    np.testing.assert_allclose(np.asarray(jitted.out), np.asarray(a.out), atol=1e-6)
    with pytest.raises(ValueError, match="paged_attention: mask: expected either mask="):
        paged_attention(q, k, v, table, lengths, mask=spec, window=3)


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    "options, match",
    [
        (dict(window=(1, 2)), r"window: expected a tuple of one window per query head"),
        (dict(window=2.0), "window"),
        (dict(window=True), "window"),
        (dict(softcap=float("nan")), "softcap"),
        (dict(sinks=jnp.zeros(3)), r"sinks: expected shape \(4,\)"),
        (dict(sinks=jnp.zeros(4, jnp.int32)), "sinks: expected a floating point"),
        (dict(pages_per_block=2.0), "pages_per_block: expected an int"),
        (dict(pages_per_block=True), "pages_per_block: expected an int"),
        (dict(mask="causal"), "mask: expected a ringattn.MaskSpec"),
    ],
)
def test_option_errors(options, match):
    rng, k, v, table, lengths = pool(3, dtype=jnp.float32)
    q = jnp.zeros((5, 1, N, H), jnp.float32)
    with pytest.raises(ValueError, match=match):
        paged_attention(q, k, v, table, lengths, **options)
    qr = jnp.zeros((5, N, H), jnp.float32)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(qr, k, v, table, lengths, jnp.arange(6), 5, **options)


def test_numpy_scalars_and_numpy_tables_are_accepted():
    rng, k, v, table, lengths = pool(4, dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((5, 1, N, H)), jnp.float32)
    base = paged_attention(q, k, v, table, lengths, window=3, scale=0.5, pages_per_block=2).out
    res = paged_attention(
        q,
        k,
        v,
        np.asarray(table),
        np.asarray(lengths),
        window=np.int64(3),
        scale=np.float32(0.5),
        softcap=None,
        pages_per_block=np.int32(2),
        causal=np.bool_(True),
    ).out
    np.testing.assert_allclose(np.asarray(res), np.asarray(base), atol=1e-6)
    ragged = ragged_paged_attention(
        q[:, 0],
        k,
        v,
        np.asarray(table),
        np.asarray(lengths),
        np.arange(6, dtype=np.int32),
        np.int32(5),
        window=(np.int32(3),) * N,
        scale=np.float64(0.5),
        queries_per_block=np.int64(2),
    ).out
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(base[:, 0]), atol=1e-6)


def test_vmap_and_jit_with_options_bound():
    """vmap over layers (pools and queries batched, table shared) and over tables."""
    rng, k, v, table, lengths = pool(5, dtype=jnp.float32)
    layers = 3
    kl = jnp.stack([k * (i + 1) for i in range(layers)])
    vl = jnp.stack([v - i for i in range(layers)])
    ql = jnp.asarray(rng.standard_normal((layers, 5, 1, N, H)), jnp.float32)
    fn = functools.partial(paged_attention, window=(None, 2, 3, None), return_page_mass=True)
    batched = jax.jit(jax.vmap(fn, in_axes=(0, 0, 0, None, None)))(ql, kl, vl, table, lengths)
    for i in range(layers):
        one = fn(ql[i], kl[i], vl[i], table, lengths)
        np.testing.assert_allclose(np.asarray(batched.out[i]), np.asarray(one.out), atol=1e-5)
        np.testing.assert_allclose(
            np.asarray(batched.page_mass[i]), np.asarray(one.page_mass), atol=1e-5
        )
    # Batched lengths (a data-dependent trip count under vmap).
    lens = jnp.stack([lengths, jnp.maximum(lengths - 1, 0)])
    per = jax.vmap(
        functools.partial(paged_attention, causal=True), in_axes=(None, None, None, None, 0)
    )(ql[0], k, v, table, lens)
    for i in range(2):
        one = paged_attention(ql[0], k, v, table, lens[i])
        np.testing.assert_allclose(np.asarray(per.out[i]), np.asarray(one.out), atol=1e-5)
    # Ragged, vmapped over two query sets.
    q, k2, v2, t2, l2, cu, _ = ragged_inputs(rng, C, K, N, H)
    qs = jnp.stack([q, -q])
    rag = jax.vmap(functools.partial(ragged_paged_attention, window=5), in_axes=(0,) + (None,) * 6)(
        qs, k2, v2, t2, l2, cu, 4
    )
    for i in range(2):
        one = ragged_paged_attention(qs[i], k2, v2, t2, l2, cu, 4, window=5)
        np.testing.assert_allclose(np.asarray(rag.out[i]), np.asarray(one.out), atol=1e-5)


def test_ragged_sinks_and_per_head_windows_match_the_reference():
    rng = np.random.default_rng(6)
    q, k, v, table, lengths, cu, _ = ragged_inputs(rng, C, K, N, H)
    sinks = jnp.asarray([1.0, -1.0, 0.0, 2.0], jnp.float32)
    window = (None, 4, 2, 7)
    run = jax.jit(
        functools.partial(
            ragged_paged_attention, window=window, queries_per_block=4, return_page_mass=True
        )
    )
    ref_fn = jax.jit(
        functools.partial(ragged_paged_attention_reference, window=window, return_page_mass=True)
    )
    for s in (sinks, None):
        res = run(q, k, v, table, lengths, cu, jnp.int32(4), sinks=s)
        ref = ref_fn(q, k, v, table, lengths, cu, jnp.int32(4), sinks=s)
        assert res.page_mass.shape == ref.page_mass.shape == (table.shape[0], N, table.shape[1])
        check_against_reference(res, ref, what=f"ragged sinks={s is not None}")
    plain = ragged_paged_attention(q, k, v, table, lengths, cu, 4)
    assert plain.page_mass is None


def test_reference_defaults_are_the_kernel_defaults():
    """Both default to causal=True and queries at the last T valid positions."""
    rng, k, v, table, lengths = pool(7, dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((5, 2, N, H)), jnp.float32)
    res = paged_attention(q, k, v, table, lengths)
    ref = paged_attention_reference(q, k, v, table, lengths)
    explicit = paged_attention_reference(
        q, k, v, table, lengths, causal=True, q_positions=lengths[:, None] - 2 + jnp.arange(2)
    )
    check_against_reference(res, ref)
    np.testing.assert_array_equal(np.asarray(ref.out), np.asarray(explicit.out))


# ------------------------------------------------------------------ masked keys have no effect


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    poison=st.sampled_from([np.nan, np.inf, -np.inf]),
    window=st.sampled_from([None, 2, (None, 1, 3, 6)]),
    sink=st.booleans(),
)
def test_garbage_in_masked_slots_never_reaches_outputs(seed, poison, window, sink):
    """NaN/inf beyond lengths, in free pages and in the null page: finite, exact outputs."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, M * C + 1, size=3).tolist()
    spare = 3 * M + 2 - sum(-(-n // C) for n in lengths)  # one pool size: one compile
    k, v, table, lens = make_pool(
        rng, K=K, C=C, H=H, lengths=lengths, M=M, dtype=jnp.float32, spare=spare
    )
    clean_k, clean_v = jnp.nan_to_num(k, nan=0.0), jnp.nan_to_num(v, nan=0.0)
    poisoned_k = jnp.where(jnp.isnan(k), poison, k)  # make_pool put NaN in every masked slot
    poisoned_v = jnp.where(jnp.isnan(v), poison, v)
    q = jnp.asarray(rng.standard_normal((3, 2, N, H)), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(N), jnp.float32) if sink else None
    fn = jax.jit(functools.partial(paged_attention, window=window, return_page_mass=True))
    dirty = fn(q, poisoned_k, poisoned_v, table, lens, sinks=sinks)
    clean = fn(q, clean_k, clean_v, table, lens, sinks=sinks)
    for a, b in zip(dirty, clean, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert not np.any(np.isnan(a))
        np.testing.assert_array_equal(a, b)
    assert np.all(np.isfinite(np.asarray(dirty.out)))


def test_garbage_in_masked_slots_never_reaches_ragged_outputs():
    rng = np.random.default_rng(8)
    q, k, v, table, lengths, cu, _ = ragged_inputs(rng, C, K, N, H)
    fn = jax.jit(functools.partial(ragged_paged_attention, window=3))
    dirty = fn(q, jnp.where(jnp.isnan(k), jnp.inf, k), v, table, lengths, cu, 4)
    clean = fn(q, jnp.nan_to_num(k, nan=0.0), jnp.nan_to_num(v, nan=0.0), table, lengths, cu, 4)
    assert np.all(np.isfinite(np.asarray(dirty.out)))
    np.testing.assert_array_equal(np.asarray(dirty.out), np.asarray(clean.out))


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("ppb", [1, 2, 32])
@pytest.mark.parametrize("kernel", ["paged", "ragged"])
def test_keys_inside_lengths_but_outside_every_window_have_no_effect(poison, ppb, kernel):
    """Poison keys and values that are valid cache slots but lie before every query's window
    (the class a window-only mask used to miss when a block was partly visible)."""
    rng = np.random.default_rng(11)
    window, T, Mw = 3, 2, 8
    lengths = np.array([24, 17, 9], np.int32)
    k, v, table, lens = make_pool(
        rng, K=K, C=C, H=H, lengths=lengths.tolist(), M=Mw, dtype=jnp.float32
    )
    k, v = jnp.nan_to_num(k, nan=0.0), jnp.nan_to_num(v, nan=0.0)
    kp, vp, tab = np.asarray(k).copy(), np.asarray(v).copy(), np.asarray(table)
    for b, n in enumerate(lengths):
        for pos in range(n - T - window + 1):  # seen by no query of the last T
            kp[:, tab[b, pos // C], pos % C] = poison
            vp[:, tab[b, pos // C], pos % C] = poison
    q = jnp.asarray(rng.standard_normal((3, T, N, H)), jnp.float32)
    if kernel == "paged":
        fn = functools.partial(paged_attention, window=window, pages_per_block=ppb)
        args = (table, lens)
    else:
        q = q.reshape(3 * T, N, H)
        fn = functools.partial(ragged_paged_attention, window=window, pages_per_block=ppb)
        args = (table, lens, jnp.arange(4, dtype=jnp.int32) * T, 3)
    dirty = jax.jit(fn)(q, jnp.asarray(kp), jnp.asarray(vp), *args)
    clean = jax.jit(fn)(q, k, v, *args)
    assert np.all(np.isfinite(np.asarray(dirty.out)))
    np.testing.assert_array_equal(np.asarray(dirty.out), np.asarray(clean.out))
    np.testing.assert_array_equal(np.asarray(dirty.lse), np.asarray(clean.lse))


# ------------------------------------------------------------------ degenerate shapes


def test_empty_batch_returns_empty_results():
    k = v = jnp.zeros((K, 4, C, H))
    res = paged_attention(
        jnp.zeros((0, 1, N, H)),
        k,
        v,
        jnp.zeros((0, 2), jnp.int32),
        jnp.zeros((0,), jnp.int32),
        return_page_mass=True,
    )
    assert res.out.shape == (0, 1, N, H) and res.lse.shape == (0, 1, N)
    assert res.page_mass.shape == (0, N, 2)
    ref = paged_attention_reference(
        jnp.zeros((0, 1, N, H)), k, v, jnp.zeros((0, 2), jnp.int32), jnp.zeros((0,), jnp.int32)
    )
    assert ref.out.shape == (0, 1, N, H)


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    "q_shape, k_shape, table_shape, match",
    [
        ((1, 1, N, 0), (K, 4, C, 0), (1, 2), r"k_pages: expected non-empty dims .*H = 0"),
        ((1, 1, 0, H), (K, 4, C, H), (1, 2), "q: expected query heads N a positive multiple"),
        # A [P, C, K, H] pool (vLLM's layout): its P is read as K; the pool is named.
        (
            (1, 1, N, H),
            (5, C, K, H),
            (1, 2),
            r"k_pages: expected \[K, P, C, H\] .*K=5.*"
            r"\[P, C, K, H\] needs \.transpose\(2, 0, 1, 3\)",
        ),
        ((1, 1, N, H), (0, 4, C, H), (1, 2), r"k_pages: expected non-empty dims .*K = 0"),
        ((1, 1, N, H), (K, 0, C, H), (1, 2), r"k_pages: expected non-empty dims .*P = 0"),
        ((1, 1, N, H), (K, 4, 0, H), (1, 2), r"k_pages: expected non-empty dims .*C = 0"),
        ((1, 1, N, H), (K, 4, C, H), (1, 0), r"page_table: expected at least one column"),
        ((1, 0, N, H), (K, 4, C, H), (1, 2), "q: expected at least one query token"),
    ],
)
def test_degenerate_shapes_name_the_argument(q_shape, k_shape, table_shape, match):
    q = jnp.zeros(q_shape)
    k = jnp.zeros(k_shape)
    table = jnp.zeros(table_shape, jnp.int32)
    lengths = jnp.zeros((table_shape[0],), jnp.int32)
    with pytest.raises(ValueError, match=f"paged_attention: {match}"):
        paged_attention(q, k, k, table, lengths)
    if q_shape[1] > 0:
        with pytest.raises(ValueError, match=f"ragged_paged_attention: {match}"):
            ragged_paged_attention(q[0], k, k, table, lengths, jnp.zeros((2,), jnp.int32), 1)
