"""Decode over mixed residency: exact with every page fetched, mass kept, page mass, jit, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
from offload import (
    RetentionPolicy,
    init_policy_state,
    mixed_residency_attention,
    select_keep,
    split_residency,
    token_attention_mass,
    update_policy_state,
)
from offload.monitoring import mass_kept_from_page_mass
from ringattn import MaskSpec, Positions, SegmentIds, attention_reference
from tests._util import assert_close

B, T, N, K, H, C, M = 5, 1, 4, 2, 8, 4, 6
P = B * M + 1  # every slot gets its own page; page 0 is the null page
LENGTHS = np.array([0, 1, C, C + 1, M * C], np.int32)  # empty, one token, page edges, full


def _setup(seed=0, T=T, dtype=jnp.float32):
    """Contiguous KV plus the same KV scattered into a pool under randomly permuted page ids."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k = rng.standard_normal((B, M * C, K, H)).astype(np.float32)
    v = rng.standard_normal((B, M * C, K, H)).astype(np.float32)
    table = rng.permutation(np.arange(1, P)).reshape(B, M).astype(np.int32)
    k_pages = np.zeros((K, P, C, H), np.float32)
    v_pages = np.zeros((K, P, C, H), np.float32)
    for b in range(B):
        for j in range(M):
            k_pages[:, table[b, j]] = k[b, j * C : (j + 1) * C].transpose(1, 0, 2)
            v_pages[:, table[b, j]] = v[b, j * C : (j + 1) * C].transpose(1, 0, 2)
    arrays = (q, k, v, k_pages, v_pages)
    return (*(jnp.asarray(a, dtype) for a in arrays), jnp.asarray(table), jnp.asarray(LENGTHS))


@functools.partial(jax.jit, static_argnames=("window", "softcap"))
def _reference(q, k, v, lengths, *, keep_tokens=None, window=None, softcap=None, sinks=None):
    """attention_reference over the contiguous KV, optionally restricted to kept tokens."""
    B, Tq = q.shape[:2]
    S = k.shape[1]
    valid = jnp.arange(S)[None] < lengths[:, None]
    if keep_tokens is not None:
        valid &= keep_tokens
    return attention_reference(
        q,
        k,
        v,
        causal=True,
        positions=Positions(
            lengths[:, None] - Tq + jnp.arange(Tq)[None], jnp.broadcast_to(jnp.arange(S), (B, S))
        ),
        segment_ids=SegmentIds(jnp.ones((B, Tq), jnp.int32), valid.astype(jnp.int32)),
        window=window,
        softcap=softcap,
        sinks=sinks,
    )


def _policy_selection(budget, q, k, lengths, kind="h2o"):
    pol = RetentionPolicy(kind, budget, page_size=C, sink=1 if kind != "recency" else 0)
    state = init_policy_state(B, M, policy=pol)
    token_mass = token_attention_mass(q, k, lengths)  # [B, N, S]
    page_mass = token_mass.reshape(B, N, M, C).sum(-1)
    state = update_policy_state(state, page_mass, policy=pol)
    return select_keep(state, lengths, policy=pol), page_mass


@pytest.mark.parametrize(
    ("separate_pool", "jit"), [(False, False), (True, True), ("compact", False), ("compact", True)]
)
def test_every_page_fetched_equals_full_attention(separate_pool, jit):
    q, k, v, k_pages, v_pages, table, lengths = _setup()
    sel, _ = _policy_selection(0.3, q, k, lengths)
    device_table, cold_table = split_residency(table, sel.keep, sel.demote)
    cold_k, cold_v = None, None
    if separate_pool == "compact":
        # A staging pool of just the demoted pages (ids 1..n, fewer pages than the device's).
        demoted = np.asarray(sel.demote)
        ids = np.asarray(table)[demoted]
        cold_k = jnp.zeros((k_pages.shape[0], ids.size + 1, *k_pages.shape[2:]), k_pages.dtype)
        cold_k, cold_v = (
            cold_k.at[:, 1:].set(k_pages[:, ids]),
            cold_k.at[:, 1:].set(v_pages[:, ids]),
        )
        compact = np.zeros(table.shape, np.int32)
        compact[demoted] = np.arange(1, ids.size + 1)
        cold_table = jnp.asarray(compact)
        assert ids.size + 1 < P
        k_pages = k_pages.at[:, jnp.asarray(ids)].set(jnp.nan)
        v_pages = v_pages.at[:, jnp.asarray(ids)].set(jnp.nan)
    elif separate_pool:
        # The cold tier is its own pool, with the demoted pages under new ids.
        rng = np.random.default_rng(5)
        new_ids = jnp.asarray(rng.permutation(np.arange(1, P)), jnp.int32)
        remap = jnp.zeros((P,), jnp.int32).at[jnp.arange(1, P)].set(new_ids)
        cold_k = jnp.zeros_like(k_pages).at[:, remap].set(k_pages)
        cold_v = jnp.zeros_like(v_pages).at[:, remap].set(v_pages)
        cold_table = remap[cold_table]
        # The device pool no longer holds the demoted pages: poison them (NaN never leaks).
        k_pages = k_pages.at[:, jnp.where(sel.demote, table, 0).ravel()].set(jnp.nan)
        v_pages = v_pages.at[:, jnp.where(sel.demote, table, 0).ravel()].set(jnp.nan)
    fn = jax.jit(mixed_residency_attention) if jit else mixed_residency_attention
    res = fn(
        q,
        k_pages,
        v_pages,
        device_table,
        lengths,
        cold_table=cold_table,
        cold_k_pages=cold_k,
        cold_v_pages=cold_v,
    )
    out_ref, lse_ref = _reference(q, k, v, lengths)
    assert_close(res.out, out_ref, dtype=jnp.float32, what="out")
    live = np.asarray(lengths) > 0
    assert_close(res.lse[live], lse_ref[live], dtype=jnp.float32, what="lse")
    assert np.all(np.isneginf(np.asarray(res.lse[~live])))
    assert np.asarray(sel.demote).any()  # the cold part is really used
    # Mass kept: exact ratio of the device part's probability mass.
    _, lse_dev = _reference(q, k, v, lengths, keep_tokens=jnp.repeat(sel.keep, C, axis=1))
    expected = jnp.where(live[:, None, None], jnp.exp(lse_dev - lse_ref), 1.0)
    assert_close(res.mass_kept, expected, dtype=jnp.float32, what="mass kept")


def test_device_only_is_the_policy_approximation():
    q, k, v, k_pages, v_pages, table, lengths = _setup(1)
    sel, page_mass = _policy_selection(0.5, q, k, lengths)
    device_table, _ = split_residency(table, sel.keep, sel.demote)
    res = mixed_residency_attention(q, k_pages, v_pages, device_table, lengths)
    assert res.mass_kept is None
    out_ref, _ = _reference(q, k, v, lengths, keep_tokens=jnp.repeat(sel.keep, C, axis=1))
    assert_close(res.out, out_ref, dtype=jnp.float32, what="out over kept pages")
    # With T = 1 the page mass of the full attention gives the same fraction as the lses.
    full = mixed_residency_attention(
        q, k_pages, v_pages, device_table, lengths, cold_table=jnp.where(sel.demote, table, 0)
    )
    from_mass = mass_kept_from_page_mass(page_mass, sel.keep)  # [B, N]
    assert_close(full.mass_kept[:, 0], from_mass, dtype=jnp.float32, what="mass kept two ways")


@pytest.mark.parametrize("kind", ["recency", "streaming", "h2o"])
def test_mass_kept_monotone_in_budget(kind):
    q, k, v, k_pages, v_pages, table, lengths = _setup(2)
    previous = None
    for budget in (1, 2, 3, 4, 6):
        sel, _ = _policy_selection(budget, q, k, lengths, kind=kind)
        device_table, cold_table = split_residency(table, sel.keep, sel.demote)
        res = mixed_residency_attention(
            q, k_pages, v_pages, device_table, lengths, cold_table=cold_table
        )
        kept = np.asarray(res.mass_kept).mean(axis=(1, 2))  # per sequence
        if previous is not None:
            assert np.all(kept >= previous - 1e-6), (kind, budget, kept, previous)
        previous = kept
    np.testing.assert_allclose(previous, 1.0, atol=1e-6)  # budget 6 = every page


def test_window_softcap_and_chunk_of_queries():
    q, k, v, k_pages, v_pages, table, lengths = _setup(3, T=3)
    keep = jnp.asarray(np.random.default_rng(3).random((B, M)) < 0.5)
    device_table, cold_table = split_residency(table, keep, ~keep)
    res = mixed_residency_attention(
        q, k_pages, v_pages, device_table, lengths, cold_table=cold_table, window=6, softcap=5.0
    )
    out_ref, _ = _reference(q, k, v, lengths, window=6, softcap=5.0)
    assert_close(res.out, out_ref, dtype=jnp.float32, what="out")


def test_bfloat16_pages():
    q, k, v, k_pages, v_pages, table, lengths = _setup(4, dtype=jnp.bfloat16)
    keep = jnp.asarray(np.random.default_rng(4).random((B, M)) < 0.5)
    device_table, cold_table = split_residency(table, keep, ~keep)
    res = mixed_residency_attention(
        q, k_pages, v_pages, device_table, lengths, cold_table=cold_table
    )
    assert res.out.dtype == jnp.bfloat16 and res.lse.dtype == jnp.float32
    out_ref, _ = _reference(*(x.astype(jnp.float32) for x in (q, k, v)), lengths)
    assert_close(res.out, out_ref, dtype=jnp.bfloat16, what="bf16 out")


def test_page_mass_feeds_policies():
    q, k, v, k_pages, v_pages, table, lengths = _setup(6)
    sel, page_mass = _policy_selection(0.5, q, k, lengths)
    device_table, cold_table = split_residency(table, sel.keep, sel.demote)
    full = mixed_residency_attention(
        q, k_pages, v_pages, device_table, lengths, cold_table=cold_table, return_page_mass=True
    )
    # Every page fetched: the page mass of full attention, whichever tier holds the page.
    assert_close(full.page_mass, page_mass, dtype=jnp.float32, what="merged page mass")
    dev = mixed_residency_attention(
        q, k_pages, v_pages, device_table, lengths, return_page_mass=True
    )
    # Device only: renormalised over the kept slots, zero elsewhere.
    expected = jnp.where(sel.keep[:, None], page_mass, 0.0) / jnp.maximum(
        jnp.sum(jnp.where(sel.keep[:, None], page_mass, 0.0), -1, keepdims=True), 1e-30
    )
    assert_close(dev.page_mass, expected, dtype=jnp.float32, what="device page mass")
    assert dev.mass_kept is None and full.page_mass.shape == (B, N, M)
    # One H2O step fed by it stays a valid selection.
    pol = RetentionPolicy("h2o", 2, page_size=C, sink=1)
    state = update_policy_state(init_policy_state(B, M, policy=pol), full.page_mass, policy=pol)
    sel2 = select_keep(state, lengths, policy=pol, page_table=table)
    assert np.all(np.asarray(sel2.keep.sum(-1)) == np.minimum(2, -(-LENGTHS // C)))


def test_split_residency_keep_wins_an_overlap():
    keep = jnp.array([[True, False, True]])
    d, c = split_residency(jnp.array([[3, 5, 7]]), keep, jnp.array([[True, True, False]]))
    assert d.tolist() == [[3, 0, 7]] and c.tolist() == [[0, 5, 0]]  # keep wins an overlap


@pytest.mark.no_typecheck
def test_errors():
    q, k, v, k_pages, v_pages, table, lengths = _setup()
    f = mixed_residency_attention
    with pytest.raises(ValueError, match=r"q: expected an array \[B, T, N, H\]"):
        f(q[0], k_pages, v_pages, table, lengths)
    with pytest.raises(ValueError, match="k_pages: expected an array"):
        f(q, k_pages[0], v_pages, table, lengths)
    with pytest.raises(ValueError, match="v_pages: expected k_pages' shape"):
        f(q, k_pages, v_pages[:, :3], table, lengths)
    with pytest.raises(
        ValueError, match="k_pages: expected kv heads K >= 1 dividing q's N=3 heads, got K=2"
    ):
        f(q[:, :, :3], k_pages, v_pages, table, lengths)
    with pytest.raises(ValueError, match="device_table: expected an integer array int"):
        f(q, k_pages, v_pages, table.astype(jnp.float32), lengths)
    with pytest.raises(ValueError, match="device_table: expected B=5 rows"):
        f(q, k_pages, v_pages, table[:2], lengths)
    with pytest.raises(ValueError, match=r"lengths: expected int \[B=5\]"):
        f(q, k_pages, v_pages, table, lengths[:2])
    with pytest.raises(
        ValueError, match="cold_v_pages: expected cold_k_pages and cold_v_pages given together"
    ):
        f(q, k_pages, v_pages, table, lengths, cold_table=table, cold_k_pages=k_pages)
    with pytest.raises(ValueError, match="cold_table: expected a cold_table with cold_k_pages"):
        f(q, k_pages, v_pages, table, lengths, cold_k_pages=k_pages, cold_v_pages=v_pages)
    with pytest.raises(ValueError, match="cold_table: expected shape"):
        f(q, k_pages, v_pages, table, lengths, cold_table=table[:, :2])
    with pytest.raises(ValueError, match="cold_k_pages: expected shape"):
        f(q, k_pages, v_pages, table, lengths, cold_table=table,
          cold_k_pages=k_pages[..., :3], cold_v_pages=v_pages[..., :3])  # fmt: skip
    with pytest.raises(ValueError, match="cold_v_pages: expected cold_k_pages' shape"):
        f(q, k_pages, v_pages, table, lengths, cold_table=table,
          cold_k_pages=k_pages[:, :3], cold_v_pages=v_pages[:, :4])  # fmt: skip
    with pytest.raises(ValueError, match="cold_k_pages: expected dtype"):
        f(q, k_pages, v_pages, table, lengths, cold_table=table,
          cold_k_pages=k_pages.astype(jnp.bfloat16), cold_v_pages=v_pages)  # fmt: skip
    with pytest.raises(ValueError, match="q_positions: expected shape"):
        f(q, k_pages, v_pages, table, lengths, q_positions=jnp.zeros((5, 2), jnp.int32))
    q2 = jnp.concatenate([q, q], axis=1)
    with pytest.raises(NotImplementedError, match="return_page_mass with a cold part needs T"):
        f(q2, k_pages, v_pages, table, lengths, cold_table=table, return_page_mass=True)
    keep = jnp.ones((B, M), bool)
    with pytest.raises(ValueError, match="page_table: expected an integer array"):
        split_residency(table.astype(jnp.float32), keep, keep)
    with pytest.raises(ValueError, match="demote: expected bool"):
        split_residency(table, keep, keep.astype(jnp.int32))


@pytest.mark.parametrize("jit", [False, True])
def test_sinks_join_once_after_the_merge(jit):
    """With every page fetched and a sink per head, the merge equals the references."""
    q, k, v, k_pages, v_pages, table, lengths = _setup(7)
    keep = jnp.asarray(np.random.default_rng(7).random((B, M)) < 0.5)
    device_table, cold_table = split_residency(table, keep, ~keep)
    sinks = jnp.asarray(np.random.default_rng(8).standard_normal(N) + 1.0, jnp.float32)
    fn = functools.partial(mixed_residency_attention, sinks=sinks, return_page_mass=True)
    fn = jax.jit(fn) if jit else fn
    res = fn(q, k_pages, v_pages, device_table, lengths, cold_table=cold_table)
    out_ref, lse_ref = _reference(q, k, v, lengths, sinks=sinks)
    assert_close(res.out, out_ref, dtype=jnp.float32, what="out vs attention_reference")
    assert_close(res.lse, lse_ref, dtype=jnp.float32, what="lse (sink included)")
    paged_ref = paged.paged_attention_reference(q, k_pages, v_pages, table, lengths, sinks=sinks)
    assert_close(res.out, paged_ref.out, dtype=jnp.float32, what="out vs paged reference")
    # Rows with no key: lse is the sink itself, out is 0 (the sink holds all the mass).
    np.testing.assert_allclose(np.asarray(res.lse[0, 0]), np.asarray(sinks), rtol=1e-6)
    # A sink applied twice (once per part) would differ: it must not match.
    twice_lse = jnp.logaddexp(res.lse, sinks)
    assert float(jnp.max(jnp.abs(twice_lse - lse_ref))) > 1e-3
    # The page mass is that of the full attention with the sink taking its share.
    full = paged.paged_attention(
        q, k_pages, v_pages, table, lengths, sinks=sinks, return_page_mass=True
    )
    assert_close(res.page_mass, full.page_mass, dtype=jnp.float32, what="page mass with sinks")
    # The mass kept is over the keys (sink excluded): exact from the keys' lses.
    _, lse_keys = _reference(q, k, v, lengths)
    _, lse_dev = _reference(q, k, v, lengths, keep_tokens=jnp.repeat(keep, C, axis=1))
    live = (np.asarray(lengths) > 0)[:, None, None]
    assert_close(
        res.mass_kept,
        jnp.where(live, jnp.exp(lse_dev - lse_keys), 1.0),
        dtype=jnp.float32,
        what="mass kept",
    )


def test_sinks_device_only_and_mask_spec():
    q, k, v, k_pages, v_pages, table, lengths = _setup(9)
    sinks = jnp.full((N,), 0.5, jnp.float32)
    spec = MaskSpec(causal=True, window=6)
    res = mixed_residency_attention(q, k_pages, v_pages, table, lengths, mask=spec, sinks=sinks)
    out_ref, lse_ref = _reference(q, k, v, lengths, window=6, sinks=sinks)
    assert res.mass_kept is None
    assert_close(res.out, out_ref, dtype=jnp.float32, what="device-only out with sinks")
    assert_close(res.lse, lse_ref, dtype=jnp.float32, what="device-only lse with sinks")


@pytest.mark.no_typecheck
def test_sinks_and_mask_errors():
    q, k, v, k_pages, v_pages, table, lengths = _setup()
    f = mixed_residency_attention
    with pytest.raises(ValueError, match=r"mixed_residency_attention: sinks: expected shape"):
        f(q, k_pages, v_pages, table, lengths, sinks=jnp.zeros(N + 1))
    with pytest.raises(ValueError, match=r"mixed_residency_attention: sinks: expected a floating"):
        f(q, k_pages, v_pages, table, lengths, sinks=jnp.zeros(N, jnp.int32))
    with pytest.raises(ValueError, match=r"mixed_residency_attention: "):
        f(q, k_pages, v_pages, table, lengths, mask=MaskSpec(causal=True), causal=True)


@pytest.mark.parametrize(
    "poisoned",
    [
        "keys",
        "values",
    ],
)
def test_keys_outside_the_window_have_no_effect_even_when_nan(poisoned):
    """Poison every key that no query of a 3-token chunk may see (window 6): same result."""
    Tq, window = 3, 6
    q, k, v, k_pages, v_pages, table, lengths = _setup(10, T=Tq)
    keep = jnp.asarray(np.random.default_rng(10).random((B, M)) < 0.5)
    device_table, cold_table = split_residency(table, keep, ~keep)
    fn = functools.partial(mixed_residency_attention, window=window)
    clean = fn(q, k_pages, v_pages, device_table, lengths, cold_table=cold_table)
    kp, vp = np.asarray(k_pages).copy(), np.asarray(v_pages).copy()
    tab = np.asarray(table)
    for b in range(B):
        first_query = int(LENGTHS[b]) - Tq
        for pos in range(M * C):
            hidden = pos <= first_query - window or pos >= LENGTHS[b]  # no query sees it
            if hidden and poisoned == "keys":
                kp[:, tab[b, pos // C], pos % C] = np.nan
            elif hidden:
                vp[:, tab[b, pos // C], pos % C] = np.inf
    dirty = fn(q, jnp.asarray(kp), jnp.asarray(vp), device_table, lengths, cold_table=cold_table)
    np.testing.assert_array_equal(np.asarray(dirty.out), np.asarray(clean.out))
    np.testing.assert_array_equal(np.asarray(dirty.lse), np.asarray(clean.lse))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_device_and_cold_pools(kind):
    """Quantized pools pass through to paged.paged_attention: the result is that of the
    decoded float pools (tight), cold pool of fewer pages included."""
    fmt = paged.KVFormat(kind)
    q, k, v, k_pages, v_pages, table, lengths = _setup(seed=3)
    sel, _ = _policy_selection(0.3, q, k, lengths)
    device_table, _ = split_residency(table, sel.keep, sel.demote)
    demoted = np.asarray(sel.demote)
    ids = np.asarray(table)[demoted]
    compact = np.zeros(table.shape, np.int32)
    compact[demoted] = np.arange(1, ids.size + 1)
    kq, vq = paged.quantize_pages(k_pages, fmt), paged.quantize_pages(v_pages, fmt)
    cold_k = paged.QuantizedPages(
        jnp.pad(kq.data[:, ids], ((0, 0), (1, 0), (0, 0), (0, 0))),
        jnp.pad(kq.scale[:, ids], ((0, 0), (1, 0), (0, 0))),
        fmt,
    )
    cold_v = paged.QuantizedPages(
        jnp.pad(vq.data[:, ids], ((0, 0), (1, 0), (0, 0), (0, 0))),
        jnp.pad(vq.scale[:, ids], ((0, 0), (1, 0), (0, 0))),
        fmt,
    )
    args = (device_table, lengths)
    options = dict(cold_table=jnp.asarray(compact), window=9, return_page_mass=True)
    run = jax.jit(functools.partial(mixed_residency_attention, window=9, return_page_mass=True))
    got = run(q, kq, vq, *args, cold_table=jnp.asarray(compact), cold_k_pages=cold_k,
              cold_v_pages=cold_v)  # fmt: skip
    want = mixed_residency_attention(
        q, kq.dequantize(), vq.dequantize(), *args, cold_k_pages=cold_k.dequantize(),
        cold_v_pages=cold_v.dequantize(), **options,
    )  # fmt: skip
    assert np.asarray(sel.demote).any()
    for name in ("out", "mass_kept", "page_mass"):
        assert_close(getattr(got, name), getattr(want, name), dtype=jnp.float32, what=name)
    with pytest.raises(ValueError, match="cold_k_pages: expected dtype quantized"):
        mixed_residency_attention(
            q, kq, vq, *args, cold_table=jnp.asarray(compact), cold_k_pages=cold_k.dequantize(),
            cold_v_pages=cold_v.dequantize(),
        )  # fmt: skip
    with pytest.raises(ValueError, match="v_pages: expected k_pages' shape"):
        mixed_residency_attention(q, kq, v_pages, *args)
