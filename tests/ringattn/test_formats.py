"""``ringattn.KVFormat``: the one KV-format vocabulary. Its codec (``encode`` / ``decode``)
against numpy oracles written from the documented rules, its errors, and ``hop_format``
taking a KVFormat (the strings are shorthand for it: the very same program)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import ringattn
from ringattn import (
    HOP_FORMATS,
    KVFormat,
    dequantize_hop,
    hop_bytes,
    quantize_hop,
    ring_attention_per_shard,
    sharded_attention,
)
from tests._util import make_test_mesh

F32 = np.float32


def _tokens(shape, seed=0):
    """Tokens over six decades, one all-zero token, one constant, one NaN and one inf."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(F32)
    x *= (F32(10.0) ** rng.uniform(-3, 3, size=(*shape[:-1], 1))).astype(F32)
    flat = x.reshape(-1, shape[-1])
    flat[0], flat[1], flat[2, 3], flat[3, 0] = 0.0, -3.25, np.nan, np.inf
    return x


def _per_token_oracle(x, qmax, storage):
    """The documented int8 / fp8 rule in numpy (see ``ringattn._formats``)."""
    finite = np.isfinite(x).all(-1)
    absmax = np.max(np.abs(np.where(np.isfinite(x), x, 0)), -1).astype(F32)
    scale = np.where(finite, absmax * (F32(1) / F32(qmax)), np.nan).astype(F32)
    keep = finite & (scale >= F32(2.0**-126))
    scale = np.where(finite & ~keep, F32(0), scale)
    with np.errstate(invalid="ignore", divide="ignore"):
        y = x * (F32(1) / np.where(keep, scale, F32(1)))[..., None]
    y = np.clip(y, -qmax, qmax)
    if storage == np.int8:
        y = np.round(y)
    return np.where(keep[..., None], y, 0).astype(storage), scale


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_encode_decode_per_token_match_the_documented_rule(kind):
    x = _tokens((64, 3, 32))
    fmt = KVFormat(kind)
    storage = np.int8 if kind == "int8" else ml_dtypes.float8_e4m3fn
    data, scale = fmt.encode(jnp.asarray(x))
    want_data, want_scale = _per_token_oracle(x, fmt.qmax, storage)
    assert data.dtype == fmt.storage_dtype and scale.shape == x.shape[:-1]
    np.testing.assert_array_equal(np.asarray(data).view(np.uint8), want_data.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale).view(np.uint32), want_scale.view(np.uint32))
    back = np.asarray(fmt.decode(data, scale))
    want = want_data.astype(F32) * want_scale[..., None]
    np.testing.assert_array_equal(back, want)
    flat = back.reshape(-1, 32)
    assert np.all(flat[0] == 0) and np.isnan(flat[2]).all() and np.isnan(flat[3]).all()


def test_encode_decode_int4_round_trip_and_bound():
    x = _tokens((16, 2, 32))
    fmt = KVFormat("int4", group_size=8)
    data, scale = jax.jit(fmt.encode)(jnp.asarray(x))
    assert data.shape == (16, 2, 16) and data.dtype == np.uint8
    assert scale.shape == (16, 2, 4) and scale.dtype == jnp.bfloat16
    back = np.asarray(fmt.decode(data, scale)).reshape(-1, 4, 8)
    groups = x.reshape(-1, 4, 8)
    finite = np.isfinite(groups).all(-1)
    absmax = np.max(np.abs(np.where(finite[..., None], groups, 0)), -1, keepdims=True)
    err = np.abs(back - groups)[finite]
    bound = (absmax / 14 * (1 + 2.0**-8) * (1 + 1e-5))[finite]
    assert np.all(err <= bound), float(np.max(err - bound))
    assert np.isnan(back[~finite]).all()


def test_kinds_and_one_class():
    import paged

    assert paged.KVFormat is KVFormat
    for kind in KVFormat.KINDS:
        assert KVFormat(kind).kind == kind
    assert set(HOP_FORMATS) <= set(KVFormat.KINDS)
    assert KVFormat("int8") == KVFormat("int8") and hash(KVFormat("fp8")) == hash(KVFormat("fp8"))


@pytest.mark.no_typecheck
def test_encode_decode_errors():
    fmt = KVFormat("int8")
    with pytest.raises(ValueError, match=r"KVFormat\.encode: x: expected a floating array"):
        fmt.encode(jnp.ones((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"KVFormat\.encode: x: expected a head dim H divisible"):
        KVFormat("int4", group_size=8).encode(jnp.ones((2, 12)))
    with pytest.raises(ValueError, match=r"KVFormat\.encode: kivi2 quantizes keys per channel"):
        KVFormat("kivi2").encode(jnp.ones((2, 8)))
    with pytest.raises(ValueError, match=r"KVFormat\.decode: kivi2 quantizes keys per channel"):
        KVFormat("kivi2").decode(jnp.ones((2, 2), jnp.uint8), jnp.ones((2,)))
    with pytest.raises(ValueError, match=r"KVFormat\.decode: data: expected a int8 array"):
        fmt.decode(jnp.ones((2, 4)), jnp.ones((2,)))
    with pytest.raises(ValueError, match=r"KVFormat\.decode: scale: expected shape \(2,\)"):
        fmt.decode(jnp.ones((2, 4), jnp.int8), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match=r"KVFormat: kind: expected one of"):
        KVFormat("int3")


# ---- hop_format takes a KVFormat ----


@pytest.mark.parametrize("kind", HOP_FORMATS)
def test_hop_format_kvformat_is_the_string_shorthand(kind):
    """``hop_format=KVFormat(kind)`` and ``hop_format=kind`` quantize to the same bits, count
    the same bytes and build the very same ring program."""
    x = jnp.asarray(_tokens((6, 2, 16)))
    by_name, by_format = (
        quantize_hop(x, hop_format=kind),
        quantize_hop(x, hop_format=KVFormat(kind)),
    )
    for a, b in zip(by_name, by_format, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    np.testing.assert_array_equal(
        np.asarray(dequantize_hop(by_format)), np.asarray(KVFormat(kind).decode(*by_format))
    )
    args = (2, 64, 2, 16, "bfloat16")
    assert hop_bytes(*args, hop_format=kind) == hop_bytes(*args, hop_format=KVFormat(kind))
    mesh = make_test_mesh((2,), ("seq",))
    q, kv = jnp.ones((1, 16, 4, 8)), jnp.ones((1, 16, 2, 8))

    def program(fmt):
        f = functools.partial(
            sharded_attention, mesh=mesh, seq_axis="seq", causal=True, hop_format=fmt
        )
        return str(jax.make_jaxpr(f)(q, kv, kv))

    assert program(kind) == program(KVFormat(kind))


@pytest.mark.no_typecheck
@pytest.mark.parametrize("fmt", [KVFormat("int4"), KVFormat("kivi2")])
def test_hop_format_refuses_kinds_hops_do_not_carry(fmt):
    q, kv = jnp.zeros((1, 8, 4, 8)), jnp.zeros((1, 8, 2, 8))
    mesh = make_test_mesh((2,), ("seq",))
    match = r"hop_format: ring hops carry the per-token formats \('int8', 'fp8'\)"
    with pytest.raises(NotImplementedError, match="sharded_attention: " + match):
        sharded_attention(q, kv, kv, mesh=mesh, seq_axis="seq", hop_format=fmt)
    with pytest.raises(NotImplementedError, match="hop_bytes: " + match):
        hop_bytes(1, 8, 2, 8, "float32", hop_format=fmt)
    with pytest.raises(NotImplementedError, match="quantize_hop: " + match):
        quantize_hop(kv, hop_format=fmt)
    f = jax.shard_map(
        lambda q, k, v: ring_attention_per_shard(q, k, v, seq_axis="seq", hop_format=fmt).out,
        mesh=mesh,
        in_specs=jax.sharding.PartitionSpec(None, "seq"),
        out_specs=jax.sharding.PartitionSpec(None, "seq"),
    )
    with pytest.raises(NotImplementedError, match="ring_attention_per_shard: " + match):
        jax.jit(f).lower(q, kv, kv)


@pytest.mark.no_typecheck
def test_dequantize_hop_refuses_a_foreign_dtype():
    with pytest.raises(ValueError, match=r"dequantize_hop: hop\.data: expected an int8 or"):
        dequantize_hop(ringattn.QuantizedHop(jnp.ones((2, 4), jnp.uint8), jnp.ones((2,))))
