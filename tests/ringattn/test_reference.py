"""The oracle itself, checked against a naive numpy loop so every other test rests on rock."""

import jax.numpy as jnp
import numpy as np
import pytest

from ringattn import Positions, SegmentIds, attention_mask, attention_reference


def _naive(q, k, v, *, causal, window, qpos, kpos, qseg, kseg, softcap, scale):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    out = np.zeros((B, T, N, H))
    lse = np.full((B, T, N), -np.inf)
    for b in range(B):
        for t in range(T):
            for n in range(N):
                logits, vals = [], []
                for s in range(S):
                    if causal and kpos[b, s] > qpos[b, t]:
                        continue
                    if window is not None and kpos[b, s] <= qpos[b, t] - window:
                        continue
                    if qseg is not None and qseg[b, t] != kseg[b, s]:
                        continue
                    x = float(np.dot(q[b, t, n], k[b, s, n // G])) * scale
                    if softcap is not None:
                        x = softcap * np.tanh(x / softcap)
                    logits.append(x)
                    vals.append(v[b, s, n // G])
                if logits:
                    logits = np.array(logits)
                    m = logits.max()
                    w = np.exp(logits - m)
                    out[b, t, n] = (w[:, None] * np.array(vals)).sum(0) / w.sum()
                    lse[b, t, n] = m + np.log(w.sum())
    return out, lse


@pytest.mark.parametrize(
    "kw",
    [
        dict(causal=False, window=None, softcap=None, seg=False),
        dict(causal=True, window=3, softcap=None, seg=False),
        dict(causal=True, window=None, softcap=2.5, seg=True),
    ],
    ids=["plain", "causal-window", "causal-softcap-segments"],
)
def test_reference_matches_naive_loop(kw):
    rng = np.random.default_rng(0)
    B, T, S, N, K, H = 2, 5, 7, 4, 2, 3
    q = rng.normal(size=(B, T, N, H)).astype(np.float32)
    k = rng.normal(size=(B, S, K, H)).astype(np.float32)
    v = rng.normal(size=(B, S, K, H)).astype(np.float32)
    qpos = np.tile(np.arange(S - T, S), (B, 1)).astype(np.int32)
    kpos = np.tile(np.arange(S), (B, 1)).astype(np.int32)
    qseg = kseg = None
    if kw["seg"]:
        qseg = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]], np.int32)
        kseg = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]], np.int32)
    want, want_lse = _naive(
        q,
        k,
        v,
        causal=kw["causal"],
        window=kw["window"],
        qpos=qpos,
        kpos=kpos,
        qseg=qseg,
        kseg=kseg,
        softcap=kw["softcap"],
        scale=0.5,
    )
    got, lse = attention_reference(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        causal=kw["causal"],
        window=kw["window"],
        softcap=kw["softcap"],
        scale=0.5,
        positions=Positions(qpos, kpos),
        segment_ids=None if qseg is None else SegmentIds(qseg, kseg),
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-5)
    if kw["seg"]:  # query (1, 3) is in segment 2, which has no key: an empty row
        assert np.isneginf(np.asarray(lse)[1, 3]).all()
        assert not np.asarray(got)[1, 3].any()


def test_attention_mask_semantics():
    qpos = jnp.array([[5, 6]])
    kpos = jnp.arange(8)[None]
    m = np.asarray(attention_mask(qpos, kpos, causal=True, window=3))
    np.testing.assert_array_equal(m[0, 0], [0, 0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(m[0, 1], [0, 0, 0, 0, 1, 1, 1, 0])
    m = np.asarray(attention_mask(qpos, kpos, window=3))  # window alone hides only the past
    np.testing.assert_array_equal(m[0, 0], [0, 0, 0, 1, 1, 1, 1, 1])
