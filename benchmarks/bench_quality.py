"""Task accuracy of the trained example model under KV retention: policy x budget x depth.

The model (``examples/longctx_lm``, the committed checkpoint) reads a passkey prompt of
``--length`` tokens with the key at a fixed depth (0/25/50/75/100% of the context), is served
from a paged cache (``examples.longctx_lm.generate.Server``), and after prefill a retention
rule keeps a budget of the prompt's pages on the device (5/10/20/50/100%). The rest is

* ``drop``: never read again: the answer is decoded from the kept pages alone;
* ``demote``: copied to pinned host memory and fetched back into a cold pool that the decode
  reads (``offload.mixed_residency_attention``): exact, at the cost of the bytes moved.

Per cell we report exact-match accuracy (all 8 digits) over ``--samples`` fresh samples, and
the attention mass kept: the fraction of the observation window's attention (the last ``W``
prompt queries, every head and layer) on the kept pages. The rules are the six
``offload.RetentionPolicy`` kinds (1 sink page for streaming/H2O/Scissorhands, a recent window
of one page for the scored kinds, SnapKV pooled over 3 pages and ranked by the max over heads),
``knorm``, a rule that reads the keys alone (:func:`knorm_select`), and, at 100%, every page.
Any function ``PromptView -> keep [B, M]`` plugs in the same way (:func:`evaluate_rule`):
another policy, an oracle, or a KV format's own selection.

Run from the repository root: ``python -m benchmarks.bench_quality [--quick] [--samples N]``
(about 15 minutes on 2 CPU cores at 1,024 tokens; ``--quick``: 4 samples, 2 depths, 2
budgets). Writes ``benchmarks/results/quality.md`` and ``quality.png`` (``--quick``: under
``benchmarks/results/quick/``).
"""

import time

import numpy as np

from benchmarks import _common

BUDGETS = (0.05, 0.10, 0.20, 0.50, 1.0)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
POLICIES = ("recency", "streaming", "h2o", "snapkv", "tova", "scissorhands")
KINDS = (*POLICIES, "knorm")
WINDOW = 16
PAGE = 16


def make_policy(kind: str, budget: float):
    import offload

    extra = {
        "recency": {},
        "streaming": {"sink": 1},
        "h2o": {"sink": 1, "recent": 1},
        "snapkv": {"recent": 1, "pool_size": 3, "head_reduce": "max"},
        "tova": {"recent": 1},
        "scissorhands": {"sink": 1, "recent": 1},
    }[kind]
    return offload.RetentionPolicy(kind, budget, page_size=PAGE, **extra)


def knorm_select(budget: float):
    """A rule that looks at the keys alone (``(k, v) -> kept``, after kvpress' KnormPress):
    keep the pages whose keys have the smallest mean L2 norm (low-norm keys draw attention),
    plus 1 sink and 1 recent page, through ``offload.select_keep`` with those scores."""
    import jax.numpy as jnp

    import offload

    policy = offload.RetentionPolicy("h2o", budget, page_size=PAGE, sink=1, recent=1)

    def select(view):
        k = view.k_pages[:, :, view.page_table]  # [L, K, B, M, C, H]
        norms = jnp.linalg.norm(k, axis=-1).mean(axis=(0, 1, 4))  # [B, M]
        state = offload.PolicyState(-norms)
        return offload.select_keep(
            state, view.lengths, policy=policy, page_table=view.page_table
        ).keep

    return select


def make_rule(kind: str, budget: float):
    """The ``PromptView -> keep`` function of a rule name."""
    from examples.longctx_lm import generate

    if kind == "knorm":
        return knorm_select(budget)
    return generate.policy_select(make_policy(kind, budget))


def passkey_prompts(length: int, depth: float, samples: int, seed: int):
    """``(prompts [n, length - m], answers [n, m])``: everything up to the question's marker,
    and the key's ``m`` digits."""
    from examples.longctx_lm import data

    cfg = data.TaskConfig("passkey", length=length + 1, depth=depth)
    tokens = data.make_batch(cfg, samples, seed).tokens
    m = cfg.key_len
    return tokens[:, :-m], tokens[:, -m:]


def evaluate_rule(model, select, mode: str, prompts, answers, *, batch: int, kv_format=None):
    """Accuracy, mean attention mass kept and bytes moved per sample of one rule.

    ``select`` is any ``PromptView -> keep [B, M]`` function (``generate.policy_select(p)``);
    ``kv_format`` a ``paged.KVFormat`` for quantized pages (None: float32).
    """
    from examples.longctx_lm import generate

    kept_mass = []

    def observed(view):
        keep = np.asarray(select(view), bool)
        mass = np.asarray(view.window_mass).sum(axis=(0, 2))  # [B, M]
        total = mass.sum(1)
        ok = total > 0
        kept_mass.extend(((mass * keep).sum(1)[ok] / total[ok]).tolist())
        return keep

    L = prompts.shape[1]
    server = generate.Server(
        model, num_pages=batch * (-(-(L + 64) // PAGE) + 4) + 8, page_size=PAGE,
        max_len=L + 32, batch=batch, chunk=256, kv_format=kv_format,
    )  # fmt: skip
    retention = generate.Retention(observed, mode=mode, window=WINDOW)
    right, moved = 0, 0
    for start in range(0, len(prompts), batch):
        rows = prompts[start : start + batch]
        out = server.generate(list(rows), answers.shape[1], retention=retention)
        right += sum(int((o == a).all()) for o, a in zip(out, answers[start:], strict=False))
        moved += server.last_info.moved_bytes
    n = len(prompts)
    return right / n, float(np.mean(kept_mass)), moved / n


def plot(path, results, budgets, depths):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in KINDS if (k, budgets[0], depths[0], "drop") in results]
    fig, axes = plt.subplots(1, 1 + len(kinds), figsize=(4 + 2.6 * len(kinds), 3.6))
    ax = axes[0]
    for kind in kinds:
        acc = [np.mean([results[kind, b, d, "drop"][0] for d in depths]) for b in budgets]
        ax.plot([100 * b for b in budgets], [100 * a for a in acc], marker="o", label=kind)
    demote = [
        np.mean([results[k, b, d, "demote"][0] for k in kinds for d in depths]) for b in budgets
    ]
    ax.plot([100 * b for b in budgets], [100 * a for a in demote], "k--", label="any, demote")
    ax.set_xscale("log")
    ax.set_xticks([100 * b for b in budgets], [f"{100 * b:g}" for b in budgets])
    ax.set_xlabel("KV budget (% of prompt pages on device)")
    ax.set_ylabel("passkey exact match (%)")
    ax.set_title("drop: accuracy vs budget")
    ax.legend(fontsize=7)
    for ax, kind in zip(axes[1:], kinds, strict=True):
        grid = np.array([[100 * results[kind, b, d, "drop"][0] for b in budgets] for d in depths])
        ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto", origin="lower")
        for i in range(len(depths)):
            for j in range(len(budgets)):
                ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=7,
                        color="w" if grid[i, j] < 60 else "k")  # fmt: skip
        ax.set_xticks(range(len(budgets)), [f"{100 * b:g}" for b in budgets])
        ax.set_yticks(range(len(depths)), [f"{100 * d:g}" for d in depths])
        ax.set_xlabel("budget %")
        ax.set_ylabel("needle depth %")
        ax.set_title(f"{kind} (drop)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def policy_table(results, budgets, depths, mode, cell):
    """Markdown rows: one per policy kind, one column per budget, ``cell(acc, mass, bytes)`` of
    the means over depths."""
    rows = [
        "| rule | " + " | ".join(f"{100 * b:g}%" for b in budgets) + " |",
        "|---|" + "---|" * len(budgets),
    ]
    for kind in KINDS:
        means = [np.mean([results[kind, b, d, mode] for d in depths], axis=0) for b in budgets]
        rows.append(f"| {kind} | " + " | ".join(cell(*m) for m in means) + " |")
    return rows


FORMAT_CELLS = (("h2o", 1.0), ("h2o", 0.2), ("h2o", 0.5), ("snapkv", 0.2), ("snapkv", 0.5))


def _kv_format(name: str, head_dim: int):
    """``paged.KVFormat(name)``; int4 takes groups of ``min(32, H)`` (the model's H is 16);
    ``kivi2-rR`` is kivi2 with a full-precision window of ``R`` tokens (``residual=R``)."""
    import paged

    if name == "int4":
        return paged.KVFormat(name, group_size=min(32, head_dim))
    if name.startswith("kivi2-r"):
        return paged.KVFormat("kivi2", residual=int(name[len("kivi2-r") :]))
    return paged.KVFormat(name)


def format_table(model, formats, results, depths, samples, length, batch):
    """Accuracy per KV format (float32 from ``results``) at full budget and with two policies
    at 20% / 50% (drop), over the same prompts."""

    head = "| pages | full | " + " | ".join(f"{k} {100 * b:g}%" for k, b in FORMAT_CELLS[1:])
    lines = [
        "### KV formats: accuracy % (drop), mean over depths",
        "",
        head + " |",
        "|---|" + "---|" * len(FORMAT_CELLS),
    ]
    rows = {}
    for name in ["float32", *formats]:
        fmt = None if name == "float32" else _kv_format(name, model.cfg.head_dim)
        accs = []
        for kind, budget in FORMAT_CELLS:
            per_depth = []
            for d_i, depth in enumerate(depths):
                if fmt is None and (kind, budget, depth, "drop") in results:
                    per_depth.append(results[kind, budget, depth, "drop"][0])
                    continue
                prompts, answers = passkey_prompts(length, depth, samples, seed=2024 + d_i)
                select = make_rule(kind, budget)
                per_depth.append(evaluate_rule(model, select, "drop", prompts, answers, batch=batch, kv_format=fmt)[0])  # fmt: skip
            accs.append(np.mean(per_depth))
        rows[name] = accs
        print(name, accs, flush=True)
    for name, accs in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{100 * a:.1f}" for a in accs) + " |")
    return [*lines, "", "(full = every page kept; the same prompts as above.)"]


def main(argv=None):
    parser = _common.make_parser(__doc__)
    parser.add_argument("--length", type=int, default=1024, help="prompt context in tokens")
    parser.add_argument("--samples", type=int, default=16, help="samples per cell")
    parser.add_argument("--checkpoint", default="examples/longctx_lm/checkpoint")
    parser.add_argument(
        "--formats", default="int8,fp8,int4,kivi2,kivi2-r32,kivi2-r128",
        help="quantized KV formats to add (comma-separated paged.KVFormat kinds, kivi2-rR for "
        "a kivi2 window of R tokens; '' for none)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    run = _common.start_run("bench_quality", args, cpu_devices=1, argv=argv)
    from examples.longctx_lm import train

    budgets = (0.1, 1.0) if args.quick else BUDGETS
    depths = (0.0, 0.5) if args.quick else DEPTHS
    samples = 4 if args.quick else args.samples
    model, meta = train.load_checkpoint(args.checkpoint)
    batch = min(8, samples)
    t0 = time.perf_counter()
    results = {}
    for d_i, depth in enumerate(depths):
        prompts, answers = passkey_prompts(args.length, depth, samples, seed=2024 + d_i)
        for kind in KINDS:
            for budget in budgets:
                select = make_rule(kind, budget)
                for mode in ("drop", "demote"):
                    if budget == 1.0 and mode == "demote":
                        results[kind, budget, depth, mode] = results[kind, budget, depth, "drop"]
                        continue
                    results[kind, budget, depth, mode] = evaluate_rule(
                        model, select, mode, prompts, answers, batch=batch
                    )
                print(kind, budget, depth, results[kind, budget, depth, "drop"], flush=True)
    elapsed = time.perf_counter() - t0
    steps = meta["history"][-1]["step"] if meta.get("history") else "?"
    lines = [
        f"Model: the committed checkpoint (`{args.checkpoint}`, step {steps}); passkey prompts of "
        f"{args.length} tokens (key of 8 digits at the given depth, question at the end), "
        f"{samples} fresh samples per depth (seeds 2024+), greedy decode of the 8 digits from a "
        f"paged cache (pages of {PAGE} tokens). After prefill each rule keeps `budget` of the "
        f"prompt's pages (ceil; the page the decode writes into always stays), observing the "
        f"last W={WINDOW} prompt queries one by one. Cells: exact-match accuracy % over depths "
        "(mean), then attention mass kept % (the observation window's mass on kept pages). "
        "`demote` moves the other pages to pinned host memory and fetches them all back.",
        "",
        "### Drop: accuracy % (mass kept %), mean over depths",
        "",
        *policy_table(
            results,
            budgets,
            depths,
            "drop",
            lambda acc, mass, moved: f"{100 * acc:.0f} ({100 * mass:.0f})",
        ),
    ]
    lines += ["", "### Drop: accuracy % by needle depth (rows) and budget (columns)", ""]
    for kind in KINDS:
        lines += [
            f"**{kind}**",
            "",
            "| depth | " + " | ".join(f"{100 * b:g}%" for b in budgets) + " |",
            "|---|" + "---|" * len(budgets),
        ]
        for d in depths:
            row = [f"{100 * results[kind, b, d, 'drop'][0]:.0f}" for b in budgets]
            lines.append(f"| {100 * d:g}% | " + " | ".join(row) + " |")
        lines.append("")
    lines += [
        "### Demote and fetch back: accuracy % (KiB moved per sample, to host and back)",
        "",
        *policy_table(
            results,
            budgets,
            depths,
            "demote",
            lambda acc, mass, moved: f"{100 * acc:.0f} ({moved / 1024:.0f})",
        ),
    ]
    formats = [f for f in args.formats.split(",") if f]
    if formats:
        lines += ["", *format_table(model, formats, results, depths, samples, args.length, batch)]
    png = run.out.with_suffix(".png")
    plot(png, results, budgets, depths)
    lines += ["", f"![accuracy vs budget]({png.name})", "", f"Total time: {elapsed:.0f} s."]
    run.write("KV retention: passkey accuracy vs budget, policy and depth", lines)


if __name__ == "__main__":
    main()
