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

from offload.planning._article import _cite, _measured, _results, _size
from offload.planning._cost_model import (
    CostEstimate,
    estimate_decode,
    estimate_prefill,
    prefill_flops,
)
from offload.planning._decisions import _degrees, _page_size, _quantization, _sizing
from offload.planning._hardware import Hardware
from offload.planning._planner_types import Decision, Plan, Reason
from offload.planning._strategy import _choose_strategy
from offload.planning._workload import Workload

__all__ = ["plan"]


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
        estimate = estimate_prefill(None, model, hardware, S=S, D=1, tensor_parallel=tp)
        strategy_reasons = (
            Reason("model", "no sequence-parallel group: no strategy", {"degree": 1}),
        )
    decode = estimate_decode(
        tiers, model, hardware, D=D, tensor_parallel=tp, weight_bytes_per_device=weights
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
