"""The article's decision procedure as a function: :func:`plan` (workload, hardware).

The article is :data:`ARTICLE` (in Chinese); its rules are cited by section
(:data:`ARTICLE_SECTIONS`).

Pure Python over the frozen dataclasses of :mod:`offload.planning._planner_types`; no arrays. The
order of decisions, each recorded with its reasons:

1. sizing length (rule 1): ``p95 + 2 sigma``, capped at the longest request, never the max;
2. page size (iron rule 2, rule 4): 64 when prefix reuse is above 50%, 4 when the sizing
   length is under 2K tokens, 16 otherwise (with this repo's measured savings and waste);
3. for the model's KV format, then each allowed lossy format (none unless the workload opts
   in): the smallest sequence-parallel degree (groups of ``TP`` tensor-parallel devices) at
   which one request fits in what the weights' share leaves of device memory. Iron rule 1: no
   sequence parallelism under 128K tokens. Iron rule 3 with the article's case B: above 512K
   the group stays inside one node and what does not fit goes to pinned host memory, then
   disk. A quantized format is chosen only when it turns "does not fit on devices" into "fits";
4. the strategy for the degree, by head counts and links, then by the cost model
   (:mod:`offload.planning._cost_model`); estimates within :data:`TIE_THRESHOLD` are reported as ties;
5. tiers, retention (fetch cold pages back, never drop them: this repo's measurements), prefix
   saving, the cost estimate and whether the request fits at all.
"""

import dataclasses
import math

from offload.planning._cost_model import (
    CostEstimate,
    estimate_decode,
    estimate_prefill,
    prefill_flops,
)
from offload.planning._planner_types import (
    Decision,
    Hardware,
    Plan,
    Reason,
    Tiers,
    Workload,
)

__all__ = [
    "ARTICLE",
    "ARTICLE_RULES",
    "ARTICLE_SECTIONS",
    "IRON_RULE_1_TOKENS",
    "IRON_RULE_3_TOKENS",
    "MEASURED",
    "PAGE_SIZE_SHORT_TOKENS",
    "PREFIX_REUSE_THRESHOLD",
    "TIE_THRESHOLD",
    "plan",
]

#: The article the decision procedure comes from, by its title (English, then the original).
ARTICLE = (
    '"The engineering truth of long-context inference, 2026: PagedAttention, Ring Attention '
    'and KV cache offloading in practice, from 128K to 1M context" '
    "(长上下文推理的工程真相 2026：从 128K 到 1M context 的 PagedAttention、Ring Attention 与 KV "
    "cache 卸载实战)"
)

_DECISION_TREE = "section 5, the practical decision tree (2026 edition)"
_TWELVE_RULES = "section 7, the twelve engineering rules for production"
_INCIDENTS = "section 8, typical incidents and their post-mortems"

#: Where in :data:`ARTICLE` each rule id is, in words.
ARTICLE_SECTIONS = {
    "iron rule 1": f"{_DECISION_TREE}, iron rule 1",
    "iron rule 2": f"{_DECISION_TREE}, iron rule 2",
    "iron rule 3": f"{_DECISION_TREE}, iron rule 3",
    "rule 1": f"{_TWELVE_RULES}, rule 1",
    "rule 2": f"{_TWELVE_RULES}, rule 2",
    "rule 4": f"{_TWELVE_RULES}, rule 4",
    "rule 5": f"{_TWELVE_RULES}, rule 5",
    "rule 6": f"{_TWELVE_RULES}, rule 6",
    "rule 11": f"{_TWELVE_RULES}, rule 11",
    "incident B": f"{_INCIDENTS}, case B (a legal SaaS's 1M-token trial on 32 H100s)",
    "incident C": f"{_INCIDENTS}, case C (an e-commerce chat service's NVMe offload)",
}

#: The article's rules the planner applies, by id (paraphrased; see :data:`ARTICLE_SECTIONS`).
ARTICLE_RULES = {
    "iron rule 1": "under 128K tokens do not use sequence parallelism",
    "iron rule 2": "with prefix reuse above 50% force page size 64 (claimed: saves 30-40%)",
    "iron rule 3": "above 512K tokens combine offload with sequence parallelism",
    "rule 1": "size for p95 + 2 sigma of the length distribution, not for the max",
    "rule 2": "with system-prompt reuse above 50% enable prefix caching and page size 64",
    "rule 4": "page size 16 by default, 64 with heavy prefix reuse, 4 under 2K tokens",
    "rule 5": "max_num_seqs 64-128 per H100",
    "rule 6": "CPU swap space of 16-32 GB for long contexts; NVMe offload is off by default",
    "rule 11": "NVMe above 100k IOPS becomes the bottleneck",
    "incident B": "a 32-GPU cross-node ring at 1M tokens spent 60% of its time communicating",
    "incident C": "NVMe offload saturated IOPS at peak: only for latency-tolerant work",
}

IRON_RULE_1_TOKENS = 128 * 1024  #: no sequence parallelism below this sizing length
IRON_RULE_3_TOKENS = 512 * 1024  #: above this, offload + sequence parallelism within a node
PAGE_SIZE_SHORT_TOKENS = 2048  #: rule 4: page size 4 below this sizing length
PREFIX_REUSE_THRESHOLD = 0.5  #: iron rule 2 / rule 2: page size 64 above this share

#: Measurements the reasons cite, by name: (file, number).
MEASURED = {
    "prefix saving C=64, 50% share": ("paged_memory.md (c)", 0.1603),
    "prefix saving C=64, 80% share": ("paged_memory.md (c)", 0.2490),
    "waste under 2K, C=4": ("paged_memory.md (b)", 0.0014),
    "waste under 2K, C=16": ("paged_memory.md (b)", 0.0070),
    "waste under 2K, C=64": ("paged_memory.md (b)", 0.0278),
    "h2o mass at 20%, concentrated": ("policies.md", 0.974),
    "h2o mass at 20%, mild": ("policies.md", 0.596),
    "h2o mass at 20%, drifting": ("policies.md", 0.789),
    "h2o mass at 20%, uniform": ("policies.md", 0.207),
    "passkey accuracy, all pages": ("quality.md", 0.94),
    "passkey accuracy, h2o drop at 20%": ("quality.md", 0.80),
    "passkey accuracy, demote and fetch back": ("quality.md", 0.94),
    "accuracy float32": ("quality.md, KV formats", 0.938),
    "accuracy int8": ("quality.md, KV formats", 0.938),
    "accuracy fp8": ("quality.md, KV formats", 0.938),
    "accuracy int4": ("quality.md, KV formats", 0.925),
    "accuracy kivi2": ("quality.md, KV formats", 0.850),
    "bytes vs bf16 int8": ("kvquant.md, Llama-3-70B", 0.516),
    "bytes vs bf16 fp8": ("kvquant.md, Llama-3-70B", 0.516),
    "bytes vs bf16 int4": ("kvquant.md, Llama-3-70B", 0.281),
    "bytes vs bf16 kivi2": ("kvquant.md, Llama-3-70B", 0.195),
}

_STRATEGY_ORDER = ("ring", "ulysses", "usp", "allgather")  # ties go to the earlier one

#: Strategies whose estimated prefill times are within this share of the cheapest tie: the
#: cost model's terms are rough (constants within about 15% on the CPU it was checked on), so
#: a smaller margin is reported as a tie and broken by ``_STRATEGY_ORDER``.
TIE_THRESHOLD = 0.01


def _measured(name: str) -> tuple[str, float]:
    return MEASURED[name]


def _results(*where: str) -> str:
    """A :data:`MEASURED` source in words: the results file(s) in this repository."""
    files = "; ".join(f"benchmarks/results/{w}" for w in dict.fromkeys(where))
    return f"this repository's benchmark results ({files}, in the source repository)"


def _cite(reason: Reason, hardware: Hardware) -> Reason:
    """``reason`` with its source filled in from its rule when it has none."""
    if reason.source:
        return reason
    if reason.rule in ARTICLE_SECTIONS:
        source = f"the article {ARTICLE}, {ARTICLE_SECTIONS[reason.rule]}"
    elif reason.rule == "cost model":
        source = "offload's cost model on the hardware description: " + "; ".join(
            f"{name} {hardware.label(name)}"
            for name in ("device_flops", "memory_bandwidth", "attention_efficiency")
        )
    else:
        return reason
    return dataclasses.replace(reason, source=source)


def _size(n: int | float) -> str:
    """Bytes in binary units, for reasons' text."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _sizing(workload: Workload) -> Decision:
    d = workload.lengths
    raw = d.p95 + 2.0 * d.sigma
    size = d.sizing_length
    numbers = {"p95": d.p95, "sigma": d.sigma, "p95 + 2 sigma": raw, "sizing_length": size}
    text = f"p95 {d.p95:,.0f} + 2 sigma ({2 * d.sigma:,.0f}) = {raw:,.0f} tokens"
    if d.max_length is not None:
        numbers["max_length"] = d.max_length
        if raw > d.max_length:
            text += f", capped at the longest request {d.max_length:,}"
        else:
            ratio = d.max_length / size
            numbers["max / sizing"] = ratio
            text += f"; sizing for the max {d.max_length:,} would cost {ratio:.2f}x the memory"
    reasons = [Reason("rule 1", text + " (rule 1: size for p95 + 2 sigma, not the max)", numbers)]
    if d.count is not None and d.max_length is not None and size < d.max_length:
        reasons.append(
            Reason(
                "model",
                "requests longer than the sizing length need a split or a reject: they are "
                "not planned for",
                {"sizing_length": size},
            )
        )
    return Decision(size, tuple(reasons))


def _page_size(workload: Workload, sizing: int) -> tuple[Decision, Decision]:
    """(page size, prefix saving)."""
    share, prefix = workload.prefix_reuse, workload.prefix_tokens
    mean = workload.lengths.mean
    ideal = min(1.0, share * prefix / mean) if prefix else 0.0
    src50, saved50 = _measured("prefix saving C=64, 50% share")
    _, saved80 = _measured("prefix saving C=64, 80% share")
    saving_reason = Reason(
        "measured",
        f"a prefix cache saves at most (share x prefix tokens) / mean resident tokens = "
        f"{share:.0%} x {prefix:,} / {mean:,.0f} = {ideal:.1%} of pages, whatever the page size: "
        f"measured {saved50:.1%} (50% share) and {saved80:.1%} (80% share) at C=64 in "
        f"{src50} with a 2K prompt, not the article's 30-40% (iron rule 2)",
        {
            "share": share,
            "prefix_tokens": prefix,
            "mean_length": mean,
            "ideal_saving": ideal,
            "measured_saving_50": saved50,
            "measured_saving_80": saved80,
        },
        source=_results(src50),
    )
    saving = Decision(ideal, (saving_reason,))
    if share > PREFIX_REUSE_THRESHOLD:
        reason = Reason(
            "iron rule 2",
            f"prefix reuse {share:.0%} > 50%: page size 64 (rule 2, rule 4); the memory it "
            f"saves is the prefix cache's ({ideal:.1%} here), not the page size's: the case "
            f"for 64 rests on fewer, larger gathers",
            {"prefix_reuse": share, "threshold": PREFIX_REUSE_THRESHOLD, "ideal_saving": ideal},
        )
        return Decision(64, (reason, saving_reason)), saving
    src, w4 = _measured("waste under 2K, C=4")
    _, w16 = _measured("waste under 2K, C=16")
    if sizing < PAGE_SIZE_SHORT_TOKENS:
        reason = Reason(
            "rule 4",
            f"sizing length {sizing:,} < 2,048 tokens: page size 4 (rule 4); measured waste on "
            f"requests under 2K is {w4:.2%} at C=4 vs {w16:.2%} at C=16 (this repo's {src})",
            {
                "sizing_length": sizing,
                "threshold": PAGE_SIZE_SHORT_TOKENS,
                "waste_c4": w4,
                "waste_c16": w16,
            },
        )
        return Decision(4, (reason,)), saving
    reason = Reason(
        "rule 4",
        f"sizing length {sizing:,} >= 2,048 tokens and prefix reuse {share:.0%} <= 50%: the "
        f"default page size 16 (rule 4; at most one partial page per request, {w16:.2%} waste "
        f"under 2K in this repo's {src})",
        {"sizing_length": sizing, "prefix_reuse": share, "waste_c16": w16},
    )
    return Decision(16, (reason,)), saving


def _degrees(hardware: Hardware, sizing: int, tp: int) -> tuple[list[int], Reason]:
    """Sequence-parallel degrees (groups of ``tp`` devices) allowed, smallest first, and why."""
    n = hardware.devices // tp
    unit = f" groups of TP={tp} devices" if tp > 1 else " devices"
    if sizing < IRON_RULE_1_TOKENS:
        return [1], Reason(
            "iron rule 1",
            f"sizing length {sizing:,} < 128K tokens: no sequence parallelism (iron rule 1); "
            "what does not fit goes to quantization (if allowed) or offload",
            {"sizing_length": sizing, "threshold": IRON_RULE_1_TOKENS},
        )
    if sizing > IRON_RULE_3_TOKENS:
        limit = min(n, max(1, hardware.devices_per_node // tp))
        degrees = [d for d in range(1, limit + 1) if limit % d == 0]
        return degrees, Reason(
            "iron rule 3",
            f"sizing length {sizing:,} > 512K tokens: sequence parallelism inside one node (at "
            f"most {limit}{unit}) with offload to host and disk for the rest (iron rule 3; "
            "the article's case B: a 32-GPU cross-node ring at 1M tokens spent 60% of its time "
            "communicating)",
            {"sizing_length": sizing, "threshold": IRON_RULE_3_TOKENS, "max_degree": limit},
        )
    degrees = [d for d in range(1, n + 1) if n % d == 0]
    return degrees, Reason(
        "iron rule 1",
        f"sizing length {sizing:,} >= 128K tokens: sequence parallelism allowed, up to {n}"
        f"{unit} (iron rule 1)",
        {"sizing_length": sizing, "threshold": IRON_RULE_1_TOKENS, "max_degree": n},
    )


def _placement(workload, hardware, sizing, C, kv_format, degrees):
    """Where one request of ``sizing`` tokens lives in ``kv_format``: a dict of numbers.

    Pages are counted on one device of a tensor-parallel group (its ``K / TP`` kv heads, or one
    replicated head); request bytes are that times ``TP`` (what the group stores)."""
    model = workload.model
    tp = workload.tensor_parallel
    bpt = model.bytes_per_token(kv_format, C, tp)
    page_bytes = C * bpt
    pages = -(-sizing // C)
    residual = model.residual_bytes(kv_format, C, tp)
    residual_pages = -(-residual // page_bytes) if residual else 0
    weights = -(-model.weight_bytes // tp)
    kv_memory = max(0, hardware.device_memory - weights)
    pool = int(kv_memory // page_bytes)
    usable = max(0, pool - 1)  # page 0 is the null page
    chosen, fits = degrees[-1], False
    for D in degrees:
        if -(-pages // D) + residual_pages <= usable:
            chosen, fits = D, True
            break
    per_device = -(-pages // chosen) + residual_pages
    device_request = math.ceil(pages * page_bytes) + residual  # one TP rank's share
    device_pages = min(pages, max(0, usable - residual_pages) * chosen)
    device = math.ceil(device_pages * page_bytes) + (residual if usable >= residual_pages else 0)
    device = min(device, device_request) * tp
    request_bytes = device_request * tp
    rest = request_bytes - device
    host = min(rest, hardware.host_memory)
    disk = min(rest - host, hardware.disk)
    if weights > hardware.device_memory:  # the model cannot be loaded: nothing is placed
        fits, device, host, disk = False, 0, 0, 0
    return {
        "kv_format": kv_format,
        "bytes_per_token": bpt,
        "page_bytes": page_bytes,
        "pages": pages,
        "residual": residual,
        "weights": weights,
        "kv_memory": kv_memory,
        "pool": pool,
        "usable": usable,
        "degree": chosen,
        "on_device": fits,
        "per_device_pages": per_device,
        "request_bytes": request_bytes,
        "tiers": Tiers(device=device, host=host, disk=disk),
        "fits": device + host + disk == request_bytes,
    }


def _quantization(workload, hardware, sizing, C, degrees):
    """(placement, kv_format decision): a lossy format only when the workload allows it and
    it turns "does not fit on the devices" into "fits"."""
    model = workload.model
    tp = workload.tensor_parallel
    base = _placement(workload, hardware, sizing, C, model.kv_format, degrees)
    base_bpt = base["bytes_per_token"]
    if base["on_device"]:
        reason = Reason(
            "model",
            f"{model.kv_format} KV fits on {base['degree']} group(s) of {tp} device(s) "
            f"({_size(base_bpt)}/token per device): no quantization (it would cost accuracy "
            "and buy nothing here)",
            {"bytes_per_token": base_bpt, "degree": base["degree"]},
        )
        return base, Decision(model.kv_format, (reason,))
    candidates = [
        k
        for k in workload.quantization
        if model.supports(k) and model.bytes_per_token(k, C, tp) < base_bpt
    ]
    candidates.sort(key=lambda k: -model.bytes_per_token(k, C, tp))
    for kind in candidates:
        trial = _placement(workload, hardware, sizing, C, kind, degrees)
        if trial["on_device"]:
            src, ratio = _measured(f"bytes vs bf16 {kind}")
            qsrc, acc = _measured(f"accuracy {kind}")
            _, acc32 = _measured("accuracy float32")
            bpt = trial["bytes_per_token"]
            reason = Reason(
                "measured",
                f"{model.kv_format} ({_size(base_bpt)}/token per device) does not fit on the "
                f"allowed devices; {kind} ({_size(bpt)}/token, {bpt / base_bpt:.3f}x; "
                f"{ratio}x bf16 in this repo's {src}) fits on {trial['degree']} group(s): "
                f"quantize, as the workload allows. {kind} is lossy: passkey accuracy "
                f"{acc:.1%} vs {acc32:.1%} float32 on this repo's 400K-parameter toy model "
                f"({qsrc}), not measured on a real model: measure yours before serving",
                {
                    "base_bytes_per_token": base_bpt,
                    "bytes_per_token": bpt,
                    "ratio": bpt / base_bpt,
                    "measured_ratio_vs_bf16": ratio,
                    "accuracy_toy_model": acc,
                    "accuracy_float32_toy_model": acc32,
                    "degree": trial["degree"],
                },
                source=_results(src, qsrc),
            )
            return trial, Decision(kind, (reason,))
    if workload.quantization:
        tried = f"no allowed lossy format ({', '.join(candidates) or 'none applies'}) makes it fit"
    else:
        tried = "lossy formats are not allowed (Workload.quantization=(), the default)"
    reason = Reason(
        "model",
        f"{model.kv_format} does not fit on the allowed devices and {tried}: keep "
        f"{model.kv_format} and offload",
        {"bytes_per_token": base_bpt, "candidates": len(candidates)},
    )
    return base, Decision(model.kv_format, (reason,))


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
    L, N, K, H, b = (
        model.layers,
        model.query_heads,
        model.kv_heads,
        model.head_dim,
        model.itemsize,
    )
    candidates = _strategy_candidates(model, hardware, D, S, free, tp)
    costs = {
        s: estimate_prefill(
            s,
            S=S,
            L=L,
            N=N,
            K=K,
            H=H,
            D=D,
            itemsize=b,
            hardware=hardware,
            ulysses_degree=u,
            params=model.params or 0,
            tensor_parallel=tp,
        )
        for s, u in candidates.items()
    }
    best = min(costs, key=lambda s: (costs[s][4], _STRATEGY_ORDER.index(s)))
    tied = [
        s
        for s in _STRATEGY_ORDER
        if s in costs and s != best and costs[s][4] <= costs[best][4] * (1 + TIE_THRESHOLD)
    ]
    spans = D * tp > hardware.devices_per_node
    N_r, K_r = N // tp, model.kv_heads_per_device(tp)
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


def plan(workload: Workload, hardware: Hardware) -> Plan:
    """Plan KV storage, parallelism and offload for a workload on a cluster.

    Pure Python, deterministic, every field of the result with the reasons that produced it
    (see :mod:`offload.planning._planner` for the order of decisions and :data:`ARTICLE_RULES`).

    Args:
      workload: a :class:`Workload` (model shape, length distribution, prefix reuse, allowed
        quantization, latency tolerance).
      hardware: a :class:`Hardware` (devices, memories, links).

    Returns:
      A :class:`Plan` of :class:`Decision` fields.

    Raises:
      ValueError: if ``workload`` or ``hardware`` has the wrong type (the dataclasses check
        their own fields when built).

    Example:
      >>> from offload.planning import Hardware, LengthDistribution, ModelShape, Workload, plan
      >>> model = ModelShape(layers=80, query_heads=64, kv_heads=8, head_dim=128,
      ...                    params=70_553_706_496)  # Llama-3-70B
      >>> lengths = LengthDistribution.from_percentiles(262144, 262144, 262144)
      >>> h100 = Hardware.h100_sxm(device_memory=72 * 10**9)  # 8 GB kept for activations
      >>> p = plan(Workload(model, lengths, tensor_parallel=8), h100)
      >>> p.kv_bytes_per_token.value, p.kv_bytes_per_token_per_device.value
      (327680, 40960)
      >>> p.degree.value, p.strategy.value  # one TP group of 8 holds 10 GiB per GPU
      (1, None)

    References:
      :data:`ARTICLE` (in Chinese): section 5's decision tree and three iron rules, section
      7's twelve rules, section 8's incidents; Kwon et al. 2023 (PagedAttention); Liu et al.
      2023 (Ring Attention); Jacobs et al. 2023 (DeepSpeed-Ulysses).
    """
    if not isinstance(workload, Workload):
        raise ValueError(f"plan: workload: expected a Workload, got {type(workload).__name__}")
    if not isinstance(hardware, Hardware):
        raise ValueError(f"plan: hardware: expected a Hardware, got {type(hardware).__name__}")
    model = workload.model
    tp = workload.tensor_parallel
    if hardware.devices % tp or tp > hardware.devices_per_node:
        raise ValueError(
            f"plan: workload.tensor_parallel: expected a divisor of hardware.devices="
            f"{hardware.devices} at most devices_per_node={hardware.devices_per_node} "
            f"(tensor parallelism stays inside a node), got {tp}"
        )
    sizing = _sizing(workload)
    S = sizing.value
    page, saving = _page_size(workload, S)
    C = page.value
    degrees, degree_reason = _degrees(hardware, S, tp)
    placement, kv_format = _quantization(workload, hardware, S, C, degrees)
    bpt = placement["bytes_per_token"]  # one device of a TP group
    L, N, K = model.layers, model.query_heads, model.kv_heads
    K_r = model.kv_heads_per_device(tp)
    total_bpt = model.bytes_per_token(kv_format.value, C)

    base_bpt = model.bytes_per_token(model.kv_format, C)
    per_token_reasons = [
        Reason(
            "model",
            f"2 (K and V) x L={L} x K={K} kv heads x {_size(total_bpt / (2 * L * K))} per head "
            f"= {total_bpt:,.0f} bytes ({_size(total_bpt)}) per token in {kv_format.value}",
            {"layers": L, "kv_heads": K, "bytes_per_token": total_bpt},
        )
    ]
    if K % tp == 0:
        split = f"TP={tp} splits the K={K} kv heads: {K_r} per device"
    else:
        split = (
            f"K={K} kv heads are fewer than TP={tp}: each device holds 1 kv head, each head "
            f"replicated on {tp // K} devices (as vLLM and Megatron do), so the group stores "
            f"{tp // K}x the model's KV"
        )
    per_device_reason = Reason(
        "model",
        f"{split}: {bpt:,.0f} bytes ({_size(bpt)}) per token on each device",
        {"tensor_parallel": tp, "kv_heads_per_device": K_r, "bytes_per_token": bpt},
    )
    weights = placement["weights"]
    if model.params is None:
        weight_reason = Reason(
            "model",
            "the model's parameter count is not given (ModelShape.params=None): no weights are "
            "subtracted from device memory and the linear layers' FLOPs are not counted; give "
            "params for a plan that includes them",
            {"weight_bytes_per_device": 0},
        )
    else:
        weight_reason = Reason(
            "model",
            f"{model.params:,} parameters x {model.weight_itemsize} bytes = "
            f"{_size(model.weight_bytes)} of weights over TP={tp} devices: "
            f"{_size(weights)} per device, leaving {_size(placement['kv_memory'])} of "
            f"{_size(hardware.device_memory)} for KV",
            {
                "params": model.params,
                "weight_bytes": model.weight_bytes,
                "weight_bytes_per_device": weights,
                "kv_memory_per_device": placement["kv_memory"],
            },
        )
    tp_reason = Reason(
        "model",
        f"tensor parallelism over {tp} device(s): {N // tp} query heads and {K_r} kv head(s) "
        f"per device; sequence parallelism runs over groups of {tp}, one request using "
        f"{tp} x {placement['degree']} = {tp * placement['degree']} device(s)",
        {"tensor_parallel": tp, "degree": placement["degree"]},
    )
    if kv_format.value != model.kv_format:
        per_token_reasons.append(kv_format.reasons[0])
    all_heads = base_bpt * N // K if isinstance(base_bpt, int) else base_bpt * N / K
    mha = Reason(
        "model",
        f"counting all N={N} query heads as kv heads (as the article's section 1.1 does for "
        f"Llama-3-70B) "
        f"gives {all_heads:,.0f} bytes ({_size(all_heads)}) per token, {N // K}x the real "
        f"{base_bpt:,.0f} ({_size(base_bpt)}) of K={K} kv heads in {model.kv_format}: GQA shares "
        f"each kv head among {N // K} query heads",
        {"query_heads": N, "kv_heads": K, "all_heads_bytes": all_heads, "bytes": base_bpt},
    )

    request_bytes = placement["request_bytes"]
    pages = placement["pages"]
    request_reason = Reason(
        "model",
        f"{pages:,} pages of {C} tokens x {_size(placement['page_bytes'])} per device x TP={tp} "
        f"= {_size(request_bytes)} per request at {S:,} tokens"
        + (
            f" (+ {_size(placement['residual'])} kivi2 float32 window)"
            if placement["residual"]
            else ""
        ),
        {
            "pages": pages,
            "page_size": C,
            "page_bytes": placement["page_bytes"],
            "request_bytes": request_bytes,
            "residual_bytes": placement["residual"],
        },
    )

    D = placement["degree"]
    tiers = placement["tiers"]
    if D > 1:
        sp_reason = Reason(
            "model",
            f"one request needs {pages:,} pages per device of a TP group; a device holds "
            f"{placement['usable']:,}: {D} group(s) of {tp} is the smallest that fits"
            if placement["on_device"]
            else f"one request needs {pages:,} pages per device; {D} group(s) of {tp} (the most "
            f"allowed) hold {min(pages, placement['usable'] * D):,}",
            {"pages": pages, "usable_pages_per_device": placement["usable"], "degree": D},
        )
        free = placement["kv_memory"] - min(
            placement["kv_memory"], placement["per_device_pages"] * placement["page_bytes"]
        )
        strategy, _, estimate, strategy_reasons = _choose_strategy(model, hardware, D, S, free, tp)
    else:
        sp_reason = Reason(
            "model",
            f"one request ({pages:,} pages per device) fits on one group of {tp} "
            f"({placement['usable']:,} pages per device)"
            if placement["on_device"] and degrees != [1]
            else f"one group of {tp} device(s) per request",
            {"pages": pages, "usable_pages_per_device": placement["usable"], "degree": 1},
        )
        strategy = None
        estimate = estimate_prefill(
            None,
            S=S,
            L=L,
            N=N,
            K=K,
            H=model.head_dim,
            D=1,
            itemsize=model.itemsize,
            hardware=hardware,
            params=model.params or 0,
            tensor_parallel=tp,
        )
        strategy_reasons = (
            Reason("model", "no sequence-parallel group: no strategy", {"degree": 1}),
        )
    decode = estimate_decode(
        device_bytes=tiers.device,
        host_bytes=tiers.host,
        disk_bytes=tiers.disk,
        D=D,
        hardware=hardware,
        weight_bytes_per_device=weights,
        params=model.params or 0,
        tensor_parallel=tp,
    )
    cost = CostEstimate(*estimate, decode_step_s=decode)
    attention_flops, linear_flops = prefill_flops(
        S=S, L=L, N=N, H=model.head_dim, params=model.params or 0
    )
    linear_text = (
        f"linear layers 2 x {model.params:,} params x {S:,} tokens = {linear_flops:.3g} FLOPs"
        if model.params
        else "linear layers not counted (no params given)"
    )
    cost_reason = Reason(
        "cost model",
        f"prefill {cost.total_s * 1e3:,.1f} ms (compute {cost.compute_s * 1e3:,.1f}, memory "
        f"{cost.memory_s * 1e3:,.1f}, communication {cost.communication_s * 1e3:,.1f}, latency "
        f"{cost.latency_s * 1e3:,.1f}); attention {attention_flops:.3g} FLOPs, {linear_text}; "
        f"decode {decode * 1e3:,.2f} ms/token (the weights' share and the KV read once)",
        {
            "prefill_s": cost.total_s,
            "decode_step_s": decode,
            "attention_flops": attention_flops,
            "linear_flops": linear_flops,
        },
        source="offload's cost model on the hardware description: "
        + "; ".join(
            f"{name} {hardware.label(name)}"
            for name in (
                "device_flops",
                "memory_bandwidth",
                "attention_efficiency",
                "decode_vs_bandwidth",
                "page_in_efficiency",
            )
        ),
    )

    pool = placement["pool"]
    per_request_per_device = placement["per_device_pages"]
    sequences = placement["usable"] // per_request_per_device if placement["on_device"] else 0
    pool_reason = Reason(
        "model",
        f"({_size(hardware.device_memory)} - {_size(weights)} of weights) / "
        f"{_size(placement['page_bytes'])} per page = {pool:,} pages (page 0 is the reserved "
        "null page)",
        {
            "device_memory": hardware.device_memory,
            "weight_bytes_per_device": weights,
            "page_bytes": placement["page_bytes"],
            "pool_pages": pool,
        },
    )
    seq_reasons = [
        Reason(
            "model",
            f"{placement['usable']:,} usable pages / {per_request_per_device:,} per request "
            f"per device = {sequences:,} sequences of {S:,} tokens",
            {
                "usable_pages": placement["usable"],
                "pages_per_request_per_device": per_request_per_device,
                "sequences": sequences,
            },
        )
    ]
    if sequences > 128:
        seq_reasons.append(
            Reason(
                "rule 5",
                f"{sequences:,} is above the article's 64-128 max_num_seqs per H100: the "
                "scheduler's limit, not memory, caps the batch",
                {"sequences": sequences, "rule_5_high": 128},
            )
        )

    tier_reasons = [
        Reason(
            "model",
            f"device {_size(tiers.device)}, host {_size(tiers.host)}, disk {_size(tiers.disk)} of "
            f"{_size(request_bytes)} per request",
            {
                "device": tiers.device,
                "host": tiers.host,
                "disk": tiers.disk,
                "request_bytes": request_bytes,
            },
        ),
        degree_reason,
    ]
    if tiers.host:
        tier_reasons.append(
            Reason(
                "rule 6",
                f"pinned host memory holds {_size(tiers.host)} of this request (rule 6 suggests "
                f"16-32 GB of swap space for long contexts; this request alone needs "
                f"{_size(tiers.host + tiers.disk)} off the devices; host memory "
                f"{_size(hardware.host_memory)})",
                {"host": tiers.host, "host_memory": hardware.host_memory},
            )
        )
    if tiers.disk:
        disk_pages = -(-tiers.disk // placement["page_bytes"])
        by_iops = hardware.disk_iops / disk_pages
        by_bandwidth = hardware.disk_bandwidth / tiers.disk
        tier_reasons.append(
            Reason(
                "rule 11",
                f"{disk_pages:,} pages on disk: an exact decode step reads each, so "
                f"{hardware.disk_iops:,.0f} IOPS allow {by_iops:,.2f} tokens/s (rule 11) and "
                f"the disk's {_size(hardware.disk_bandwidth)}/s {by_bandwidth:,.3f} tokens/s",
                {
                    "disk_pages": disk_pages,
                    "disk_iops": hardware.disk_iops,
                    "tokens_per_s_by_iops": by_iops,
                    "tokens_per_s_by_bandwidth": by_bandwidth,
                },
            )
        )
        tier_reasons.append(
            Reason(
                "incident C",
                "disk offload is for latency-tolerant work (the article's case C)"
                + (
                    ""
                    if workload.latency_tolerant
                    else ": this workload is not, serve a shorter context or add devices"
                ),
                {"latency_tolerant": float(workload.latency_tolerant)},
            )
        )

    offloaded = tiers.host + tiers.disk > 0
    src, kept_mild = _measured("h2o mass at 20%, mild")
    _, kept_conc = _measured("h2o mass at 20%, concentrated")
    qsrc, acc_drop = _measured("passkey accuracy, h2o drop at 20%")
    _, acc_back = _measured("passkey accuracy, demote and fetch back")
    _, acc_full = _measured("passkey accuracy, all pages")
    retention = Decision(
        "fetch back" if offloaded else "none",
        (
            Reason(
                "measured",
                (
                    "cold pages live on host/disk and are fetched back, never dropped"
                    if offloaded
                    else "every page stays on the device: nothing to retain"
                )
                + f": the article's claim (section 4.1) that keeping 20% heavy hitters keeps 95% "
                f"of attention holds only for concentrated "
                f"attention ({src}: H2O at 20% keeps {kept_conc:.1%} concentrated, "
                f"{kept_mild:.1%} mild); dropping to 20% cut passkey accuracy to "
                f"{acc_drop:.0%} from {acc_full:.0%}, fetching back kept {acc_back:.0%} ({qsrc})",
                {
                    "h2o_mass_20_concentrated": kept_conc,
                    "h2o_mass_20_mild": kept_mild,
                    "accuracy_drop_20": acc_drop,
                    "accuracy_fetch_back": acc_back,
                },
                source=_results(src, qsrc),
            ),
        ),
    )

    fits = placement["fits"]
    fits_reason = Reason(
        "model",
        (
            f"one request of {S:,} tokens fits"
            if fits
            else f"one request of {S:,} tokens does not fit: {_size(request_bytes - tiers.total)} "
            "beyond device, host and disk"
        )
        + f" ({_size(request_bytes)} needed)"
        + (
            f"; the weights' share ({_size(weights)}) exceeds a device's "
            f"{_size(hardware.device_memory)}: the model cannot be loaded, raise "
            "tensor_parallel or use more memory per device"
            if weights > hardware.device_memory
            else f"; the weights' share ({_size(weights)}) leaves no device memory for KV"
            if placement["kv_memory"] < placement["page_bytes"]
            else ""
        ),
        {"request_bytes": request_bytes, "placed_bytes": tiers.total},
    )

    fields = dict(
        sizing_length=sizing,
        page_size=page,
        kv_format=kv_format,
        kv_bytes_per_token=Decision(total_bpt, tuple(per_token_reasons)),
        kv_bytes_per_token_all_heads=Decision(all_heads, (mha,)),
        kv_bytes_per_request=Decision(request_bytes, (request_reason,)),
        pages_per_request=Decision(pages, (request_reason,)),
        sequence_parallel=Decision(D > 1, (degree_reason, sp_reason)),
        degree=Decision(D, (sp_reason, degree_reason)),
        strategy=Decision(strategy, strategy_reasons),
        max_pages_per_device=Decision(pool, (pool_reason,)),
        max_sequences_per_device=Decision(sequences, tuple(seq_reasons)),
        tiers=Decision(tiers, tuple(tier_reasons)),
        retention=retention,
        prefix_saving=saving,
        cost=Decision(cost, (cost_reason,)),
        fits=Decision(fits, (fits_reason,)),
        tensor_parallel=Decision(tp, (tp_reason, per_device_reason)),
        weight_bytes_per_device=Decision(weights, (weight_reason,)),
        kv_bytes_per_token_per_device=Decision(bpt, (per_device_reason,)),
    )
    return Plan(
        **{
            name: Decision(d.value, tuple(_cite(r, hardware) for r in d.reasons))
            for name, d in fields.items()
        }
    )
