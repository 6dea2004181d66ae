"""The benchmarks' own correctness checks, at tiny sizes (no timing).

``bench_train`` and ``bench_decode`` check, before timing, that every method they time computes
the same thing (the same training-step loss and gradient norm; the same greedy tokens). These
tests run those checks on a tiny model so a broken benchmark path shows up in CI.
``bench_kvquant``'s tables are checked for internal consistency (measured bytes against the
formats' formulas and the docs' quantized-KV numbers, the documented error bounds, error
ordered by bits).
``bench_gaps``'s tables are built from real tiny-size measurements and checked for structure
(one row per gap and per doubling, positive finite ratios), and its port of the Ring Attention
paper's code is checked against the reference.
"""

import dataclasses
import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import (
    _paper_ring,
    bench_blockwise,
    bench_decode,
    bench_decode_scaling,
    bench_gaps,
    bench_host_copy,
    bench_kvquant,
    bench_paged,
    bench_quality,
    bench_ring_quant,
    bench_train,
)
from examples.longctx_lm.model import ModelConfig, Transformer
from ringattn import BlockSizes

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ModelConfig(width=32, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, mlp_width=64)


@pytest.mark.slow  # ~40 s (the strategies' equality is also tested in tests/ringattn)
def test_bench_train_strategies_agree_with_the_one_device_step():
    errors = bench_train.check_agreement(
        context=128, batch=2, model_cfg=TINY, block_sizes=BlockSizes(block_q=16, block_kv=16)
    )
    assert set(errors) == set(bench_train.METHODS)


def test_bench_decode_methods_emit_the_same_greedy_tokens():
    model = Transformer(TINY, rngs=nnx.Rngs(3))
    tokens = bench_decode.check_greedy_agreement(model, context=40, new_tokens=6)
    assert tokens.shape == (6,)


def test_bench_ring_quant_bytes_match_the_program():
    """The hop bytes the benchmark reports (``hop_bytes``) are those the ring's ``ppermute``
    sends, and a quantized hop changes the output a little, the exact hop not at all."""
    results = bench_ring_quant.check_hops(64, block_sizes=BlockSizes(block_q=4, block_kv=4))
    assert set(results) == set(bench_ring_quant.FORMATS)
    for fmt, (computed, measured, err) in results.items():
        assert computed == measured, fmt
        assert err == 0.0 if fmt is None else 0.0 < err < 0.5, (fmt, err)
    positions = 8 * 4  # one row of 8 int32 positions travels with every hop
    assert (results["int8"][0] - positions) * 4 * 128 == (results[None][0] - positions) * 132


@pytest.mark.slow
def test_bench_quality_demote_is_exact_and_drop_is_scored():
    """The harness on a tiny model, scored against its own full-KV greedy output: every rule
    is exact when demoting (all pages come back), and full budget is exact when dropping."""
    from examples.longctx_lm import generate

    model = Transformer(TINY, rngs=nnx.Rngs(4))
    prompts, _ = bench_quality.passkey_prompts(120, 0.5, 3, seed=0)
    server = generate.Server(model, num_pages=64, page_size=16, max_len=160, batch=3, chunk=64)
    answers = np.stack(server.generate(list(prompts), 4))
    for kind in bench_quality.KINDS:
        select = bench_quality.make_rule(kind, 0.2)
        acc, mass, moved = bench_quality.evaluate_rule(model, select, "demote", prompts, answers, batch=3)  # fmt: skip
        assert acc == 1.0 and 0.0 <= mass <= 1.0 and moved > 0, kind
    full = bench_quality.make_rule("h2o", 1.0)
    acc, mass, moved = bench_quality.evaluate_rule(model, full, "drop", prompts, answers, batch=3)
    assert acc == 1.0 and abs(mass - 1.0) < 1e-5 and moved == 0


def _kvquant_cases():
    cfg = dataclasses.replace(TINY, num_layers=1)
    model = Transformer(cfg, rngs=nnx.Rngs(5))
    dims = (1, 1, 48, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)  # the model's shape
    return [
        bench_kvquant.random_case(*dims, outliers=False),
        bench_kvquant.random_case(*dims, outliers=True, seed=1),
        bench_kvquant.model_case(model, 1, 48, label="tiny model"),
    ]


def test_bench_kvquant_bytes_match_the_formula_and_the_docs():
    bk = bench_kvquant
    names, skipped = bk.available_kinds()
    assert {"int8", "fp8"} <= set(names) and set(names) | set(skipped) == set(bk.KINDS)
    tiny = bk.ModelShape("tiny", 2, 8, 2, 16)
    for shape in (bk.LLAMA_70B, bk.LLAMA_70B_MHA, tiny):
        rows = bk.bytes_rows(names, shape, 1000)
        extra = {f"kivi2 (C={bk.KIVI_BIG_PAGE})"} if "kivi2" in names else set()
        assert set(rows) == {"float32", "bf16", *names} | extra
        for name, row in rows.items():
            assert row["per_token"] == row["formula_per_token"], (shape, name, row)
            assert row["sequence"] == 1000 * row["per_token"]
        assert rows["bf16"]["per_token"] == 2 * shape.layers * shape.kv_heads * shape.head_dim * 2
        assert rows["float32"]["vs_bf16"] == 2.0
    llama = bk.bytes_rows(["int8"], bk.LLAMA_70B, bk.LLAMA_TOKENS)
    # docs/concepts/quantized.md: 168,960 bytes per token, 41.25 / 80 / 160 GiB at 256K.
    assert llama["int8"]["per_token"] == 168_960
    assert [llama[n]["sequence"] / bk.GiB for n in ("int8", "bf16", "float32")] == [41.25, 80, 160]
    article = bk.bytes_rows([], bk.LLAMA_70B_MHA, bk.LLAMA_TOKENS)  # the article's 640 GB
    assert article["bf16"]["sequence"] == 640 * bk.GiB
    assert bk.target_cell("int8", llama["int8"]["vs_bf16"]) == "<= 0.53x: met"
    assert "missed" in bk.target_cell("int8", 0.6) and bk.target_cell("fp8", 0.5) == "-"
    if "kivi2" in names:  # H = 128: 100 bytes (K + V) at C = 16, 76 at C = 64, vs bf16's 512
        big = f"kivi2 (C={bk.KIVI_BIG_PAGE})"
        kivi = bk.bytes_rows(["kivi2"], bk.LLAMA_70B, bk.LLAMA_TOKENS)
        assert kivi["kivi2"]["per_token"] == 80 * 8 * 100 and kivi[big]["per_token"] == 80 * 8 * 76
        assert bk.target_cell(big, kivi[big]["vs_bf16"]) == "<= 0.16x: met"
    text = "\n".join(bk.bytes_section(names, tiny, 1000))
    assert all(f"| {n} |" in text for n in ["float32", "bf16", *names])


def test_bench_kvquant_errors_are_within_bounds_and_ordered_by_bits():
    bk = bench_kvquant
    names, _ = bk.available_kinds()
    cases = _kvquant_cases()
    results = {case.name: bk.evaluate_case(case, names) for case in cases}
    by_bits = [n for n in ("bf16", "int8", "fp8", "int4", "kivi2") if n in ["bf16", *names]]
    for case in cases:
        res = results[case.name]
        assert set(res) == {"bf16", *names}
        for kind in ("int8", "fp8", "int4", "kivi2"):  # the documented element-wise bounds hold
            assert res[kind].k_in_bound and res[kind].v_in_bound, (case.name, kind)
        for name, r in res.items():
            assert 0 < r.k.rel < 1 and 0 < r.v.rel < 1 and 0 < r.out.rel < 1, (case.name, name, r)
        assert res["bf16"].out.rel < 1e-2 and res["int8"].out.rel < 0.1, (case.name, res)
        if "outlier" not in case.name:
            assert res["int8"].out.rel < 2e-2 and res["fp8"].out.rel < 6e-2, (case.name, res)
    normal = results[cases[0].name]
    for part in ("k", "v"):  # fewer bits, larger error, on normal KV
        rel = [getattr(normal[n], part).rel for n in by_bits]
        assert rel == sorted(rel) and len(set(rel)) == len(rel), (part, by_bits, rel)
    # Outlier key channels coarsen int8's per-token scales: the attention error grows.
    assert results[cases[1].name]["int8"].out.rel > 2 * normal["int8"].out.rel
    text = "\n".join(bk.error_sections(cases, results))
    assert "## 2." in text and "## 3." in text and "**no**" not in text


def test_bench_kvquant_decode_timing_runs_every_storage():
    """The decode harness at a tiny size (no timing is asserted): every storage runs and its
    bytes are the pools'."""
    bk = bench_kvquant
    names, _ = bk.available_kinds()
    B, S, N, K, H = 1, 48, 8, 2, 8
    timing = bk.decode_timing(names, B, S, N, K, H, 1)
    assert list(timing) == ["float32", "bf16", *names]
    slots = K * (B * -(-S // bk.PAGE) + 1) * bk.PAGE
    for name, (t, nbytes) in timing.items():
        assert len(t.times) == 1 and nbytes == bk.measured_bytes(name, H) * slots, name
    text = "\n".join(bk.decode_section(timing, B, S, N, K, H, 1))
    assert "target int8 <= bf16" in text


@pytest.mark.slow
def test_bench_kvquant_quick_run_writes_every_section(tmp_path):
    """``--quick`` end to end, in its own process (it sets up one CPU device before JAX)."""
    out = tmp_path / "kvquant.md"
    command = [sys.executable, "-m", "benchmarks.bench_kvquant", "--quick", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    for title in ("## 1.", "## 2.", "## 3.", "## 4.", "Llama-3-70B", "trained model"):
        assert title in text, title
    assert "**no**" not in text  # every documented bound held


@pytest.mark.slow  # ~1.5 min on 2 shared cores
def test_bench_retrieval_quick_run_checks_and_reports_every_mode(tmp_path):
    """``--quick`` end to end in its own process: its correctness checks (fetch everything =
    all on device; retrieval from host = retrieval on device) run before any timing."""
    out = tmp_path / "retrieval.md"
    command = [sys.executable, "-m", "benchmarks.bench_retrieval", "--quick", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    for row in ("| all on device |", "| fetch everything |", "| retrieval 10% |",
                "| retrieval 10%, all on device |", "| full cache (all on device) |", "Goal:"):  # fmt: skip
        assert row in text, row


def _check_gaps_tables(results):
    """The gap and scaling tables of ``results``: every row there, every ratio positive and
    finite, every row of the Markdown body present (no timing is asserted)."""
    sizes = bench_gaps.TINY
    gaps = bench_gaps.gap_rows(results, sizes)
    assert len(gaps) == 8  # backward, two efficiencies, causal, paged, page-out, page-in, ring
    for gap, value, target, met, _note in gaps:
        assert math.isfinite(value) and value > 0, (gap, value)
        assert isinstance(met, bool) and target[:2] in ("<=", ">="), (gap, target)
    scaling = bench_gaps.scaling_rows(results, sizes)
    counts = (
        sizes.fwd_lengths,
        sizes.bwd_lengths,
        sizes.decode_lengths,
        *[sizes.memory_lengths] * 2,
    )
    assert len(scaling) == sum(len(lengths) - 1 for lengths in counts)
    for name, a, b, ratio, expected in scaling:
        assert b == 2 * a and math.isfinite(ratio) and ratio > 0, (name, a, b, ratio)
        assert expected in ("~2x", "~4x"), name
    text = bench_gaps.report_lines(results, sizes, "tiny")
    table = [line for line in text if line.startswith("| ") and "---" not in line]
    assert len(table) == 2 + len(gaps) + len(scaling)  # two header rows
    assert [line.count("|") for line in table] == [6] * (1 + len(gaps)) + [5] * (1 + len(scaling))
    return gaps, scaling


def test_bench_gaps_tables_from_known_numbers():
    """The tables from made-up measurements at the tiny sizes: each ratio is the quotient it
    names, each target's verdict follows, each doubling's ratio is value(2S) / value(S)."""
    B, N, H = bench_gaps.TINY.blockwise_shape
    mm = 1e9
    flops = bench_blockwise.attention_flops(256, 256, N, H, False, False) * B
    results = {
        "blockwise": {
            "matmul_flops": mm,
            "fwd": {"128": 0.25 * flops / mm, "256": flops / mm},  # 100% efficient at 256
            "fwd_causal": {"128": 0.5 * 0.25 * flops / mm, "256": 0.6 * flops / mm},
            "fwd_bwd": {"128": 7.0 * flops / mm / 4, "256": 7.0 * flops / mm},  # 50% efficient
            "bwd": {"128": 1.0, "256": 2.0 * flops / mm},
            "temp_fwd": {"128": 10, "256": 20, "512": 50},
            "temp_fwd_bwd": {"128": 30, "256": 60, "512": 90},
            "matmuls_fwd": {"256": 0.8 * flops / mm},  # the ceilings: 125% and 70%
            "matmuls_bwd": {"256": 4.2 * flops / mm},
        },
        "paged": {
            "by_length": {
                "64": {"contiguous": 1.0, "paged": 1.5, "gathers": 0.8, "best": 2},
                "128": {"contiguous": 2.0, "paged": 2.1, "gathers": 1.8, "best": 4},
            }
        },
        "offload": {"memcpy": 0.9, "page_out": 1.0, "page_in": 1.2, "fresh device_put": 3.0},
        "ring": {"ours": 1.0, "paper": 2.0, "grad_err": 0.0, "S": 128, "B": 1, "N": 8, "H": 64},
    }
    gaps, scaling = _check_gaps_tables(results)
    measured = [round(value, 6) for _, value, _, _, _ in gaps]
    assert measured == [2.0, 0.5, 1.0, 0.6, 1.05, 0.9, 0.75, 0.5]
    assert [met for *_, met, _ in gaps] == [True, False, True, False, True, True, False, True]
    assert "the walk's gathers alone: 0.90x" in gaps[4][4]  # the paged row's note, at 128
    assert gaps[1][4].endswith("the same block matmuls alone (no softmax): 70%")  # fwd+bwd
    assert gaps[2][4] == "the same block matmuls alone (no softmax): 125%"  # forward
    # The matmul rate timed in the same rounds as the 256 rows replaces the part's first one.
    results["blockwise"]["matmul_flops_interleaved"] = {"256": 2 * mm}
    with_rate, _ = _check_gaps_tables(results)
    assert [round(v, 6) for _, v, _, _, _ in with_rate][1:3] == [0.25, 0.5]  # half as efficient
    assert with_rate[1][4].startswith("matmul 2.0 GFLOP/s timed with these rows (1.0 at the")
    assert with_rate[2][4] == "the same block matmuls alone (no softmax): 62%"
    del results["blockwise"]["matmul_flops_interleaved"]
    del results["blockwise"]["matmuls_fwd"], results["blockwise"]["matmuls_bwd"]
    older, _ = _check_gaps_tables(results)  # a run from before the ceiling was measured
    assert older[2][4] == "" and older[1][4] == "matmul 1.0 GFLOP/s"
    ratios = [round(r, 6) for _, _, _, r, _ in scaling]
    assert ratios[:3] == [4.0, 4.0, 1.4]  # fwd, fwd+bwd, paged decode
    assert [round(r, 6) for name, *_, r, _ in scaling if "temporaries" in name] == [2, 2.5, 2, 1.5]


@pytest.mark.slow  # ~1 min on 2 busy cores: compiles every part, both rings on 8 devices
def test_bench_gaps_parts_at_tiny_sizes():
    """Every part of ``bench_gaps`` measured at tiny sizes (the ring on the 8 test devices, the
    rest on device 0), then both tables; the two rings' gradients agree."""
    results = {part: bench_gaps.MEASURE[part](bench_gaps.TINY) for part in bench_gaps.PARTS}
    assert results["ring"]["grad_err"] < 1e-4
    assert len(results["blockwise"]["temp_fwd_bwd"]) == len(bench_gaps.TINY.memory_lengths)
    assert set(results["blockwise"]["matmuls_bwd"]) == {str(max(bench_gaps.TINY.bwd_lengths))}
    assert set(results["blockwise"]["matmul_flops_interleaved"]) == {
        str(max(bench_gaps.TINY.bwd_lengths))
    }
    _check_gaps_tables(results)


@pytest.mark.slow  # ~20 s on 2 shared cores; the default suite is at its 20-minute budget
@pytest.mark.parametrize("causal", [True, False])
def test_paper_ring_port_matches_the_reference(causal):
    """The benchmark's baseline, the port of the paper's ring, is ring attention: output and
    gradients match ``attention_reference`` (float32, 8 devices, 2 chunks per shard)."""
    import jax
    import jax.numpy as jnp

    from ringattn import attention_reference
    from tests._util import assert_close, make_test_mesh

    mesh = make_test_mesh((8,), ("seq",))
    port = jax.jit(_paper_ring.make_paper_ring(mesh, "seq", causal=causal, chunk=2))
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 32, 2, 8)) for i in range(3))

    def reference(q, k, v):
        return attention_reference(q, k, v, causal=causal).out

    assert_close(port(q, k, v), reference(q, k, v), dtype=jnp.float32, what="out")

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))

    got = jax.jit(jax.grad(loss(port), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert_close(g, w, dtype=jnp.float32, grad=True, what=f"d{name}")


# ------------------------------------------------------------------------------------------
# bench_million: the bookkeeping, the float64 reference, and the --tiny run end to end
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens, chunks", [(2**14, 4), (2**14, 1), (2**15, 3), (2**17, 4)])
def test_bench_million_layout_places_every_page_once(tokens, chunks):
    """Every page-table column is in exactly one tier; 20% stay on the device (to a page per
    device), the open page among them; host slots are distinct, on their page's device, never
    a chunk's null slot; each chunk's table points at the slots that chunk fetches."""
    from benchmarks import bench_million as bm

    layout = bm.Layout(tokens, chunks)
    D, M_d = bm.DEVICES, layout.per_device
    hot, cold = layout.hot_table().reshape(D, M_d), np.zeros((D, M_d), np.int64)
    counts = [len(h) for h in layout.hot]
    assert max(counts) - min(counts) <= 1 and sum(counts) == round(0.2 * layout.pages)
    assert hot[-1, -1] != 0  # the open page stays on the device
    for d in range(D):  # device pool ids: 1 .. count, each once
        assert sorted(hot[d][hot[d] > 0]) == list(range(1, counts[d] + 1))
    ids, slots = layout.page_out_ids()
    assert len(np.unique(slots)) == len(slots) == layout.cold_pages
    assert np.array_equal(ids // (M_d + 1), slots // layout.slots_per_device)  # same device
    local_slots = slots % layout.slots_per_device
    assert np.all(local_slots % (layout.chunk_width + 1) != 0)  # null slots stay empty
    slot_of = {int(i): int(s) for i, s in zip(ids, slots, strict=True)}
    batches = list(layout.page_out_batches(per_device=5))
    got = np.concatenate([b[0] for b in batches])
    assert sorted(got.tolist()) == sorted(ids.tolist())
    for batch_ids, batch_slots in batches:
        assert np.bincount(batch_ids // (M_d + 1), minlength=D).max() <= 5
        assert [slot_of[int(i)] for i in batch_ids] == batch_slots.tolist()
    gather = layout.hot_gather_ids().reshape(D, layout.hot_capacity)
    for chunk in range(chunks):
        table = layout.chunk_table(chunk).reshape(D, M_d)
        fetched = layout.chunk_slots(chunk).reshape(D, layout.chunk_width + 1)
        for d in range(D):
            for column in np.flatnonzero(table[d]):
                page_id = d * (M_d + 1) + 1 + column
                assert fetched[d, table[d, column]] == slot_of[page_id]
        cold += table > 0
    assert np.array_equal((hot > 0).astype(int) + cold, np.ones((D, M_d), int))
    for d in range(D):  # the device pool holds the kept pages, in table order
        kept = np.flatnonzero(hot[d])
        assert np.array_equal(gather[d, hot[d, kept]], kept + 1)


@pytest.mark.parametrize("tokens", [64, 1024, 4096])
def test_bench_million_reference_is_dense_attention(tokens):
    """The chunked float64 reference (running lse merge) equals dense softmax attention over
    the same generated pages, for lengths from one token to the whole cache."""
    from benchmarks import bench_million as bm

    steps = 4
    q = bm.queries(steps)
    lengths = np.array([1, tokens // 3 + 1, tokens - 1, tokens])
    out, lse = bm.reference(tokens, q, lengths, block_pages=3)
    kv = np.concatenate([bm.page_kv(p) for p in range(tokens // bm.C)], axis=2)
    kv = kv.astype(np.float64)  # [2, K, S, H]
    G = bm.N // bm.K
    for t in range(steps):
        for n in range(bm.N):
            k, v = kv[0, n // G, : lengths[t]], kv[1, n // G, : lengths[t]]
            logits = k @ q[t, n].astype(np.float64) / np.sqrt(bm.H)
            want_lse = np.log(np.sum(np.exp(logits - logits.max()))) + logits.max()
            want = np.exp(logits - want_lse) @ v
            np.testing.assert_allclose(out[t, n], want, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(lse[t, n], want_lse, rtol=1e-12)


@pytest.mark.slow  # 18-30 s on 2 shared cores: the eight devices' page copies compile
def test_bench_million_tiny_run_is_exact_with_an_80_20_split(tmp_path):
    """``--tiny`` end to end in its own process (8 CPU devices before JAX): the decode over
    device pages plus fetched host pages matches the float64 reference within tolerance, and
    the printed split is 80% of pages (and bytes) on pinned host, 20% on device, per device."""
    import re

    out = tmp_path / "million.md"
    command = [sys.executable, "-m", "benchmarks.bench_million", "--tiny", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    relative = float(re.search(r"relative ([0-9.e+-]+)\); max \|lse", text).group(1))
    lse_err = float(re.search(r"max \|lse - ref\| = ([0-9.e+-]+)", text).group(1))
    assert relative <= 1e-4 and lse_err <= 1e-4, (relative, lse_err)
    for what in ("pages", "bytes"):
        host, device = map(
            float, re.search(rf"host/device = ([0-9.]+)% / ([0-9.]+)% of {what}", text).groups()
        )
        assert abs(host - 80) <= 1 and abs(device - 20) <= 1 and abs(host + device - 100) < 0.2
    rows = re.findall(r"^\| (\d) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|$", text, re.M)
    assert [int(r[0]) for r in rows] == list(range(8))
    for _, on_device, _, pinned in rows:  # every device holds both tiers, 4:1
        assert 3.5 <= float(pinned) / float(on_device) <= 4.5, (on_device, pinned)
    assert "within the float32 tolerance" in text and "decode step" in text


@pytest.mark.slow  # ~30-60 s on 2 shared cores: every kernel compiles in interpret mode
def test_bench_accel_interpret_smoke_agrees_and_cpu_run_exits_cleanly(capsys):
    from benchmarks import bench_accel

    errors = bench_accel.interpret_smoke()
    names = {key.split("/")[0] for key in errors}
    assert {"pallas", "xla"} <= names
    assert all(np.isfinite(e) and e <= 2e-2 for e in errors.values())
    # 4 * B * N * H * T * S forward, half causal, 3.5x with the backward.
    assert bench_accel.attention_flops(1, 8, 8, 2, 4, False, False) == 4 * 2 * 4 * 64
    assert bench_accel.attention_flops(1, 8, 8, 2, 4, True, True) == 4 * 2 * 4 * 64 * 0.5 * 3.5
    assert bench_accel.main([]) == 0  # on CPU: says it needs a GPU
    assert "needs a GPU" in capsys.readouterr().out


def test_bench_accel_tpu_section_peaks_and_baseline_lowers_for_tpu():
    # The TPU section cannot run here; check its peak table and that its baseline (JAX's
    # TPU flash attention, forward and backward) lowers to Mosaic for the tpu platform.
    import jax
    import jax.numpy as jnp
    from jax import export

    from benchmarks import bench_accel

    assert bench_accel.tpu_peak_tflops("TPU v5 lite") == 197.0
    assert bench_accel.tpu_peak_tflops("TPU v5") == 459.0
    assert bench_accel.tpu_peak_tflops("TPU v6 lite") == 918.0
    assert bench_accel.tpu_peak_tflops("cpu") is None
    impls = bench_accel.make_impls(True, interpret=False, mha_ok=True, backend="tpu")
    assert sorted(impls) == ["jax_flash", "pallas", "xla"]
    _, bwd = bench_accel.forward_and_backward(impls["jax_flash"])
    x = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.float32)
    exported = export.export(bwd, platforms=("tpu",))(x, x, x, w)
    assert exported.mlir_module().count("@tpu_custom_call(") >= 2


def test_bench_host_copy_times_every_arrangement_of_the_same_copy():
    # measure() checks every arrangement's copy against the source pages before returning.
    timings, cpu = bench_host_copy.measure(2 * 1024 * 1024, 256 * 1024, repeats=1)
    assert set(timings) == set(cpu) and len(timings) == 8
    assert all(t.best > 0 for t in timings.values()) and all(c >= 0 for c in cpu.values())


@pytest.mark.parametrize("pages_per_block", [1, 3, 4])
def test_bench_paged_gathers_only_walk_reads_every_page_once(pages_per_block):
    """The decode floor ``bench_paged`` reports: a walk over a (permuted) page table whose
    length is not a multiple of the block (4: padded with the zero null page) sums exactly
    the sequences' keys and values."""
    B, S, N, K, H, C = 2, 96, 4, 2, 8, 16  # M = 6 pages per sequence
    _, k, v, k_pages, v_pages, table, _ = bench_paged.make_data(B, S, N, K, H, C)
    assert not k_pages[:, 0].any() and not v_pages[:, 0].any()
    walk = bench_paged.gathers_only(k_pages, v_pages, table, pages_per_block)
    np.testing.assert_allclose(float(walk()), float(k.sum() + v.sum()), rtol=1e-5, atol=1e-4)
    # a walk that skipped the ragged tail (or read a page twice) would miss by a whole page
    assert abs(float(k[:, :, -C:].sum())) > 1e-2


@pytest.mark.parametrize("blocks", [(32, 48), (96, 16)])
def test_bench_blockwise_block_matmuls_are_the_products_of_unnormalised_attention(blocks):
    """The efficiency ceiling's program computes ``(q k^T) v`` per head and its exact VJP."""
    B, L, N, H = 2, 96, 3, 8
    q, k, v, do = (jax.random.normal(jax.random.key(i), (B, L, N, H)) for i in range(4))

    def linear_attention(q, k, v):
        return jnp.einsum("btns,bsnh->btnh", jnp.einsum("btnh,bsnh->btns", q, k), v)

    forward, backward = bench_blockwise.block_matmuls(*blocks)
    want, vjp = jax.vjp(linear_attention, q, k, v)
    np.testing.assert_allclose(forward(q, k, v), want, rtol=1e-5, atol=1e-4)
    for got, grad in zip(backward(q, k, v, do), vjp(do), strict=True):
        np.testing.assert_allclose(got, grad, rtol=1e-5, atol=1e-4)


def test_bench_decode_scaling_layouts_compute_the_same_steps():
    """The per-layer cache and the stacked (0.2) baseline it is timed against give the same
    decode outputs over two steps (the check the benchmark runs before timing)."""
    assert bench_decode_scaling.check_layouts_agree(pages=80, tokens=40) <= 1e-6


@pytest.mark.slow  # ~30 s: the real model's decode loops compile at tiny sizes
def test_bench_llama_quick_runs_without_torch_and_ends_with_its_json(tmp_path):
    """Without torch (made unimportable), ``bench_llama`` still runs every jax column, leaves
    the transformers columns empty and prints one JSON object as its last line (tiny shapes
    stand in for the quick ones)."""
    out = tmp_path / "llama.md"
    script = (
        "import importlib.abc, sys\n"
        "class NoTorch(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "from benchmarks import bench_llama as b\n"
        "b.QUICK_PREFILL, b.QUICK_DECODE, b.STEPS = (64,), ((1, 64), (2, 48)), 2\n"
        f"b.main(['--quick', '--out', {str(out)!r}])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch is not installed" in done.stdout
    import json

    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["torch"] is None
    assert set(summary["decode_over_bound"]) == {"1x64", "2x48"}
    for key in ("max_decode_over_bound", "max_decode_over_copy_bound"):
        assert 0 < summary[key] < 1e4 and math.isfinite(summary[key]), key
    assert summary["max_decode_over_bound"] == max(summary["decode_over_bound"].values())
    for key in ("max_decode_over_torch", "max_int8_over_torch", "max_prefill_over_torch"):
        assert summary[key] is None, key
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 2 x 48 ")]
    assert len(rows) == 1 and rows[0].count("| - |") >= 2, rows  # torch's columns left empty


def test_bench_kernel_ab_measures_and_toggles_the_barrier():
    """The per-commit measurement's keys and ratios, and the barrier A/B, at a tiny size (the
    worktrees and processes of ``main`` are left to the benchmark itself)."""
    from benchmarks import bench_kernel_ab

    got = bench_kernel_ab.child(256, 1)
    # The ratios come from unrounded times, the times are rounded to 0.1 ms.
    ratio = got["fwd_causal"] / got["fwd_full"]
    assert got["causal_over_full"] == pytest.approx(
        ratio, abs=0.1 / got["fwd_full"] * (1 + ratio) + 1e-3
    )
    bwd = (got["fb_full"] - got["fwd_full"]) / got["fwd_full"]
    assert got["bwd_over_fwd"] == pytest.approx(bwd, abs=0.2 / got["fwd_full"] * (2 + bwd) + 1e-3)
    ab = bench_kernel_ab.barrier_ab(256, 1)  # raises if the identity left a barrier behind
    assert set(ab) == {"full", "causal"} and all(t > 0 for pair in ab.values() for t in pair)
    import jax

    assert jax.lax.optimization_barrier.__module__.startswith("jax")  # restored
