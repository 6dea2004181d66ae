"""Serve the example model from a paged KV cache: chunked prefill, then a jitted decode loop.

The path a request takes:

1. ``PageAllocator.admit`` finds the longest cached prefix of the prompt (prefix caching
   across requests that share a system prompt) and allocates pages for the rest.
2. Prefill, in chunks of ``chunk`` tokens per sequence: each layer writes the chunk's K/V into
   the pages (``paged.write_layer``) and attends with ``paged.ragged_paged_attention`` (the
   chunk attends to the cached past and causally to itself). Then ``commit`` publishes the
   prompt's full pages to the prefix cache.
3. Decode: a ``lax.fori_loop`` under ``jax.jit`` emits ``max_new_tokens`` greedy tokens for
   the whole batch; each step takes a fresh page from an on-device free-page stack when a
   sequence crosses a page boundary (``paged.ensure_next_page``), writes the token's K/V and
   attends with ``paged.paged_attention``. No host round trip per token: the allocator
   reserves pages before the loop and ``settle``s after it.

:class:`Server` keeps one allocator and one pool for many calls, so later requests hit the
prefix cache of earlier ones.
"""

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import paged
from examples.longctx_lm.model import Transformer


def _cached_forward(model: Transformer, cache: paged.PagedKVCache, tokens, prev_tokens,
                    positions, attend_layer):  # fmt: skip
    """Runs the model over ``tokens [B, T]`` at ``positions``, writing every layer's K/V into
    ``cache`` first and attending with ``attend_layer(q, cache, layer)``; returns
    ``(logits [B, T, V], cache)``."""
    x = model.embed_inputs(tokens, prev_tokens)
    for layer, block in enumerate(model.blocks):
        q, k, v = block.attn.project(block.attn_norm(x), positions)
        cache = paged.write_layer(cache, layer, k, v, positions[:, 0])
        x = x + block.attn.output(attend_layer(q, cache, layer))
        x = x + block.mlp(block.mlp_norm(x))
    return model.logits(x), cache


def _prefill_chunk(graphdef, state, cache, tokens, prev_tokens, start):
    """One chunk ``[B, T]`` at ``start [B]``: pages written, logits of every position."""
    model = nnx.merge(graphdef, state)
    B, T = tokens.shape
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)
    # Every row attends as if it held T new tokens; a row's padding tokens come after its real
    # ones, so causality keeps them out of the real queries' view.
    lengths = start + T
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T

    def attend(q, cache, layer):
        res = paged.ragged_paged_attention(
            q.reshape(B * T, *q.shape[2:]), cache.k_pages[layer], cache.v_pages[layer],
            cache.page_table, lengths, cu, B,
        )  # fmt: skip
        return res.out.reshape(q.shape)

    return _cached_forward(model, cache, tokens, prev_tokens, positions, attend)


_prefill_chunk_jit = jax.jit(_prefill_chunk, static_argnums=0)


@functools.partial(jax.jit, static_argnums=(0, 6))
def _decode(graphdef, state, cache, stack, token, prev, steps: int):
    """``steps`` greedy tokens for every row; returns ``(tokens [B, steps], cache, stack)``."""
    model = nnx.merge(graphdef, state)
    B = token.shape[0]

    def attend(q, cache, layer):
        # The new token is already written at position lengths: attend over lengths + 1 keys.
        return paged.paged_attention(
            q, cache.k_pages[layer], cache.v_pages[layer], cache.page_table, cache.lengths + 1
        ).out

    def step(i, carry):
        cache, stack, token, prev, out = carry
        cache, stack, ok = paged.ensure_next_page(cache, stack)
        positions = cache.lengths[:, None]
        logits, cache = _cached_forward(model, cache, token[:, None], prev[:, None], positions, attend)  # fmt: skip
        cache = paged.advance(cache, ok.astype(jnp.int32))
        nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        return cache, stack, nxt, token, out.at[:, i].set(nxt)

    out = jnp.zeros((B, steps), jnp.int32)
    cache, stack, _, _, out = jax.lax.fori_loop(0, steps, step, (cache, stack, token, prev, out))
    return out, cache, stack


@dataclasses.dataclass
class Server:
    """One page pool and one allocator for many :meth:`generate` calls (prefix caching).

    Attributes:
      model: the trained model.
      num_pages: pages in the pool (page 0 is the null page).
      page_size: tokens per page ``C``.
      max_len: the longest prompt + generation a row can hold.
      batch: rows per call.
      chunk: prefill tokens per sequence per step.
    """

    model: Transformer
    num_pages: int = 512
    page_size: int = 16
    max_len: int = 4096
    batch: int = 4
    chunk: int = 256

    def __post_init__(self):
        cfg = self.model.cfg
        # Room for one chunk past max_len: a chunk's padding tokens need table slots (null).
        self.max_pages = -(-(self.max_len + self.chunk) // self.page_size)
        self.allocator = paged.PageAllocator(
            self.num_pages, self.page_size, max_pages_per_seq=self.max_pages
        )
        self.cache = paged.init_paged_cache(
            cfg.num_layers, cfg.num_kv_heads, self.num_pages, self.page_size, cfg.head_dim,
            batch=self.batch, max_pages_per_seq=self.max_pages,
        )  # fmt: skip
        self.graphdef, self.state = nnx.split(self.model)
        self._ids = 0

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, salt=None):
        """Greedy continuations of up to ``batch`` prompts; returns a list of int arrays.

        The prompts' pages are committed (later calls sharing a prefix reuse them); every
        page of these requests is freed at the end (committed full pages stay cached).
        """
        if not 1 <= len(prompts) <= self.batch:
            raise ValueError(f"generate: prompts: expected 1..{self.batch}, got {len(prompts)}")
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens: expected >= 1, got {max_new_tokens}")
        prompts = [np.asarray(p, np.int32) for p in prompts]
        for p in prompts:
            if p.ndim != 1 or p.size < 1 or p.size + max_new_tokens > self.max_len:
                raise ValueError(
                    f"generate: prompts: expected 1..{self.max_len - max_new_tokens} tokens each"
                    f", got shape {p.shape}"
                )
        B = self.batch
        seqs = [("req", self._ids + i) for i in range(len(prompts))]
        pad_seqs = [("pad", self._ids + i) for i in range(B - len(prompts))]
        self._ids += B
        admissions = [self.allocator.admit(s, p, salt=salt) for s, p in zip(seqs, prompts, strict=True)]  # fmt: skip
        for s in pad_seqs:
            self.allocator.allocate(s, 1)
        rows = seqs + pad_seqs
        starts = np.array([a.num_cached_tokens for a in admissions] + [0] * len(pad_seqs), np.int32)
        ends = np.array([len(p) for p in prompts] + [1] * len(pad_seqs), np.int32)
        cache = paged.with_page_table(
            self.cache, self.allocator.page_table(rows), jnp.asarray(starts)
        )
        # Prefill everything but each prompt's last token in chunks; the last token starts the
        # decode loop (its logits give the first new token).
        full = np.zeros((B, self.max_len), np.int32)
        for i, p in enumerate(prompts):
            full[i, : len(p)] = p
        prev_full = np.pad(full[:, :-1], ((0, 0), (1, 0)))
        pos = starts.copy()
        last = ends - 1
        while (pos < last).any():
            T = self.chunk
            idx = np.clip(pos[:, None] + np.arange(T), 0, self.max_len - 1)
            tokens = np.take_along_axis(full, idx, 1)
            prev = np.take_along_axis(prev_full, idx, 1)
            _, cache = _prefill_chunk_jit(self.graphdef, self.state, cache, jnp.asarray(tokens), jnp.asarray(prev), jnp.asarray(pos))  # fmt: skip
            pos = np.minimum(pos + T, np.maximum(last, pos))
        cache = paged.with_page_table(cache, cache.page_table, jnp.asarray(last))
        for s, a in zip(seqs, admissions, strict=True):
            self.allocator.commit(s, a.num_tokens - 1)
        # Pages for the generated tokens come from an on-device stack (no host round trips).
        need = sum(
            -(-(e + max_new_tokens) // self.page_size) - -(-e // self.page_size) + 1 for e in ends
        )
        reserve = self.allocator.reserve(need)
        stack = paged.make_free_stack(reserve, capacity=self.num_pages)
        token = jnp.asarray(full[np.arange(B), last])
        prev = jnp.asarray(prev_full[np.arange(B), last])
        out, cache, stack = _decode(self.graphdef, self.state, cache, stack, token, prev, max_new_tokens)  # fmt: skip
        _, unused = paged.taken_pages(stack, len(reserve))
        self.allocator.settle(rows, np.asarray(cache.page_table), np.asarray(cache.lengths), unused=unused)  # fmt: skip
        self.cache = cache
        for s in rows:
            self.allocator.free(s)
        return [np.asarray(out[i]) for i in range(len(prompts))]


def generate_dense(model: Transformer, prompt: Sequence[int], max_new_tokens: int, attend):
    """The oracle: greedy decoding by recomputing the whole sequence every step."""
    tokens = list(prompt)

    @jax.jit
    def next_token(state, x):
        m = nnx.merge(graphdef, state)
        pos = jnp.arange(x.shape[1])[None]
        return jnp.argmax(m(x, pos, attend)[0, -1])

    graphdef, state = nnx.split(model)
    for _ in range(max_new_tokens):
        tokens.append(int(next_token(state, jnp.asarray([tokens], jnp.int32))))
    return np.asarray(tokens[len(prompt) :], np.int32)
