"""offload.planning.plan: the article's decision procedure, checked against independent arithmetic,
numpy, the library's real page pools and this repo's measured results (benchmarks/results)."""

import dataclasses
import math
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import paged
from offload.planning import (
    ARTICLE,
    ARTICLE_RULES,
    ARTICLE_SECTIONS,
    KV_FORMATS,
    MEASURED,
    Decision,
    Hardware,
    LengthDistribution,
    ModelShape,
    Plan,
    PlanRow,
    Reason,
    Tiers,
    Workload,
    plan,
)
from offload.planning import _cost_model as cost_model
from offload.planning._hardware import RATE_FIELDS
from offload.planning._strategy import _choose_strategy

RESULTS = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "results"
GiB = 2**30
K128, K512 = 128 * 1024, 512 * 1024

LLAMA_70B = ModelShape(layers=80, query_heads=64, kv_heads=8, head_dim=128)


def h100s(devices=8, per_node=8, memory=80 * GiB, host=0, disk=0, **kw) -> Hardware:
    return Hardware(
        devices=devices,
        devices_per_node=per_node,
        device_memory=memory,
        device_flops=989e12,
        memory_bandwidth=3.35e12,
        intra_node_bandwidth=450e9,
        inter_node_bandwidth=25e9,
        host_memory=host,
        disk=disk,
        **kw,
    )


def fixed(length: int) -> LengthDistribution:
    """Every request exactly ``length`` tokens (sigma 0, so the sizing length is ``length``)."""
    return LengthDistribution.from_percentiles(length, length, length)


def small_model(kv_format="bfloat16", layers=4, N=8, K=2, H=64) -> ModelShape:
    return ModelShape(layers=layers, query_heads=N, kv_heads=K, head_dim=H, kv_format=kv_format)


# --- the article's worked example ---------------------------------------------------------


def test_llama_70b_at_256k_shows_real_and_article_bytes_per_token():
    p = plan(Workload(LLAMA_70B, fixed(256 * 1024), quantization=()), h100s(host=GiB))
    assert p.kv_bytes_per_token.value == 2 * 80 * 8 * 128 * 2 == 327_680  # 320 KiB
    assert p.kv_bytes_per_token_all_heads.value == 2 * 80 * 64 * 128 * 2 == 2_621_440  # 2.5 MiB
    (why,) = p.kv_bytes_per_token_all_heads.reasons
    assert "2.50 MiB" in why.text and "320.00 KiB" in why.text and "8x" in why.text
    assert why.numbers["kv_heads"] == 8 and why.numbers["query_heads"] == 64
    assert p.kv_bytes_per_request.value == 80 * GiB  # 262,144 tokens x 320 KiB
    # 80 GiB does not fit one 80 GiB device (page 0 is the null page): 2 devices, no offload.
    assert p.sequence_parallel.value and p.degree.value == 2
    assert p.tiers.value == Tiers(device=80 * GiB, host=0, disk=0)
    assert p.fits.value and p.kv_format.value == "bfloat16"
    # With the article's 64 kv heads, 640 GiB: int8 (330 GiB) fits on 8 devices, bf16 does not.
    # Lossy int8 only when the workload opts in (the default is exact formats only).
    article = dataclasses.replace(LLAMA_70B, kv_heads=64)
    q = plan(Workload(article, fixed(256 * 1024), quantization=("int8",)), h100s(memory=60 * GiB))
    assert q.kv_bytes_per_token.value == 1_351_680  # kvquant.md's int8 row, 64 kv heads
    assert q.kv_format.value == "int8" and q.degree.value == 8 and q.fits.value
    exact = plan(Workload(article, fixed(256 * 1024)), h100s(memory=60 * GiB))
    assert exact.kv_format.value == "bfloat16" and not exact.fits.value  # no host, no disk
    assert "not allowed" in exact.kv_format.reasons[0].text


@pytest.mark.parametrize(
    ("kv_format", "page_size", "expected"),
    # kvquant.md, Llama-3-70B (8 KV heads), bytes / token
    [
        ("float32", 16, 655_360),
        ("bfloat16", 16, 327_680),
        ("int8", 16, 168_960),
        ("fp8", 16, 168_960),
        ("int4", 16, 92_160),
        ("kivi2", 16, 64_000),
        ("kivi2", 64, 48_640),
    ],
)
def test_bytes_per_token_match_measured_table(kv_format, page_size, expected):
    assert LLAMA_70B.bytes_per_token(kv_format, page_size) == expected
    ratio = f"{expected / 327_680:.3f}x"
    assert ratio in (RESULTS / "kvquant.md").read_text()


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_bytes_per_token_match_real_pools(kv_format):
    """Against the bytes of an actual ``paged.init_paged_cache`` pool of each format."""
    L, K, P, C, H = 2, 2, 4, 16, 32
    model = ModelShape(layers=L, query_heads=4, kv_heads=K, head_dim=H, kv_format=kv_format)
    if kv_format in ("float32", "bfloat16", "float16"):
        cache = paged.init_paged_cache(L, K, P, C, H, 1, 2, jnp.dtype(kv_format))
    else:
        spec = paged.KVFormat("int4", group_size=32) if kv_format == "int4" else None
        spec = spec or paged.KVFormat(kv_format)
        cache = paged.init_paged_cache(L, K, P, C, H, 1, 2, kv_format=spec)
    nbytes = cache.k_pages.nbytes + cache.v_pages.nbytes
    assert model.bytes_per_token(page_size=C) == pytest.approx(nbytes / (P * C))


# --- rule 1: the sizing percentile --------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_sizing_length_is_p95_plus_two_sigma_against_numpy(seed):
    rng = np.random.default_rng(seed)
    samples = np.ceil(rng.lognormal(np.log(4096), 1.2, size=500 + 300 * seed)).astype(int)
    d = LengthDistribution.from_samples(samples)
    expected = min(np.percentile(samples, 95) + 2 * np.std(samples), samples.max())
    assert d.sizing_length == math.ceil(expected)
    assert (d.p50, d.p99, d.mean) == pytest.approx(
        (np.percentile(samples, 50), np.percentile(samples, 99), samples.mean())
    )
    p = plan(Workload(small_model(), d), h100s())
    assert p.sizing_length.value == d.sizing_length
    assert p.sizing_length.reasons[0].rule == "rule 1"


def test_sizing_length_is_capped_at_the_longest_request_and_not_the_max_otherwise():
    capped = LengthDistribution.from_samples([10] * 90 + [1000] * 10)  # p95 + 2 sigma > max
    assert capped.sizing_length == 1000
    lengths = np.array([100] * 990 + [5000] * 10)
    d = LengthDistribution.from_samples(lengths)
    assert d.sizing_length == math.ceil(np.percentile(lengths, 95) + 2 * np.std(lengths))
    assert d.sizing_length < 5000  # not the max
    reason = plan(Workload(small_model(), d), h100s()).sizing_length.reasons[0]
    assert reason.numbers["max / sizing"] == pytest.approx(5000 / d.sizing_length)


def test_from_percentiles_matches_a_lognormal_sample():
    rng = np.random.default_rng(0)
    x = rng.lognormal(np.log(4096), 1.0, size=400_000)
    p50, p95, p99 = np.percentile(x, [50, 95, 99])
    d = LengthDistribution.from_percentiles(p50, p95, p99)
    assert d.mean == pytest.approx(x.mean(), rel=0.03)
    assert d.sigma == pytest.approx(x.std(), rel=0.1)
    given_sigma = LengthDistribution.from_percentiles(10, 20, 30, sigma=5, max_length=30)
    assert given_sigma.sizing_length == 30 and given_sigma.sigma == 5


# --- page size: rules 2 and 4 -------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "reuse", "page", "rule"),
    [
        (2047, 0.0, 4, "rule 4"),
        (2048, 0.0, 16, "rule 4"),
        (100_000, 0.5, 16, "rule 4"),
        (100_000, 0.51, 64, "iron rule 2"),
        (1000, 0.8, 64, "iron rule 2"),  # reuse wins over short requests
        (1, 0.0, 4, "rule 4"),
    ],
)
def test_page_size_rules(length, reuse, page, rule):
    w = Workload(small_model(), fixed(length), prefix_reuse=reuse, prefix_tokens=512)
    p = plan(w, h100s())
    assert p.page_size.value == page
    assert p.page_size.reasons[0].rule == rule
    assert p.pages_per_request.value == -(-length // page)


def test_prefix_saving_cites_the_measurement_not_the_article():
    lengths = fixed(8192)
    p = plan(Workload(small_model(), lengths, prefix_reuse=0.8, prefix_tokens=2048), h100s())
    assert p.prefix_saving.value == pytest.approx(0.8 * 2048 / 8192)
    for reason in (*p.page_size.reasons, *p.prefix_saving.reasons):
        if reason.rule == "measured":
            assert "paged_memory.md" in reason.text and "24.9%" in reason.text
            assert reason.numbers["measured_saving_80"] == 0.2490
            break
    else:
        raise AssertionError(p.page_size.reasons)


# --- iron rule 1: no sequence parallelism under 128K ---------------------------------------


def _tight(length: int, model: ModelShape, devices=8, per_node=8, pages_per_device=None):
    """Hardware where one request of ``length`` tokens needs about 2 devices (C=16)."""
    page_bytes = 16 * model.bytes_per_token(page_size=16)
    pages = -(-length // 16)
    usable = pages_per_device or -(-pages // 2)
    return h100s(devices, per_node, memory=int((usable + 1) * page_bytes), host=1 << 50)


@pytest.mark.parametrize(
    ("length", "parallel"), [(127 * 1024, False), (K128, True), (129 * 1024, True)]
)
def test_iron_rule_1_boundary(length, parallel):
    model = small_model()
    hw = _tight(129 * 1024, model)  # 129K needs 2 devices; 127K too (more than one holds)
    p = plan(Workload(model, fixed(length), quantization=()), hw)
    assert p.sequence_parallel.value is parallel
    assert p.sequence_parallel.reasons[0].rule == "iron rule 1"
    if parallel:
        assert p.degree.value == 2 and p.tiers.value.host == 0 and p.strategy.value is not None
    else:
        assert p.degree.value == 1 and p.strategy.value is None
        assert p.tiers.value.host > 0  # offload instead
    assert p.fits.value


# --- iron rule 3: above 512K, inside one node plus offload ---------------------------------


@pytest.mark.parametrize(("length", "above"), [(511 * 1024, False), (513 * 1024, True)])
def test_iron_rule_3_boundary(length, above):
    model = small_model()
    pages_513 = -(-513 * 1024 // 16)
    usable = -(-pages_513 // 8)  # 8 devices over 2 nodes hold 513K; one node of 4 does not
    hw = _tight(length, model, devices=8, per_node=4, pages_per_device=usable)
    p = plan(Workload(model, fixed(length), quantization=()), hw)
    tiers = p.tiers.value
    if above:
        assert p.degree.value == 4  # inside one node
        assert tiers.host == p.kv_bytes_per_request.value - tiers.device > 0
        assert any(r.rule == "iron rule 3" for r in p.tiers.reasons)
        assert p.retention.value == "fetch back"
    else:
        assert p.degree.value == 8 and tiers.host == 0 and p.retention.value == "none"
        assert any(r.rule == "incident B" for r in p.strategy.reasons)  # spans 2 nodes
    assert tiers.total == p.kv_bytes_per_request.value


def test_tiers_spill_to_host_then_disk_and_report_shortfall():
    model = small_model()
    page_bytes = 16 * model.bytes_per_token()
    length = 600 * 1024
    request = -(-length // 16) * page_bytes
    hw = h100s(devices=1, per_node=1, memory=101 * page_bytes, host=200 * page_bytes, disk=10**15)
    p = plan(Workload(model, fixed(length), quantization=()), hw)
    assert p.tiers.value == Tiers(100 * page_bytes, 200 * page_bytes, request - 300 * page_bytes)
    assert {"rule 11", "incident C", "rule 6"} <= {r.rule for r in p.tiers.reasons}
    (io,) = (r for r in p.tiers.reasons if r.rule == "rule 11")
    disk_pages = -(-(request - 300 * page_bytes) // page_bytes)
    assert io.numbers["disk_pages"] == disk_pages
    assert io.numbers["tokens_per_s_by_iops"] == pytest.approx(100_000 / disk_pages)
    assert io.numbers["tokens_per_s_by_bandwidth"] == pytest.approx(
        3e9 / (request - 300 * page_bytes)
    )
    short = dataclasses.replace(hw, disk=page_bytes)
    q = plan(Workload(model, fixed(length), quantization=()), short)
    assert not q.fits.value and q.tiers.value.total == 301 * page_bytes < request


# --- quantization only when it changes the verdict -----------------------------------------


@pytest.mark.parametrize(
    ("memory_pages", "allowed", "expected"),
    [
        (10_000, ("int8", "int4"), "bfloat16"),  # bf16 fits already
        (4_600, ("int8", "int4"), "int8"),  # bf16 needs 8,192 pages, int8 (0.52x) fits
        (2_500, ("int8", "int4"), "int4"),  # int8 needs 4,224 bf16-pages, int4 (0.28x) fits
        (2_500, ("int8",), "bfloat16"),  # only int8 allowed: nothing fits, offload
        (1_000, ("int8", "int4"), "bfloat16"),  # even int4 does not fit: offload
        (4_600, (), "bfloat16"),
    ],
)
def test_quantization_only_when_it_makes_the_request_fit(memory_pages, allowed, expected):
    model = small_model(H=128)
    length = 8192 * 16  # 8,192 pages of 16 (sizing 128K, but one device only)
    hw = h100s(
        devices=1, per_node=1, memory=memory_pages * 16 * model.bytes_per_token(), host=1 << 50
    )
    p = plan(Workload(model, fixed(length), quantization=allowed), hw)
    assert p.kv_format.value == expected
    # Independent check: the verdict of each format on this hardware.
    fits = {
        f: -(-length // 16) <= hw.device_memory // (16 * model.bytes_per_token(f)) - 1
        for f in ("bfloat16", *allowed)
    }
    assert fits[expected] == (p.tiers.value.host == 0)
    if expected != "bfloat16":
        assert not fits["bfloat16"]
        assert p.kv_bytes_per_token.value == model.bytes_per_token(expected)
        (why,) = p.kv_format.reasons
        assert "kvquant.md" in why.text and "quality.md" in why.text


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 96),
    st.sampled_from([1, 2, 8]),
    st.sampled_from([64, 128]),
    st.sampled_from(["float32", "bfloat16"]),
    st.integers(1, 2**20),
    st.floats(0.05, 1.5),
)
def test_quantization_picks_the_least_compressed_format_that_fits(L, K, H, dtype, length, scale):
    model = ModelShape(layers=L, query_heads=K, kv_heads=K, head_dim=H, kv_format=dtype)
    C = 16 if length >= 2048 else 4
    pages = -(-length // C)
    memory = max(1, int((pages + 1) * C * model.bytes_per_token(dtype, C) * scale))
    hw = h100s(devices=1, per_node=1, memory=memory, host=1 << 50)
    p = plan(Workload(model, fixed(length), quantization=("int8", "int4")), hw)

    def fits(f):
        return pages <= memory // (C * model.bytes_per_token(f, C)) - 1

    expected = next((f for f in (dtype, "int8", "int4") if fits(f)), dtype)
    assert p.kv_format.value == expected
    assert (p.tiers.value.host == 0) == fits(expected)


# --- strategy: head counts, links, and the measured 8-device results -----------------------


def _plan_degree(model, devices, per_node, D):
    """A 256K plan on hardware where exactly ``D`` devices hold one request."""
    length = 256 * 1024
    page_bytes = 16 * model.bytes_per_token()
    usable = -(-(length // 16) // D)
    hw = h100s(devices, per_node, memory=(usable + 1) * page_bytes)
    p = plan(Workload(model, fixed(length), quantization=()), hw)
    assert p.degree.value == D
    return p


def test_strategy_by_heads_and_links():
    # Ulysses: N divisible by D inside a node; chosen without overlap (the a2a moves less).
    cpu = dataclasses.replace(h100s(8, 8), overlap=False)
    model = small_model(N=8, K=8)
    strat, _, _, _ = _choose_strategy(model, cpu, 8, 256 * 1024)
    assert strat == "ulysses"
    # N=12 over 8 devices: no Ulysses; USP (Ulysses over 4 inside the node) or ring.
    p = _plan_degree(small_model(N=12, K=2), 8, 8, 8)
    assert p.strategy.value in ("usp", "ring", "allgather")
    assert "not a multiple" in p.strategy.reasons[0].text
    # 16 devices over 2 nodes: Ulysses would cross nodes: never chosen, incident B reported.
    p = _plan_degree(small_model(N=16, K=4), 16, 8, 16)
    assert p.strategy.value != "ulysses"
    assert any(r.rule == "incident B" for r in p.strategy.reasons)
    # Across nodes with heads to split inside each: USP (Ulysses over the 8 devices of a node,
    # a ring over the 2 nodes) sends far less over the slow link than a ring over all 16.
    for overlap in (False, True):
        hw = dataclasses.replace(h100s(16, 8), overlap=overlap)
        strat, u, _, _ = _choose_strategy(small_model(N=16, K=4), hw, 16, 256 * 1024)
        assert (strat, u) == ("usp", 8)
    # K < D: Ulysses repeats kv heads, and says so.
    strat, _, _, reasons = _choose_strategy(small_model(N=8, K=2), cpu, 8, 256 * 1024)
    assert "lcm(K, D)=8" in reasons[0].text


def _measured_causal_forward(path: pathlib.Path, S: int, K: int) -> dict[str, float]:
    """{strategy: causal forward ms} from a ring*.md timing table (ring: the zigzag row)."""
    out = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and cells[0] == str(S) and cells[1] == str(K):
            strategy, layout = cells[2], cells[3]
            if strategy != "ring" or layout == "zigzag":
                out[strategy] = float(cells[6])
    return out


def test_cost_model_agrees_with_the_measured_8_device_results():
    """ring.md, S=2048, K=2, N=8, H=64, float32, 8 CPU devices: the cost model ranks the four
    strategies as measured (causal forward), and the planner's choice is the measured best."""
    measured = _measured_causal_forward(RESULTS / "ring.md", 2048, 2)
    assert set(measured) == {"ring", "allgather", "ulysses", "usp"}, measured
    hw = Hardware.emulated_cpu()
    model = ModelShape(layers=1, query_heads=8, kv_heads=2, head_dim=64, kv_format="float32")
    predicted = {}
    for s in measured:
        u = 4 if s == "usp" else 1
        total = cost_model.estimate_prefill(s, model, hw, S=2048, D=8, ulysses_degree=u)[4]
        predicted[s] = total * 1e3
        assert 1 / 1.5 < predicted[s] / measured[s] < 1.5, (s, predicted[s], measured[s])
    assert sorted(measured, key=measured.get) == sorted(predicted, key=predicted.get)
    assert (predicted["ring"] < predicted["ulysses"]) == (measured["ring"] < measured["ulysses"])
    strat, _, _, _ = _choose_strategy(model, hw, 8, 2048)
    assert strat == min(measured, key=measured.get) == "ulysses"
    # And the ring alone at the other measured lengths.
    for path, S in ((RESULTS / "ring.md", 4096), (RESULTS / "ring_16k.md", 16384)):
        ms = _measured_causal_forward(path, S, 2)["ring"]
        est = cost_model.estimate_prefill("ring", model, hw, S=S, D=8)[4]
        assert 1 / 1.5 < est * 1e3 / ms < 1.5, (S, est * 1e3, ms)


def test_communication_bytes_match_ring_md():
    """ring.md's 'Bytes sent per device, forward, S=4096' table (float32, N=8, H=64, D=8)."""
    mib = 2**20
    kw = dict(S=4096, D=8)
    mha, gqa = (cost_model.Heads(N=8, K=K, H=64, itemsize=4) for K in (8, 2))
    assert cost_model.communication_bytes("ring", mha, **kw) == 14 * mib
    assert cost_model.communication_bytes("allgather", mha, **kw) == 14 * mib
    assert cost_model.communication_bytes("ulysses", mha, **kw) == 3.5 * mib
    assert cost_model.communication_bytes("ring", gqa, **kw) == 3.5 * mib
    assert cost_model.communication_bytes("ulysses", gqa, **kw) == 3.5 * mib
    # USP, Ulysses over u=4 (kv heads repeated to lcm(2, 4) = 4), then a ring over 2 devices of
    # S/2 tokens and one kv head: (2 * 8 + 2 * 4) * 512 * 64 * 4 * 3/4 + 1 hop of 2 * 2048 * 64 * 4
    usp = cost_model.communication_bytes("usp", gqa, ulysses_degree=4, **kw)
    assert usp == 2_359_296 + 1_048_576
    assert cost_model.communication_bytes(None, gqa, **kw) == 0


# --- constants and citations come from the results files -----------------------------------


def _percent(x: float) -> list[str]:
    return [
        f"{100 * x:.1f}%",
        f"{100 * x:.2f}%",
        f"{100 * x:.1f}",
        f"{x}x",
        f"{x:.3f}x",
        f"{100 * x:.0f} (",
        f"| {100 * x:.1f} |",
    ]


def test_measured_numbers_appear_in_their_results_files():
    for name, (where, value) in MEASURED.items():
        path = RESULTS / where.split(" ")[0].rstrip(",")
        text = path.read_text()
        assert any(s in text for s in _percent(value)), (name, where, value)
    gaps = (RESULTS / "gaps_2026-12-01.md").read_text()
    assert "| 73% |" in gaps and "matmul 129.3 GFLOP/s" in gaps
    offload_md = (RESULTS / "offload_2026-12-01.md").read_text()
    assert "| 5.48 |" in offload_md
    page_in = "| host page-in vs same-run memcpy (median, 256 MiB in 16 MiB pages) | 0.93x |"
    assert cost_model.PAGE_IN_VS_MEMCPY == 0.93
    assert page_in in (RESULTS / "gaps_2026-12-02.md").read_text()
    paged = "| paged_attention (pages_per_block=64) | 386.7 ms | 1.45x | 1.94x |"
    assert cost_model.PAGED_DECODE_VS_BANDWIDTH == 1.94
    assert paged in (RESULTS / "paged.md").read_text()
    ring = (RESULTS / "ring.md").read_text()
    for S, ms in cost_model.RING_ZIGZAG_FORWARD_MS.items():
        assert f"| {S} | 2 | ring | zigzag | {ms:.0f} |" in ring


# --- every field has reasons; properties ---------------------------------------------------

RULE_IDS = {*ARTICLE_RULES, "measured", "model", "cost model"}


def _check_reasons(p: Plan):
    for field in dataclasses.fields(Plan):
        decision = getattr(p, field.name)
        assert isinstance(decision, Decision), field.name
        assert decision.reasons, field.name
        for reason in decision.reasons:
            assert isinstance(reason, Reason) and reason.text, field.name
            assert reason.rule in RULE_IDS, (field.name, reason.rule)
            assert all(isinstance(v, (int, float)) for v in reason.numbers.values()), reason
            if reason.rule in ARTICLE_SECTIONS:  # cited by title and section
                assert reason.source == f"the article {ARTICLE}, {ARTICLE_SECTIONS[reason.rule]}"


models = st.builds(
    lambda L, K, G, H, f: ModelShape(
        layers=L, query_heads=K * G, kv_heads=K, head_dim=H, kv_format=f
    ),
    st.integers(1, 96),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([64, 128]),
    st.sampled_from(KV_FORMATS),
)


def log_uniform(low_exp: int, high_exp: int):
    """Integers spread over orders of magnitude, ``2**low_exp`` to ``2**(high_exp + 1)``."""
    return st.builds(lambda e, f: int(2**e * f), st.integers(low_exp, high_exp), st.floats(1, 2))


lengths = st.builds(
    lambda a, b, c: LengthDistribution.from_percentiles(*sorted([a, b, c])),
    *(log_uniform(0, 21),) * 3,
)
hardware = st.builds(
    lambda nodes, per_node, mem, host, disk, overlap: h100s(
        nodes * per_node, per_node, memory=mem, host=host, disk=disk, overlap=overlap
    ),
    st.integers(1, 4),
    st.sampled_from([1, 2, 4, 8]),
    log_uniform(20, 37),
    st.one_of(st.just(0), log_uniform(20, 41)),
    st.one_of(st.just(0), log_uniform(20, 43)),
    st.booleans(),
)
# Workload is built in the test body: building it inside a strategy runs beartype's sampling
# of its tuple field under hypothesis, which hypothesis flags.
workload_args = st.fixed_dictionaries(
    {
        "model": models,
        "lengths": lengths,
        "prefix_reuse": st.floats(0, 1),
        "prefix_tokens": st.integers(0, 8192),
        "quantization": st.sampled_from([(), ("int8",), ("int8", "int4"), ("kivi2", "int4")]),
    }
)


@settings(max_examples=60, deadline=None)
@given(workload_args, hardware)
def test_every_field_has_reasons_and_tiers_add_up(args, hw):
    w = Workload(**args)
    p = plan(w, hw)
    _check_reasons(p)
    tiers = p.tiers.value
    request = p.kv_bytes_per_request.value
    assert min(tiers.device, tiers.host, tiers.disk) >= 0
    assert tiers.host <= hw.host_memory and tiers.disk <= hw.disk
    assert tiers.device <= p.degree.value * hw.device_memory
    assert (tiers.total == request) == p.fits.value and tiers.total <= request
    assert p.page_size.value in (4, 16, 64)
    assert p.degree.value == 1 or p.sizing_length.value >= K128
    assert p.sequence_parallel.value == (p.degree.value > 1)
    assert (p.strategy.value is None) == (p.degree.value == 1)
    if p.sizing_length.value > K512:
        assert p.degree.value <= hw.devices_per_node
    assert hw.devices % p.degree.value == 0
    if p.kv_format.value != w.model.kv_format:  # quantized only to make it fit on devices
        assert tiers.host == tiers.disk == 0
        base = plan(dataclasses.replace(w, quantization=()), hw)
        assert base.tiers.value.host + base.tiers.value.disk > 0 or not base.fits.value
    assert p.cost.value.total_s > 0 and (p.cost.value.decode_step_s > 0 or not p.fits.value)


@settings(max_examples=60, deadline=None)
@given(workload_args, hardware, st.integers(1, 2**36))
def test_more_memory_never_needs_more_devices_or_offload(args, hw, extra):
    """For a fixed format: never more devices, never less on them, never more offloaded. With
    quantization allowed the format may change (quantized only to fit), so only the offloaded
    bytes and the verdict are monotone; more host memory never breaks a fit either."""
    w = Workload(**args)
    bigger = dataclasses.replace(hw, device_memory=hw.device_memory + extra)
    fixed_format = dataclasses.replace(w, quantization=())
    small, big = plan(fixed_format, hw), plan(fixed_format, bigger)
    assert big.degree.value <= small.degree.value
    assert big.tiers.value.device >= small.tiers.value.device
    assert big.max_pages_per_device.value >= small.max_pages_per_device.value
    assert big.max_sequences_per_device.value >= small.max_sequences_per_device.value

    def offloaded(p):
        return p.tiers.value.host + p.tiers.value.disk

    for workload in (fixed_format, w):
        small, big = plan(workload, hw), plan(workload, bigger)
        assert offloaded(big) <= offloaded(small) or big.kv_format.value != small.kv_format.value
        assert (offloaded(big) == 0) >= (offloaded(small) == 0)
        assert big.fits.value >= small.fits.value
        more_host = plan(workload, dataclasses.replace(hw, host_memory=hw.host_memory + extra))
        assert more_host.fits.value >= small.fits.value


def regime(tokens: int) -> int:
    """Which iron rule applies: 0 under 128K, 1 up to 512K, 2 above."""
    return (tokens >= K128) + (tokens > K512)


@settings(max_examples=40, deadline=None)
@given(models, log_uniform(0, 21), log_uniform(0, 20), hardware)
def test_longer_requests_never_need_less(model, length, extra, hw):
    """More bytes, and (inside one regime of the iron rules) no fewer devices; at the same
    degree no more sequences per device (a larger group holds a share of each request, so
    sequences per device may grow when the degree does)."""
    short = plan(Workload(model, fixed(length), quantization=()), hw)
    long = plan(Workload(model, fixed(length + extra), quantization=()), hw)
    if short.page_size.value == long.page_size.value:
        assert long.kv_bytes_per_request.value >= short.kv_bytes_per_request.value
        if long.degree.value == short.degree.value:
            assert long.max_sequences_per_device.value <= short.max_sequences_per_device.value
        if regime(long.sizing_length.value) == regime(short.sizing_length.value):
            assert long.degree.value >= short.degree.value
            offloaded = long.tiers.value.host + long.tiers.value.disk
            assert offloaded >= short.tiers.value.host + short.tiers.value.disk


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ModelShape(-1, 8, 2, 64), "layers"),
        (lambda: ModelShape(8, 8, 3, 64), "kv_heads: expected a divisor"),
        (lambda: ModelShape(8, 8, 2, 0), "head_dim"),
        (lambda: ModelShape(8, 8, 2, 2.0), "head_dim"),
        (lambda: ModelShape(8, 8, 2, 64, "int3"), "kv_format"),
        (lambda: ModelShape(8, 8, 2, 48, "int4"), "group_size"),
        (lambda: ModelShape(8, 8, 2, 6, "kivi2"), "kivi2 packs 4"),
        (lambda: LengthDistribution.from_samples([]), "non-empty"),
        (lambda: LengthDistribution.from_samples([[1, 2]]), "non-empty 1-D"),
        (lambda: LengthDistribution.from_samples([1.5, 2]), "integer lengths"),
        (lambda: LengthDistribution.from_samples([0, 5]), ">= 1"),
        (lambda: LengthDistribution.from_percentiles(10, 5, 20), "p50 <= p95 <= p99"),
        (lambda: LengthDistribution.from_percentiles(-1, 5, 20), "p50"),
        (lambda: LengthDistribution.from_percentiles(1, 5, 20, max_length=10), "max_length"),
        (lambda: LengthDistribution.from_percentiles(1, 5, 20, sigma=-1.0), "sigma"),
        (lambda: LengthDistribution(5.0, 4.0, 6.0, 1.0, 5.0), "p50 <= p95"),
        (lambda: h100s(devices=0), "devices"),
        (lambda: h100s(devices=12, per_node=8), "multiple"),
        (lambda: h100s(memory=-5), "device_memory"),
        (lambda: h100s(host=-1), "host_memory"),
        (lambda: dataclasses.replace(h100s(), device_flops=0.0), "device_flops"),
        (lambda: dataclasses.replace(h100s(), overlap=1), "overlap"),
        (lambda: Workload(LLAMA_70B, fixed(10), prefix_reuse=1.5), "prefix_reuse"),
        (lambda: Workload(LLAMA_70B, fixed(10), prefix_tokens=-1), "prefix_tokens"),
        (lambda: Workload(LLAMA_70B, fixed(10), quantization=("bf16",)), "quantization"),
        (lambda: Workload(LLAMA_70B, fixed(10), quantization=["int8"]), "quantization"),
        (lambda: Workload("llama", fixed(10)), "model"),
        (lambda: plan("workload", h100s()), "plan: workload"),
        (lambda: plan(Workload(LLAMA_70B, fixed(10)), "h100"), "plan: hardware"),
    ],
)
def test_bad_inputs_raise(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_reason_and_rows_print():
    p = plan(Workload(LLAMA_70B, fixed(256 * 1024)), h100s())
    rows = p.rows()
    assert all(isinstance(r, PlanRow) for r in rows)
    assert [r.field for r in rows] == [f.name for f in dataclasses.fields(Plan)]
    assert rows[7].field == "sequence_parallel" and rows[7].value is p.sequence_parallel.value
    assert rows[7].reasons == p.sequence_parallel.reasons  # Reason objects, not joined text
    assert str(p.sizing_length.reasons[0]).startswith("[rule 1] ")
    assert re.search(r"\[iron rule 1\]", p.format())


def test_retention_cites_the_measurements_not_the_article():
    model = small_model()
    hw = h100s(devices=1, per_node=1, memory=16 * model.bytes_per_token() * 1000, host=1 << 50)
    p = plan(Workload(model, fixed(64 * 1024), quantization=()), hw)
    assert p.retention.value == "fetch back" and p.tiers.value.host > 0
    (why,) = p.retention.reasons
    assert why.rule == "measured"
    for cited in ("policies.md", "97.4%", "59.6%", "quality.md", "80%", "94%"):
        assert cited in why.text, cited


# --- a second worked example, by hand: a 32B GQA model, TP=8, 256K, 8 x H100 ----------------


def test_32b_gqa_at_256k_with_tp8_by_hand():
    """A 32B GQA model (Qwen2.5-32B's shape: L=64, N=40, K=8, H=128; 32e9 parameters, bf16) at
    256K tokens on one node of 8 H100 SXM (80e9 bytes each), TP=8, 40% prefix reuse of a 2K
    prompt. Every expected number is derived here from the shapes, not from the planner."""
    L, N, K, H, params, S, tp = 64, 40, 8, 128, 32 * 10**9, 262_144, 8
    model = ModelShape(layers=L, query_heads=N, kv_heads=K, head_dim=H, params=params)
    w = Workload(model, fixed(S), prefix_reuse=0.4, prefix_tokens=2048, tensor_parallel=tp)
    hw = Hardware.h100_sxm()
    p = plan(w, hw)
    # Page size: 40% reuse <= 50% and 256K >= 2K tokens: the default 16 (rule 4).
    C = 16
    assert p.page_size.value == C
    # KV per token, whole model: 2 (K and V) x 64 layers x 8 kv heads x 128 x 2 bytes = 256 KiB.
    assert p.kv_bytes_per_token.value == 2 * 64 * 8 * 128 * 2 == 262_144
    # TP=8 splits the 8 kv heads, one per device: 2 x 64 x 1 x 128 x 2 = 32 KiB per token.
    assert p.kv_bytes_per_token_per_device.value == 2 * 64 * 1 * 128 * 2 == 32_768
    # 256K tokens / 16 = 16,384 pages; a page on one device is 16 x 32 KiB = 512 KiB, so one
    # request is 16,384 x 512 KiB = 8 GiB per device, 64 GiB over the 8 devices.
    assert p.pages_per_request.value == 16_384
    assert p.kv_bytes_per_request.value == 16_384 * 524_288 * 8 == 64 * GiB
    # Weights: 32e9 x 2 bytes = 64e9, over TP=8: 8e9 per device; 80e9 - 8e9 = 72e9 left for
    # KV: 72e9 // 512 KiB = 137,329 pages (137,328 usable, page 0 is the null page).
    assert p.weight_bytes_per_device.value == 8 * 10**9
    assert p.max_pages_per_device.value == 72 * 10**9 // 524_288 == 137_329
    # 16,384 pages fit one TP group: no sequence parallelism, no ring (the old planner, with
    # no weights and no TP, put the 64 GiB on 2 devices of 60 GiB as a ring).
    assert p.degree.value == 1 and not p.sequence_parallel.value and p.strategy.value is None
    assert p.max_sequences_per_device.value == 137_328 // 16_384 == 8
    assert p.tiers.value == Tiers(device=64 * GiB, host=0, disk=0) and p.fits.value
    assert p.kv_format.value == "bfloat16" and p.tensor_parallel.value == 8
    # Prefill on one group of 8 (no sequence-parallel strategy), H100 peaks (assumed):
    # attention 4 S^2 N H / 2 per layer, each device 40 / 8 = 5 heads, at 989 TFLOP/s;
    attention_s = 2 * S**2 * 5 * H * L / 989e12
    # linear layers 2 x params x S over 8 devices;
    linear_s = 2 * params * S / 8 / 989e12
    # memory: q, k, v, out of 5 query and 1 kv head per device, 2 bytes, at 3.35 TB/s;
    memory_s = L * (2 * 5 + 2 * 1) * S * H * 2 / 3.35e12
    # TP: two all-reduces per layer of S x (40 x 128) bf16 hidden states, 2 x 7/8 of it sent
    # per device over NVLink at 450 GB/s;
    tp_s = L * 2 * (2 * 7 / 8) * S * N * H * 2 / 450e9
    # latency: one local attention call and two all-reduces per layer at 20 us.
    latency_s = L * 3 * 20e-6
    cost = p.cost.value
    assert cost.compute_s == pytest.approx(attention_s + linear_s, rel=1e-12)
    assert cost.memory_s == pytest.approx(memory_s, rel=1e-12)
    assert cost.communication_s == pytest.approx(tp_s, rel=1e-12)
    assert cost.latency_s == pytest.approx(latency_s, rel=1e-12)
    assert cost.total_s == pytest.approx(
        attention_s + linear_s + memory_s + tp_s + latency_s, rel=1e-12
    )
    # Decode, one token: each device reads its 8e9 bytes of weights (slower than its
    # 2 x 32e9 / 8 FLOPs) and its 8 GiB of KV at 3.35 TB/s.
    assert 8e9 / 3.35e12 > 2 * params / 8 / 989e12
    assert cost.decode_step_s == pytest.approx((8e9 + 8 * GiB) / 3.35e12, rel=1e-12)
    # At 32K tokens the linear layers are 3x attention's FLOPs (params / (S N H L)).
    attention, linear = cost_model.prefill_flops(S=32_768, L=L, N=N, H=H, params=params)
    assert (
        linear / attention == pytest.approx(params / (32_768 * N * H * L))
        and 2.9 < (linear / attention) < 3.1
    )
    # Every assumed H100 number says it is an assumption.
    (why,) = p.cost.reasons
    assert "assumed: published peak" in why.source and "measured:" not in why.source


def test_tensor_parallel_replicates_kv_heads_when_fewer_than_tp():
    """K=2 kv heads over TP=8: each device holds one head, each head on 4 devices (as vLLM
    does), so the group stores 4x the model's KV; a TP the heads cannot follow is an error."""
    model = ModelShape(layers=4, query_heads=8, kv_heads=2, head_dim=64)
    assert model.kv_heads_per_device(8) == 1 and model.kv_heads_per_device(2) == 1
    assert model.kv_heads_per_device(1) == 2
    p = plan(Workload(model, fixed(4096), tensor_parallel=8), h100s())
    one_head = 2 * 4 * 1 * 64 * 2
    assert p.kv_bytes_per_token_per_device.value == one_head
    assert p.kv_bytes_per_request.value == 4096 * one_head * 8  # 4x the model's 2 heads
    assert p.kv_bytes_per_request.value == 4 * 4096 * model.bytes_per_token()
    assert any("replicated on 4 devices" in r.text for r in p.tensor_parallel.reasons)
    with pytest.raises(ValueError, match="tensor_parallel: expected a divisor or a multiple"):
        ModelShape(layers=4, query_heads=12, kv_heads=4, head_dim=64).kv_heads_per_device(6)


def test_weights_take_device_memory_and_can_leave_none():
    """The weights' share comes off each device's memory; TP divides it; weights that fill a
    device leave no KV pages and the plan says so."""
    page = 16 * small_model().bytes_per_token()
    hw = h100s(devices=8, per_node=8, memory=1000 * page)
    light = ModelShape(layers=4, query_heads=8, kv_heads=2, head_dim=64, params=100 * page // 2)
    p = plan(Workload(light, fixed(4096)), hw)
    assert p.weight_bytes_per_device.value == 100 * page
    assert p.max_pages_per_device.value == 900
    q = plan(Workload(light, fixed(4096), tensor_parallel=2), hw)
    assert q.weight_bytes_per_device.value == 50 * page
    heavy = dataclasses.replace(light, params=1000 * page // 2)
    r = plan(Workload(heavy, fixed(4096)), hw)
    assert r.max_pages_per_device.value == 0 and not r.fits.value
    assert "leaves no device memory for KV" in r.fits.reasons[0].text
    # Weights larger than a device: nothing can be placed, host memory or not.
    too_heavy = dataclasses.replace(light, params=1001 * page // 2)
    t = plan(Workload(too_heavy, fixed(4096)), dataclasses.replace(hw, host_memory=1 << 50))
    assert not t.fits.value and t.tiers.value == Tiers(0, 0, 0)
    assert "cannot be loaded" in t.fits.reasons[0].text
    assert plan(Workload(too_heavy, fixed(4096), tensor_parallel=2), hw).fits.value
    none = plan(Workload(small_model(), fixed(4096)), hw)
    assert none.weight_bytes_per_device.value == 0
    assert "not given" in none.weight_bytes_per_device.reasons[0].text


def test_linear_layers_are_counted_in_prefill_and_decode():
    hw = h100s()
    base = small_model()
    with_weights = dataclasses.replace(base, params=10**9)
    a = plan(Workload(base, fixed(4096)), hw).cost.value
    b = plan(Workload(with_weights, fixed(4096)), hw).cost.value
    assert b.compute_s - a.compute_s == pytest.approx(2 * 10**9 * 4096 / 989e12)
    # decode reads the 2e9 bytes of weights once per token
    assert b.decode_step_s - a.decode_step_s == pytest.approx(2e9 / 3.35e12)


# --- ties, hardware labels, lossy formats, citations ----------------------------------------


def test_strategies_within_one_percent_are_reported_as_a_tie():
    """On an overlapping H100 node at 256K the ring hides its hops behind attention and
    Ulysses' all-to-alls are small: their estimates differ by under 1%, which the plan reports
    as a tie with its tie-break rule; on the non-overlapping CPU they are far apart."""
    model = small_model(N=8, K=8)
    S, D = 256 * 1024, 8
    for hw, tie in ((h100s(8, 8), True), (dataclasses.replace(h100s(8, 8), overlap=False), False)):
        totals = {
            s: cost_model.estimate_prefill(s, model, hw, S=S, D=D, ulysses_degree=u)[4]
            for s, u in (("ring", 1), ("ulysses", 8))
        }
        margin = abs(totals["ring"] - totals["ulysses"]) / min(totals.values())
        assert (margin < 0.01) == tie, margin
        strat, _, _, reasons = _choose_strategy(model, hw, D, S)
        text = reasons[0].text
        if tie:
            assert strat == "ring"  # the tie-break: the first in (ring, ulysses, usp, allgather)
            assert "tie" in text and "tie-break" in text and reasons[0].numbers["ties"] >= 1
        else:
            assert "tie" not in text and reasons[0].numbers["ties"] == 0
            assert strat == min(totals, key=totals.get)


def test_hardware_numbers_are_labelled_assumed_or_measured():
    h100 = Hardware.h100_sxm()
    for field in RATE_FIELDS:
        assert h100.label(field).startswith("assumed"), field
    assert h100.attention_efficiency == h100.decode_vs_bandwidth == 1.0
    cpu = Hardware.emulated_cpu()
    assert cpu.attention_efficiency == cost_model.BLOCKWISE_FORWARD_EFFICIENCY == 0.73
    assert cpu.decode_vs_bandwidth == cost_model.PAGED_DECODE_VS_BANDWIDTH
    assert cpu.page_in_efficiency == cost_model.PAGE_IN_VS_MEMCPY
    for field, where in (
        ("attention_efficiency", "gaps_2026-12-01.md, run A"),
        ("device_flops", "gaps_2026-12-01.md, run A"),
        ("decode_vs_bandwidth", "paged.md"),
        ("page_in_efficiency", "gaps_2026-12-02.md, run B"),
    ):
        assert cpu.label(field).startswith("measured") and where in cpu.label(field), field
        assert "CPU" in cpu.label(field)
    assert h100s().label("device_flops") == "given by the caller (no label)"
    assert h100s().label("attention_efficiency") == "assumed: Hardware's default 1"
    # The plan's cost reason carries the labels of the hardware it ran on.
    p = plan(Workload(small_model(), fixed(4096)), Hardware.emulated_cpu())
    assert "gaps_2026-12-01.md, run A" in p.cost.reasons[0].source


def test_lossy_formats_are_opt_in_and_say_their_loss_is_a_toy_models():
    assert Workload(small_model(), fixed(10)).quantization == ()
    model = small_model(H=128)
    hw = h100s(devices=1, per_node=1, memory=4_600 * 16 * model.bytes_per_token(), host=1 << 50)
    exact = plan(Workload(model, fixed(8192 * 16)), hw)
    assert exact.kv_format.value == "bfloat16" and exact.tiers.value.host > 0
    assert "not allowed" in exact.kv_format.reasons[0].text
    lossy = plan(Workload(model, fixed(8192 * 16), quantization=("int8",)), hw)
    assert lossy.kv_format.value == "int8" and lossy.tiers.value.host == 0
    (why,) = lossy.kv_format.reasons
    assert "lossy" in why.text and "toy model" in why.text and "not measured on a real" in why.text


def test_reasons_cite_the_article_by_title_and_section():
    model = small_model()
    hw = h100s(devices=16, per_node=8, memory=16 * model.bytes_per_token() * 3000, host=1 << 50)
    p = plan(Workload(model, fixed(600 * 1024), prefix_reuse=0.6, prefix_tokens=512), hw)
    seen = set()
    for row in p.rows():
        for reason in row.reasons:
            assert "seed" not in reason.text and "shared/" not in reason.text, reason
            assert not re.search(r"\bincident [ABC]\b", reason.text), reason
            if reason.rule in ARTICLE_SECTIONS:
                assert reason.source.startswith(f"the article {ARTICLE}"), reason
                assert "section" in reason.source
                seen.add(reason.rule)
            if reason.rule == "measured":
                assert "benchmarks/results/" in reason.source, reason
    assert {"rule 1", "iron rule 2", "iron rule 3"} <= seen
    assert "长上下文推理的工程真相" in ARTICLE and "engineering truth" in ARTICLE


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ModelShape(8, 8, 2, 64, params=0), "params"),
        (lambda: ModelShape(8, 8, 2, 64, params=10, weight_itemsize=3), "weight_itemsize"),
        (lambda: Workload(small_model(N=8, K=2), fixed(10), tensor_parallel=3), "query_heads"),
        (lambda: Workload(small_model(N=12, K=4), fixed(10), tensor_parallel=6), "kv_heads"),
        (lambda: Workload(small_model(), fixed(10), tensor_parallel=0), "tensor_parallel"),
        (
            lambda: plan(Workload(small_model(N=16, K=16), fixed(10), tensor_parallel=16), h100s()),
            "plan: workload.tensor_parallel",
        ),
        (
            lambda: plan(Workload(small_model(), fixed(10), tensor_parallel=4), h100s(2, 2)),
            "plan: workload.tensor_parallel",
        ),
        (lambda: dataclasses.replace(h100s(), attention_efficiency=1.5), "attention_efficiency"),
        (lambda: dataclasses.replace(h100s(), decode_vs_bandwidth=0.5), "decode_vs_bandwidth"),
        (lambda: dataclasses.replace(h100s(), labels=(("device_flops", "peak"),)), "labels"),
        (lambda: dataclasses.replace(h100s(), labels=(("flops", "assumed: x"),)), "labels"),
    ],
)
def test_bad_new_inputs_raise(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@settings(max_examples=40, deadline=None)
@given(
    models,
    lengths,
    st.sampled_from([1, 2, 4, 8]),
    st.one_of(st.none(), log_uniform(20, 36)),
    hardware,
)
def test_tensor_parallel_plans_add_up(model, lengths, tp, params, hw):
    """With weights and TP: the KV on devices fits in what the weights leave on the request's
    TP x degree devices, the tiers add up, and every reason has a rule and a source."""
    model = dataclasses.replace(model, params=params)
    if model.query_heads % tp or (model.kv_heads % tp and tp % model.kv_heads):
        return
    if hw.devices % tp or tp > hw.devices_per_node:
        with pytest.raises(ValueError, match=r"plan: workload\.tensor_parallel"):
            plan(Workload(model, lengths, tensor_parallel=tp), hw)
        return
    p = plan(Workload(model, lengths, tensor_parallel=tp), hw)
    _check_reasons(p)
    weights = -(-model.weight_bytes // tp)
    assert p.weight_bytes_per_device.value == weights
    tiers, request = p.tiers.value, p.kv_bytes_per_request.value
    devices = tp * p.degree.value
    assert devices <= hw.devices and hw.devices % devices == 0
    assert tiers.device <= devices * max(0, hw.device_memory - weights)
    assert (tiers.total == request) == p.fits.value and tiers.total <= request
    per_device = model.bytes_per_token(p.kv_format.value, p.page_size.value, tp)
    assert p.kv_bytes_per_token_per_device.value == per_device
    assert request >= p.pages_per_request.value * p.page_size.value * per_device * tp
