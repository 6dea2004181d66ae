"""The options object and the one validator: MaskSpec, resolve_mask, scalars, degenerate shapes."""

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
    resolve_mask,
    shard_positions,
    to_layout,
)
from tests._util import assert_close


def test_mask_spec_accepts_numpy_scalars_and_normalises():
    spec = MaskSpec(causal=np.bool_(True), window=np.int32(4), softcap=np.float32(2.5), scale=1)
    assert spec == MaskSpec(causal=True, window=4, softcap=2.5, scale=1.0)
    assert type(spec.causal) is bool and type(spec.window) is int
    assert type(spec.softcap) is float and type(spec.scale) is float
    assert hash(spec) == hash(MaskSpec(causal=True, window=4, softcap=2.5, scale=1.0))
    heads = MaskSpec(window=(np.int64(3), None, 5, 5))
    assert heads.window == (3, None, 5, 5) and heads.per_head
    assert heads.widest_window is None and heads.narrowest_window == 3
    same = MaskSpec(window=(4, 4))
    assert not same.per_head and same.uniform_window == 4
    assert BlockSizes(np.int64(8), np.int32(16)) == BlockSizes(8, 16)
    assert type(BlockSizes(np.int64(8)).block_q) is int


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(causal=1), "MaskSpec: causal: expected a bool"),
        (dict(window=True), "MaskSpec: window: expected an int >= 1"),
        (dict(window=3.0), "MaskSpec: window: expected an int >= 1"),
        (dict(window=np.float32(3)), "MaskSpec: window: expected an int >= 1"),
        (dict(window=0), "MaskSpec: window: expected an int >= 1"),
        (dict(window=()), "MaskSpec: window: expected a non-empty tuple"),
        (dict(window=(2, 0)), r"MaskSpec: window\[1\]: expected an int >= 1"),
        (dict(softcap=True), "MaskSpec: softcap: expected a positive finite float"),
        (dict(softcap=0.0), "MaskSpec: softcap: expected a positive finite float"),
        (dict(softcap="1"), "MaskSpec: softcap: expected a positive finite float"),
        (dict(scale=float("inf")), "MaskSpec: scale: expected a finite float"),
        (dict(scale=np.float64("nan")), "MaskSpec: scale: expected a finite float"),
    ],
)
def test_mask_spec_rejects_wrong_kinds(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MaskSpec(**kwargs)


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    ("kwargs", "arg", "name"),
    [
        (dict(causal=True), "causal", "causal"),
        (dict(window=3), "window", "window"),
        (dict(window=(None, 3)), r"window\[1\]", "window"),
        (dict(softcap=3.0), "softcap", "softcap"),
    ],
)
def test_a_traced_option_says_it_is_traced_and_how_to_bind_it(kwargs, arg, name):
    """``jax.jit(f)(q, k, v, causal=True)`` traces the option: the error says so and names
    both ways to bind it (the docs' semantics page promises this message). Bound, the same
    call runs."""
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(
        ValueError,
        match=rf"blockwise_attention: {arg}: expected .* known before tracing .*got a traced "
        rf"value .*functools\.partial\(blockwise_attention, {name}=\.\.\.\).*"
        rf"jax\.jit\(blockwise_attention, static_argnames=\('{name}',\)\)",
    ):
        jax.jit(blockwise_attention)(q, q, q, **kwargs)
    jax.jit(blockwise_attention, static_argnames=tuple(kwargs))(q, q, q, **kwargs)


def test_resolve_mask_is_the_one_validator():
    assert resolve_mask("f") == MaskSpec()
    assert resolve_mask("f", default_causal=True) == MaskSpec(causal=True)
    assert resolve_mask("f", causal=False, default_causal=True) == MaskSpec()
    spec = MaskSpec(window=3)
    assert resolve_mask("f", spec) is spec
    with pytest.raises(ValueError, match=r"f: mask: expected either mask= or .* \['causal'\]"):
        resolve_mask("f", spec, causal=True)
    with pytest.raises(ValueError, match="f: window: expected an int >= 1, got 0"):
        resolve_mask("f", window=0)
    dense = MaskSpec(dense=DenseMask.causal(2, 2))
    assert resolve_mask("f", dense, dense_ok=True) is dense
    with pytest.raises(NotImplementedError, match="f: mask: a DenseMask is supported by"):
        resolve_mask("f", dense)  # paged and the distributed paths reject it


@pytest.mark.no_typecheck
def test_resolve_mask_rejects_non_spec():
    with pytest.raises(ValueError, match=r"f: mask: expected a ringattn\.MaskSpec"):
        resolve_mask("f", {"causal": True})


def _qkv(B=1, T=9, S=11, N=4, K=2, H=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(ks[0], (B, T, N, H)),
        jax.random.normal(ks[1], (B, S, K, H)),
        jax.random.normal(ks[2], (B, S, K, H)),
    )


def test_numpy_scalar_options_give_the_same_result():
    q, k, v = _qkv(S=9)
    fast = functools.partial(blockwise_attention, block_sizes=BlockSizes(np.int32(4), 4))
    a = fast(q, k, v, causal=np.bool_(True), window=np.int64(5), softcap=np.float32(3.0))
    b = fast(q, k, v, causal=True, window=5, softcap=3.0)
    assert_close(a.out, b.out, dtype=jnp.float32)
    pos = shard_positions("zigzag", np.int32(1), np.int64(2), np.int16(4))
    assert pos.tolist() == [2, 3, 4, 5]
    assert to_layout(jnp.arange(8)[None], "striped", num_shards=np.int8(2)).shape == (1, 8)


@pytest.mark.parametrize("fn", [blockwise_attention, attention_reference])
@pytest.mark.parametrize(
    "shape", [(0, 5, 7), (2, 0, 7), (2, 5, 0), (0, 0, 0)], ids=["B0", "T0", "S0", "all0"]
)
def test_degenerate_lengths_give_empty_results(fn, shape):
    B, T, S = shape
    q, k, v = _qkv(B, T, S)
    sinks = jnp.asarray([0.5, -1.0, 0.0, 2.0])
    for kw in (dict(), dict(causal=True, window=3), dict(sinks=sinks)):
        out, lse = fn(q, k, v, **kw)
        assert out.shape == (B, T, 4, 8) and lse.shape == (B, T, 4)
        assert not np.asarray(out).any()
        want_lse = sinks if "sinks" in kw else -jnp.inf
        np.testing.assert_array_equal(np.asarray(lse), np.broadcast_to(want_lse, lse.shape))

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, causal=True).out)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert all(not np.asarray(g).any() for g in grads)


@pytest.mark.no_typecheck
@pytest.mark.parametrize("fn", [blockwise_attention, attention_reference])
def test_degenerate_heads_name_the_argument(fn):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="q: expected head dim H >= 1"):
        fn(q[..., :0], k[..., :0], v[..., :0])
    with pytest.raises(ValueError, match="k: expected kv heads K >= 1"):
        fn(q, k[:, :, :0], v[:, :, :0])
    with pytest.raises(ValueError, match="q: expected query heads N a positive multiple"):
        fn(q[:, :, :0], k, v)


def test_options_travel_as_pytrees_under_jit():
    """SegmentIds and Positions are traced arrays; MaskSpec is a static argument."""
    q, k, v = _qkv(B=2)
    seg = SegmentIds(jnp.zeros((2, 9), jnp.int32), jnp.zeros((2, 11), jnp.int32))
    pos = Positions(jnp.arange(2, 11, dtype=jnp.int32)[None].repeat(2, 0), None)
    f = jax.jit(blockwise_attention, static_argnames=("mask",))
    got = f(q, k, v, mask=MaskSpec(causal=True), segment_ids=seg, positions=pos)
    want = attention_reference(q, k, v, causal=True, positions=pos)
    assert_close(got.out, want.out, dtype=jnp.float32)


@pytest.mark.parametrize("window", [(None, None, None, None), (3, 3, 3, 3)])
def test_a_tuple_of_equal_windows_is_the_uniform_window(window):
    """One entry per head, all equal (all None included): the same as the scalar window."""
    q = jax.random.normal(jax.random.key(0), (1, 8, 4, 8))
    kv = jax.random.normal(jax.random.key(1), (1, 8, 2, 8))
    for fn in (attention_reference, blockwise_attention):
        got = fn(q, kv, kv, causal=True, window=window).out
        want = fn(q, kv, kv, causal=True, window=window[0]).out
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


@pytest.mark.parametrize("fn", [blockwise_attention, attention_reference])
@pytest.mark.parametrize(
    "mask",
    [MaskSpec(causal=True), MaskSpec(window=2), MaskSpec(window=(None, 3, None, None))],
    ids=["causal", "window", "head-window"],
)
def test_a_query_block_of_another_length_needs_its_positions(fn, mask):
    """Issue 29 item 3: T != S under a positional mask is a ValueError without positions.q
    (``ringattn`` used to put the queries first, ``paged`` puts them last)."""
    T, S = 2, 6
    q, k, v = _qkv(1, T, S)
    match = rf"{fn.__name__}: positions: expected ringattn.Positions\(q=...\) for a .* T={T}"
    with pytest.raises(ValueError, match=match):
        fn(q, k, v, mask=mask)
    with pytest.raises(ValueError, match=r"got only positions\.kv"):
        fn(q, k, v, mask=mask, positions=Positions(q=None, kv=jnp.arange(S)[None]))
    # Stated positions: queries at the end, as paged and the decode functions put them.
    last = Positions(q=jnp.arange(S - T, S, dtype=jnp.int32)[None], kv=None)
    got = fn(q, k, v, mask=mask, positions=last)
    padded = jnp.concatenate([jnp.zeros((1, S - T, 4, 8)), q], axis=1)  # T == S: unambiguous
    want = attention_reference(padded, k, v, mask=mask)
    assert_close(got.out, want.out[:, S - T :], dtype=jnp.float32, what="queries at the end")
    # No positional mask, or T == S: nothing is ambiguous.
    fn(q, k, v, mask=MaskSpec(softcap=2.0))
    fn(q, k[:, :T], v[:, :T], mask=mask)


def test_sharded_entries_ask_for_query_positions_too():
    from ringattn import ring_attention_per_shard, sharded_attention
    from tests._util import make_test_mesh

    q, k, v = _qkv(1, 2, 6)
    mesh = make_test_mesh((1,), ("s",))
    match = r"positions: expected ringattn.Positions\(q=...\) for a causal mask over T=2"
    with pytest.raises(ValueError, match="sharded_attention: " + match):
        sharded_attention(q, k, v, mesh=mesh, seq_axis="s", causal=True)
    ring = jax.shard_map(
        lambda q, k, v: ring_attention_per_shard(q, k, v, seq_axis="s", causal=True).out,
        mesh=mesh,
        in_specs=jax.sharding.PartitionSpec(None, "s"),
        out_specs=jax.sharding.PartitionSpec(None, "s"),
    )
    with pytest.raises(ValueError, match="ring_attention_per_shard: " + match):
        ring(q, k, v)
