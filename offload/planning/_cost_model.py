"""A small cost model of long-context serving; every rate and efficiency is a field of
:class:`offload.planning.Hardware` (labelled assumed or measured there).

The planner (:func:`offload.planning.plan`) uses it to compare sequence-parallel strategies and to
estimate prefill and decode times. It is deliberately small: four terms per strategy, summed
over the ``L`` layers of one causal prefill of ``S`` tokens on ``D`` sequence-parallel groups
of ``TP`` tensor-parallel devices (``N``, ``K`` below are one device's heads: ``N / TP`` and
``K / TP``, or one replicated kv head when ``K < TP``).

* compute: attention, ``4 * S**2 * N * H / 2`` FLOPs per layer (causal: half the score matrix;
  the zigzag layout balances it), split over ``D`` at ``device_flops * attention_efficiency``;
  plus the linear layers, ``2 * params * S`` FLOPs split over ``TP * D`` at ``device_flops``.
* tensor parallelism: two all-reduces per layer of the local tokens' hidden states
  (``N * H`` wide, the whole model's), ``2 (TP - 1) / TP`` of them sent, on the intra-node
  link, plus two steps of latency.
* memory traffic: the local q, k, v and out read or written once, plus (all-gather) the
  gathered K/V written and permuted back to natural order, at ``memory_bandwidth``.
* communication: bytes sent per device over the slowest link the group uses (``inter_node``
  once the group spans nodes):

  ====================  ============================================================
  ring                  ``(D - 1)`` hops of ``2 * S/D * K * H`` elements
  ulysses               four all-to-alls (q, k, v, out) of ``(2 N + 2 K') * S/D * H``
                        elements times ``(D - 1) / D``; ``K' = lcm(K, D)`` (kv heads
                        repeated until the devices can split them)
  usp                   Ulysses over ``u`` devices of a node (the all-to-alls on the
                        intra-node link), then a ring over ``r = D / u`` of ``S / r``
                        tokens and ``K' / u`` kv heads per hop (``K' = lcm(K, u)``)
  allgather             ``(D - 1) / D`` of the whole ``2 * S * K * H`` K/V
  ====================  ============================================================

  The ring's hops overlap with compute when ``Hardware.overlap`` (``max`` of the two, as on
  GPUs and TPUs); all-to-alls and all-gathers do not (they sit between compute phases).
* latency: ``collective_latency`` per step, a step being one collective or one local attention
  call: ring ``2 D - 1``, ulysses 5, usp ``4 + 2 r - 1``, allgather 2.

Decode (one token, all layers): the weights' share read once (or ``2 * params / TP`` FLOPs,
whichever is slower), the device-resident KV read at ``memory_bandwidth`` times
``decode_vs_bandwidth``, host pages fetched at ``host_bandwidth * page_in_efficiency`` per
device, disk pages at ``disk_bandwidth``.

The module constants are this repo's CPU measurements; :meth:`offload.planning.Hardware.emulated_cpu`
carries them (labelled with their results files), and nothing else uses them.

Not modelled: the backward pass (training), kernel fusion details, contention between
concurrent requests. Element size is 4 bytes for a float32 model and 2 otherwise.
"""

import dataclasses
import math
from typing import NamedTuple

__all__ = [
    "BLOCKWISE_FORWARD_EFFICIENCY",
    "CPU_MATMUL_FLOPS",
    "CPU_MEMCPY_BYTES_PER_S",
    "CPU_STEP_LATENCY_S",
    "PAGED_DECODE_VS_BANDWIDTH",
    "PAGE_IN_VS_MEMCPY",
    "RING_ZIGZAG_FORWARD_MS",
    "CostEstimate",
    "Heads",
    "collective_steps",
    "communication_bytes",
    "estimate_decode",
    "estimate_prefill",
    "prefill_flops",
]

# --- This repo's CPU measurements, each from a file in benchmarks/results/ -----------------

#: gaps_2026-12-01.md (run A): "blockwise forward efficiency (T=S=16K)": 73% of the same run's matmul FLOP/s.
BLOCKWISE_FORWARD_EFFICIENCY = 0.73
#: gaps_2026-12-01.md: the same-run matmul on this machine's 2 CPU cores, 129.3 GFLOP/s.
CPU_MATMUL_FLOPS = 129.3e9
#: offload_2026-12-01.md (a): memcpy of 256 MiB in 16 MiB pages, median 5.48 GiB/s.
CPU_MEMCPY_BYTES_PER_S = 5.48 * 2**30
#: paged.md (12-02): paged_attention decode is 1.94x the KV-bytes / memcpy bandwidth limit
#: (the 11-29 run, paged_2026-11-29.md: 1.70x).
PAGED_DECODE_VS_BANDWIDTH = 1.94
#: gaps_2026-12-02.md (run B): page_in reaches 0.93x of the same-run memcpy (median), since
#: the key and value copies run side by side (offload_2026-12-01.md, before: 0.56x;
#: offload.md's 1.13x the same day is above the memcpy it is compared to, which a host link
#: cannot be).
PAGE_IN_VS_MEMCPY = 0.93
#: ring.md: non-causal zigzag ring forward on 8 CPU devices, K=2, N=8, H=64, float32 (ms).
RING_ZIGZAG_FORWARD_MS = {2048: 99.0, 4096: 354.0}


def _step_latency_from_ring() -> float:
    """Per-step fixed cost: the intercept of ``t(S) = a S**2 + c`` through the two ring points
    of :data:`RING_ZIGZAG_FORWARD_MS`, over the ring's ``2 D - 1 = 15`` steps at ``D = 8``."""
    (s1, t1), (s2, t2) = sorted(RING_ZIGZAG_FORWARD_MS.items())
    a = (t2 - t1) / (s2**2 - s1**2)
    intercept_ms = t1 - a * s1**2
    return intercept_ms / 1e3 / (2 * 8 - 1)


#: Fixed cost of one step (a collective or a local attention call) on the emulated CPU
#: devices, fitted from ring.md's two ring timings (about 0.93 ms).
CPU_STEP_LATENCY_S = _step_latency_from_ring()


@dataclasses.dataclass(frozen=True)
class CostEstimate:
    """Estimated seconds for one causal prefill of ``S`` tokens over all ``L`` layers.

    Attributes:
      compute_s: attention FLOPs over the group's FLOP/s (times the blockwise efficiency).
      memory_s: local memory traffic (q, k, v, out; all-gather's gathered K/V).
      communication_s: bytes sent per device over the link used.
      latency_s: fixed per-step costs.
      total_s: the sum, except that an overlapping ring hides its communication behind
        compute (``max(compute, communication)``).
      decode_step_s: one decode token over all layers (device, host and disk reads).
    """

    compute_s: float
    memory_s: float
    communication_s: float
    latency_s: float
    total_s: float
    decode_step_s: float


def _ulysses_kv_heads(K: int, D: int) -> int:
    """``K' = lcm(K, D)``: kv heads after repeating them so ``D`` devices can split them."""
    return K * (D // math.gcd(K, D))


class Heads(NamedTuple):
    """One device's attention heads in a layer: ``N`` query and ``K`` key/value heads of dim
    ``H``, ``itemsize`` bytes per element (the whole model's heads over tensor parallelism)."""

    N: int
    K: int
    H: int
    itemsize: int


def _usp_bytes(heads: Heads, S, D, u) -> tuple[float, float]:
    """USP's (all-to-all bytes over ``u`` devices of a node, ring bytes over ``D / u``)."""
    N, K, H, itemsize = heads
    r = D // u
    kv = _ulysses_kv_heads(K, u)
    a2a = (2 * N + 2 * kv) * (S / D) * H * itemsize * (u - 1) / u
    hop = 2 * (S / r) * (kv / u) * H * itemsize  # after the all-to-all: S / r tokens, K' / u heads
    return a2a, (r - 1) * hop


def collective_steps(strategy: str | None, D: int, ulysses_degree: int = 1) -> int:
    """Steps (collectives plus local attention calls) of one layer's forward on ``D`` devices.

    Args:
      strategy: ``"ring"``, ``"ulysses"``, ``"usp"`` or ``"allgather"`` (``None``: 1 device).
      D: devices in the sequence-parallel group.
      ulysses_degree: ``u`` of ``"usp"`` (the ring is over ``D // u``).

    Returns:
      The step count the latency term multiplies.
    """
    if strategy is None or D == 1:
        return 1
    if strategy == "ring":
        return 2 * D - 1
    if strategy == "ulysses":
        return 5
    if strategy == "usp":
        r = D // ulysses_degree
        return 4 + 2 * r - 1
    return 2  # allgather: one gather, one local call


def communication_bytes(
    strategy, heads: Heads, *, S: int, D: int, ulysses_degree: int = 1
) -> float:
    """Bytes one device sends in one layer's forward (the table in the module docstring).

    Args:
      strategy: ``"ring"``, ``"ulysses"``, ``"usp"``, ``"allgather"`` or ``None`` (no group).
      heads: one device's :class:`Heads` (``N``, ``K``, ``H``, ``itemsize``: 4 float32, 2 bf16).
      S: tokens of the sequence; D: devices.
      ulysses_degree: ``u`` of ``"usp"``.

    Returns:
      Bytes per device (0 for ``None`` or ``D == 1``).

    Example:
      >>> communication_bytes("ring", Heads(N=8, K=2, H=64, itemsize=4), S=4096, D=8) / 2**20
      3.5
    """
    if strategy is None or D == 1:
        return 0.0
    N, K, H, itemsize = heads
    local = S / D
    if strategy == "ring":
        return (D - 1) * 2 * local * K * H * itemsize
    if strategy == "ulysses":
        kv = _ulysses_kv_heads(K, D)
        return (2 * N + 2 * kv) * local * H * itemsize * (D - 1) / D
    if strategy == "usp":
        return sum(_usp_bytes(heads, S, D, ulysses_degree))
    return 2 * S * K * H * itemsize * (D - 1) / D  # allgather


def prefill_flops(*, S: int, L: int, N: int, H: int, params: int = 0) -> tuple[float, float]:
    """``(attention, linear)`` FLOPs of one causal prefill of ``S`` tokens, whole model.

    Attention: ``4 * S**2 * N * H / 2`` per layer (QK^T and PV, half the score matrix).
    Linear layers: ``2 * params * S`` (a multiply and an add per weight per token; ``params``
    0 when the model's size is not given).

    Example:
      >>> attention, linear = prefill_flops(S=32768, L=64, N=40, H=128, params=32_500_000_000)
      >>> round(linear / attention, 2)  # a 32B model at 32K: the linear layers are 3x
      3.03
    """
    return 4.0 * S * S * N * H * 0.5 * L, 2.0 * params * S


def _tensor_parallel_bytes(S, N, H, D, itemsize, tensor_parallel) -> float:
    """Bytes one device sends per layer for tensor parallelism: two all-reduces (after
    attention and after the MLP) of its ``S / D`` tokens' hidden states (``N * H`` wide), a
    ring all-reduce sending ``2 (TP - 1) / TP`` of them."""
    if tensor_parallel == 1:
        return 0.0
    share = 2 * (tensor_parallel - 1) / tensor_parallel
    return 2 * share * (S / D) * N * H * itemsize


def estimate_prefill(
    strategy, model, hardware, *, S: int, D: int, ulysses_degree: int = 1, tensor_parallel: int = 1
) -> tuple[float, float, float, float, float]:
    """``(compute_s, memory_s, communication_s, latency_s, total_s)`` of one causal prefill.

    Args:
      strategy: as :func:`communication_bytes`.
      model: an :class:`offload.planning.ModelShape`: its layers, heads (the whole model's),
        head dim and KV itemsize; its ``params`` give ``2 * params * S`` linear FLOPs, split
        over the ``TP * D`` devices at ``device_flops`` (``None``: not counted).
      hardware: an :class:`offload.planning.Hardware` (FLOP/s, bandwidths, latency, overlap,
        ``attention_efficiency``).
      S, D: tokens of the request and sequence-parallel groups.
      ulysses_degree: ``u`` of ``"usp"``.
      tensor_parallel: ``TP``: each device has ``N / TP`` query heads and ``K / TP`` kv
        heads (one, replicated, when ``K < TP``), and sends two all-reduces per layer over
        the intra-node link.

    Returns:
      Seconds per term and their total (see the module docstring). ``compute_s`` is the
      attention and the linear layers together; only attention overlaps with a ring's hops.
    """
    tp = tensor_parallel
    L, N, H = model.layers, model.query_heads, model.head_dim
    itemsize, params = model.itemsize, model.params or 0
    comm_bytes = _tensor_parallel_bytes(S, N, H, D, itemsize, tp)
    N, K = N // tp, model.kv_heads_per_device(tp)
    heads = Heads(N, K, H, itemsize)
    attention_flops, linear_flops = prefill_flops(S=S, L=L, N=N, H=H, params=params)
    attention = attention_flops / D / (hardware.device_flops * hardware.attention_efficiency)
    linear = linear_flops / (D * tp) / hardware.device_flops
    compute = attention + linear
    local_io = (2 * N + 2 * K) * (S / D) * H * itemsize
    if strategy == "allgather":
        local_io += 2 * (2 * S * K * H * itemsize)  # written by the gather, then permuted
    memory = L * local_io / hardware.memory_bandwidth
    spans_nodes = D * tp > hardware.devices_per_node
    link = hardware.inter_node_bandwidth if spans_nodes else hardware.intra_node_bandwidth
    tp_s = L * comm_bytes / hardware.intra_node_bandwidth
    steps = collective_steps(strategy, D, ulysses_degree) + (2 if tp > 1 else 0)
    latency = L * steps * hardware.collective_latency
    if strategy == "usp":  # the all-to-alls stay inside a node, the ring may cross nodes
        a2a, ring = _usp_bytes(heads, S, D, ulysses_degree)
        a2a_s = L * a2a / hardware.intra_node_bandwidth
        ring_s = L * ring / link
        communication = a2a_s + ring_s + tp_s
        hidden = max(attention, ring_s) if hardware.overlap else attention + ring_s
        total = hidden + linear + a2a_s + tp_s + memory + latency
    else:
        sent = communication_bytes(strategy, heads, S=S, D=D, ulysses_degree=ulysses_degree)
        sp_s = L * sent / link
        communication = sp_s + tp_s
        if strategy == "ring" and hardware.overlap:
            total = max(attention, sp_s) + linear + tp_s + memory + latency
        else:
            total = compute + communication + memory + latency
    return float(compute), float(memory), float(communication), float(latency), float(total)


def estimate_decode(
    tiers,
    model,
    hardware,
    *,
    D: int,
    tensor_parallel: int = 1,
    weight_bytes_per_device: int | float = 0,
) -> float:
    """Seconds of one decode token (batch of one) that reads the whole KV of one request.

    Args:
      tiers: an :class:`offload.planning.Tiers`: the request's KV bytes on the device, on
        the host and on disk (all layers, all devices of the group together).
      model: an :class:`offload.planning.ModelShape`: its ``params`` give ``2 * params``
        linear FLOPs per token (``None``: not counted).
      hardware: an :class:`offload.planning.Hardware`.
      D: sequence-parallel groups the KV is split over.
      tensor_parallel: ``TP``: devices per group.
      weight_bytes_per_device: the weights each device reads once per token.

    Returns:
      ``max(weights / memory_bandwidth, 2 params / TP / device_flops) + device / (D TP)
      / memory_bandwidth * decode_vs_bandwidth + host / (D TP) / (host_bandwidth *
      page_in_efficiency) + disk / disk_bandwidth`` (the bytes of ``tiers``).
    """
    params = model.params or 0
    device_bytes, host_bytes, disk_bytes = tiers.device, tiers.host, tiers.disk
    devices = D * tensor_parallel
    linear = max(
        weight_bytes_per_device / hardware.memory_bandwidth,
        2.0 * params / tensor_parallel / hardware.device_flops,
    )
    device = device_bytes / devices / hardware.memory_bandwidth * hardware.decode_vs_bandwidth
    host = host_bytes / devices / (hardware.host_bandwidth * hardware.page_in_efficiency)
    disk = disk_bytes / hardware.disk_bandwidth if disk_bytes else 0.0
    return float(linear + device + host + disk)
