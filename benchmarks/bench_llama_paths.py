"""The real model through every path: the same greedy tokens as transformers, and what
quantized KV pages cost in agreement and logit error.

For each prompt of the committed reference (``tests/examples/data/smollm2_reference.npz``:
transformers' float32 run of SmolLM2-135M on a 104-token story, a 1,026-token passkey and a
1,979-token RULER needle), 64 greedy tokens through the paged serving loop
(``examples.llama.generate``: chunked ragged prefill, jitted paged decode) with float32,
int8, fp8 and int4 pages, against transformers' 64 tokens: tokens equal before the first
difference and in all; and the logit error at the prompt's last position when K and V go
through each format's codec (``paged.quantize_pages(...).dequantize()``) in a dense forward.

    python -m benchmarks.bench_llama_paths [--quick]

Writes ``benchmarks/results/llama_paths.md`` (``--quick``: the story prompt, 16 tokens).
"""

import pathlib

import numpy as np

from benchmarks import _common

REFERENCE = pathlib.Path(__file__).resolve().parents[1] / "tests/examples/data/smollm2_reference.npz"  # fmt: skip
FORMATS = ("float32", "int8", "fp8", "int4")


def codec_attend(fmt):
    """A dense causal ``attend`` whose K and V went through ``fmt``'s codec."""
    import jax.numpy as jnp

    import paged
    import ringattn

    def attend(q, k, v, positions):
        if fmt is not None:
            k, v = (paged.quantize_pages(x, fmt).dequantize().astype(jnp.float32) for x in (k, v))
        pos = ringattn.Positions(positions, positions)
        return ringattn.attention_reference(q, k, v, causal=True, positions=pos).out

    return attend


def main(argv=None):
    args = _common.make_parser(__doc__).parse_args(argv)
    run = _common.start_run("bench_llama_paths", args, argv=argv)
    import jax.numpy as jnp

    import paged
    from examples.llama.generate import generate, load_model

    ref = dict(np.load(REFERENCE))
    model, _ = load_model()
    names = ["story"] if args.quick else [str(n) for n in ref["names"]]
    new = 16 if args.quick else 64
    lines = [
        f"Greedy tokens ({new} per prompt) through the paged serving loop against transformers'; "
        "'first diff' is the index of the first token that differs (= all equal when none).",
        "",
        "| prompt (tokens) | pages | first diff | equal tokens | last-position max abs logit error (dense, codec'd K/V) |",
        "|---|---|---:|---:|---:|",
    ]
    for name in names:
        ids, want = ref[f"{name}/ids"], ref[f"{name}/greedy"][:new]
        x = jnp.asarray(ids, jnp.int32)[None]
        pos = jnp.arange(len(ids))[None]
        base = np.asarray(model(x, pos, codec_attend(None))[0, -1])
        for fmt_name in FORMATS:
            fmt = None if fmt_name == "float32" else paged.KVFormat(fmt_name)
            (got,) = generate(model, [ids], new, kv_format=fmt)
            diff = np.nonzero(got != want)[0]
            first = int(diff[0]) if diff.size else new
            logits = base if fmt is None else np.asarray(model(x, pos, codec_attend(fmt))[0, -1])
            ref_err = np.abs(base - ref[f"{name}/logits"][-1]).max() if fmt is None else None
            err = np.abs(logits - base).max() if fmt is not None else ref_err
            what = "vs transformers" if fmt is None else "vs float32 here"
            lines.append(
                f"| {name} ({len(ids)}) | {fmt_name} | {first} | {int((got == want).sum())}/{new} | "
                f"{err:.2e} ({what}) |"
            )  # fmt: skip
            print(lines[-1], flush=True)
    run.write("SmolLM2-135M through the paged path: float32 and quantized pages", lines)


if __name__ == "__main__":
    main()
