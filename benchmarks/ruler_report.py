"""Tables and figures from ``bench_ruler``'s JSON lines (``--out FILE.jsonl``).

    python -m benchmarks.ruler_report [--jsonl benchmarks/results/ruler/4k/sweep.jsonl]

writes ``ruler.md`` (per task: score per press and ratio removed, with the samples and 95%
intervals; the quantized formats; page sizes; modes) and ``ruler.png`` (score against the
ratio removed per press, averaged over the tasks, as kvpress's leaderboard plots it; and a
task x press heat map at one ratio) beside the JSON lines file. Every row comes from a line
of the file, each line from one ``bench_ruler`` command.
"""

import argparse
import collections
import json
import pathlib

import numpy as np

DEFAULT = pathlib.Path(__file__).resolve().parent / "results" / "ruler" / "4k" / "sweep.jsonl"


def load(path: pathlib.Path) -> list[dict]:
    """The JSON lines, the last of any repeated configuration winning."""
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            key = tuple(r[k] for k in ("task", "length", "press", "ratio", "mode", "residency", "page_size", "kv_format"))  # fmt: skip
            rows[key] = r
    return list(rows.values())


def _is_base(r: dict) -> bool:
    return r["press"] != "retrieval" and r["mode"] == "agnostic" and r["residency"] == "drop" and r["page_size"] == 16 and r["kv_format"] == "float32"  # fmt: skip


def _cell(r: dict) -> str:
    lo, hi = r["ci95"]
    return f"{100 * r['score']:.0f} [{100 * lo:.0f}-{100 * hi:.0f}] (n={r['samples']})"


def tables(rows: list[dict]) -> list[str]:
    lines = []
    base = [r for r in rows if _is_base(r)]
    if not base:
        return lines + retrieval_tables(rows)
    for task in sorted({r["task"] for r in base}):
        sub = [r for r in base if r["task"] == task]
        length = sub[0]["length"]
        ratios = sorted({r["ratio"] for r in sub if r["press"] != "none"})
        full = [r for r in sub if r["press"] == "none"]
        lines += [f"### {task} at {length} tokens (score %, 95% interval, samples)", ""]
        if full:
            lines += [f"Full KV: {_cell(full[0])}.", ""]
        lines += ["| press | " + " | ".join(f"{r:g} removed" for r in ratios) + " |",
                  "|---|" + "---:|" * len(ratios)]  # fmt: skip
        by = {(r["press"], r["ratio"]): r for r in sub}
        for press in sorted({r["press"] for r in sub} - {"none"}):
            cells = [_cell(by[(press, q)]) if (press, q) in by else "-" for q in ratios]
            lines.append(f"| {press} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += cost_table(base)
    lines += retrieval_tables(rows)
    other = [r for r in rows if not _is_base(r) and r["press"] != "retrieval"]
    if other:
        lines += ["### Formats, page sizes, modes and residency", "",
                  "| task | press | ratio | mode | residency | page size | KV format | score | kept | device bytes / full | moved MiB | prefill s | answer s/token |",
                  "|---|---|---:|---|---|---:|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in sorted(other, key=lambda r: (r["task"], r["kv_format"], r["page_size"], r["mode"], r["press"], r["ratio"])):  # fmt: skip
            lines.append(
                f"| {r['task']} | {r['press']} | {r['ratio']:g} | {r['mode']} | {r['residency']} | "
                f"{r['page_size']} | {r['kv_format']} | {_cell(r)} | {r['kept_fraction']:.2f} | "
                f"{r['device_bytes'] / r['full_bytes']:.2f} | {r['moved_bytes'] / 2**20:.0f} | "
                f"{r['prefill_s']:.1f} | {r['answer_s_per_token']:.3f} |"
            )  # fmt: skip
        lines.append("")
    return lines


def cost_table(base: list[dict]) -> list[str]:
    """What each press costs and frees, from the arrays: the device pools' bytes after the
    press against the full pools', the time to first token (the prefill) and per output token
    (the answer, question included), averaged over the tasks of the run."""
    if not base:
        return []
    by = collections.defaultdict(list)
    for r in base:
        by[(r["press"], r["ratio"])].append(r)
    lines = ["### Device memory and time per press (mean over the tasks)", "",
             "Device bytes are the K/V pools the answer read (kept pages, pages still to be "
             "written and padding to a few pool sizes), measured from the arrays; PyramidKV and "
             "Ada-KV pad every (layer, head) to the largest selection, so they can exceed the "
             "full pool. The time to first token is the prefill; the time per output token "
             "includes the question's tokens and one compile per pool size.", "",
             "| press | ratio | pages kept | device bytes / full | MiB on device | prefill s | answer s/token |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for (press, ratio), rs in sorted(by.items()):
        mean = lambda k, rs=rs: float(np.mean([r[k] for r in rs]))
        frac = float(np.mean([r["device_bytes"] / r["full_bytes"] for r in rs]))
        lines.append(
            f"| {press} | {ratio:g} | {mean('kept_fraction'):.2f} | {frac:.2f} | "
            f"{mean('device_bytes') / 2**20:.0f} | {mean('prefill_s'):.1f} | "
            f"{mean('answer_s_per_token'):.3f} |"
        )  # fmt: skip
    lines.append("")
    return lines


STATIC = ("snapkv", "h2o", "streaming")  # beside retrieval, at the same fraction kept


def retrieval_tables(rows: list[dict]) -> list[str]:
    """Query-aware retrieval (every decoded token reads the pages its query selects) per task:
    score against the measured fraction of the KV read per step, beside the static presses
    that keep that fraction of the pages on the device for good."""
    ret = [r for r in rows if r["press"] == "retrieval"]
    if not ret:
        return []
    lines = ["### Query-aware retrieval against static retention (same KV fraction)", "",
             "`--press retrieval --ratio R`: each decoded token reads, in every layer and kv head, "
             "the pages whose key bounds give its query the highest logit upper bound (Quest's "
             "rule); 'read' is the measured fraction of the context's K/V pages read per step "
             "(sink and recent pages included), 'bounds' the per-page key min/max every step "
             "also reads. The static presses keep `1 - ratio` of the pages for good.", "",
             "| task | full KV | fraction of KV read per step | retrieval | read | bounds | dense layers | " + " | ".join(STATIC) + " |",
             "|---|---|---:|---|---:|---:|---:|" + "---|" * len(STATIC)]  # fmt: skip
    base = {(r["task"], r["press"], r["ratio"]): r for r in rows if _is_base(r)}
    for r in sorted(ret, key=lambda r: (r["task"], r["ratio"])):
        full = base.get((r["task"], "none", 0.0))
        static = [_cell(base[(r["task"], p, r["ratio"])]) if (r["task"], p, r["ratio"]) in base else "-" for p in STATIC]  # fmt: skip
        lines.append(
            f"| {r['task']} | {_cell(full) if full else '-'} | {1 - r['ratio']:.2f} | {_cell(r)} | "
            f"{r['read_fraction']:.3f} | {r['bounds_fraction']:.3f} | {r['dense_layers']} | "
            + " | ".join(static) + " |"
        )  # fmt: skip
    lines.append("")
    return lines


def figure(rows: list[dict], path: pathlib.Path, ratio: float = 0.75) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = [r for r in rows if _is_base(r)]
    tasks = sorted({r["task"] for r in base})
    full = {r["task"]: r["score"] for r in base if r["press"] == "none"}
    curves = collections.defaultdict(lambda: collections.defaultdict(list))
    # A point averages the same tasks at every ratio: only ratios every task of the run has.
    ratios = {t: {r["ratio"] for r in base if r["task"] == t and r["press"] != "none"} for t in tasks}  # fmt: skip
    common = set.intersection(*ratios.values()) if ratios else set()
    for r in base:
        if r["press"] != "none" and r["ratio"] in common:
            curves[r["press"]][r["ratio"]].append(r["score"])
    ret = [r for r in rows if r["press"] == "retrieval"]
    fig, axes = plt.subplots(1, 3 if ret else 2, figsize=(18 if ret else 12, 4.5))
    a, b = axes[0], axes[1]
    if full:
        a.axhline(100 * np.mean(list(full.values())), color="k", ls="--", label=f"full KV ({len(full)} tasks)")  # fmt: skip
    for press, pts in sorted(curves.items()):
        xs = sorted(pts)
        label = f"{press} ({len(pts[xs[0]])} tasks)"
        a.plot(xs, [100 * np.mean(pts[x]) for x in xs], marker="o", label=label)
    a.set_xlabel("ratio of the context's KV removed")
    a.set_ylabel("score (%), mean over the tasks each press ran")
    a.set_title("SmolLM2-135M, RULER-style tasks, question-agnostic")
    a.legend(fontsize=8)
    presses = sorted(curves)
    grid = np.full((len(tasks), len(presses)), np.nan)
    by = {(r["task"], r["press"]): r["score"] for r in base if r["ratio"] == ratio}
    for i, t in enumerate(tasks):
        for j, p in enumerate(presses):
            grid[i, j] = 100 * by.get((t, p), np.nan)
    im = b.imshow(grid, vmin=0, vmax=100, cmap="viridis")
    b.set_xticks(range(len(presses)), presses, rotation=45, ha="right")
    b.set_yticks(range(len(tasks)), tasks)
    for i in range(len(tasks)):
        for j in range(len(presses)):
            if not np.isnan(grid[i, j]):
                b.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", color="w", fontsize=8)
    b.set_title(f"score (%) with {ratio:g} of the KV removed")
    fig.colorbar(im, ax=b, fraction=0.03)
    if ret:  # score against the fraction of the KV read per step, per needle task
        c = axes[2]
        for t in sorted({r["task"] for r in ret}):
            pts = sorted((r["read_fraction"], r["score"]) for r in ret if r["task"] == t)
            c.plot([100 * x for x, _ in pts], [100 * y for _, y in pts], marker="o", label=f"retrieval, {t}")  # fmt: skip
            for press, marker in zip(STATIC, "sv^", strict=False):
                st = sorted((1 - r["ratio"], r["score"]) for r in base if r["task"] == t and r["press"] == press)  # fmt: skip
                if st:
                    c.plot([100 * x for x, _ in st], [100 * y for _, y in st], marker=marker, ls=":", alpha=0.7, label=f"{press} (kept), {t}")  # fmt: skip
        c.set_xscale("log")
        c.set_xlabel("% of the context's KV read per decode step (static: kept)")
        c.set_ylabel("score (%)")
        c.set_title("query-aware retrieval vs static retention")
        c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jsonl", type=pathlib.Path, default=DEFAULT)
    args = p.parse_args(argv)
    rows = load(args.jsonl)
    commands = sorted({f"--task {r['task']} --length {r['length']} --seed {r['seed']}" for r in rows})  # fmt: skip
    text = [
        "# RULER-style quality of KV presses on SmolLM2-135M-Instruct",
        "",
        f"From `{args.jsonl.name}` ({len(rows)} configurations), each line written by "
        "`python -m benchmarks.bench_ruler ... --out` (see `bench_ruler --help`); the runs: "
        + "; ".join(f"`{c}`" for c in commands) + ". Tables: `python -m benchmarks.ruler_report`.",
        "",
        "Scores are RULER's (the fraction of expected strings in the greedy answer), in %, with",
        "the 95% Wilson interval over the samples; 'removed' is kvpress's compression ratio.",
        "",
        *tables(rows),
    ]  # fmt: skip
    out = args.jsonl.with_name("ruler.md")
    out.write_text("\n".join(text).rstrip() + "\n")
    figure(rows, args.jsonl.with_name("ruler.png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
