"""Quantized KV pages per format: bytes per token, reconstruction and attention error, decode time.

Every ``paged.KVFormat`` kind of ``("int8", "fp8", "int4", "kivi2")`` that constructs (a kind
still raising ``NotImplementedError`` is left out and named in the output; ``--formats``
chooses) is compared with float32 and bfloat16 pools, through the public API only
(``paged.init_paged_cache(..., kv_format=)``, ``paged.write``, ``paged.gather_kv``,
``paged.paged_attention``, ``pool.nbytes``):

1. **Bytes per token** (keys + values, scales included), measured: the ``nbytes`` of the two
   pools of a small cache built with each format, divided by its token slots, layers and kv
   heads (at the page size used everywhere here, ``C = 16``), next to the format's own
   ``2 * KVFormat.bytes_per_token(H)``. Scaled to the worked example of the article
   (``offload.planning.ARTICLE``), Llama-3-70B (80
   layers, 64 query heads, 8 kv heads, ``H = 128``) at 256K tokens (GiB per sequence; also the
   article's variant that counts all 64 heads as kv heads) and to the example model of
   ``examples/longctx_lm`` (config of the committed checkpoint). Targets (issue 11, against
   bf16, scales included): int8 <= 0.53x, int4 <= 0.28x, 2-bit (kivi2) <= 0.16x.
2. **Reconstruction error** of K and V written through a cache of each format and read back
   with ``gather_kv``: random normal KV, random KV whose keys have 1% of their channels (per
   kv head, at least one) scaled by 20 (the outlier channels of real keys), and the trained
   model's own K/V (``examples/longctx_lm/checkpoint``, a passkey prompt from the task
   generator prefilled layer by layer with the model's ``attn.project``). Max abs error and
   relative RMS error (``||x - x'|| / ||x||``); for int8 and fp8 also whether every element is
   within the bound documented in ``ringattn/_formats.py``.
3. **Attention output error** of ``paged_attention`` over each format's pools against the same
   KV in float32 pools: the last ``T = 16`` positions' queries (causal, as 16 decode steps),
   random normal queries for the random KV and the model's own queries for the model KV. Max
   abs error and relative error (``||o - o_32|| / ||o_32||``).
4. **Decode time**: one jitted ``paged_attention`` decode step (one query per sequence), B = 8
   sequences x 32K tokens, page size 16, permuted page table, N = 32 query heads, K = 8 kv
   heads, H = 128 (``bench_paged``'s shape), median (best) of interleaved runs after a warm-up,
   for float32, bf16 and each format, with the ratio to bf16 in the same run. Queries are
   float32 for float32 pools and bf16 otherwise. Target: int8 no slower than bf16.

Run from the repository root::

    python -m benchmarks.bench_kvquant            (full sizes: about 3-5 minutes on 2 cores,
                                                   peak memory about 9 GiB)
    python -m benchmarks.bench_kvquant --quick    (tiny sizes: 20-40 s, mostly compiles)
    python -m benchmarks.bench_kvquant --formats int8,fp8
    python -m benchmarks.bench_kvquant --decode-batch 1 --decode-len 8192   (a smaller step)

Writes ``benchmarks/results/kvquant.md`` (``--quick``: ``benchmarks/results/quick/``).
"""

import dataclasses
import functools
import time
from typing import Any, NamedTuple

import numpy as np

from benchmarks import _common

KINDS = ("int8", "fp8", "int4", "kivi2")
# Issue 11's memory targets: bytes per token including scales, as a fraction of bf16.
TARGETS = {"int8": 0.53, "int4": 0.28, "kivi2": 0.16}
PAGE = 16
QUERIES = 16  # decode queries per sequence in the attention-error section
CHECKPOINT = "examples/longctx_lm/checkpoint"
GiB = _common.GiB


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A model's KV geometry: layers, query heads, kv heads, head dim."""

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int


LLAMA_70B = ModelShape("Llama-3-70B (8 KV heads, GQA)", 80, 64, 8, 128)
LLAMA_70B_MHA = ModelShape("Llama-3-70B as the article counts it (64 KV heads)", 80, 64, 64, 128)
LLAMA_TOKENS = 256 * 1024
MODEL_TOKENS = 32 * 1024  # the example model's row: one sequence of bench_decode's 32K


class Sizes(NamedTuple):
    """Problem sizes of one run (full or ``--quick``)."""

    error_layers: int  # random KV: layers
    error_batch: int  # random KV: sequences
    error_len: int  # random KV: tokens per sequence
    error_heads: int  # random KV: query heads N
    error_kv_heads: int  # random KV: kv heads K
    error_head_dim: int  # random KV: H
    model_batch: int  # model KV: prompts
    model_len: int  # model KV: tokens per prompt
    decode_batch: int
    decode_len: int
    decode_heads: int
    decode_kv_heads: int
    decode_head_dim: int
    repeats: int


FULL = Sizes(1, 4, 4096, 32, 8, 128, 4, 1024, 8, 32768, 32, 8, 128, 7)
# Quick: the random cases take the model's shape (L=2, N=8, K=2, H=16 at 2 x 128 tokens), so
# one compile of each path serves all three cases.
QUICK = Sizes(2, 2, 128, 8, 2, 16, 2, 128, 2, 128, 8, 2, 16, 2)


# ------------------------------------------------------------------------------------------
# Pools of each storage
# ------------------------------------------------------------------------------------------
def available_kinds(kinds=KINDS) -> tuple[list[str], dict[str, str]]:
    """``(usable, skipped)``: the kinds whose ``paged.KVFormat`` constructs, and kind -> why not."""
    import paged

    usable, skipped = [], {}
    for kind in kinds:
        try:
            paged.KVFormat(kind)
        except NotImplementedError as e:
            skipped[kind] = str(e)
        else:
            usable.append(kind)
    return usable, skipped


def storage(name: str, head_dim: int) -> tuple[Any, Any]:
    """``(dtype, kv_format)`` for ``init_paged_cache``: ``"float32"``, ``"bf16"`` or a kind.

    int4 uses its default group of 32 values along ``H``, or one group of ``H`` when the head
    dim is smaller (the tiny shapes of the tests)."""
    import jax.numpy as jnp

    import paged

    if name == "float32":
        return jnp.float32, None
    if name == "bf16":
        return jnp.bfloat16, None
    if name == "int4" and 0 < head_dim < 32:
        return jnp.float32, paged.KVFormat(name, group_size=head_dim)
    return jnp.float32, paged.KVFormat(name)


def make_cache(name: str, k: np.ndarray, v: np.ndarray, *, page_size: int = PAGE, seed: int = 0):
    """``(cache, table, lengths)``: ``k, v [L, B, S, K, H]`` written with ``paged.write`` into
    a cache of storage ``name`` over a randomly permuted page table (``B * M`` pages + null)."""
    import jax.numpy as jnp

    import paged

    L, B, S, K, H = k.shape
    M = -(-S // page_size)
    rng = np.random.default_rng(seed)
    table = (rng.permutation(B * M) + 1).astype(np.int32).reshape(B, M)
    dtype, kv_format = storage(name, H)
    cache = paged.init_paged_cache(
        L, K, B * M + 1, page_size, H, batch=B, max_pages_per_seq=M, dtype=dtype,
        kv_format=kv_format,
    )  # fmt: skip
    cache = paged.with_page_table(cache, table, np.zeros(B, np.int32))
    cache = paged.write(cache, jnp.asarray(k), jnp.asarray(v), 0)
    return cache, table, np.full(B, S, np.int32)


def read_back(cache, S: int) -> tuple[np.ndarray, np.ndarray]:
    """The cache's decoded ``k, v [L, B, S, K, H]`` float32 (``paged.gather_kv``)."""
    import paged

    ks, vs = [], []
    for layer in range(cache.k_pages.shape[0]):
        k, v = paged.gather_kv(cache, layer)
        ks.append(np.asarray(k, np.float32)[:, :S])
        vs.append(np.asarray(v, np.float32)[:, :S])
    return np.stack(ks), np.stack(vs)


# ------------------------------------------------------------------------------------------
# 1. Bytes per token
# ------------------------------------------------------------------------------------------
def measured_bytes(name: str, head_dim: int, *, page_size: int = PAGE) -> float:
    """Bytes one token takes per layer and kv head, keys + values, scales included: the
    ``nbytes`` of both pools of a 2-layer, 2-kv-head, 4-page cache over its token slots."""
    import paged

    L, K, P = 2, 2, 4
    dtype, kv_format = storage(name, head_dim)
    cache = paged.init_paged_cache(
        L, K, P, page_size, head_dim, batch=1, max_pages_per_seq=1, dtype=dtype,
        kv_format=kv_format,
    )  # fmt: skip
    return (cache.k_pages.nbytes + cache.v_pages.nbytes) / (L * K * P * page_size)


def formula_bytes(name: str, head_dim: int, *, page_size: int = PAGE) -> float:
    """The same from the format's own formula: ``2 * H * itemsize`` for float pools,
    ``2 * KVFormat.bytes_per_token(H)`` for a quantized one (kivi2: at ``page_size``)."""
    import jax.numpy as jnp

    dtype, kv_format = storage(name, head_dim)
    if kv_format is None:
        return 2 * head_dim * jnp.dtype(dtype).itemsize
    if kv_format.kind == "kivi2":
        return 2 * kv_format.bytes_per_token(head_dim, page_size=page_size)
    return 2 * kv_format.bytes_per_token(head_dim)


# kivi2's key statistics are per page: its bytes also shown at a larger page size.
KIVI_BIG_PAGE = 64


def bytes_rows(names, shape: ModelShape, tokens: int) -> dict[str, dict[str, float]]:
    """name -> ``{"per_token", "formula_per_token", "sequence", "vs_bf16", "vs_float32"}`` for
    ``shape`` (all layers and kv heads) and a sequence of ``tokens`` tokens; a string saying
    why for a format that cannot store this head dim."""
    per_head, pages = {}, {}
    entries = [(n, n, PAGE) for n in ["float32", "bf16", *names]]
    if "kivi2" in names:
        entries.append((f"kivi2 (C={KIVI_BIG_PAGE})", "kivi2", KIVI_BIG_PAGE))
    for label, n, C in entries:
        pages[label] = (n, C)
        try:
            per_head[label] = measured_bytes(n, shape.head_dim, page_size=C)
        except (ValueError, NotImplementedError) as e:  # a format that rejects this H
            per_head[label] = e
    scale = shape.layers * shape.kv_heads
    rows = {}
    for label, b in per_head.items():
        n, C = pages[label]
        if isinstance(b, Exception):
            rows[label] = f"n/a ({b})"
            continue
        rows[label] = {
            "per_token": b * scale,
            "formula_per_token": formula_bytes(n, shape.head_dim, page_size=C) * scale,
            "sequence": b * scale * tokens,
            "vs_bf16": b / per_head["bf16"],
            "vs_float32": b / per_head["float32"],
        }
    return rows


def size_text(nbytes: float) -> str:
    if nbytes >= GiB:
        return f"{nbytes / GiB:,.2f} GiB"
    if nbytes >= _common.MiB:
        return f"{nbytes / _common.MiB:,.2f} MiB"
    return f"{nbytes / 1024:,.2f} KiB"


def target_cell(name: str, vs_bf16: float) -> str:
    name = name.split(" ")[0]  # "kivi2 (C=64)" -> kivi2's target
    if name not in TARGETS:
        return "-"
    met = vs_bf16 <= TARGETS[name]
    return f"<= {TARGETS[name]:.2f}x: {'met' if met else '**missed**'}"


def bytes_section(names, model_shape: ModelShape, model_tokens: int) -> list[str]:
    lines = [
        "## 1. Bytes per token (keys + values, all layers, scales included)",
        "",
        "Measured: `(k_pages.nbytes + v_pages.nbytes)` of a small cache of each format (2 "
        f"layers, 2 kv heads, 4 pages of C={PAGE}) over its token slots, layers and kv heads, "
        "then times the model's layers x kv heads; `formula` is `2 * H * itemsize` (float "
        "pools) or `2 * KVFormat.bytes_per_token(H)`.",
        "",
    ]
    shapes = [
        (LLAMA_70B, LLAMA_TOKENS),
        (LLAMA_70B_MHA, LLAMA_TOKENS),
        (model_shape, model_tokens),
    ]
    for shape, tokens in shapes:
        rows = bytes_rows(names, shape, tokens)
        lines += [
            f"**{shape.name}**: L={shape.layers}, N={shape.heads}, K={shape.kv_heads}, "
            f"H={shape.head_dim}; one sequence of {tokens:,} tokens.",
            "",
            "| pages | bytes / token (measured) | formula | per sequence | vs bf16 | vs float32 "
            "| target (vs bf16) |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for n, r in rows.items():
            if isinstance(r, str):
                lines.append(f"| {n} | {r} | | | | | |")
                continue
            lines.append(
                f"| {n} | {r['per_token']:,.0f} | {r['formula_per_token']:,.0f} "
                f"| {size_text(r['sequence'])} | {r['vs_bf16']:.3f}x | {r['vs_float32']:.3f}x "
                f"| {target_cell(n, r['vs_bf16'])} |"
            )
        lines.append("")
    lines += [
        "The ratios depend on H only (one float32 scale per token and kv head costs 4 bytes "
        "against `H` stored values): at the example model's H="
        f"{model_shape.head_dim} the scale is a larger share than at H=128, so the targets "
        "(stated for H=128) are judged on the Llama rows.",
        "",
    ]
    return lines


# ------------------------------------------------------------------------------------------
# 2. Reconstruction error, 3. attention error
# ------------------------------------------------------------------------------------------
class Case(NamedTuple):
    """KV to quantize: ``k, v [L, B, S, K, H]`` and decode queries ``q [L, B, T, N, H]``."""

    name: str
    k: np.ndarray
    v: np.ndarray
    q: np.ndarray


def random_case(L, B, S, N, K, H, *, outliers: bool, seed: int = 0) -> Case:
    """Normal KV and queries; ``outliers``: 1% of each kv head's key channels (at least one,
    the same for every token and layer) scaled by 20."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((L, B, S, K, H), dtype=np.float32)
    v = rng.standard_normal((L, B, S, K, H), dtype=np.float32)
    q = rng.standard_normal((L, B, min(QUERIES, S), N, H), dtype=np.float32)
    name = "random normal"
    if outliers:
        n_out = max(1, round(0.01 * H))
        for h in range(K):
            channels = rng.choice(H, n_out, replace=False)
            k[..., h, channels] *= 20.0
        name = f"random, keys with {n_out} outlier channel(s) x20 per kv head"
    return Case(name, k, v, q)


def load_model():
    """``(model, step)``: the committed checkpoint and its last training step."""
    from examples.longctx_lm import train

    model, meta = train.load_checkpoint(CHECKPOINT)
    step = meta["history"][-1]["step"] if meta.get("history") else "?"
    return model, step


def model_shape(model) -> ModelShape:
    cfg = model.cfg
    name = f"the example model (`{CHECKPOINT}`)"
    return ModelShape(name, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)


def passkey_prompts(batch: int, length: int, seed: int = 7) -> np.ndarray:
    """``[batch, length]``: passkey samples from the task generator, cut right after the
    question's marker (the next token would be the key's first digit)."""
    from examples.longctx_lm import data

    cfg = data.TaskConfig("passkey", length=length + 8, key_len=8)
    return np.asarray(data.make_batch(cfg, batch, seed).tokens[:, :length])


def capture_qkv(model, tokens: np.ndarray):
    """The model's ``q [L, B, S, N, H]``, ``k, v [L, B, S, K, H]`` over ``tokens [B, S]``
    (positions 0.., each layer's ``attn.project`` after its norm, as ``generate`` writes them
    to the cache; attention by ``attention.blockwise()``)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from examples.longctx_lm.attention import blockwise
    from examples.longctx_lm.model import previous_tokens

    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens):
        model = nnx.merge(graphdef, state)
        B, S = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        attend = blockwise()
        x = model.embed_inputs(tokens, previous_tokens(tokens))
        qs, ks, vs = [], [], []
        for block in model.blocks:
            q, k, v = block.attn.project(block.attn_norm(x), positions)
            qs.append(q)
            ks.append(k)
            vs.append(v)
            x = x + block.attn.output(attend(q, k, v, positions))
            x = x + block.mlp(block.mlp_norm(x))
        return jnp.stack(qs), jnp.stack(ks), jnp.stack(vs)

    q, k, v = run(state, jnp.asarray(tokens, jnp.int32))
    return np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(v, np.float32)


def model_case(model, batch: int, length: int, *, label: str = "trained model") -> Case:
    """The model's K/V over ``batch`` passkey prompts of ``length`` tokens, and its queries
    at the last ``T = 16`` positions."""
    q, k, v = capture_qkv(model, passkey_prompts(batch, length))
    T = min(QUERIES, length)
    name = f"{label}, {batch} passkey prompt(s) of {length} tokens"
    return Case(name, k, v, q[:, :, -T:])


# Element-wise bounds documented in ringattn/_formats.py (x: values, absmax: the token's
# max |x| over H), plus float32 rounding of the scale and the product.
def _int8_bound(x, absmax):
    return absmax / 254


def _fp8_bound(x, absmax):
    return np.abs(x) / 16 + absmax / 448 * 2.0**-10


def _int4_bound(x, absmax):  # absmax: the group's (see within_bound)
    return absmax / 14 * (1 + 2.0**-8)


BOUNDS = {"int8": _int8_bound, "fp8": _fp8_bound, "int4": _int4_bound, "kivi2": None}


def _kivi2_in_bound(x: np.ndarray, y: np.ndarray, role: str) -> bool:
    """paged/_kivi.py's bound ``(max - min) / 6 + (|min| + |max|) * 2**-8`` over each group
    (keys: a channel over a page of ``PAGE`` tokens; values: a token over ``H``) for the
    stored pages; the open page (``S % PAGE`` last tokens, the residual) exactly."""
    L, B, S, K, H = x.shape
    n = S // PAGE * PAGE
    if n:
        xs = x[:, :, :n].astype(np.float64)
        if role == "keys":
            g = xs.reshape(L, B, n // PAGE, PAGE, K, H)
            lo, hi = g.min(axis=3, keepdims=True), g.max(axis=3, keepdims=True)
            lo, hi = (np.broadcast_to(a, g.shape).reshape(xs.shape) for a in (lo, hi))
        else:
            lo, hi = xs.min(axis=-1, keepdims=True), xs.max(axis=-1, keepdims=True)
        bound = (hi - lo) / 6 + (np.abs(lo) + np.abs(hi)) * 2.0**-8
        bound = bound + 1e-6 * np.maximum(np.abs(lo), np.abs(hi)) + 1e-30
        if not np.all(np.abs(xs - y[:, :, :n]) <= bound):
            return False
    return bool(np.array_equal(x[:, :, n:], y[:, :, n:]))


def within_bound(kind: str, x: np.ndarray, y: np.ndarray, role: str = "keys") -> bool | None:
    """Whether every ``|x - y|`` is within ``kind``'s documented bound (None: none documented);
    ``x, y [L, B, S, K, H]``, ``role`` ``"keys"`` or ``"values"`` (kivi2 differs)."""
    if kind not in BOUNDS:
        return None
    if kind == "kivi2":
        return _kivi2_in_bound(x, y, role)
    absmax = np.abs(x).max(axis=-1, keepdims=True)
    if kind == "int4":  # per group of storage()'s group size along H
        _, kv_format = storage(kind, x.shape[-1])
        g = kv_format.group_size
        groups = np.abs(x).reshape(*x.shape[:-1], x.shape[-1] // g, g)
        absmax = np.repeat(groups.max(axis=-1), g, axis=-1)
    bound = BOUNDS[kind](x, absmax) + 1e-6 * absmax + 1e-30
    return bool(np.all(np.abs(x - y) <= bound))


class Errors(NamedTuple):
    max_abs: float
    rel: float  # ||x - y|| / ||x||


def errors(x: np.ndarray, y: np.ndarray) -> Errors:
    x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
    diff = np.abs(x64 - y64)
    norm = np.sqrt(np.sum(x64**2))
    return Errors(float(diff.max()), float(np.sqrt(np.sum(diff**2)) / max(norm, 1e-300)))


class CaseResult(NamedTuple):
    """One storage on one case."""

    k: Errors
    v: Errors
    k_in_bound: bool | None
    v_in_bound: bool | None
    out: Errors  # paged_attention output vs float32 pools


def attention_out(cache, table, lengths, q: np.ndarray) -> np.ndarray:
    """``paged_attention`` of ``q [L, B, T, N, H]`` over every layer, ``[L, B, T, N, H]``
    float32 (queries cast to bf16 for bf16 pools)."""
    import jax.numpy as jnp

    import paged

    dtype = jnp.bfloat16 if cache.k_pages.dtype == jnp.bfloat16 else jnp.float32
    outs = []
    for layer in range(q.shape[0]):
        res = paged.paged_attention(
            jnp.asarray(q[layer], dtype), cache.k_pages[layer], cache.v_pages[layer], table,
            lengths,
        )  # fmt: skip
        outs.append(np.asarray(res.out, np.float32))
    return np.stack(outs)


def evaluate_case(case: Case, names) -> dict[str, CaseResult]:
    """name -> :class:`CaseResult` for ``"bf16"`` and each kind (float32 is the reference), or
    a string saying why not for a format that rejects the case's shape."""
    S = case.k.shape[2]
    ref_cache, table, lengths = make_cache("float32", case.k, case.v)
    ref_out = attention_out(ref_cache, table, lengths, case.q)
    results = {}
    for name in ["bf16", *names]:
        try:
            cache, table, lengths = make_cache(name, case.k, case.v)
        except (ValueError, NotImplementedError) as e:  # a format that rejects this shape
            results[name] = f"n/a ({e})"
            continue
        k, v = read_back(cache, S)
        out = attention_out(cache, table, lengths, case.q)
        results[name] = CaseResult(
            errors(case.k, k),
            errors(case.v, v),
            within_bound(name, case.k, k, "keys"),
            within_bound(name, case.v, v, "values"),
            errors(ref_out, out),
        )
    return results


def _bound_text(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "**no**")


def error_sections(cases, results) -> list[str]:
    lines = [
        "## 2. Reconstruction error (written with `paged.write`, read with `paged.gather_kv`)",
        "",
        "rel = `||x - x'|| / ||x||` over the whole tensor; in bound: every element within the "
        "bound documented in `ringattn/_formats.py` (int8 `absmax / 254`, fp8 `|x| / 16 + "
        "absmax / 448 * 2**-10`, int4 `group_absmax / 14 * (1 + 2**-8)`; kivi2, in "
        "`paged/_kivi.py`, `(max - min) / 6 + (|min| + |max|) * 2**-8` per key channel over "
        "a page / per value token, the residual page exact; `-`: no bound documented).",
        "",
    ]
    for case in cases:
        L, B, S, K, H = case.k.shape
        lines += [
            f"**{case.name}**: L={L}, B={B}, S={S}, K={K}, H={H}.",
            "",
            "| pages | K max abs | K rel | V max abs | V rel | K, V in bound |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for name, r in results[case.name].items():
            if isinstance(r, str):
                lines.append(f"| {name} | {r} | | | | |")
                continue
            lines.append(
                f"| {name} | {r.k.max_abs:.3g} | {r.k.rel:.2e} | {r.v.max_abs:.3g} "
                f"| {r.v.rel:.2e} | {_bound_text(r.k_in_bound)}, {_bound_text(r.v_in_bound)} |"
            )
        lines.append("")
    lines += [
        "## 3. Attention output error vs float32 pools (`paged.paged_attention`)",
        "",
        f"Queries: the last T={QUERIES} positions of each sequence (causal, like {QUERIES} "
        "decode steps); random normal for the random KV, the model's own (after RoPE) for the "
        "model KV. bf16 pools take bf16 queries; quantized pools float32 ones. rel = "
        "`||o - o_32|| / ||o_32||`.",
        "",
        "| KV | pages | out max abs | out rel |",
        "|---|---|---:|---:|",
    ]
    for case in cases:
        for name, r in results[case.name].items():
            if isinstance(r, str):
                lines.append(f"| {case.name} | {name} | {r} | |")
                continue
            lines.append(f"| {case.name} | {name} | {r.out.max_abs:.3g} | {r.out.rel:.2e} |")
    return [*lines, ""]


# ------------------------------------------------------------------------------------------
# 4. Decode time
# ------------------------------------------------------------------------------------------
def decode_timing(names, B, S, N, K, H, repeats, *, seed: int = 0):
    """name -> (:class:`_common.Timing`, KV bytes read per step) for ``["float32", "bf16",
    *names]``: one jitted ``paged_attention`` decode step over ``B x S`` tokens (a string
    saying why not for a format that rejects the shape)."""
    import jax
    import jax.numpy as jnp

    import paged

    rng = np.random.default_rng(seed)
    # One device copy of the source KV serves every format's write (not one copy per write).
    k = jnp.asarray(rng.standard_normal((1, B, S, K, H), dtype=np.float32))
    v = jnp.asarray(rng.standard_normal((1, B, S, K, H), dtype=np.float32))
    q = rng.standard_normal((B, 1, N, H), dtype=np.float32)
    step = jax.jit(paged.paged_attention)
    fns, nbytes, skipped = {}, {}, {}
    for name in ["float32", "bf16", *names]:
        try:
            cache, table, lengths = make_cache(name, k, v, seed=seed)
        except (ValueError, NotImplementedError) as e:  # a format that rejects this shape
            skipped[name] = f"n/a ({e})"
            continue
        kp, vp = cache.k_pages[0], cache.v_pages[0]
        del cache
        jax.block_until_ready((kp, vp))
        qn = jnp.asarray(q, jnp.float32 if name == "float32" else jnp.bfloat16)
        table, lengths = jnp.asarray(table), jnp.asarray(lengths)
        fns[name] = functools.partial(step, qn, kp, vp, table, lengths)
        nbytes[name] = kp.nbytes + vp.nbytes
    del k, v
    timing = _common.time_interleaved(fns, repeats=repeats)
    return {name: (timing[name], nbytes[name]) for name in fns} | skipped


def decode_section(timing, B, S, N, K, H, repeats) -> list[str]:
    base = timing["bf16"][0].median
    lines = [
        "## 4. Decode time: one `paged_attention` step",
        "",
        f"B={B} sequences x S={S:,} tokens, N={N} query heads, K={K} kv heads, H={H}, page "
        f"size {PAGE}, permuted page table, jitted `paged.paged_attention` (default "
        "`pages_per_block`), one query token per sequence (float32 for float32 pools, bf16 "
        f"otherwise). Median (best) of {repeats} interleaved runs after a warm-up; vs bf16 = "
        "median / bf16's median, same run (below 1 is faster); GB/s = pool bytes / median.",
        "",
        "| pages | pool bytes | median | best | vs bf16 | GB/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, entry in timing.items():
        if isinstance(entry, str):
            lines.append(f"| {name} | {entry} | | | | |")
            continue
        t, nbytes = entry
        lines.append(
            f"| {name} | {size_text(nbytes)} | {_common.ms(t.median)} | {_common.ms(t.best)} "
            f"| {t.median / base:.2f}x | {nbytes / t.median / 1e9:.1f} |"
        )
    lines.append("")
    if isinstance(timing.get("int8"), tuple):
        t8 = timing["int8"][0].median
        verdict = "met" if t8 <= base else "**missed**"
        lines.append(
            f"int8 decode {_common.ms(t8)} vs bf16 {_common.ms(base)} ({t8 / base:.2f}x): "
            f"target int8 <= bf16 {verdict}."
        )
        lines.append("")
    return lines


def plot(path, names, cases, results) -> None:
    """Attention output error (relative, log scale) against bytes per token vs bf16 (H=128,
    the Llama rows) for each format, one series per KV case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_token = bytes_rows(names, LLAMA_70B, LLAMA_TOKENS)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for case in cases:
        xs, ys, labels = [], [], []
        for n in ["bf16", *names]:
            r, b = results[case.name].get(n), per_token.get(n)
            if isinstance(r, CaseResult) and isinstance(b, dict):
                xs.append(b["vs_bf16"])
                ys.append(max(r.out.rel, 1e-9))
                labels.append(n)
        ax.plot(xs, ys, "o-", label=case.name[:40])
        for x, y, n in zip(xs, ys, labels, strict=True):
            ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per token vs bf16 (H=128, scales included)")
    ax.set_ylabel("attention output error vs float32 (relative)")
    ax.set_title("Quantized KV: memory vs attention error")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------
def main(argv=None):
    parser = _common.make_parser(__doc__)
    parser.add_argument(
        "--formats", default=None,
        help=f"comma-separated KVFormat kinds (default: those of {','.join(KINDS)} that exist)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=None, help="decode timing rounds")
    parser.add_argument("--skip-decode", action="store_true", help="sections 1-3 only")
    parser.add_argument("--decode-batch", type=int, default=None, help="section 4's B")
    parser.add_argument("--decode-len", type=int, default=None, help="section 4's S")
    args = parser.parse_args(argv)
    run = _common.start_run("bench_kvquant", args, cpu_devices=1, argv=argv)
    sizes = QUICK if args.quick else FULL
    sizes = sizes._replace(
        decode_batch=args.decode_batch or sizes.decode_batch,
        decode_len=args.decode_len or sizes.decode_len,
    )
    repeats = args.repeats or sizes.repeats

    if args.formats is None:
        names, skipped = available_kinds()
    else:
        names = [f for f in args.formats.split(",") if f]
        names, skipped = available_kinds(names)
    t0 = time.perf_counter()
    model, step = load_model()
    shape = model_shape(model)
    lines = [
        f"Formats: {', '.join(names) or 'none'}"
        + ("; not measured (not implemented yet): " + ", ".join(sorted(skipped)) if skipped else "")
        + ". Baselines: float32 and bf16 pools. One CPU device.",
        "",
        *bytes_section(names, shape, MODEL_TOKENS),
    ]
    print("\n".join(lines), flush=True)

    s = sizes
    dims = (s.error_layers, s.error_batch, s.error_len, s.error_heads, s.error_kv_heads,
            s.error_head_dim)  # fmt: skip
    cases = [
        random_case(*dims, outliers=False),
        random_case(*dims, outliers=True, seed=1),
        model_case(model, s.model_batch, s.model_len, label=f"trained model (step {step})"),
    ]
    results = {}
    for case in cases:
        results[case.name] = evaluate_case(case, names)
        print(f"  errors: {case.name} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    lines += error_sections(cases, results)
    png = run.out.with_suffix(".png")
    try:
        plot(png, names, cases, results)
        lines += [f"![memory vs attention error]({png.name})", ""]
    except ImportError:  # matplotlib comes with the notebooks extra, not the test one
        lines += ["(figure skipped: matplotlib is not installed)", ""]

    if not args.skip_decode:
        t1 = time.perf_counter()
        dims = (s.decode_batch, s.decode_len, s.decode_heads, s.decode_kv_heads,
                s.decode_head_dim)  # fmt: skip
        timing = decode_timing(names, *dims, repeats)
        lines += decode_section(timing, *dims, repeats)
        print(f"  decode timing: {time.perf_counter() - t1:.0f} s", flush=True)
    lines.append(f"Total benchmark time: {time.perf_counter() - t0:.0f} s.")
    run.write("Quantized KV: bytes, error and decode time per format", lines)


if __name__ == "__main__":
    main()
