"""The seed article's decision procedure as a function: :func:`plan` (workload, hardware).

Pure Python over the frozen dataclasses of :mod:`offload._planner_types`; no arrays. The
order of decisions, each recorded with its reasons:

1. sizing length (rule 1): ``p95 + 2 sigma``, capped at the longest request, never the max;
2. page size (iron rule 2, rule 4): 64 when prefix reuse is above 50%, 4 when the sizing
   length is under 2K tokens, 16 otherwise (with this repo's measured savings and waste);
3. for the model's KV format, then each allowed quantized format: the smallest
   sequence-parallel degree at which one request fits in device memory. Iron rule 1: no
   sequence parallelism under 128K tokens. Iron rule 3 with incident B: above 512K the group
   stays inside one node and what does not fit goes to pinned host memory, then disk. A
   quantized format is chosen only when it turns "does not fit on devices" into "fits";
4. the strategy for the degree, by head counts and links, then by the cost model
   (:mod:`offload._cost_model`);
5. tiers, retention (fetch cold pages back, never drop them: this repo's measurements), prefix
   saving, the cost estimate and whether the request fits at all.
"""

import math

from offload._cost_model import CostEstimate, estimate_decode, estimate_prefill
from offload._planner_types import (
    Decision,
    Hardware,
    Plan,
    Reason,
    Tiers,
    Workload,
)

__all__ = [
    "ARTICLE_RULES",
    "IRON_RULE_1_TOKENS",
    "IRON_RULE_3_TOKENS",
    "MEASURED",
    "PAGE_SIZE_SHORT_TOKENS",
    "PREFIX_REUSE_THRESHOLD",
    "plan",
]

#: The seed article's rules the planner applies, by id (paraphrased).
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


def _measured(name: str) -> tuple[str, float]:
    return MEASURED[name]


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
            f"requests under 2K is {w4:.2%} at C=4 vs {w16:.2%} at C=16 ({src})",
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
        f"under 2K in {src})",
        {"sizing_length": sizing, "prefix_reuse": share, "waste_c16": w16},
    )
    return Decision(16, (reason,)), saving


def _degrees(hardware: Hardware, sizing: int) -> tuple[list[int], Reason]:
    """Sequence-parallel degrees allowed, smallest first, and why."""
    n = hardware.devices
    if sizing < IRON_RULE_1_TOKENS:
        return [1], Reason(
            "iron rule 1",
            f"sizing length {sizing:,} < 128K tokens: no sequence parallelism (iron rule 1); "
            "what does not fit goes to quantization or offload",
            {"sizing_length": sizing, "threshold": IRON_RULE_1_TOKENS},
        )
    if sizing > IRON_RULE_3_TOKENS:
        limit = min(n, hardware.devices_per_node)
        degrees = [d for d in range(1, limit + 1) if limit % d == 0]
        return degrees, Reason(
            "iron rule 3",
            f"sizing length {sizing:,} > 512K tokens: sequence parallelism inside one node (at "
            f"most {limit} devices) with offload to host and disk for the rest (iron rule 3; "
            "incident B: a cross-node ring at 1M spent 60% of its time communicating)",
            {"sizing_length": sizing, "threshold": IRON_RULE_3_TOKENS, "max_degree": limit},
        )
    degrees = [d for d in range(1, n + 1) if n % d == 0]
    return degrees, Reason(
        "iron rule 1",
        f"sizing length {sizing:,} >= 128K tokens: sequence parallelism allowed, up to all "
        f"{n} devices (iron rule 1)",
        {"sizing_length": sizing, "threshold": IRON_RULE_1_TOKENS, "max_degree": n},
    )


def _placement(workload, hardware, sizing, C, kv_format, degrees):
    """Where one request of ``sizing`` tokens lives in ``kv_format``: a dict of numbers."""
    model = workload.model
    bpt = model.bytes_per_token(kv_format, C)
    page_bytes = C * bpt
    pages = -(-sizing // C)
    residual = model.residual_bytes(kv_format, C)
    residual_pages = -(-residual // page_bytes) if residual else 0
    pool = int(hardware.device_memory // page_bytes)
    usable = max(0, pool - 1)  # page 0 is the null page
    chosen, fits = degrees[-1], False
    for D in degrees:
        if -(-pages // D) + residual_pages <= usable:
            chosen, fits = D, True
            break
    per_device = -(-pages // chosen) + residual_pages
    request_bytes = math.ceil(pages * page_bytes) + residual
    device_pages = min(pages, max(0, usable - residual_pages) * chosen)
    device = math.ceil(device_pages * page_bytes) + (residual if usable >= residual_pages else 0)
    device = min(device, request_bytes)
    rest = request_bytes - device
    host = min(rest, hardware.host_memory)
    disk = min(rest - host, hardware.disk)
    return {
        "kv_format": kv_format,
        "bytes_per_token": bpt,
        "page_bytes": page_bytes,
        "pages": pages,
        "residual": residual,
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
    """(placement, kv_format decision): quantize only when it turns "offload" into "fits"."""
    model = workload.model
    base = _placement(workload, hardware, sizing, C, model.kv_format, degrees)
    base_bpt = base["bytes_per_token"]
    if base["on_device"]:
        reason = Reason(
            "model",
            f"{model.kv_format} KV fits on {base['degree']} device(s) ({_size(base_bpt)}/token): "
            "no quantization (it would cost accuracy and buy nothing here)",
            {"bytes_per_token": base_bpt, "degree": base["degree"]},
        )
        return base, Decision(model.kv_format, (reason,))
    candidates = [
        k
        for k in workload.quantization
        if model.supports(k) and model.bytes_per_token(k, C) < base_bpt
    ]
    candidates.sort(key=lambda k: -model.bytes_per_token(k, C))
    for kind in candidates:
        trial = _placement(workload, hardware, sizing, C, kind, degrees)
        if trial["on_device"]:
            src, ratio = _measured(f"bytes vs bf16 {kind}")
            qsrc, acc = _measured(f"accuracy {kind}")
            _, acc32 = _measured("accuracy float32")
            bpt = trial["bytes_per_token"]
            reason = Reason(
                "measured",
                f"{model.kv_format} ({_size(base_bpt)}/token) does not fit on the allowed "
                f"devices; {kind} ({_size(bpt)}/token, {bpt / base_bpt:.3f}x; {src}: "
                f"{ratio}x bf16) fits on {trial['degree']}: quantize (passkey accuracy "
                f"{acc:.1%} vs {acc32:.1%} float32 in {qsrc}; incident B: prefer "
                "quantization to more devices)",
                {
                    "base_bytes_per_token": base_bpt,
                    "bytes_per_token": bpt,
                    "ratio": bpt / base_bpt,
                    "measured_ratio_vs_bf16": ratio,
                    "accuracy": acc,
                    "accuracy_float32": acc32,
                    "degree": trial["degree"],
                },
            )
            return trial, Decision(kind, (reason,))
    tried = ", ".join(candidates) or "none allowed"
    reason = Reason(
        "model",
        f"{model.kv_format} does not fit on the allowed devices and no allowed quantized format "
        f"({tried}) makes it fit: keep {model.kv_format} and offload",
        {"bytes_per_token": base_bpt, "candidates": len(candidates)},
    )
    return base, Decision(model.kv_format, (reason,))


def _strategy_candidates(model, hardware, D, S, free):
    """{strategy: ulysses degree} of the strategies that can run ``D`` devices (``free``: bytes
    of a device's KV memory this request leaves free)."""
    N, K, H = model.query_heads, model.kv_heads, model.head_dim
    out = {"ring": 1}
    spans = D > hardware.devices_per_node
    if N % D == 0 and not spans:
        out["ulysses"] = D
    if "ulysses" not in out:
        us = [u for u in range(2, D) if D % u == 0 and N % u == 0]
        us = [u for u in us if u <= hardware.devices_per_node]
        if us:
            out["usp"] = max(us)
    gathered = 2 * S * K * H * model.itemsize
    out["allgather"] = 1 if gathered <= free else None
    return {k: v for k, v in out.items() if v is not None}


def _choose_strategy(model, hardware, D, S, free=None):
    """(strategy, ulysses degree, estimate tuple, reasons); ``free``: bytes of a device's KV
    memory the request leaves free (default: all of it)."""
    free = hardware.device_memory if free is None else free
    L, N, K, H, b = (
        model.layers,
        model.query_heads,
        model.kv_heads,
        model.head_dim,
        model.itemsize,
    )
    candidates = _strategy_candidates(model, hardware, D, S, free)
    costs = {
        s: estimate_prefill(
            s, S=S, L=L, N=N, K=K, H=H, D=D, itemsize=b, hardware=hardware, ulysses_degree=u
        )
        for s, u in candidates.items()
    }
    best = min(costs, key=lambda s: (costs[s][4], _STRATEGY_ORDER.index(s)))
    spans = D > hardware.devices_per_node
    heads = f"N={N} query heads, K={K} kv heads over D={D} devices"
    notes = []
    if "ulysses" not in candidates:
        why = "the group spans nodes" if spans else f"N={N} is not a multiple of D={D}"
        notes.append(f"Ulysses needs N divisible by D inside a node: {why}")
    elif K < D:
        notes.append(f"Ulysses repeats kv heads to lcm(K, D)={K * (D // math.gcd(K, D))}")
    if "allgather" not in candidates:
        notes.append(
            "all-gather would hold a whole layer's K/V on each device: it does not fit beside "
            "the request's pages"
        )
    summary = ", ".join(f"{s} {costs[s][4] * 1e3:,.1f} ms" for s in _STRATEGY_ORDER if s in costs)
    numbers = {f"{s}_ms": costs[s][4] * 1e3 for s in costs}
    numbers.update({"N": N, "K": K, "D": D})
    reasons = [
        Reason(
            "cost model",
            f"{heads}: {best} is the cheapest prefill ({summary})"
            + (f"; {'; '.join(notes)}" if notes else ""),
            numbers,
        )
    ]
    if spans:
        _, _, comm, _, total = costs[best]
        share = comm / total if total else 0.0
        reasons.append(
            Reason(
                "incident B",
                f"the group spans {D // hardware.devices_per_node} nodes: communication is "
                f"{share:.0%} of the estimated prefill (incident B saw 60% on a 32-GPU ring)",
                {"communication_share": share, "incident_b_share": 0.60},
            )
        )
    return best, candidates[best], costs[best], tuple(reasons)


def plan(workload: Workload, hardware: Hardware) -> Plan:
    """Plan KV storage, parallelism and offload for a workload on a cluster.

    Pure Python, deterministic, every field of the result with the reasons that produced it
    (see :mod:`offload._planner` for the order of decisions and :data:`ARTICLE_RULES`).

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
      >>> from offload import Hardware, LengthDistribution, ModelShape, Workload, plan
      >>> model = ModelShape(layers=80, query_heads=64, kv_heads=8, head_dim=128)
      >>> lengths = LengthDistribution.from_percentiles(262144, 262144, 262144)
      >>> h100 = Hardware(devices=8, devices_per_node=8, device_memory=60 * 2**30,
      ...                 device_flops=989e12, memory_bandwidth=3.35e12,
      ...                 intra_node_bandwidth=450e9, inter_node_bandwidth=25e9)
      >>> p = plan(Workload(model, lengths), h100)
      >>> p.kv_bytes_per_token.value, p.degree.value, p.strategy.value
      (327680, 2, 'ring')

    References:
      The seed article (shared/seed): its decision tree, three iron rules and twelve rules;
      Kwon et al. 2023 (PagedAttention); Liu et al. 2023 (Ring Attention); Jacobs et al. 2023
      (DeepSpeed-Ulysses).
    """
    if not isinstance(workload, Workload):
        raise ValueError(f"plan: workload: expected a Workload, got {type(workload).__name__}")
    if not isinstance(hardware, Hardware):
        raise ValueError(f"plan: hardware: expected a Hardware, got {type(hardware).__name__}")
    model = workload.model
    sizing = _sizing(workload)
    S = sizing.value
    page, saving = _page_size(workload, S)
    C = page.value
    degrees, degree_reason = _degrees(hardware, S)
    placement, kv_format = _quantization(workload, hardware, S, C, degrees)
    bpt = placement["bytes_per_token"]
    L, N, K = model.layers, model.query_heads, model.kv_heads

    base_bpt = model.bytes_per_token(model.kv_format, C)
    per_token_reasons = [
        Reason(
            "model",
            f"2 (K and V) x L={L} x K={K} kv heads x {_size(bpt / (2 * L * K))} per head = "
            f"{bpt:,.0f} bytes ({_size(bpt)}) per token in {kv_format.value}",
            {"layers": L, "kv_heads": K, "bytes_per_token": bpt},
        )
    ]
    if kv_format.value != model.kv_format:
        per_token_reasons.append(kv_format.reasons[0])
    all_heads = base_bpt * N // K if isinstance(base_bpt, int) else base_bpt * N / K
    mha = Reason(
        "model",
        f"counting all N={N} query heads as kv heads (as the article does for Llama-3-70B) "
        f"gives {all_heads:,.0f} bytes ({_size(all_heads)}) per token, {N // K}x the real "
        f"{base_bpt:,.0f} ({_size(base_bpt)}) of K={K} kv heads in {model.kv_format}: GQA shares "
        f"each kv head among {N // K} query heads",
        {"query_heads": N, "kv_heads": K, "all_heads_bytes": all_heads, "bytes": base_bpt},
    )

    request_bytes = placement["request_bytes"]
    pages = placement["pages"]
    request_reason = Reason(
        "model",
        f"{pages:,} pages of {C} tokens x {_size(placement['page_bytes'])} = "
        f"{_size(request_bytes)} per request at {S:,} tokens"
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
            f"one request needs {pages:,} pages; a device holds {placement['usable']:,}: "
            f"{D} devices is the smallest group that fits"
            if placement["on_device"]
            else f"one request needs {pages:,} pages; {D} devices (the most allowed) hold "
            f"{min(pages, placement['usable'] * D):,}",
            {"pages": pages, "usable_pages_per_device": placement["usable"], "degree": D},
        )
        free = hardware.device_memory - min(
            hardware.device_memory, placement["per_device_pages"] * placement["page_bytes"]
        )
        strategy, _, estimate, strategy_reasons = _choose_strategy(model, hardware, D, S, free)
    else:
        sp_reason = Reason(
            "model",
            f"one request ({pages:,} pages) fits on one device ({placement['usable']:,} pages)"
            if placement["on_device"] and degrees != [1]
            else "one device per request",
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
    )
    cost = CostEstimate(*estimate, decode_step_s=decode)
    cost_reason = Reason(
        "cost model",
        f"prefill {cost.total_s * 1e3:,.1f} ms (compute {cost.compute_s * 1e3:,.1f}, memory "
        f"{cost.memory_s * 1e3:,.1f}, communication {cost.communication_s * 1e3:,.1f}, latency "
        f"{cost.latency_s * 1e3:,.1f}); decode {decode * 1e3:,.2f} ms/token "
        "(constants: offload/_cost_model.py, from benchmarks/results/)",
        {"prefill_s": cost.total_s, "decode_step_s": decode},
    )

    pool = placement["pool"]
    per_request_per_device = placement["per_device_pages"]
    sequences = placement["usable"] // per_request_per_device if placement["on_device"] else 0
    pool_reason = Reason(
        "model",
        f"{_size(hardware.device_memory)} / {_size(placement['page_bytes'])} per page = {pool:,} "
        "pages (page 0 is the reserved null page)",
        {
            "device_memory": hardware.device_memory,
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
                "disk offload is for latency-tolerant work (incident C)"
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
                + f": the article's 20% heavy hitters keep 95% holds only for concentrated "
                f"attention ({src}: H2O at 20% keeps {kept_conc:.1%} concentrated, "
                f"{kept_mild:.1%} mild); dropping to 20% cut passkey accuracy to "
                f"{acc_drop:.0%} from {acc_full:.0%}, fetching back kept {acc_back:.0%} ({qsrc})",
                {
                    "h2o_mass_20_concentrated": kept_conc,
                    "h2o_mass_20_mild": kept_mild,
                    "accuracy_drop_20": acc_drop,
                    "accuracy_fetch_back": acc_back,
                },
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
        + f" ({_size(request_bytes)} needed)",
        {"request_bytes": request_bytes, "placed_bytes": tiers.total},
    )

    return Plan(
        sizing_length=sizing,
        page_size=page,
        kv_format=kv_format,
        kv_bytes_per_token=Decision(bpt, tuple(per_token_reasons)),
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
    )
