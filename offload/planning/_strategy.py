"""Step 4 of :func:`offload.planning.plan`: the parallel strategy for a sequence-parallel degree.

Which of ring, Ulysses, USP and all-gather can run D groups of devices (head counts, node
boundaries, memory left for a gathered layer), and the cheapest by the cost model
(:mod:`offload.planning._cost_model`), with estimates within :data:`TIE_THRESHOLD` reported as
ties broken by a fixed order. Pure Python; no arrays.
"""

import math

from offload.planning._cost_model import (
    estimate_prefill,
)
from offload.planning._planner_types import (
    Reason,
)

__all__ = ["TIE_THRESHOLD"]


_STRATEGY_ORDER = ("ring", "ulysses", "usp", "allgather")  # ties go to the earlier one


#: Strategies whose estimated prefill times are within this share of the cheapest tie: the
#: cost model's terms are rough (constants within about 15% on the CPU it was checked on), so
#: a smaller margin is reported as a tie and broken by ``_STRATEGY_ORDER``.
TIE_THRESHOLD = 0.01


def _strategy_candidates(model, hardware, D, S, free, tp=1):
    """{strategy: ulysses degree} of the strategies that can run ``D`` groups of ``tp``
    devices (``free``: bytes of a device's KV memory this request leaves free)."""
    N, H = model.query_heads // tp, model.head_dim
    K = model.kv_heads_per_device(tp)
    per_node = max(1, hardware.devices_per_node // tp)  # groups inside one node
    out = {"ring": 1}
    spans = D * tp > hardware.devices_per_node
    if N % D == 0 and not spans:
        out["ulysses"] = D
    if "ulysses" not in out:
        us = [u for u in range(2, D) if D % u == 0 and N % u == 0]
        us = [u for u in us if u <= per_node]
        if us:
            out["usp"] = max(us)
    gathered = 2 * S * K * H * model.itemsize
    out["allgather"] = 1 if gathered <= free else None
    return {k: v for k, v in out.items() if v is not None}


def _choose_strategy(model, hardware, D, S, free=None, tp=1):
    """(strategy, ulysses degree, estimate tuple, reasons); ``free``: bytes of a device's KV
    memory the request leaves free (default: all of it); ``tp``: devices per group."""
    free = hardware.device_memory if free is None else free
    candidates = _strategy_candidates(model, hardware, D, S, free, tp)
    costs = {
        s: estimate_prefill(s, model, hardware, S=S, D=D, ulysses_degree=u, tensor_parallel=tp)
        for s, u in candidates.items()
    }
    best = min(costs, key=lambda s: (costs[s][4], _STRATEGY_ORDER.index(s)))
    tied = [
        s
        for s in _STRATEGY_ORDER
        if s in costs and s != best and costs[s][4] <= costs[best][4] * (1 + TIE_THRESHOLD)
    ]
    spans = D * tp > hardware.devices_per_node
    N_r, K_r = model.query_heads // tp, model.kv_heads_per_device(tp)
    heads = f"N={N_r} query heads, K={K_r} kv heads per device over D={D} sequence shards"
    notes = []
    if "ulysses" not in candidates:
        why = "the group spans nodes" if spans else f"N={N_r} is not a multiple of D={D}"
        notes.append(f"Ulysses needs N divisible by D inside a node: {why}")
    elif K_r < D:
        notes.append(f"Ulysses repeats kv heads to lcm(K, D)={K_r * (D // math.gcd(K_r, D))}")
    if "allgather" not in candidates:
        notes.append(
            "all-gather would hold a whole layer's K/V on each device: it does not fit beside "
            "the request's pages"
        )
    summary = ", ".join(f"{s} {costs[s][4] * 1e3:,.1f} ms" for s in _STRATEGY_ORDER if s in costs)
    numbers = {f"{s}_ms": costs[s][4] * 1e3 for s in costs}
    numbers.update({"N": N_r, "K": K_r, "D": D, "ties": len(tied)})
    if tied:
        names = " and ".join([best, *tied])
        verdict = (
            f"{names} tie: their estimates are within {TIE_THRESHOLD:.0%} of each other, "
            f"closer than this cost model can tell apart; tie-break: the first in the order "
            f"{', '.join(_STRATEGY_ORDER)} (fewest constraints on head counts and memory "
            f"first), so {best}"
        )
    else:
        verdict = f"{best} is the cheapest prefill, by more than {TIE_THRESHOLD:.0%}"
    reasons = [
        Reason(
            "cost model",
            f"{heads}: {verdict} ({summary})" + (f"; {'; '.join(notes)}" if notes else ""),
            numbers,
        )
    ]
    if spans:
        _, _, comm, _, total = costs[best]
        share = comm / total if total else 0.0
        reasons.append(
            Reason(
                "incident B",
                f"the group spans {D * tp // hardware.devices_per_node} nodes: communication "
                f"is {share:.0%} of the estimated prefill (in the article's case B, a 32-GPU "
                "cross-node ring, it was 60%)",
                {"communication_share": share, "incident_b_share": 0.60},
            )
        )
    return best, candidates[best], costs[best], tuple(reasons)
