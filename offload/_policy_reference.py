"""Numpy oracles of the retention policies (loops over sequences and units, no jnp)."""

import numpy as np

from offload._policies import Selection, units_by_length
from offload._retention import RetentionPolicy, budget_units

__all__ = ["select_keep_reference", "update_policy_state_reference"]


def update_policy_state_reference(scores, mass, *, policy: RetentionPolicy) -> np.ndarray:
    """Numpy oracle of :func:`update_policy_state` on raw arrays (``[B, U]``, ``[B, N, U]``).

    Plain numpy loops for tests (not jittable).
    """
    scores = np.asarray(scores, np.float32)
    mass = np.asarray(mass, np.float32)
    if not policy.uses_scores:
        return scores.copy()
    B, N, U = mass.shape
    w, half = policy.pool_size, policy.pool_size // 2
    pooled = np.empty_like(mass)
    for u in range(U):
        lo, hi = max(0, u - half), min(U, u + half + 1)
        window = mass[:, :, lo:hi]
        if policy.pool == "max":
            pooled[:, :, u] = window.max(axis=-1)
        else:
            pooled[:, :, u] = window.sum(axis=-1) / w
    reduced = pooled.sum(axis=1) if policy.head_reduce == "sum" else pooled.max(axis=1)
    if policy.kind == "h2o":
        return scores + reduced
    if policy.kind != "scissorhands":
        return reduced
    # Scissorhands: count the important units of this observation (module docstring of
    # offload._policies), after decaying the counts.
    out = scores * np.float32(policy.decay)
    for b in range(B):
        part = [u for u in range(U) if any(mass[b, n, u] > 0 for n in range(N))]
        if not part:
            continue
        values = reduced[b, part]
        mean = np.float32(np.sum(values, dtype=np.float32) / np.float32(len(part)))
        threshold = min(mean, values.max()) if not np.isnan(mean) else np.nan
        for u in part:
            if reduced[b, u] >= threshold:
                out[b, u] += np.float32(1.0)
    return out


def select_keep_reference(
    scores, lengths, *, policy: RetentionPolicy, page_table=None, pinned=None, mode="demote"
) -> Selection:
    """Numpy oracle of :func:`select_keep`: a :class:`Selection` of numpy bool ``[B, U]``.

    Plain numpy loops for tests (not jittable); unpacks as ``keep, demote, drop, retrieve`` like the
    function it checks.
    """
    scores = np.asarray(scores, np.float32)
    B, U = scores.shape
    lengths = np.asarray(lengths)
    keep = np.zeros((B, U), bool)
    evicted = np.zeros((B, U), bool)
    for b in range(B):
        n_len = int(units_by_length(policy, int(lengths[b])))
        live = [u for u in range(min(U, n_len)) if page_table is None or int(page_table[b][u]) != 0]

        def key(u, n_len=n_len, b=b):
            if u < policy.sink:
                return (0, 0.0, u)
            if u >= n_len - policy.recent:
                return (1, 0.0, -u)
            s = float(scores[b, u])
            s = 0.0 if np.isnan(s) else s
            return (2, -s, -u)

        ranked = sorted(live, key=key)
        k = len(ranked)
        if pinned is None or not bool(pinned[b]):
            k = int(budget_units(policy, k))
        for u in ranked[:k]:
            keep[b, u] = True
        for u in ranked[k:]:
            evicted[b, u] = True
    if page_table is not None:  # a page kept by any row that holds it is kept by all
        table = np.asarray(page_table)
        kept_ids = {int(p) for p in table[keep]} - {0}
        for b in range(B):
            for u in range(U):
                if evicted[b, u] and int(table[b, u]) in kept_ids:
                    keep[b, u], evicted[b, u] = True, False
    none = np.zeros((B, U), bool)
    return Selection(
        keep=keep,
        demote=evicted if mode == "demote" else none,
        drop=evicted if mode == "drop" else none,
        retrieve=evicted if mode == "retrieve" else none,
    )
