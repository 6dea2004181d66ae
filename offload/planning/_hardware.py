"""The planner's cluster description: :class:`Hardware`, every number labelled.

Devices, memories, links, efficiencies and rates (:data:`RATE_FIELDS`), each labelled assumed or
measured, with presets measured on this repository's CPU benchmark. Validated when built. Pure
Python.
"""

import dataclasses

from offload import _checks
from offload.planning._cost_model import (
    BLOCKWISE_FORWARD_EFFICIENCY,
    CPU_MATMUL_FLOPS,
    CPU_MEMCPY_BYTES_PER_S,
    CPU_STEP_LATENCY_S,
    PAGE_IN_VS_MEMCPY,
    PAGED_DECODE_VS_BANDWIDTH,
)

__all__ = ["Hardware", "RATE_FIELDS"]


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
