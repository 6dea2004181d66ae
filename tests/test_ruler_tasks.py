"""The RULER-style task generator ``examples.llama.ruler`` (of ``benchmarks.bench_ruler`` and
the real-model notebook): reproducible from a seed, at most the asked length, every expected
answer in the context, RULER's scoring."""

import json

import pytest

from benchmarks import bench_ruler
from examples.llama import ruler


def count(text: str) -> int:  # a stand-in tokenizer: whitespace-separated words
    return len(text.split())


@pytest.mark.parametrize("task", sorted(ruler.TASKS))
def test_samples_are_reproducible_bounded_and_answerable(task):
    a = ruler.make_sample(task, 600, seed=4, count=count)
    assert a == ruler.make_sample(task, 600, seed=4, count=count)
    assert a != ruler.make_sample(task, 600, seed=5, count=count)
    assert 500 < count(a.prompt) <= 600
    assert a.task == task and a.expected
    for expected in a.expected:
        assert expected in a.context and expected not in a.question + a.answer_prefix
    assert ruler.score(a, " ".join(a.expected)) == 1.0
    assert ruler.score(a, "") == 0.0


def test_multi_answer_scores_are_recall_and_distractors_differ():
    s = ruler.make_sample("niah_multivalue", 400, seed=0, count=count)
    assert len(s.expected) == 4 and ruler.score(s, s.expected[0]) == 0.25
    k = ruler.make_sample("niah_multikey", 400, seed=0, count=count)
    assert k.context.count("special magic numbers for") == 4 and len(k.expected) == 1


def test_checks_and_the_interval():
    with pytest.raises(ValueError, match="task: expected one of"):
        ruler.make_sample("niah", 600, seed=0, count=count)
    with pytest.raises(ValueError, match="length: expected >= 64"):
        ruler.make_sample("niah_single", 10, seed=0, count=count)
    lo, hi = bench_ruler.wilson(8, 8)
    assert 0.6 < lo < 0.7 and hi == 1.0
    lo, hi = bench_ruler.wilson(0, 8)
    assert lo == 0.0 and 0.3 < hi < 0.4
    with pytest.raises(SystemExit):
        bench_ruler.parse(["--press", "kvzip"])
    policy = bench_ruler.make_policy("snapkv", 0.75, 16, 32)
    assert policy.budget == 0.25 and policy.recent == 2 and policy.pool_size == 1


def test_report_tables_and_figure_from_json_lines(tmp_path):
    from benchmarks import ruler_report

    def row(press, ratio, score, **kw):
        r = {"task": "niah_single", "length": 2048, "press": press, "ratio": ratio,
             "samples": 4, "score": score, "ci95": list(bench_ruler.wilson(4 * score, 4)),
             "mode": "agnostic", "residency": "drop", "page_size": 16, "kv_format": "float32",
             "seed": 0, "kept_fraction": 1 - ratio, "device_bytes": 50, "full_bytes": 100,
             "moved_bytes": 0, "prefill_s": 1.0, "answer_s_per_token": 0.1}  # fmt: skip
        return {**r, **kw}

    lines = [row("none", 0.0, 1.0), row("snapkv", 0.5, 0.75), row("snapkv", 0.5, 0.5),
             row("recency", 0.5, 0.0), row("none", 0.0, 0.25, kv_format="int4")]  # fmt: skip
    path = tmp_path / "sweep.jsonl"
    path.write_text("\n".join(map(json.dumps, lines)) + "\n")
    ruler_report.main(["--jsonl", str(path)])
    text = (tmp_path / "ruler.md").read_text()
    assert "| snapkv | 50 [" in text  # the later line of a repeated configuration wins
    assert "| recency | 0 [0-49] (n=4) |" in text and "Full KV: 100 [" in text
    assert "| niah_single | none | 0 | agnostic | drop | 16 | int4 | 25 [" in text
    assert (tmp_path / "ruler.png").stat().st_size > 10_000
