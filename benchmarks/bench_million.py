"""A 1,048,576-token decode on 8 emulated CPU devices, with 80% of the KV pages in pinned host memory.

The cache: one sequence of ``S = 2**20`` tokens, one layer, ``K = 2`` kv heads, ``H = 64``,
float32 (``2 * K * H * 4 = 1024`` bytes per token for keys and values: 1 GiB in all), in
pages of ``C = 64`` tokens (the page size the README's paged sections use for long
sequences), laid out as ``paged.sharded_paged_attention`` reads it: device ``d`` of the 8
holds the contiguous token range ``[d * S / 8, (d + 1) * S / 8)`` in its own pool shard.

1. Prefill: the device pool ``[1, K, 8 * (M_d + 1), C, H]`` (``M_d = S / (8 C)`` pages per
   device, each device's local page 0 the null page) is built shard by shard from a
   deterministic numpy generator (one seed per page), holding tokens ``0 .. S - steps - 1``.
2. Residency: 20% of the pages stay on the device, chosen **at random** (seeded), the same
   number on every device (to one page) so each device keeps a fifth of its own range; the
   open page (the last one, where decode writes) always stays. A global retention policy
   (``offload.select_keep``) would not do here: recency keeps only the last device's pages,
   and a sharded pool has one capacity per device. The other 80% are written to a
   ``offload.HostPagePool`` in ``pinned_host`` memory split along its pages like the device
   pool (``offload.page_out``: each page goes to a slot of its own device); the kept pages
   are gathered into a device pool a fifth the size and the full pool is deleted.
3. Decode ``steps`` tokens (``N = 8`` query heads, GQA ``G = 4``): each step writes its
   token's keys and values into the open page, then attends over all ``S - steps + t + 1``
   tokens: ``paged.sharded_paged_attention`` over the device pages, and over the cold pages
   fetched back from pinned host in ``chunks`` groups (``offload.prefetch_layer`` of the
   page-split host pool: each device fetches its own slots into a staging pool whose local
   page 0 is a never-written null slot), double-buffered (chunk ``c + 1`` is issued before
   chunk ``c`` is computed), every part merged exactly with ``ringattn.merge_attention``.
   Device memory during a step: the kept fifth plus two staging chunks.
4. Check: every step's output and log-sum-exp against exact attention over the full cache
   computed independently in numpy float64, one page block at a time with a running
   log-sum-exp merge, from the same generator (never from the library's arrays).

Printed: bytes resident per device and memory kind (from the shards of ``jax.live_arrays()``;
``Device.memory_stats()`` is ``None`` on CPU), pinned-host bytes, the process's RSS and peak
RSS (``/proc/self/status``), time per decode step, time to fetch all cold pages, max error.

Run from the repository root: ``python -m benchmarks.bench_million`` (about a minute on 2
shared cores, 2.5 GiB peak RSS: ``benchmarks/results/million.md``), ``--quick`` (131,072 tokens, writes
``benchmarks/results/quick/million.md``) or ``--tiny`` (16,384 tokens, seconds;
``benchmarks/results/quick/million_tiny.md``).
"""

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from benchmarks import _common
from offload import make_host_page_pool, page_out, prefetch_layer, wait
from paged import sharded_paged_attention
from ringattn import merge_attention

DEVICES = 8
SIZES = {"full": 2**20, "quick": 2**17, "tiny": 2**14}
K, N, H, C = 2, 8, 64, 64  # kv heads, query heads, head dim, tokens per page
PAGE_OUT_BATCH = 1 << 20  # cold pages per device per offload.page_out call: all of them
DEVICE_SHARE = 0.2  # fraction of pages kept on the device
SEED = 0
# float32 kernels against a float64 reference: max |out - ref| / max |ref| and max |lse - ref|.
TOLERANCE = {"out_rel": 1e-4, "lse_abs": 1e-4}
MiB = _common.MiB


# ------------------------------------------------------------------------------------------
# The cache's contents: a deterministic function of the page index (build and reference).
# ------------------------------------------------------------------------------------------
def page_kv(page: int) -> np.ndarray:
    """Keys and values of global page ``page``: ``[2, K, C, H]`` float32, standard normal."""
    rng = np.random.default_rng([SEED, 0, page])
    return rng.standard_normal((2, K, C, H), dtype=np.float32)


def queries(steps: int) -> np.ndarray:
    """One decode query per step: ``[steps, N, H]`` float32."""
    return np.random.default_rng([SEED, 1]).standard_normal((steps, N, H), dtype=np.float32)


class Layout:
    """Which pages stay on the device, where the others go on host, and the page tables.

    Host side bookkeeping only (numpy). Device ``d`` owns global pages ``[d * M_d, (d + 1) *
    M_d)`` of the sequence (page-table columns), local page ``p + 1`` of its shard of the full
    pool holding column ``d * M_d + p``.
    """

    def __init__(self, tokens: int, chunks: int, seed: int = SEED):
        self.tokens, self.chunks = tokens, chunks
        self.pages = tokens // C
        self.per_device = self.pages // DEVICES  # M_d
        rng = np.random.default_rng([seed, 2])
        total_hot = round(DEVICE_SHARE * self.pages)
        counts = [total_hot // DEVICES + (d < total_hot % DEVICES) for d in range(DEVICES)]
        self.hot, self.cold = [], []  # per device: local column indices (0 .. M_d - 1)
        for d, count in enumerate(counts):
            columns = np.arange(self.per_device)
            if d == DEVICES - 1:  # the open page always stays
                rest = rng.choice(columns[:-1], size=count - 1, replace=False)
                hot = np.sort(np.append(rest, columns[-1]))
            else:
                hot = np.sort(rng.choice(columns, size=count, replace=False))
            self.hot.append(hot)
            self.cold.append(np.setdiff1d(columns, hot))
        self.hot_capacity = max(counts) + 1  # per device, with its null page
        self.chunk_width = -(-max(len(c) for c in self.cold) // chunks)  # cold pages per chunk
        self.slots_per_device = chunks * (self.chunk_width + 1)  # one null slot per chunk

    @property
    def hot_pages(self) -> int:
        return sum(len(h) for h in self.hot)

    @property
    def cold_pages(self) -> int:
        return sum(len(c) for c in self.cold)

    def page_out_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """``(page_ids, host_slots)``: each cold page of the full pool and its host slot.

        Device ``d``'s cold page ``i`` goes to chunk ``i // w`` at position ``i % w``: local
        slot ``chunk * (w + 1) + 1 + position`` (slot ``chunk * (w + 1)`` stays zero: the
        staging pool's null page when that chunk is fetched).
        """
        w, ids, slots = self.chunk_width, [], []
        for d, cold in enumerate(self.cold):
            i = np.arange(len(cold))
            ids.append(d * (self.per_device + 1) + 1 + cold)
            slots.append(d * self.slots_per_device + (i // w) * (w + 1) + 1 + i % w)
        return np.concatenate(ids), np.concatenate(slots)

    def page_out_batches(self, per_device: int = PAGE_OUT_BATCH):
        """:meth:`page_out_ids` in calls of up to ``per_device`` pages of each device.

        By default one call with every cold page (1,638 per device at 1M tokens): the page
        copy of a pool split over the devices is one looped program over the mesh, compiled
        once per power-of-two bucket (earlier releases unrolled it per device, and this
        benchmark paged out in batches of 16 to keep the compiles small).
        """
        ids, slots = self.page_out_ids()
        device = slots // self.slots_per_device
        rank = np.zeros_like(ids)  # each page's index among its device's cold pages
        for d in range(DEVICES):
            rank[device == d] = np.arange(int((device == d).sum()))
        for batch in range(-(-int(rank.max(initial=-1) + 1) // per_device)):
            mine = rank // per_device == batch
            yield ids[mine], slots[mine]

    def hot_gather_ids(self) -> np.ndarray:
        """``[D * hot_capacity]`` local page ids of the full pool that form the device pool:
        per device its null page, then its kept pages (padded with the null page)."""
        rows = []
        for hot in self.hot:
            row = np.zeros(self.hot_capacity, np.int32)
            row[1 : 1 + len(hot)] = hot + 1
            rows.append(row)
        return np.concatenate(rows)

    def hot_table(self) -> np.ndarray:
        """``[1, D * M_d]`` local ids into the device pool (0 for a cold column)."""
        table = np.zeros((DEVICES, self.per_device), np.int32)
        for d, hot in enumerate(self.hot):
            table[d, hot] = 1 + np.arange(len(hot))
        return table.reshape(1, -1)

    def chunk_slots(self, chunk: int) -> np.ndarray:
        """Host slots fetched for ``chunk``: per device, in device order, its null slot then
        its ``w`` slots (consecutive: one block copy per device)."""
        w = self.chunk_width
        local = chunk * (w + 1) + np.arange(w + 1)
        return np.concatenate([d * self.slots_per_device + local for d in range(DEVICES)])

    def chunk_table(self, chunk: int) -> np.ndarray:
        """``[1, D * M_d]`` local ids into ``chunk``'s staging pool (0 outside the chunk)."""
        w = self.chunk_width
        table = np.zeros((DEVICES, self.per_device), np.int32)
        for d, cold in enumerate(self.cold):
            part = cold[chunk * w : (chunk + 1) * w]
            table[d, part] = 1 + np.arange(len(part))
        return table.reshape(1, -1)

    def open_page(self) -> int:
        """The open (last) page's index in the device pool."""
        return (DEVICES - 1) * self.hot_capacity + len(self.hot[-1])


# ------------------------------------------------------------------------------------------
# Building the cache
# ------------------------------------------------------------------------------------------
def build_full_pool(layout: Layout, mesh, prefill: int):
    """The prefilled device pool ``(k, v)``, each ``[1, K, D * (M_d + 1), C, H]`` split along
    pages, built shard by shard (tokens ``>= prefill`` are zero: not yet written)."""
    sharding = NamedSharding(mesh, PartitionSpec(None, None, "seq"))
    shape = (1, K, DEVICES * (layout.per_device + 1), C, H)
    shards: dict[int, np.ndarray] = {}

    def shard(d: int) -> np.ndarray:
        if d not in shards:
            kv = np.zeros((2, 1, K, layout.per_device + 1, C, H), np.float32)
            for p in range(layout.per_device):
                page = d * layout.per_device + p
                start = page * C
                if start >= prefill:
                    continue
                data = page_kv(page)
                data[:, :, max(prefill - start, 0) :] = 0.0
                kv[:, 0, :, p + 1] = data
            shards[d] = kv
        return shards[d]

    def make(part):
        def callback(index):
            d = (index[2].start or 0) // (layout.per_device + 1)
            return shard(d)[part]

        return jax.make_array_from_callback(shape, sharding, callback)

    k, v = make(0), make(1)
    jax.block_until_ready((k, v))
    return k, v


def gather_pages(mesh, pool, ids):
    """Each device's local pages ``ids`` of ``pool [1, K, P, C, H]``: ``[K, D * n, C, H]``."""

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(PartitionSpec(None, None, "seq"), PartitionSpec("seq")),
        out_specs=PartitionSpec(None, "seq"),
    )
    def take(local_pool, local_ids):
        return jnp.take(local_pool[0], local_ids, axis=1)

    return jax.jit(take)(pool, ids)


def place_residency(layout: Layout, mesh, prefill: int):
    """Prefill, page 80% out to pinned host, keep 20% on device; returns ``(hot_k, hot_v,
    host_pool, seconds)`` with seconds for ``build`` / ``page_out`` / ``gather``."""
    seconds = {}
    start = time.perf_counter()
    full_k, full_v = build_full_pool(layout, mesh, prefill)
    seconds["build"] = time.perf_counter() - start
    start = time.perf_counter()
    host = make_host_page_pool(full_k, full_v, DEVICES * layout.slots_per_device)
    for ids, slots in layout.page_out_batches():
        host = page_out(full_k, full_v, ids, host, slots).value
    host = jax.block_until_ready(host)
    seconds["page_out"] = time.perf_counter() - start
    start = time.perf_counter()
    gather_ids = jax.device_put(
        jnp.asarray(layout.hot_gather_ids()), NamedSharding(mesh, PartitionSpec("seq"))
    )
    hot_k = gather_pages(mesh, full_k, gather_ids)
    hot_v = gather_pages(mesh, full_v, gather_ids)
    jax.block_until_ready((hot_k, hot_v))
    seconds["gather"] = time.perf_counter() - start
    full_k.delete()
    full_v.delete()
    return hot_k, hot_v, host, seconds


# ------------------------------------------------------------------------------------------
# Decode
# ------------------------------------------------------------------------------------------
class Decoder:
    """One decode step over mixed residency: device pages, plus cold pages fetched per step."""

    def __init__(self, layout: Layout, mesh, hot_k, hot_v, host):
        self.layout, self.mesh, self.host = layout, mesh, host
        self.hot_k, self.hot_v = hot_k, hot_v
        columns = NamedSharding(mesh, PartitionSpec(None, "seq"))
        self.hot_table = jax.device_put(jnp.asarray(layout.hot_table()), columns)
        self.chunk_tables = [
            jax.device_put(jnp.asarray(layout.chunk_table(c)), columns)
            for c in range(layout.chunks)
        ]
        self.chunk_slots = [layout.chunk_slots(c) for c in range(layout.chunks)]
        self.attend = jax.jit(
            lambda q, kp, vp, table, lengths: sharded_paged_attention(
                q, kp, vp, table, lengths, mesh=mesh, seq_axis="seq"
            )
        )
        self.merge = jax.jit(merge_attention)
        pool_sharding = hot_k.sharding

        @functools.partial(
            jax.jit, donate_argnums=(0, 1), out_shardings=(pool_sharding, pool_sharding)
        )
        def write_token(kp, vp, k_new, v_new, page, offset):  # k_new [K, H]
            return kp.at[:, page, offset].set(k_new), vp.at[:, page, offset].set(v_new)

        self.write_token = write_token
        self.staging_peak = 0  # bytes of fetched pages alive at once, per device

    def fetch(self, chunk: int):
        return prefetch_layer(self.host, self.chunk_slots[chunk], layer=0)

    def fetch_all(self) -> None:
        """Every cold page back to device memory, chunk after chunk (timing only)."""
        for chunk in range(self.layout.chunks):
            wait(self.fetch(chunk))

    def step(self, q, k_new, v_new, position: int):
        """Writes token ``position``'s keys and values, then attends ``q [1, 1, N, H]`` over
        tokens ``0 .. position``; returns ``(out [1, 1, N, H], lse [1, 1, N])``."""
        page, offset = self.layout.open_page(), position % C
        self.hot_k, self.hot_v = self.write_token(
            self.hot_k, self.hot_v, k_new, v_new, np.int32(page), np.int32(offset)
        )
        lengths = jnp.full((1,), position + 1, jnp.int32)
        pending = self.fetch(0)
        acc = self.attend(q, self.hot_k, self.hot_v, self.hot_table, lengths)
        acc = (acc.out, acc.lse)
        for chunk in range(self.layout.chunks):
            current = pending
            if chunk + 1 < self.layout.chunks:
                pending = self.fetch(chunk + 1)
            k_cold, v_cold = wait(current)
            alive = k_cold.nbytes + v_cold.nbytes
            if chunk + 1 < self.layout.chunks:
                alive *= 2
            self.staging_peak = max(self.staging_peak, alive // DEVICES)
            part = self.attend(q, k_cold, v_cold, self.chunk_tables[chunk], lengths)
            merged = self.merge(acc[0], acc[1], part.out, part.lse)
            acc = (merged.out, merged.lse)
        return jax.block_until_ready(acc)


# ------------------------------------------------------------------------------------------
# The independent reference: numpy float64, page block by page block, running lse merge
# ------------------------------------------------------------------------------------------
def reference(tokens: int, q: np.ndarray, lengths: np.ndarray, block_pages: int = 256):
    """Exact attention of each step's query over its first ``lengths[t]`` tokens.

    Args:
      tokens: cache length (the generator's pages ``0 .. tokens / C - 1``).
      q: ``[T, N, H]`` queries (one per step).
      lengths: ``[T]`` tokens each query sees.

    Returns:
      ``(out [T, N, H], lse [T, N])`` float64.
    """
    T = q.shape[0]
    G = N // K
    scale = 1.0 / math.sqrt(H)
    qg = q.astype(np.float64).reshape(T, K, G, H).transpose(1, 0, 2, 3).reshape(K, T * G, H)
    m = np.full((K, T * G), -np.inf)
    l = np.zeros((K, T * G))
    acc = np.zeros((K, T * G, H))
    pages = tokens // C
    for first in range(0, pages, block_pages):
        last = min(first + block_pages, pages)
        kv = np.stack([page_kv(p) for p in range(first, last)], axis=2)  # [2, K, n, C, H]
        kv = kv.reshape(2, K, -1, H).astype(np.float64)
        positions = first * C + np.arange(kv.shape[2])
        logits = np.matmul(qg, kv[0].transpose(0, 2, 1)) * scale  # [K, T * G, S_block]
        visible = positions[None, :] < np.repeat(lengths, G)[:, None]  # [T * G, S_block]
        logits = np.where(visible[None], logits, -np.inf)
        block_max = logits.max(axis=-1)
        new_m = np.maximum(m, block_max)
        safe = np.where(np.isneginf(new_m), 0.0, new_m)
        p = np.exp(logits - safe[..., None])
        rescale = np.exp(np.where(np.isneginf(m), -np.inf, m - safe))
        l = l * rescale + p.sum(axis=-1)
        acc = acc * rescale[..., None] + np.matmul(p, kv[1])
        m = new_m
    out = acc / l[..., None]
    lse = m + np.log(l)
    out = out.reshape(K, T, G, H).transpose(1, 0, 2, 3).reshape(T, N, H)
    lse = lse.reshape(K, T, G).transpose(1, 0, 2).reshape(T, N)
    return out, lse


# ------------------------------------------------------------------------------------------
# Memory accounting
# ------------------------------------------------------------------------------------------
def resident_bytes() -> dict[tuple[int, str], int]:
    """(device id, memory kind) -> bytes of the buffers of every live JAX array there.

    Each buffer counts once (by its address): the per-device arrays a page copy assembles
    into a global array alias the global array's shards.
    """
    total: dict[tuple[int, str], int] = {}
    seen = set()
    for array in jax.live_arrays():
        if array.is_deleted():
            continue
        kind = array.sharding.memory_kind or "device"
        for shard in array.addressable_shards:
            buffer = (shard.device.id, shard.data.unsafe_buffer_pointer())
            if buffer in seen:
                continue
            seen.add(buffer)
            key = (shard.device.id, kind)
            total[key] = total.get(key, 0) + shard.data.nbytes
    return total


def process_memory() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak RSS) of this process in bytes (empty if unavailable)."""
    found = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM"):
                    found[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return found


def memory_lines(layout: Layout, staging_peak: int) -> list[str]:
    resident = resident_bytes()
    stats = jax.devices()[0].memory_stats()
    header = (
        "| device | device memory MiB (at rest) | + staging during a step MiB | pinned_host MiB |"
    )
    rows = [header + (" memory_stats bytes_in_use MiB |" if stats else ""), "|---|---:|---:|---:|"]
    rows[1] += "---:|" if stats else ""
    for device in jax.devices()[:DEVICES]:
        on_device = resident.get((device.id, "device"), 0)
        pinned = resident.get((device.id, "pinned_host"), 0)
        row = f"| {device.id} | {on_device / MiB:.2f} | {staging_peak / MiB:.2f} | {pinned / MiB:.2f} |"
        if stats:  # an accelerator's allocator (None on CPU)
            row += f" {(device.memory_stats() or {}).get('bytes_in_use', 0) / MiB:.2f} |"
        rows.append(row)
    dev_total = sum(b for (_, kind), b in resident.items() if kind == "device")
    host_total = sum(b for (_, kind), b in resident.items() if kind == "pinned_host")
    process = process_memory()
    pages = layout.pages
    host_share = layout.cold_pages / pages
    lines = [
        f"Pages: {pages} ({layout.per_device} per device); on host {layout.cold_pages}, on "
        f"device {layout.hot_pages}: split host/device = {100 * host_share:.1f}% / "
        f"{100 * (1 - host_share):.1f}% of pages.",
        "",
        f"Bytes: device {dev_total / MiB:.1f} MiB, pinned host {host_total / MiB:.1f} MiB: "
        f"split host/device = {100 * host_total / (host_total + dev_total):.1f}% / "
        f"{100 * dev_total / (host_total + dev_total):.1f}% of bytes (each device's null "
        "page, the padding to one capacity per device and one null slot per chunk included).",
        "",
        "Resident bytes per device and memory kind, summed over the shards of "
        "`jax.live_arrays()` (`Device.memory_stats()` is "
        f"{'available' if stats else 'None'} on this platform):",
        "",
        *rows,
        "",
        f"Process RSS {process.get('VmRSS', 0) / MiB:.0f} MiB, peak RSS "
        f"{process.get('VmHWM', 0) / MiB:.0f} MiB (`/proc/self/status`; on CPU device and host "
        "memory are both this process's DRAM).",
    ]
    return lines


# ------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------
def run_decode(tokens: int, steps: int, chunks: int, fetch_repeats: int = 3) -> dict:
    """Builds the cache, decodes ``steps`` tokens and checks them; returns the measurements."""
    if not 1 <= steps <= C:
        raise ValueError(f"run_decode: steps: expected 1 .. {C} (one open page), got {steps}")
    mesh = jax.make_mesh((DEVICES,), ("seq",), axis_types=(AxisType.Auto,))
    layout = Layout(tokens, chunks)
    prefill = tokens - steps
    hot_k, hot_v, host, setup = place_residency(layout, mesh, prefill)
    decoder = Decoder(layout, mesh, hot_k, hot_v, host)
    q_all = queries(steps)
    outs, lses, times = [], [], []
    replicated = NamedSharding(mesh, PartitionSpec())
    for t in range(steps):
        position = prefill + t
        kv = page_kv(position // C)[:, :, position % C]  # [2, K, H]
        q = jax.device_put(jnp.asarray(q_all[t][None, None]), replicated)
        k_new, v_new = (jax.device_put(jnp.asarray(x), replicated) for x in kv)
        start = time.perf_counter()
        out, lse = decoder.step(q, k_new, v_new, position)
        times.append(time.perf_counter() - start)
        outs.append(np.asarray(out)[0, 0])
        lses.append(np.asarray(lse)[0, 0])
    fetch_times = []
    for _ in range(fetch_repeats):
        start = time.perf_counter()
        decoder.fetch_all()
        fetch_times.append(time.perf_counter() - start)
    memory = memory_lines(layout, decoder.staging_peak)
    start = time.perf_counter()
    lengths = prefill + 1 + np.arange(steps)
    ref_out, ref_lse = reference(tokens, q_all, lengths)
    ref_seconds = time.perf_counter() - start
    out, lse = np.stack(outs), np.stack(lses)
    out_err = float(np.max(np.abs(out - ref_out)))
    out_scale = float(np.max(np.abs(ref_out)))
    lse_err = float(np.max(np.abs(lse - ref_lse)))
    return {
        "layout": layout,
        "setup": setup,
        "step_times": times,
        "fetch_times": fetch_times,
        "memory": memory,
        "reference_seconds": ref_seconds,
        "out_err": out_err,
        "out_rel": out_err / out_scale,
        "out_scale": out_scale,
        "lse_err": lse_err,
        "ok": out_err / out_scale <= TOLERANCE["out_rel"] and lse_err <= TOLERANCE["lse_abs"],
    }


def report_lines(res: dict, steps: int) -> list[str]:
    layout = res["layout"]
    tokens = layout.tokens
    kv_bytes = tokens * 2 * K * H * 4
    times = res["step_times"]
    later = _common.Timing(tuple(times[1:])) if len(times) > 1 else _common.Timing(tuple(times))
    fetch = _common.Timing(tuple(res["fetch_times"]))
    cold_bytes = layout.cold_pages * C * 2 * K * H * 4
    setup = res["setup"]
    verdict = "within" if res["ok"] else "**outside**"
    return [
        f"Cache: {tokens:,} tokens, 1 layer, K={K} kv heads, H={H}, float32: "
        f"2 * K * H * 4 = {2 * K * H * 4} bytes per token, {kv_bytes / MiB:,.0f} MiB of keys "
        f"and values; pages of C={C} tokens, split over {DEVICES} emulated CPU devices by "
        "sequence range (`paged.sharded_paged_attention`'s layout). Residency: 20% of the pages "
        "on device chosen at random (seeded), the same number per device to one page, the "
        "open page always kept; 80% in `pinned_host` memory (`offload.page_out` into a "
        "page-split `offload.HostPagePool`).",
        "",
        f"Decode: {steps} steps, N={N} query heads (GQA, G={N // K}); each step writes its "
        f"token into the open page and attends over every token so far: the device pages and "
        f"the cold pages fetched back in {layout.chunks} chunks of {layout.chunk_width} pages "
        "per device (`offload.prefetch_layer`, double-buffered), merged with "
        "`ringattn.merge_attention`.",
        "",
        "## Memory",
        "",
        *res["memory"],
        "",
        "## Time",
        "",
        "| what | seconds |",
        "|---|---:|",
        f"| build the prefilled device pool (numpy generator, shard by shard) "
        f"| {setup['build']:.2f} |",
        f"| page out 80% to pinned host (`offload.page_out`) | {setup['page_out']:.2f} |",
        f"| gather the kept 20% into the device pool | {setup['gather']:.2f} |",
        f"| decode step 1 (compiles) | {times[0]:.2f} |",
        f"| decode step, median of steps 2-{steps} (best {later.best:.2f}) | {later.median:.2f} |",
        f"| fetch every cold page ({cold_bytes / MiB:,.0f} MiB) back, median of "
        f"{len(fetch.times)} (best {fetch.best:.2f}) | {fetch.median:.2f} |",
        f"| numpy float64 reference, all steps | {res['reference_seconds']:.2f} |",
        "",
        "## Error against the float64 reference",
        "",
        f"Max |out - ref| = {res['out_err']:.3g} (max |ref| = {res['out_scale']:.3g}, "
        f"relative {res['out_rel']:.3g}); max |lse - ref| = {res['lse_err']:.3g}: {verdict} "
        f"the float32 tolerance (relative {TOLERANCE['out_rel']:g}, lse {TOLERANCE['lse_abs']:g}).",
        "",
        'On CPU, "device" and "pinned host" are the same DRAM and the 8 devices share the '
        "host's cores: the fetch is a memcpy that competes with the attention for bandwidth, "
        "so the numbers bound the bookkeeping, not PCIe.",
    ]


def main(argv=None):
    parser = _common.make_parser(__doc__)
    parser.add_argument(
        "--tiny", action="store_true", help="16,384 tokens, seconds (the same code path)"
    )
    parser.add_argument("--steps", type=int, default=8, help="decode steps (1 .. 64)")
    parser.add_argument("--chunks", type=int, default=4, help="cold-page fetch chunks per step")
    args = parser.parse_args(argv)
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    stem = "million_tiny" if args.tiny else "million"
    if args.tiny and args.out is None:
        args.out = _common.QUICK_DIR / f"{stem}.md"
    run = _common.start_run("bench_million", args, cpu_devices=DEVICES, argv=argv, stem=stem)
    res = run_decode(SIZES[size], args.steps, args.chunks)
    title = f"A {SIZES[size]:,}-token decode with 80% of the KV pages in pinned host memory"
    run.write(title, report_lines(res, args.steps))
    if not res["ok"]:
        raise SystemExit(
            f"bench_million: error outside tolerance: relative {res['out_rel']:.3g}, "
            f"lse {res['lse_err']:.3g}"
        )


if __name__ == "__main__":
    main()
