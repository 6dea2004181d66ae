"""The planner's inputs and outputs: frozen dataclasses, validated when they are built.

Inputs: :class:`ModelShape` (``L``, ``N``, ``K``, ``H``, the KV format, the parameter count),
:class:`LengthDistribution` (from samples or from p50 / p95 / p99), :class:`Workload` (model,
lengths, prefix reuse, tensor parallelism, opt-in lossy formats) and :class:`Hardware`
(devices, memories, links, efficiencies, each number labelled assumed or measured).
Outputs: :class:`Plan`, whose every field is a :class:`Decision` ``(value, reasons)``; a
:class:`Reason` is ``(rule, text, numbers, source)``; :class:`Tiers` are bytes per tier;
:meth:`Plan.rows` yields :class:`PlanRow` objects.
"""

import dataclasses
import math
import textwrap
from typing import NamedTuple

import numpy as np

from offload import _checks
from offload.planning._cost_model import (
    BLOCKWISE_FORWARD_EFFICIENCY,
    CPU_MATMUL_FLOPS,
    CPU_MEMCPY_BYTES_PER_S,
    CPU_STEP_LATENCY_S,
    PAGE_IN_VS_MEMCPY,
    PAGED_DECODE_VS_BANDWIDTH,
)
from paged import KVFormat

__all__ = [
    "FLOAT_FORMATS",
    "KV_FORMATS",
    "QUANTIZED_FORMATS",
    "Decision",
    "Hardware",
    "LengthDistribution",
    "ModelShape",
    "Plan",
    "PlanRow",
    "RATE_FIELDS",
    "Reason",
    "Tiers",
    "Workload",
]

#: KV formats stored as plain floats, with their bytes per element.
FLOAT_FORMATS = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Quantized KV formats: every ``paged.KVFormat`` kind (``paged.KVFormat.KINDS``).
QUANTIZED_FORMATS = KVFormat.KINDS
#: Every KV format a :class:`ModelShape` accepts.
KV_FORMATS = (*FLOAT_FORMATS, *QUANTIZED_FORMATS)


def _group_size_of(fn: str, kv_format: KVFormat, model) -> int:
    """The ``group_size`` a :class:`ModelShape` keeps for ``kv_format`` (a ``KVFormat``):
    its own for int4 (``ValueError`` if the model names another one), else the model's."""
    _refuse_kivi2_window(fn, "kv_format", kv_format)
    if kv_format.kind != "int4":
        return model.group_size
    if model.group_size not in (32, kv_format.group_size):
        raise ValueError(
            f"{fn}: group_size: expected the int4 KVFormat's group_size={kv_format.group_size} "
            f"(or the default 32), got {model.group_size}"
        )
    return kv_format.group_size


def _refuse_kivi2_window(fn: str, name: str, kv_format: KVFormat) -> None:
    if kv_format.kind == "kivi2" and kv_format.residual:
        raise NotImplementedError(
            f"{fn}: {name}: the planner sizes kivi2's float32 window as the open page only, "
            f"got {kv_format!r}; pass KVFormat('kivi2') (residual=0) and count the window with "
            "ModelShape.residual_bytes(KVFormat('kivi2', residual=R))"
        )


# Normal quantiles of the 95th and 99th percentiles (for a log-normal through p50 and p99).
_Z95, _Z99 = 1.6448536269514722, 2.3263478740408408


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The attention shape of a model and how its KV is stored.

    Attributes:
      layers: ``L``, attention layers.
      query_heads: ``N``.
      kv_heads: ``K`` (``N % K == 0``; ``K < N`` is GQA, ``K == N`` multi-head).
      head_dim: ``H``.
      kv_format: one of :data:`KV_FORMATS`: ``"float32"``, ``"bfloat16"``, ``"float16"``,
        or a quantized format: a ``paged.KVFormat`` or its kind ``"int8"``, ``"fp8"``,
        ``"int4"``, ``"kivi2"``. A KVFormat is stored as its kind (and, for int4, its
        ``group_size``), so ``kv_format=KVFormat("int8")`` and ``"int8"`` give equal shapes.
      group_size: int4's group along ``H`` (``paged.KVFormat``'s ``group_size``, default 32;
        taken from ``kv_format`` when that is a ``KVFormat("int4", group_size=g)``).
      params: parameters of the whole model (its weights), or ``None`` when not given. The
        planner subtracts the weights' share (``params * weight_itemsize / TP``) from each
        device's memory and counts ``2 * params`` FLOPs per token for the linear layers; with
        ``None`` it counts neither and says so in the plan.
      weight_itemsize: bytes per weight (2: bf16/fp16, 1: int8/fp8 weights, 4: float32).

    Raises:
      ValueError: on a non-positive size, ``N % K != 0``, an unknown format, a head dim the
        format cannot store (int4: ``H % group_size``; kivi2: ``H % 4``), ``params`` not a
        positive int, ``weight_itemsize`` not 1, 2 or 4, or an int4 KVFormat whose
        ``group_size`` differs from a ``group_size`` also given.
      NotImplementedError: a ``KVFormat("kivi2", residual=R)`` with ``R > 0`` (the planner
        sizes kivi2's float32 window as the open page only).

    Example:
      >>> llama = ModelShape(layers=80, query_heads=64, kv_heads=8, head_dim=128)
      >>> llama.bytes_per_token(), llama.bytes_per_token("int4")
      (327680, 92160)
    """

    layers: int
    query_heads: int
    kv_heads: int
    head_dim: int
    kv_format: str | KVFormat = "bfloat16"
    group_size: int = 32
    params: int | None = None
    weight_itemsize: int = 2

    def __post_init__(self):
        fn = "ModelShape"
        for name in ("layers", "query_heads", "kv_heads", "head_dim", "group_size"):
            _checks.check_int(fn, name, getattr(self, name), low=1)
        if self.params is not None:
            _checks.check_int(fn, "params", self.params, low=1)
        if _checks.check_int(fn, "weight_itemsize", self.weight_itemsize, low=1) not in (1, 2, 4):
            raise ValueError(
                f"{fn}: weight_itemsize: expected 1, 2 or 4 bytes per weight, got "
                f"{self.weight_itemsize}"
            )
        if self.query_heads % self.kv_heads:
            raise ValueError(
                f"{fn}: kv_heads: expected a divisor of query_heads={self.query_heads}, "
                f"got {self.kv_heads}"
            )
        if isinstance(self.kv_format, KVFormat):
            object.__setattr__(self, "group_size", _group_size_of(fn, self.kv_format, self))
            object.__setattr__(self, "kv_format", self.kv_format.kind)
        _checks.check_choice(fn, "kv_format", self.kv_format, KV_FORMATS)
        if self.kv_format in QUANTIZED_FORMATS:
            self.kv_spec(self.kv_format).check_head_dim(fn, "head_dim", self.head_dim)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights, ``params * weight_itemsize`` (0 when ``params`` is ``None``)."""
        return 0 if self.params is None else self.params * self.weight_itemsize

    def kv_heads_per_device(self, tensor_parallel: int = 1) -> int:
        """KV heads one device of a tensor-parallel group of ``tensor_parallel`` holds.

        ``K / TP`` when ``TP`` divides ``K``; when ``K < TP`` and ``K`` divides ``TP`` every
        device holds one kv head, each replicated on ``TP / K`` devices (what vLLM and
        Megatron do).

        Raises:
          ValueError: when neither ``K % TP == 0`` nor ``TP % K == 0``.
        """
        fn = "ModelShape.kv_heads_per_device"
        _checks.check_int(fn, "tensor_parallel", tensor_parallel, low=1)
        if self.kv_heads % tensor_parallel == 0:
            return self.kv_heads // tensor_parallel
        if tensor_parallel % self.kv_heads == 0:
            return 1
        raise ValueError(
            f"{fn}: tensor_parallel: expected a divisor or a multiple of kv_heads="
            f"{self.kv_heads} (kv heads are split over the group, or replicated when fewer), "
            f"got {tensor_parallel}"
        )

    def kv_spec(self, kv_format: str | KVFormat) -> KVFormat:
        """The ``paged.KVFormat`` of a quantized ``kv_format``: a kind (with this model's
        group size), or a KVFormat, returned as it is."""
        if isinstance(kv_format, KVFormat):
            return kv_format
        if kv_format == "int4":
            return KVFormat("int4", group_size=self.group_size)
        return KVFormat(kv_format)

    def supports(self, kv_format: str | KVFormat) -> bool:
        """Whether ``kv_format`` (a name of :data:`KV_FORMATS` or a ``paged.KVFormat``) can
        store this model's head dim."""
        if isinstance(kv_format, str) and kv_format in FLOAT_FORMATS:
            return True
        try:
            self.kv_spec(kv_format).check_head_dim("ModelShape", "head_dim", self.head_dim)
        except ValueError:
            return False
        return True

    def bytes_per_token(
        self,
        kv_format: str | KVFormat | None = None,
        page_size: int = 16,
        tensor_parallel: int = 1,
    ) -> int | float:
        """KV bytes of one token, keys and values, all layers and kv heads, scales included.

        ``2 * L * K * b`` (on one device of a tensor-parallel group: ``K`` is
        :meth:`kv_heads_per_device`) where ``b`` is ``H * itemsize`` for a float format or
        ``paged.KVFormat.bytes_per_token(H, page_size)`` for a quantized one (so the numbers
        are the library's real pools'). kivi2's per-sequence float32 window is not per token:
        see :meth:`residual_bytes`.

        Args:
          kv_format: a format of :data:`KV_FORMATS` or a ``paged.KVFormat`` (its own
            ``group_size``; default: this model's format).
          page_size: ``C`` (kivi2's key scales are per page).
          tensor_parallel: ``TP``: the bytes one device of a tensor-parallel group holds.
        """
        kv_format = self.kv_format if kv_format is None else kv_format
        if not isinstance(kv_format, KVFormat):
            _checks.check_choice("ModelShape.bytes_per_token", "kv_format", kv_format, KV_FORMATS)
        heads = self.kv_heads_per_device(tensor_parallel)
        if isinstance(kv_format, str) and kv_format in FLOAT_FORMATS:
            per_head = self.head_dim * FLOAT_FORMATS[kv_format]
        else:
            per_head = self.kv_spec(kv_format).bytes_per_token(self.head_dim, page_size)
        return 2 * self.layers * heads * per_head

    def residual_bytes(
        self,
        kv_format: str | KVFormat | None = None,
        page_size: int = 16,
        tensor_parallel: int = 1,
    ) -> int:
        """Bytes per sequence of kivi2's float32 window (``residual_pages(C)`` pages of keys
        and values, all layers and kv heads of one device; a ``KVFormat("kivi2",
        residual=R)`` counts its own window); 0 for the other formats."""
        kv_format = self.kv_format if kv_format is None else kv_format
        spec = kv_format if isinstance(kv_format, KVFormat) else None
        if (spec.kind if spec else kv_format) != "kivi2":
            return 0
        heads = self.kv_heads_per_device(tensor_parallel)
        pages = self.kv_spec(spec or "kivi2").residual_pages(page_size)
        return 2 * self.layers * heads * pages * page_size * self.head_dim * 4

    @property
    def itemsize(self) -> int:
        """Bytes per element of activations and of K/V on the wire: 4 for a float32 model,
        2 otherwise."""
        return 4 if self.kv_format == "float32" else 2


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Context lengths (tokens per request) as a few statistics.

    Build it with :meth:`from_samples` (observed lengths) or :meth:`from_percentiles`.

    Attributes:
      p50, p95, p99: percentiles in tokens (``1 <= p50 <= p95 <= p99``).
      sigma: standard deviation in tokens (``>= 0``).
      mean: mean in tokens (``> 0``).
      max_length: the longest request (samples) or the longest allowed (``>= p99``), or
        ``None`` when unknown.
      count: number of samples, or ``None``.

    Raises:
      ValueError: on percentiles out of order, non-positive lengths, a negative or non-finite
        sigma, or ``max_length < p99``.
    """

    p50: float
    p95: float
    p99: float
    sigma: float
    mean: float
    max_length: int | None = None
    count: int | None = None

    def __post_init__(self):
        fn = "LengthDistribution"
        for name in ("p50", "p95", "p99", "mean"):
            _checks.check_float(fn, name, getattr(self, name), low=0.0, low_open=True)
        _checks.check_float(fn, "sigma", self.sigma, low=0.0)
        if not self.p50 <= self.p95 <= self.p99:
            raise ValueError(
                f"{fn}: percentiles: expected p50 <= p95 <= p99, got p50={self.p50}, "
                f"p95={self.p95}, p99={self.p99}"
            )
        if self.p50 < 1:
            raise ValueError(f"{fn}: p50: expected at least 1 token, got {self.p50}")
        if self.max_length is not None:
            _checks.check_int(fn, "max_length", self.max_length, low=1)
            if self.max_length < self.p99:
                raise ValueError(
                    f"{fn}: max_length: expected >= p99={self.p99}, got {self.max_length}"
                )
        if self.count is not None:
            _checks.check_int(fn, "count", self.count, low=1)

    @classmethod
    def from_samples(cls, samples) -> "LengthDistribution":
        """Statistics of observed lengths (numpy's linear percentiles, population ``std``).

        Args:
          samples: a non-empty 1-D sequence of positive integer lengths in tokens.

        Raises:
          ValueError: on an empty, non-1-D, non-integer or non-positive sample set.

        Example:
          >>> LengthDistribution.from_samples([100, 200, 300]).p50
          200.0
        """
        fn = "LengthDistribution.from_samples"
        x = np.asarray(samples)
        if x.ndim != 1 or x.size == 0:
            raise ValueError(f"{fn}: samples: expected a non-empty 1-D sequence, got {x.shape}")
        if x.dtype.kind not in "iu":
            if x.dtype.kind != "f" or not np.all(np.isfinite(x)) or np.any(x != np.round(x)):
                raise ValueError(f"{fn}: samples: expected integer lengths, got dtype {x.dtype}")
        if np.any(x < 1):
            raise ValueError(f"{fn}: samples: expected lengths >= 1, got min {x.min()}")
        x = x.astype(np.float64)
        p50, p95, p99 = (float(v) for v in np.percentile(x, [50, 95, 99]))
        return cls(
            p50=p50,
            p95=p95,
            p99=p99,
            sigma=float(np.std(x)),
            mean=float(np.mean(x)),
            max_length=int(x.max()),
            count=int(x.size),
        )

    @classmethod
    def from_percentiles(
        cls, p50, p95, p99, *, sigma=None, mean=None, max_length=None
    ) -> "LengthDistribution":
        """Statistics from percentiles; ``sigma`` and ``mean`` default to those of the
        log-normal through ``p50`` and ``p99`` (production lengths are long-tailed, rule 3).

        With ``s = ln(p99 / p50) / z99``: ``mean = p50 * exp(s**2 / 2)``, ``sigma = p50 *
        sqrt(exp(s**2) * (exp(s**2) - 1))``.

        Args:
          p50, p95, p99: percentiles in tokens, ``1 <= p50 <= p95 <= p99``.
          sigma, mean: override the log-normal estimates.
          max_length: the longest request allowed (caps the sizing length), or ``None``.

        Raises:
          ValueError: as the class.
        """
        fn = "LengthDistribution.from_percentiles"
        named = (("p50", p50), ("p95", p95), ("p99", p99))
        p50, p95, p99 = (_checks.check_float(fn, n, v, low=0.0, low_open=True) for n, v in named)
        if not p50 <= p95 <= p99:
            raise ValueError(
                f"{fn}: percentiles: expected p50 <= p95 <= p99, got p50={p50}, p95={p95}, "
                f"p99={p99}"
            )
        s2 = (math.log(p99 / p50) / _Z99) ** 2
        if sigma is None:
            sigma = p50 * math.sqrt(math.exp(s2) * math.expm1(s2))
        if mean is None:
            mean = p50 * math.exp(s2 / 2)
        sigma = _checks.check_float(fn, "sigma", sigma, low=0.0)
        mean = _checks.check_float(fn, "mean", mean, low=0.0, low_open=True)
        return cls(p50=p50, p95=p95, p99=p99, sigma=sigma, mean=mean, max_length=max_length)

    @property
    def sizing_length(self) -> int:
        """Rule 1: ``ceil(p95 + 2 sigma)``, capped at ``max_length`` when it is known."""
        length = self.p95 + 2.0 * self.sigma
        if self.max_length is not None:
            length = min(length, float(self.max_length))
        return math.ceil(length)


#: Hardware numbers a :class:`Hardware` may label, and what each is.
RATE_FIELDS = (
    "device_memory",
    "device_flops",
    "memory_bandwidth",
    "intra_node_bandwidth",
    "inter_node_bandwidth",
    "host_bandwidth",
    "disk_bandwidth",
    "disk_iops",
    "collective_latency",
    "attention_efficiency",
    "decode_vs_bandwidth",
    "page_in_efficiency",
)

_CPU_RUN = "this repository's CPU benchmark (8 emulated devices on 2 cores)"
_H100_SHEET = "NVIDIA H100 SXM5 80GB datasheet"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Devices, memories, links and efficiencies of a cluster (sizes in bytes, rates per second).

    Every number the cost model uses is a field here, and ``labels`` says where each one comes
    from: ``"assumed: ..."`` (a published peak, or a guess) or ``"measured: ..."`` (where and
    how). :meth:`h100_sxm` and :meth:`emulated_cpu` are labelled presets; a field without a
    label is reported as given by the caller.

    Attributes:
      devices: accelerators available to one request's tensor- and sequence-parallel group
        and its replicas.
      devices_per_node: devices joined by the fast intra-node link (``devices`` must be at most
        this or a multiple of it).
      device_memory: bytes per device for the weights' share and the KV cache (leave out what
        activations and the runtime need).
      device_flops: FLOP/s per device (dense matmul, the compute dtype).
      memory_bandwidth: bytes/s of one device's memory.
      intra_node_bandwidth, inter_node_bandwidth: bytes/s one device sends over each link.
      host_memory: bytes of pinned host memory for KV, all nodes together (``>= 0``).
      host_bandwidth: bytes/s between one device and host memory.
      disk: bytes of disk (NVMe) for KV (``>= 0``).
      disk_bandwidth: bytes/s of the disk.
      disk_iops: the disk's operations per second before it saturates (rule 11: 100k/s).
      collective_latency: seconds of fixed cost per step (a collective or a local call).
      overlap: whether a ring's hops overlap with compute (accelerators: yes; CPU: no).
      attention_efficiency: share of ``device_flops`` blockwise attention reaches, in
        ``(0, 1]`` (1: the peak; this repo's CPU: 0.73).
      decode_vs_bandwidth: a paged decode's time over the bandwidth bound of the bytes it
        reads, ``>= 1`` (1: at the bound; this repo's CPU: 1.94).
      page_in_efficiency: share of ``host_bandwidth`` a page-in reaches, in ``(0, 1]``.
      labels: ``((field, label), ...)``: where each number comes from; each label starts
        with ``"assumed"`` or ``"measured"``.

    Raises:
      ValueError: on a non-positive count, size or rate (host memory and disk may be 0), an
        efficiency outside its range, ``devices`` neither at most nor a multiple of
        ``devices_per_node``, or a label on an unknown field or not starting with
        ``"assumed"`` / ``"measured"``.
    """

    devices: int
    devices_per_node: int
    device_memory: int
    device_flops: float | int
    memory_bandwidth: float | int
    intra_node_bandwidth: float | int
    inter_node_bandwidth: float | int
    host_memory: int = 0
    host_bandwidth: float | int = 25e9
    disk: int = 0
    disk_bandwidth: float | int = 3e9
    disk_iops: float | int = 100_000.0
    collective_latency: float | int = 20e-6
    overlap: bool = True
    attention_efficiency: float | int = 1.0
    decode_vs_bandwidth: float | int = 1.0
    page_in_efficiency: float | int = 1.0
    labels: tuple = ()  # of (field, label) pairs; a bare tuple: beartype does not sample it

    def __post_init__(self):
        fn = "Hardware"
        for name in ("devices", "devices_per_node", "device_memory"):
            _checks.check_int(fn, name, getattr(self, name), low=1)
        for name in ("host_memory", "disk"):
            _checks.check_int(fn, name, getattr(self, name), low=0)
        for name in (
            "device_flops",
            "memory_bandwidth",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
            "host_bandwidth",
            "disk_bandwidth",
            "disk_iops",
        ):
            _checks.check_float(fn, name, getattr(self, name), low=0.0, low_open=True)
        _checks.check_float(fn, "collective_latency", self.collective_latency, low=0.0)
        for name in ("attention_efficiency", "page_in_efficiency"):
            _checks.check_float(fn, name, getattr(self, name), low=0.0, low_open=True, high=1.0)
        _checks.check_float(fn, "decode_vs_bandwidth", self.decode_vs_bandwidth, low=1.0)
        if not isinstance(self.overlap, bool):
            raise ValueError(f"{fn}: overlap: expected a bool, got {self.overlap!r}")
        if self.devices > self.devices_per_node and self.devices % self.devices_per_node:
            raise ValueError(
                f"{fn}: devices: expected at most devices_per_node={self.devices_per_node} or "
                f"a multiple of it, got {self.devices}"
            )
        if not isinstance(self.labels, tuple):
            raise ValueError(
                f"{fn}: labels: expected a tuple of (field, label), got {self.labels!r}"
            )
        for item in self.labels:
            if not (isinstance(item, tuple) and len(item) == 2 and item[0] in RATE_FIELDS):
                raise ValueError(
                    f"{fn}: labels: expected (field, label) pairs with a field of "
                    f"{RATE_FIELDS}, got {item!r}"
                )
            if not (isinstance(item[1], str) and item[1].startswith(("assumed", "measured"))):
                raise ValueError(
                    f"{fn}: labels: expected a label starting with 'assumed' or 'measured', "
                    f"got {item!r}"
                )

    @property
    def nodes(self) -> int:
        """Nodes the devices span."""
        return max(1, self.devices // self.devices_per_node)

    def label(self, field: str) -> str:
        """Where ``field``'s number comes from: its label; else, for a field left at its
        default, ``"assumed: Hardware's default ..."``; else ``"given by the caller"``."""
        labels = dict(self.labels)
        if field in labels:
            return labels[field]
        default = {f.name: f.default for f in dataclasses.fields(self)}[field]
        if default is not dataclasses.MISSING and getattr(self, field) == default:
            return f"assumed: Hardware's default {default:g}"
        return "given by the caller (no label)"

    @classmethod
    def h100_sxm(
        cls,
        *,
        devices: int = 8,
        devices_per_node: int = 8,
        device_memory: int = 80 * 10**9,
        host_memory: int = 0,
        disk: int = 0,
    ) -> "Hardware":
        """H100 SXM5 80GB nodes (NVLink inside a node, 200 Gb/s InfiniBand per GPU across).

        Every number is a published peak or an assumption, labelled so: no efficiency was
        measured on an H100 (the estimates are lower bounds on time). ``device_memory``
        defaults to the datasheet's 80 GB (decimal); pass less to keep room for activations
        and the runtime.
        """
        peak = f"assumed: published peak, {_H100_SHEET}"
        memory = (
            f"assumed: {device_memory / 1e9:g} GB for weights and KV of the datasheet's 80 GB"
            + ("" if device_memory == 80 * 10**9 else " (the rest kept for activations)")
        )
        labels = (
            ("device_memory", memory),
            ("device_flops", f"{peak}: 989 TFLOP/s dense bf16"),
            ("memory_bandwidth", f"{peak}: 3.35 TB/s HBM3"),
            ("intra_node_bandwidth", f"{peak}: NVLink 900 GB/s, 450 GB/s per direction"),
            ("inter_node_bandwidth", "assumed: one 200 Gb/s InfiniBand NIC per GPU, 25 GB/s"),
            ("host_bandwidth", "assumed: PCIe 5 x16, 64 GB/s peak, taken as 25 GB/s achieved"),
            ("disk_bandwidth", "assumed: one NVMe drive, 3 GB/s"),
            ("disk_iops", "assumed: 100k IOPS (the article's rule 11)"),
            ("collective_latency", "assumed: 20 us per collective or kernel launch"),
            ("attention_efficiency", "assumed: 1.0 (the peak); not measured on an H100"),
            ("decode_vs_bandwidth", "assumed: 1.0 (at the bandwidth bound); not measured"),
            ("page_in_efficiency", "assumed: 1.0 of host_bandwidth; not measured"),
        )
        return cls(
            devices=devices,
            devices_per_node=devices_per_node,
            device_memory=device_memory,
            device_flops=989e12,
            memory_bandwidth=3.35e12,
            intra_node_bandwidth=450e9,
            inter_node_bandwidth=25e9,
            host_memory=host_memory,
            host_bandwidth=25e9,
            disk=disk,
            disk_bandwidth=3e9,
            disk_iops=100_000.0,
            collective_latency=20e-6,
            overlap=True,
            labels=labels,
        )

    @classmethod
    def emulated_cpu(cls, *, device_memory: int = 2**30, host_memory: int = 0) -> "Hardware":
        """This repo's benchmark machine: 8 emulated CPU devices sharing 2 cores.

        FLOP/s and bandwidths are the machine's (``CPU_MATMUL_FLOPS``, ``CPU_MEMCPY_BYTES_PER_S``)
        divided over the 8 devices that share them; no overlap; ``CPU_STEP_LATENCY_S``; the
        efficiencies measured there. Each number is labelled with the results file and run.
        """
        share = 8
        memcpy = f"measured: {_CPU_RUN}, memcpy 5.48 GiB/s (benchmarks/results/offload_2026-12-01.md) / 8 devices"
        labels = (
            ("device_memory", "assumed: 1 GiB per emulated device (a choice, not a limit)"),
            (
                "device_flops",
                f"measured: {_CPU_RUN}, matmul 129.3 GFLOP/s "
                "(benchmarks/results/gaps_2026-12-01.md, run A) / 8 devices",
            ),
            ("memory_bandwidth", memcpy),
            ("intra_node_bandwidth", memcpy),
            ("inter_node_bandwidth", memcpy),
            ("host_bandwidth", memcpy),
            ("disk_bandwidth", "assumed: 3 GB/s (no disk was measured)"),
            ("disk_iops", "assumed: 100k IOPS (the article's rule 11)"),
            (
                "collective_latency",
                f"measured: {_CPU_RUN}, fitted from two ring timings (benchmarks/results/ring.md)",
            ),
            (
                "attention_efficiency",
                f"measured: {_CPU_RUN}, blockwise forward at T=S=16K, 73% of the same run's "
                "matmul (benchmarks/results/gaps_2026-12-01.md, run A)",
            ),
            (
                "decode_vs_bandwidth",
                f"measured: {_CPU_RUN}, paged_attention decode 1.94x the bandwidth bound "
                "(benchmarks/results/paged.md, 12-02)",
            ),
            (
                "page_in_efficiency",
                f"measured: {_CPU_RUN}, page_in 0.93x of the same run's memcpy "
                "(benchmarks/results/gaps_2026-12-02.md, run B)",
            ),
        )
        return cls(
            devices=8,
            devices_per_node=8,
            device_memory=device_memory,
            device_flops=CPU_MATMUL_FLOPS / share,
            memory_bandwidth=CPU_MEMCPY_BYTES_PER_S / share,
            intra_node_bandwidth=CPU_MEMCPY_BYTES_PER_S / share,
            inter_node_bandwidth=CPU_MEMCPY_BYTES_PER_S / share,
            host_memory=host_memory,
            host_bandwidth=CPU_MEMCPY_BYTES_PER_S / share,
            collective_latency=CPU_STEP_LATENCY_S,
            overlap=False,
            attention_efficiency=BLOCKWISE_FORWARD_EFFICIENCY,
            decode_vs_bandwidth=PAGED_DECODE_VS_BANDWIDTH,
            page_in_efficiency=PAGE_IN_VS_MEMCPY,
            labels=labels,
        )


@dataclasses.dataclass(frozen=True)
class Workload:
    """What is served and how: the model, the lengths, the prefix reuse, tensor parallelism
    and which lossy KV formats (if any) are allowed.

    Attributes:
      model: a :class:`ModelShape`.
      lengths: a :class:`LengthDistribution` of context lengths.
      prefix_reuse: share of requests that start with the same shared prefix, in ``[0, 1]``.
      prefix_tokens: tokens of that shared prefix (``>= 0``).
      quantization: lossy quantized KV formats the planner may switch to when the model's own
        format does not fit (tried from the most bytes to the fewest): ``paged.KVFormat``
        values or their kinds, stored as kinds (an int4 KVFormat must have the model's
        ``group_size``). Default ``()``: only
        the model's own format. Lossy formats are opt-in: their accuracy loss was measured only
        on this repo's 400K-parameter toy model, not on a real one; measure yours first.
      latency_tolerant: whether requests tolerate disk (NVMe) latency (the article's case C:
        batch document analysis yes, real-time chat no).
      tensor_parallel: ``TP``, devices one copy of the weights is split over (each holds
        ``N / TP`` query heads, ``K / TP`` kv heads, or one replicated kv head when
        ``K < TP``); sequence parallelism then runs over groups of ``TP`` devices.

    Raises:
      ValueError: on a share outside ``[0, 1]``, negative tokens, an unknown format, a
        non-positive ``tensor_parallel``, ``N % TP != 0``, or a ``TP`` that is neither a
        divisor nor a multiple of ``K``.
    """

    model: ModelShape
    lengths: LengthDistribution
    prefix_reuse: float = 0.0
    prefix_tokens: int = 0
    quantization: tuple[str | KVFormat, ...] = ()
    latency_tolerant: bool = False
    tensor_parallel: int = 1

    def __post_init__(self):
        fn = "Workload"
        if not isinstance(self.model, ModelShape):
            raise ValueError(f"{fn}: model: expected a ModelShape, got {self.model!r}")
        if not isinstance(self.lengths, LengthDistribution):
            raise ValueError(f"{fn}: lengths: expected a LengthDistribution, got {self.lengths!r}")
        _checks.check_float(fn, "prefix_reuse", self.prefix_reuse, low=0.0, high=1.0)
        _checks.check_int(fn, "prefix_tokens", self.prefix_tokens, low=0)
        if not isinstance(self.quantization, tuple):
            raise ValueError(f"{fn}: quantization: expected a tuple, got {self.quantization!r}")
        kinds = []
        for kind in self.quantization:
            if isinstance(kind, KVFormat):
                _refuse_kivi2_window(fn, "quantization", kind)
                if kind != self.model.kv_spec(kind.kind):
                    raise ValueError(
                        f"{fn}: quantization: expected {self.model.kv_spec(kind.kind)!r} (int4 "
                        f"takes the model's group_size; set it on ModelShape), got {kind!r}"
                    )
                kind = kind.kind
            _checks.check_choice(fn, "quantization", kind, QUANTIZED_FORMATS)
            kinds.append(kind)
        object.__setattr__(self, "quantization", tuple(kinds))
        if not isinstance(self.latency_tolerant, bool):
            raise ValueError(
                f"{fn}: latency_tolerant: expected a bool, got {self.latency_tolerant!r}"
            )
        tp = _checks.check_int(fn, "tensor_parallel", self.tensor_parallel, low=1)
        if self.model.query_heads % tp:
            raise ValueError(
                f"{fn}: tensor_parallel: expected a divisor of query_heads="
                f"{self.model.query_heads} (each device computes whole heads), got {tp}"
            )
        if self.model.kv_heads % tp and tp % self.model.kv_heads:
            raise ValueError(
                f"{fn}: tensor_parallel: expected a divisor or a multiple of kv_heads="
                f"{self.model.kv_heads} (kv heads are split, or replicated when fewer than "
                f"TP), got {tp}"
            )


@dataclasses.dataclass(frozen=True)
class Reason:
    """Why a value was chosen.

    Attributes:
      rule: the rule's id: an article rule (``"rule 1"``, ``"iron rule 3"``, ``"incident B"``),
        ``"measured"`` (a benchmark of this repository decides), ``"model"`` (plain
        arithmetic on the inputs) or ``"cost model"``.
      text: one sentence with the numbers in words.
      numbers: the numbers the text uses, by name.
      source: where the rule or the numbers come from, in words a reader can follow: the
        article's title and section, a results file of this repository, or the hardware
        description's labels (``""``: arithmetic on the inputs).
    """

    rule: str
    text: str
    numbers: dict = dataclasses.field(default_factory=dict)
    source: str = ""

    def __str__(self) -> str:
        return f"[{self.rule}] {self.text}" + (f" (source: {self.source})" if self.source else "")


@dataclasses.dataclass(frozen=True)
class Decision:
    """A planned value and the reasons that produced it (at least one)."""

    value: object
    reasons: tuple[Reason, ...]


@dataclasses.dataclass(frozen=True)
class Tiers:
    """Bytes of one request's KV in each tier (they sum to the request's KV bytes)."""

    device: int
    host: int
    disk: int

    @property
    def total(self) -> int:
        """Bytes placed in all tiers (less than the request's bytes when it does not fit)."""
        return self.device + self.host + self.disk


class PlanRow(NamedTuple):
    """One row of :meth:`Plan.rows`: a field's name, its value and its reasons."""

    field: str
    value: object
    reasons: tuple[Reason, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's answer; every field is a :class:`Decision` (``.value``, ``.reasons``).

    Attributes:
      sizing_length: tokens one request is sized for (rule 1: p95 + 2 sigma, not max).
      page_size: ``C`` in tokens, 4, 16 or 64 (rules 2 and 4).
      kv_format: the planned KV format (the model's, or a quantized one that makes it fit).
      kv_bytes_per_token: KV bytes per token in ``kv_format`` (all layers, keys and values, the
        model's ``K`` kv heads; one device's share is ``kv_bytes_per_token_per_device``).
      kv_bytes_per_token_all_heads: the same in the model's format with ``K = N`` (how the
        article counts Llama-3-70B: 2.5 MB instead of 320 KB).
      kv_bytes_per_request: KV bytes the devices of a TP group store for one request at
        ``sizing_length`` (whole pages; replicated kv heads counted on every device).
      pages_per_request: pages of one request (on each device of a TP group).
      sequence_parallel: whether the sequence is sharded over devices (iron rule 1).
      degree: groups of ``TP`` devices the sequence is sharded over (1 without).
      strategy: ``"ring"``, ``"ulysses"``, ``"usp"``, ``"allgather"`` or ``None``.
      max_pages_per_device: pages of ``page_size`` one device's memory holds after the
        weights' share (the pool's ``P``, page 0 being the reserved null page).
      max_sequences_per_device: requests of ``sizing_length`` one device holds at once (each
        request's share of the group's pages; 0 when one does not fit).
      tiers: a :class:`Tiers` of one request's bytes on devices, pinned host and disk.
      retention: how cold pages are handled (``"none"``: all resident; ``"fetch back"``).
      prefix_saving: expected share of pages a prefix cache saves on this workload.
      cost: a :class:`CostEstimate` of one prefill and one decode token.
      fits: whether one request of ``sizing_length`` fits the cluster (all tiers).
      tensor_parallel: ``TP``, devices one copy of the weights is split over (``degree``
        counts groups of ``TP`` devices, so one request uses ``TP * degree`` devices).
      weight_bytes_per_device: the weights' share on each device, subtracted from its memory.
      kv_bytes_per_token_per_device: KV bytes per token one device of a tensor-parallel group
        holds (its ``K / TP`` kv heads, or one replicated head).
    """

    sizing_length: Decision
    page_size: Decision
    kv_format: Decision
    kv_bytes_per_token: Decision
    kv_bytes_per_token_all_heads: Decision
    kv_bytes_per_request: Decision
    pages_per_request: Decision
    sequence_parallel: Decision
    degree: Decision
    strategy: Decision
    max_pages_per_device: Decision
    max_sequences_per_device: Decision
    tiers: Decision
    retention: Decision
    prefix_saving: Decision
    cost: Decision
    fits: Decision
    tensor_parallel: Decision
    weight_bytes_per_device: Decision
    kv_bytes_per_token_per_device: Decision

    def rows(self) -> list[PlanRow]:
        """One :class:`PlanRow` ``(field, value, reasons)`` per field, in field order."""
        return [
            PlanRow(f.name, getattr(self, f.name).value, getattr(self, f.name).reasons)
            for f in dataclasses.fields(self)
        ]

    def format(self, width: int = 100) -> str:
        """The plan as text: one line per field, then each reason indented and wrapped."""
        lines = []
        for row in self.rows():
            lines.append(f"{row.field}: {row.value}")
            for reason in row.reasons:
                lines.extend(
                    textwrap.wrap(
                        str(reason), width, initial_indent="    ", subsequent_indent="      "
                    )
                )
        return "\n".join(lines)
