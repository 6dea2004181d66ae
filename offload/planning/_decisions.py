"""Steps 1-3 of :func:`offload.planning.plan`: sizing length, page size, degrees, placement.

Each function returns a decision (or the numbers behind one) with the reasons that produced it:
the sizing length (rule 1), the page size and prefix saving (iron rule 2, rule 4), the
sequence-parallel degrees allowed (iron rules 1 and 3), where one request lives in a KV format,
and which KV format to store (quantization only when it turns "does not fit" into "fits").
Pure Python; no arrays.
"""

import math

from offload.planning._article import (
    IRON_RULE_1_TOKENS,
    IRON_RULE_3_TOKENS,
    PAGE_SIZE_SHORT_TOKENS,
    PREFIX_REUSE_THRESHOLD,
    _measured,
    _results,
    _size,
)
from offload.planning._hardware import Hardware
from offload.planning._planner_types import Decision, Reason, Tiers
from offload.planning._workload import Workload


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
