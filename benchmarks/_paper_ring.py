"""A port of the Ring Attention paper's JAX code, the baseline ``bench_gaps`` times our ring against.

The paper's code (Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for
Near-Infinite Context", 2023; ``haoliuhl/ringattention``, PyPI ``ringattention`` 0.1.2,
``ringattention_jax.py``) no longer imports on current JAX (``jax.lib.xla_bridge`` is gone),
so its algorithm is restated here, structure for structure, on the current API:

* ``ring_attention`` is a ``jax.custom_vjp``; the forward is a ``lax.scan`` over the ``n``
  hops, each hop a blockwise attention of the local queries against the visiting K/V block,
  then a ``ppermute`` of K and V to the next device (also after the last hop, as the paper's
  forward does);
* the blockwise attention is a ``lax.scan`` over query chunks, inside it a ``lax.scan`` over
  key chunks whose body is skipped with ``lax.cond`` when the chunk pair lies wholly above the
  causal diagonal; the causal mask is an additive bias of ``-1e10`` (the paper's chunk bias);
  the running statistics are the numerator, the denominator and the running max (not a
  log-sum-exp);
* the backward is a ``lax.scan`` over the hops rotating K, V, dK and dV, each hop a scan over
  key chunks with, inside, a scan over query chunks (again ``lax.cond``-skipped above the
  diagonal) that recomputes the probabilities from the saved max and denominator.

Kept out: attention bias, segment ids, dropout, the decode cache index and
``jax.checkpoint`` policies (none of which the causal fwd+bwd timing uses), so this is the
paper's causal path with ``causal_block_size=1``. Like the paper's code: no load balancing
(contiguous shards), no GQA (``K == N``), and ``check_vma=False`` (its ``lax.cond`` does not
pass the varying-axes check). Only public JAX is used; nothing from ``ringattn``.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

MASK_VALUE = -1e10  # the paper's additive mask value


def _causal_bias(q_chunk_index, k_chunk_index, chunk_q, chunk_kv):
    """``[1, 1, chunk_q, chunk_kv]``: 0 where a query may see the key, ``MASK_VALUE`` else."""
    q_idx = q_chunk_index * chunk_q + lax.broadcasted_iota(jnp.int32, (chunk_q, chunk_kv), 0)
    k_idx = k_chunk_index * chunk_kv + lax.broadcasted_iota(jnp.int32, (chunk_q, chunk_kv), 1)
    return jnp.where(q_idx < k_idx, MASK_VALUE, 0.0)[None, None].astype(jnp.float32)


def _visible(q_chunk_index, k_chunk_index, chunk_q, chunk_kv):
    """Whether any query of the query chunk sees any key of the key chunk (causal)."""
    return (q_chunk_index + 1) * chunk_q - 1 >= k_chunk_index * chunk_kv


def _chunks(x, size):
    """``[B, L, N, H]`` -> ``[L // size, B, size, N, H]``."""
    B, L, N, H = x.shape
    return jnp.moveaxis(x.reshape(B, L // size, size, N, H), 1, 0)


def _unchunks(x):
    """``[n, B, size, N, H]`` -> ``[B, n * size, N, H]``."""
    n, B, size, N, H = x.shape
    return jnp.moveaxis(x, 0, 1).reshape(B, n * size, N, H)


def _stats_chunks(x, size):
    """``[B, N, L]`` -> ``[L // size, B, N, size]``."""
    B, N, L = x.shape
    return jnp.moveaxis(x.reshape(B, N, L // size, size), 2, 0)


def _stats_unchunks(x):
    """``[n, B, N, size]`` -> ``[B, N, n * size]``."""
    n, B, N, size = x.shape
    return jnp.moveaxis(x, 0, 2).reshape(B, N, n * size)


def _blockwise_fwd(q, k, v, carry, q_start, k_start, causal, chunk_q, chunk_kv):
    """One hop: accumulates ``q`` against the visiting ``k, v`` into (numerator, denominator,
    max). ``q_start`` / ``k_start``: global chunk index of the first local query / key chunk."""
    numerator, denominator, max_score = carry
    scale = jnp.sqrt(q.shape[-1]).astype(q.dtype)
    qc, kc, vc = _chunks(q, chunk_q), _chunks(k, chunk_kv), _chunks(v, chunk_kv)
    num_c = _chunks(numerator, chunk_q)
    den_c, max_c = _stats_chunks(denominator, chunk_q), _stats_chunks(max_score, chunk_q)

    def per_query_chunk(_, xs):
        q_chunk, num, den, prev_max, q_index = xs

        def per_key_chunk(carry, ys):
            num, den, prev_max = carry
            k_chunk, v_chunk, k_index = ys
            s = jnp.einsum("bqhd,bkhd->bhqk", q_chunk, k_chunk) / scale
            if causal:
                s = s + _causal_bias(q_start + q_index, k_start + k_index, chunk_q, chunk_kv)
            new_max = lax.stop_gradient(jnp.maximum(prev_max, jnp.max(s, axis=-1)))
            p = jnp.exp(s - new_max[..., None])
            correction = jnp.exp(prev_max - new_max)
            num = num * jnp.moveaxis(correction, 1, 2)[..., None] + jnp.einsum(
                "bhqk,bkhd->bqhd", p, v_chunk
            )
            den = den * correction + p.sum(axis=-1)
            return (num, den, new_max), None

        def skip_upper_half(carry, ys):
            if not causal:
                return per_key_chunk(carry, ys)
            seen = _visible(q_start + q_index, k_start + ys[2], chunk_q, chunk_kv)
            return lax.cond(seen, per_key_chunk, lambda c, _: (c, None), carry, ys)

        ks = (kc, vc, jnp.arange(kc.shape[0]))
        (num, den, new_max), _ = lax.scan(skip_upper_half, (num, den, prev_max), ks)
        return (), (num, den, new_max)

    xs = (qc, num_c, den_c, max_c, jnp.arange(qc.shape[0]))
    _, (num_c, den_c, max_c) = lax.scan(per_query_chunk, (), xs)
    return _unchunks(num_c), _stats_unchunks(den_c), _stats_unchunks(max_c)


def _blockwise_bwd(q, k, v, g, carry, q_start, k_start, causal, chunk_q, chunk_kv):
    """One backward hop: adds this K/V block's contribution to dq, dk, dv."""
    dq, dk, dv, output, denominator, max_score = carry
    scale = jnp.sqrt(q.shape[-1]).astype(q.dtype)
    qc, gc, dqc, oc = (_chunks(x, chunk_q) for x in (q, g, dq, output))
    kc, vc, dkc, dvc = (_chunks(x, chunk_kv) for x in (k, v, dk, dv))
    den_c, max_c = _stats_chunks(denominator, chunk_q), _stats_chunks(max_score, chunk_q)

    def per_key_chunk(dq_all, xs):
        dk_chunk, dv_chunk, k_chunk, v_chunk, k_index = xs

        def per_query_chunk(carry, ys):
            dk_chunk, dv_chunk = carry
            q_chunk, dq_chunk, g_chunk, o_chunk, den, max_s, q_index = ys
            s = jnp.einsum("bqhd,bkhd->bhqk", q_chunk, k_chunk) / scale
            if causal:
                s = s + _causal_bias(q_start + q_index, k_start + k_index, chunk_q, chunk_kv)
            p = jnp.exp(s - max_s[..., None]) / den[..., None]
            dp = jnp.einsum("bqhd,bkhd->bhqk", g_chunk, v_chunk)
            ds = (dp - jnp.einsum("bqhd,bqhd->bhq", g_chunk, o_chunk)[..., None]) * p
            dq_chunk = dq_chunk + jnp.einsum("bhqk,bkhd->bqhd", ds, k_chunk) / scale
            dk_chunk = dk_chunk + jnp.einsum("bqhd,bhqk->bkhd", q_chunk, ds) / scale
            dv_chunk = dv_chunk + jnp.einsum("bhqk,bqhd->bkhd", p, g_chunk)
            return (dk_chunk, dv_chunk), dq_chunk

        def skip_upper_half(carry, ys):
            if not causal:
                return per_query_chunk(carry, ys)
            seen = _visible(q_start + ys[-1], k_start + k_index, chunk_q, chunk_kv)
            return lax.cond(seen, per_query_chunk, lambda c, y: (c, y[1]), carry, ys)

        ys = (qc, dq_all, gc, oc, den_c, max_c, jnp.arange(qc.shape[0]))
        (dk_chunk, dv_chunk), dq_all = lax.scan(skip_upper_half, (dk_chunk, dv_chunk), ys)
        return dq_all, (dk_chunk, dv_chunk)

    xs = (dkc, dvc, kc, vc, jnp.arange(kc.shape[0]))
    dqc, (dkc, dvc) = lax.scan(per_key_chunk, dqc, xs)
    return _unchunks(dqc), _unchunks(dkc), _unchunks(dvc)


def _rotate(x, axis_name, n):
    return lax.ppermute(x, axis_name, perm=[(i, (i + 1) % n) for i in range(n)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def ring_attention(q, k, v, axis_name, causal, chunk_q, chunk_kv):
    """Per-shard ring attention (inside ``shard_map``): q, k, v ``[B, L, N, H]`` -> out."""
    return _ring_fwd(q, k, v, axis_name, causal, chunk_q, chunk_kv)[0]


def _ring_fwd(q, k, v, axis_name, causal, chunk_q, chunk_kv):
    B, L, N, H = q.shape
    n = lax.psum(1, axis_name)
    me = lax.axis_index(axis_name)
    numerator = jnp.zeros((B, L, N, H), q.dtype)
    denominator = jnp.zeros((B, N, L), q.dtype)
    max_score = jnp.full((B, N, L), -jnp.inf, q.dtype)

    def hop(carry, step):
        max_score, numerator, denominator, k, v = carry
        source = (me - step) % n  # whose K/V block is visiting
        numerator, denominator, max_score = _blockwise_fwd(
            q, k, v, (numerator, denominator, max_score),
            me * (L // chunk_q), source * (L // chunk_kv), causal, chunk_q, chunk_kv,
        )  # fmt: skip
        k, v = _rotate(k, axis_name, n), _rotate(v, axis_name, n)
        return (max_score, numerator, denominator, k, v), None

    init = (max_score, numerator, denominator, k, v)
    (max_score, numerator, denominator, _, _), _ = lax.scan(hop, init, jnp.arange(n))
    output = numerator / jnp.moveaxis(denominator, 1, 2)[..., None]
    return output.astype(v.dtype), (output, q, k, v, denominator, max_score)


def _ring_bwd(axis_name, causal, chunk_q, chunk_kv, res, g):
    output, q, k, v, denominator, max_score = res
    L = q.shape[1]
    n = lax.psum(1, axis_name)
    me = lax.axis_index(axis_name)
    dq = jnp.zeros_like(q, dtype=jnp.float32)
    dk = jnp.zeros_like(k, dtype=jnp.float32)
    dv = jnp.zeros_like(v, dtype=jnp.float32)

    def hop(carry, step):
        dq, dk, dv, k, v = carry
        source = (me - step) % n
        dq, dk, dv = _blockwise_bwd(
            q, k, v, g, (dq, dk, dv, output, denominator, max_score),
            me * (L // chunk_q), source * (L // chunk_kv), causal, chunk_q, chunk_kv,
        )  # fmt: skip
        k, v, dk, dv = (_rotate(x, axis_name, n) for x in (k, v, dk, dv))
        return (dq, dk, dv, k, v), None

    (dq, dk, dv, _, _), _ = lax.scan(hop, (dq, dk, dv, k, v), jnp.arange(n))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


ring_attention.defvjp(_ring_fwd, _ring_bwd)


def make_paper_ring(mesh, seq_axis, *, causal, chunk=512):
    """``f(q, k, v) -> out`` on global ``[B, S, N, H]`` arrays sharded contiguously along S over
    ``mesh``'s ``seq_axis`` (``K == N``: the paper's code has no GQA). Query and key chunks are
    ``min(chunk, S / devices)`` (the paper's ``query_chunk_size`` / ``key_chunk_size``)."""
    n = mesh.shape[seq_axis]

    def per_shard(q, k, v):
        size = min(chunk, q.shape[1])
        return ring_attention(q, k, v, seq_axis, causal, size, size)

    spec = P(None, seq_axis)

    def attend(q, k, v):
        if q.shape[1] % n or k.shape != q.shape:
            raise ValueError(f"make_paper_ring: expected q, k, v of one shape, S % {n} == 0")
        return jax.shard_map(
            per_shard, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False
        )(q, k, v)

    return attend
