"""Plumbing between the kernels and their callers: vmap folded into the batch axis (with the
batch axis elsewhere than 0 in block-major layouts) and the ring's one-buffer hop packing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringattn._batching import fold_vmap
from ringattn._ring import _pack, _unpack


def _kernel(blocks, x, y):
    """Batch-polymorphic: ``blocks [n, B, m]`` (B at axis 1), ``x [B, m]``, ``y [B]`` or None.

    Returns ``([n, B, m], [B])``: each row depends on its own batch row only.
    """
    extra = 0.0 if y is None else y[None, :, None]
    return blocks * x[None] + extra, jnp.sum(blocks, axis=(0, 2)) * jnp.sum(x, axis=1)


@pytest.mark.parametrize("with_y", [False, True])
@pytest.mark.parametrize("mapped", ["all", "blocks only", "x only"])
def test_fold_vmap_with_batch_axes_matches_plain_vmap(with_y, mapped):
    V, n, B, m = 3, 4, 2, 5
    rng = np.random.default_rng(0)
    blocks = jnp.asarray(rng.standard_normal((V, n, B, m)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((V, B, m)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((V, B)), jnp.float32) if with_y else None
    in_axes = {"all": (0, 0, 0), "blocks only": (0, None, None), "x only": (None, 0, 0)}[mapped]
    if mapped == "blocks only":
        x, y = x[0], None if y is None else y[0]
    if mapped == "x only":
        blocks = blocks[0]
    if y is None:
        in_axes = (*in_axes[:2], None)
    folded = fold_vmap(_kernel, in_axes=(1, 0, 0), out_axes=(1, 0))
    got = jax.jit(jax.vmap(folded, in_axes=in_axes))(blocks, x, y)
    want = jax.vmap(_kernel, in_axes=in_axes)(blocks, x, y)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    # Unmapped, the folded kernel is the kernel itself.
    one = (blocks if blocks.ndim == 3 else blocks[0], x if x.ndim == 2 else x[0], None)
    for g, w in zip(folded(*one), _kernel(*one), strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize(
    "dtypes",
    [
        (jnp.float32, jnp.float32, jnp.int32, jnp.int32),
        (jnp.bfloat16, jnp.bfloat16, jnp.int32, None),
        (jnp.int8, jnp.float32, jnp.int8, jnp.float32, jnp.int32, jnp.int32),
        (jnp.float8_e4m3fn, jnp.float32, jnp.float8_e4m3fn, jnp.float32, jnp.int32, None),
    ],
    ids=["f32", "bf16", "int8-hops", "fp8-hops"],
)
def test_hop_packing_round_trips_bitwise(dtypes):
    rng = np.random.default_rng(1)
    arrays = []
    for i, dt in enumerate(dtypes):
        if dt is None:
            arrays.append(None)
            continue
        shape = (2, 3, 5) if i % 2 == 0 else (2, 7)
        if dt == jnp.int32:  # every 16-bit half pattern a bfloat16 NaN could take, and more
            halves = np.array([0x7F81, 0x7FFF, 0xFF81, 0xFFC1, 0x0001, 0x7F80], np.uint32)
            x = (halves[rng.integers(0, 6, shape)] << 16) | halves[rng.integers(0, 6, shape)]
            arrays.append(jnp.asarray(x.view(np.int32)))
            continue
        if jnp.issubdtype(dt, jnp.integer):
            info = jnp.iinfo(dt)
            x = rng.integers(info.min, info.max, size=shape, endpoint=True).astype(dt)
        else:
            x = rng.standard_normal(shape).astype(np.float32)
            x.reshape(-1)[0] = np.nan  # any bit pattern survives, NaN included
        arrays.append(jnp.asarray(x, dt))
    narrowest = min(np.dtype(a.dtype).itemsize for a in arrays if a is not None)
    # The bug the integer buffer avoids: a bfloat16 concatenate canonicalizes NaN payloads.
    for fn in (lambda a: _unpack(*_pack(a)), jax.jit(lambda a: _unpack(*_pack(a)))):
        buffer, _ = _pack(arrays)
        assert buffer.ndim == 1 and np.dtype(buffer.dtype).itemsize == narrowest
        assert jnp.issubdtype(buffer.dtype, jnp.unsignedinteger)
        back = fn(arrays)
        assert len(back) == len(arrays)
        for a, b in zip(arrays, back, strict=True):
            if a is None:
                assert b is None
                continue
            assert b.shape == a.shape and b.dtype == a.dtype
            np.testing.assert_array_equal(
                jax.lax.bitcast_convert_type(b, jnp.uint8),
                jax.lax.bitcast_convert_type(a, jnp.uint8),
            )
