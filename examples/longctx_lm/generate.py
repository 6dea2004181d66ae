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
   reserves the pages the loop will pop (``paged.pages_to_reserve``) before it and
   ``settle``s after it. Batch rows without a request are empty rows (``None`` in the
   allocator's ``page_table`` / ``settle``; inactive in ``ensure_next_page``).

Optionally (``retention=Retention(...)``), between 2 and 3 a retention rule chooses which
prompt pages stay on the device: an ``offload.RetentionPolicy`` (recency, StreamingLLM, H2O,
SnapKV, TOVA, Scissorhands) fed from the prefill's attention (the last ``window`` prompt
queries are prefilled one query per sequence, so each one's page mass is observed), or any
function of a :class:`PromptView`. A page shared by several rows (a prefix-cache hit) stays
for all of them when one keeps it (``offload.keep_shared_pages``). The other pages are
dropped (the decode never reads them) or demoted: copied to pinned host memory with an
``offload.OffloadManager``, fetched back into a staging pool holding just them
(``offload.staging_table``, ``offload.make_staging_pool``) and read there by
``offload.mixed_residency_attention`` (exact). Either way the rows give those pages back to
the allocator (``PageAllocator.release_pages``): the ones nobody else holds are free for the
decode's new tokens.

:class:`Server` keeps one allocator and one pool for many calls, so later requests hit the
prefix cache of earlier ones.

Example (the committed checkpoint, a 20% device budget chosen by SnapKV, the rest demoted)::

    model, _ = train.load_checkpoint("examples/longctx_lm/checkpoint")
    server = Server(model, num_pages=256, max_len=1100, batch=2)
    policy = offload.RetentionPolicy("snapkv", 0.2, page_size=16, recent=1)
    out = server.generate(prompts, 8, retention=Retention(policy, mode="demote"))
    server.last_info  # prompt pages, pages kept on device, bytes moved
"""

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import offload
import paged
from examples.longctx_lm.model import Transformer


def _cached_forward(model: Transformer, cache: paged.PagedKVCache, tokens, prev_tokens,
                    positions, attend_layer, count=None):  # fmt: skip
    """Runs the model over ``tokens [B, T]`` at ``positions``, writing every layer's K/V into
    ``cache`` first (the first ``count [B]`` tokens of each row, all if None) and attending
    with ``attend_layer(q, cache, layer) -> (out, page_mass)``; returns
    ``(logits [B, T, V], cache, masses)`` with ``masses`` the per-layer page masses (a list,
    empty entries None)."""
    x = model.embed_inputs(tokens, prev_tokens)
    masses = []
    for layer, block in enumerate(model.blocks):
        q, k, v = block.attn.project(block.attn_norm(x), positions)
        cache = paged.write_layer(cache, layer, k, v, positions[:, 0], count=count)
        out, mass = attend_layer(q, cache, layer)
        masses.append(mass)
        x = x + block.attn.output(out)
        x = x + block.mlp(block.mlp_norm(x))
    return model.logits(x), cache, masses


def _prefill_chunk(graphdef, state, cache, tokens, prev_tokens, start, n, per_query: bool):
    """One chunk ``tokens [B, T]`` at ``start [B]``, of which row ``b`` holds ``n[b]`` real
    tokens (the rest is padding, written past the row's end and never read).

    The real queries are packed to the front of the flat batch so that
    ``ragged_paged_attention`` sees exactly them: its ``page_mass`` is then the attention of
    real queries only. With ``per_query`` every query is its own (one-token) sequence on its
    row's page table, which gives the mass of each query separately (the observation window
    of the retention policies) at the same result.

    Returns ``(cache, mass)``: ``mass`` is the page mass summed over layers, ``[B, N, M]``
    (summed over the chunk's real queries) or, with ``per_query``, ``[B, T, N, M]``.
    """
    model = nnx.merge(graphdef, state)
    B, T = tokens.shape
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)
    valid = (jnp.arange(T)[None, :] < n[:, None]).reshape(-1)  # [B * T]
    order = jnp.argsort(~valid, stable=True)  # the real queries first, in row order
    inverse = jnp.argsort(order)
    if per_query:
        row, t = order // T, order % T
        table = cache.page_table[row]
        lengths = start[row] + t + 1
        cu = jnp.arange(B * T + 1, dtype=jnp.int32)
        num_seqs = valid.sum()
    else:
        table, lengths = cache.page_table, start + n
        cu = paged.make_cu_q_lens(n)  # rows with no token in this chunk own no query
        num_seqs = B

    def attend(q, cache, layer):
        flat = q.reshape(B * T, *q.shape[2:])[order]
        if per_query:  # each query reads its own row's residual page (kivi2 pools)
            k = paged.select_rows(cache.k_pages[layer], row)
            v = paged.select_rows(cache.v_pages[layer], row)
            res = paged.ragged_paged_attention(
                flat, k, v, table, lengths, cu, num_seqs, return_page_mass=True
            )
        else:
            res = paged.ragged_paged_attention(
                flat, cache.k_pages[layer], cache.v_pages[layer], table, lengths, cu, num_seqs,
                return_page_mass=True,
            )  # fmt: skip
        out = jnp.where(valid[:, None, None], res.out[inverse], 0).reshape(q.shape)
        mass = res.page_mass
        if per_query:
            mass = jnp.where(valid[:, None, None], mass[inverse], 0)
            mass = mass.reshape(B, T, *mass.shape[1:])
        return out, mass

    _, cache, masses = _cached_forward(model, cache, tokens, prev_tokens, positions, attend, n)
    return cache, sum(masses)


_prefill_chunk_jit = jax.jit(_prefill_chunk, static_argnums=(0, 7))


@functools.partial(jax.jit, static_argnums=(0, 6))
def _decode(graphdef, state, cache, stack, token, prev, steps: int, active, cold=None):
    """``steps`` greedy tokens for every ``active [B]`` row (the others are empty rows: no
    page, nothing written); returns ``(tokens [B, steps], cache, stack)``.

    Table slots whose pages left the device (dropped or demoted by a retention policy) hold
    the null page: attention skips them there, and, with ``cold = (cold_table [B, M],
    stage_k [L, K, Ps, C, H], stage_v)``, reads them from the fetched staging pool instead
    (``offload.mixed_residency_attention``).
    """
    model = nnx.merge(graphdef, state)
    B = token.shape[0]

    def attend(q, cache, layer, table):
        # The new token is already written at position lengths: attend over lengths + 1 keys.
        if cold is None:
            out = paged.paged_attention(
                q, cache.k_pages[layer], cache.v_pages[layer], table, cache.lengths + 1
            ).out
            return out, None
        k, v = cache.k_pages[layer], cache.v_pages[layer]
        cold_table, cold_k, cold_v = cold
        res = offload.mixed_residency_attention(
            q, k, v, table, cache.lengths + 1,
            cold_table=cold_table, cold_k_pages=cold_k[layer], cold_v_pages=cold_v[layer],
        )  # fmt: skip
        return res.out, None

    def step(i, carry):
        cache, stack, token, prev, out = carry
        cache, stack, ok = paged.ensure_next_page(cache, stack, active=active)
        positions = cache.lengths[:, None]
        attend_step = functools.partial(attend, table=cache.page_table)
        logits, cache, _ = _cached_forward(model, cache, token[:, None], prev[:, None], positions, attend_step)  # fmt: skip
        cache = paged.advance(cache, ok.astype(jnp.int32))
        nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        return cache, stack, nxt, token, out.at[:, i].set(nxt)

    out = jnp.zeros((B, steps), jnp.int32)
    cache, stack, _, _, out = jax.lax.fori_loop(0, steps, step, (cache, stack, token, prev, out))
    return out, cache, stack


class PromptView(NamedTuple):
    """What a retention rule sees at the end of prefill (one selection for all layers: the
    cache has one page table, so a page is resident in every layer or in none).

    Attributes:
      k_pages, v_pages: ``[L, K, P, C, H]`` the pools, with every prompt page written.
      page_table: ``[B, M]`` int the rows' tables (0 = null page).
      lengths: ``[B]`` int tokens in the cache (the prompt but its last token).
      prompt_mass: ``[B, N, M]`` float32 attention probability per page, summed over every
        prefilled query and over layers (H2O's accumulated mass; tokens served from the prefix
        cache were not prefilled by this request and contribute nothing).
      window_mass: ``[W, B, N, M]`` float32 the same, for each of the last ``W`` prefilled
        queries separately (oldest first; zeros where a row had fewer): SnapKV's observation
        window, TOVA's last query, Scissorhands' steps.
      page_size: ``C``.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    lengths: jax.Array
    prompt_mass: jax.Array
    window_mass: jax.Array
    page_size: int


def policy_select(policy: offload.RetentionPolicy):
    """A retention rule ``view -> keep [B, M] bool`` from an ``offload.RetentionPolicy``
    (page granularity): the policy's scores are fed from the prefill's attention (H2O the
    accumulated ``prompt_mass``, SnapKV the summed ``window_mass``, TOVA its last query,
    Scissorhands each window query in turn) and ``offload.select_keep`` picks the pages."""
    if not isinstance(policy, offload.RetentionPolicy) or policy.granularity != "page":
        raise ValueError(f"policy_select: policy: expected a page RetentionPolicy, got {policy!r}")

    def select(view: PromptView):
        B, M = view.page_table.shape
        state = offload.init_policy_state(B, M, policy=policy)
        update = functools.partial(offload.update_policy_state, policy=policy)
        if policy.kind == "h2o":
            state = update(state, view.prompt_mass)
        elif policy.kind == "snapkv":
            state = update(state, view.window_mass.sum(0))
        elif policy.kind == "tova":
            state = update(state, view.window_mass[-1])
        elif policy.uses_scores:  # scissorhands: one observation per query
            for w in range(view.window_mass.shape[0]):
                state = update(state, view.window_mass[w])
        return offload.select_keep(state, view.lengths, policy=policy, page_table=view.page_table).keep  # fmt: skip

    return select


@dataclasses.dataclass(frozen=True)
class Retention:
    """Which prompt pages stay on the device after prefill, and what happens to the rest.

    Attributes:
      select: an ``offload.RetentionPolicy`` (see :func:`policy_select`) or any function
        ``PromptView -> keep [B, M] bool`` (the quality harness's hook: a rule of your own,
        an oracle).
      mode: ``"drop"``: the other pages are never read again (the decode's approximation);
        ``"demote"``: they are copied to pinned host memory (``offload.OffloadManager``),
        fetched back into a cold pool and read from there (exact).
      window: ``W``, prompt queries observed one by one at the end of prefill.
      scrub: overwrite the device pages the retention freed (evicted by every row holding
        them, held by no other sequence, out of the prefix cache) with NaN, so nothing can
        read them by mistake (a testing aid).
    """

    select: Any
    mode: str = "drop"
    window: int = 16
    scrub: bool = False

    def __post_init__(self):
        if self.mode not in ("drop", "demote"):
            raise ValueError(f"Retention: mode: expected 'drop' or 'demote', got {self.mode!r}")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"Retention: window: expected an int >= 1, got {self.window!r}")
        if not (isinstance(self.select, offload.RetentionPolicy) or callable(self.select)):
            raise ValueError(
                f"Retention: select: expected a RetentionPolicy or a callable, got {self.select!r}"
            )

    def rule(self):
        if isinstance(self.select, offload.RetentionPolicy):
            return policy_select(self.select)
        return self.select


class GenerationInfo(NamedTuple):
    """What the last :meth:`Server.generate` did with the prompt pages.

    Attributes:
      prompt_pages: ``[B]`` live prompt pages per row.
      kept_pages: ``[B]`` of them resident on the device during decode (a page shared with a
        row that keeps it counts as kept).
      moved_bytes: bytes copied to host and back (demote), 0 otherwise.
      freed_pages: device pages the retention gave back to the allocator (evicted by every
        holder); the decode's new pages may reuse them.
      tier_bytes: bytes by tier after the retention, measured from the arrays that hold them
        (``offload.page_nbytes``, ``offload.measure_bytes``): ``"device"`` the distinct pages
        the batch's rows hold, ``"staging"`` the staging pool the demoted pages were fetched
        into (0 without one).
    """

    prompt_pages: np.ndarray
    kept_pages: np.ndarray
    moved_bytes: int
    freed_pages: int = 0
    tier_bytes: dict | None = None


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
      kv_format: ``None`` (float32 pages) or a ``paged.KVFormat`` (int8 / fp8 pages with
        per-token scales: written quantized, read dequantized block by block).
    """

    model: Transformer
    num_pages: int = 512
    page_size: int = 16
    max_len: int = 4096
    batch: int = 4
    chunk: int = 256
    kv_format: paged.KVFormat | None = None

    def __post_init__(self):
        cfg = self.model.cfg
        # Room for one chunk past max_len: a chunk's padding tokens need table slots (null).
        self.max_pages = -(-(self.max_len + self.chunk) // self.page_size)
        self.allocator = paged.PageAllocator(
            self.num_pages, self.page_size, max_pages_per_seq=self.max_pages
        )
        self.cache = paged.init_paged_cache(
            cfg.num_layers, cfg.num_kv_heads, self.num_pages, self.page_size, cfg.head_dim,
            batch=self.batch, max_pages_per_seq=self.max_pages, kv_format=self.kv_format,
        )  # fmt: skip
        self.graphdef, self.state = nnx.split(self.model)
        self._ids = 0
        self.offload: offload.OffloadManager | None = None
        self.last_info: GenerationInfo | None = None

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, salt=None,
                 retention: Retention | None = None):  # fmt: skip
        """Greedy continuations of up to ``batch`` prompts; returns a list of int arrays.

        The prompts' pages are committed (later calls sharing a prefix reuse them); every
        page of these requests is freed at the end (committed full pages stay cached). With
        ``retention``, the last ``retention.window`` prompt tokens are prefilled one query at
        a time to observe their attention, the rule picks the prompt pages that stay on the
        device, and the rest are dropped or demoted (see :class:`Retention`); the page the
        decode writes into (holding the prompt's last token) always stays. Pages made by the
        decode are all kept. :attr:`last_info` says what happened.
        """
        if not 1 <= len(prompts) <= self.batch:
            raise ValueError(f"generate: prompts: expected 1..{self.batch}, got {len(prompts)}")
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens: expected >= 1, got {max_new_tokens}")
        if retention is not None and not isinstance(retention, Retention):
            raise ValueError(f"generate: retention: expected a Retention, got {retention!r}")
        prompts = [np.asarray(p, np.int32) for p in prompts]
        for p in prompts:
            if p.ndim != 1 or p.size < 1 or p.size + max_new_tokens > self.max_len:
                raise ValueError(
                    f"generate: prompts: expected 1..{self.max_len - max_new_tokens} tokens each"
                    f", got shape {p.shape}"
                )
        B, C = self.batch, self.page_size
        seqs = [("req", self._ids + i) for i in range(len(prompts))]
        pads = B - len(prompts)
        self._ids += B
        admissions = [self.allocator.admit(s, p, salt=salt) for s, p in zip(seqs, prompts, strict=True)]  # fmt: skip
        rows = seqs + [None] * pads  # None: an empty row of the batch (no page, length 0)
        starts = np.array([a.num_cached_tokens for a in admissions] + [0] * pads, np.int32)
        ends = np.array([len(p) for p in prompts] + [1] * pads, np.int32)
        cache = paged.with_page_table(
            self.cache, self.allocator.page_table(rows), jnp.asarray(starts)
        )
        # Prefill everything but each prompt's last token in chunks; the last token starts the
        # decode loop (its logits give the first new token).
        W = retention.window if retention is not None else 0
        full = np.zeros((B, self.max_len + max(self.chunk, W)), np.int32)
        for i, p in enumerate(prompts):
            full[i, : len(p)] = p
        prev_full = np.pad(full[:, :-1], ((0, 0), (1, 0)))
        pos, last = starts.copy(), ends - 1
        observe_from = np.maximum(pos, last - W)

        def chunk(pos, n, T, per_query):
            idx = pos[:, None] + np.arange(T)
            args = (jnp.asarray(np.take_along_axis(a, idx, 1)) for a in (full, prev_full))
            return _prefill_chunk_jit(self.graphdef, self.state, cache, *args, jnp.asarray(pos), jnp.asarray(n), per_query)  # fmt: skip

        prompt_mass = 0.0
        while (pos < observe_from).any():
            n = np.clip(observe_from - pos, 0, self.chunk).astype(np.int32)
            cache, mass = chunk(pos, n, self.chunk, False)
            prompt_mass, pos = prompt_mass + mass, pos + n
        window_mass = None
        if retention is not None:
            n = (last - pos).astype(np.int32)
            cache, mass = chunk(pos, n, W, True)  # [B, W, N, M]
            # Right-align each row's queries: window_mass[W - 1] is its last prefilled query.
            src = np.arange(W)[None, :] - (W - n)[:, None]
            mass = jnp.where(
                jnp.asarray(src >= 0)[:, :, None, None],
                jnp.take_along_axis(mass, jnp.asarray(np.maximum(src, 0))[:, :, None, None], 1),
                0.0,
            )
            prompt_mass = prompt_mass + mass.sum(1)
            window_mass = jnp.moveaxis(mass, 1, 0)
        cache = paged.with_page_table(cache, cache.page_table, jnp.asarray(last))
        for s, a in zip(seqs, admissions, strict=True):
            self.allocator.commit(s, a.num_tokens - 1)
        cache, cold, info = self._retain(cache, rows, retention, prompt_mass, window_mass, last)
        self.last_info = info
        # Pages for the generated tokens come from an on-device stack (no host round trips).
        # The loop writes max_new_tokens tokens per request row from its last prompt token on.
        writes = np.array([max_new_tokens] * len(prompts) + [0] * pads)
        need = paged.pages_to_reserve(last, writes, page_size=C, max_pages_per_seq=self.max_pages)
        reserve = self.allocator.reserve(need)
        stack = paged.make_free_stack(reserve, capacity=self.num_pages)
        token = jnp.asarray(full[np.arange(B), last])
        prev = jnp.asarray(prev_full[np.arange(B), last])
        active = jnp.asarray(writes > 0)
        out, cache, stack = _decode(self.graphdef, self.state, cache, stack, token, prev, max_new_tokens, active, cold)  # fmt: skip
        _, unused = paged.taken_pages(stack, len(reserve))
        self.allocator.settle(rows, np.asarray(cache.page_table), np.asarray(cache.lengths), unused=unused)  # fmt: skip
        self.cache = cache
        for s in seqs:
            self.allocator.free(s)
        return [np.asarray(out[i]) for i in range(len(prompts))]

    def _retain(self, cache, rows, retention, prompt_mass, window_mass, last):
        """Applies ``retention``: returns ``(cache, cold | None, info)``, ``cache`` with the
        evicted pages out of its table (given back to the allocator; the freed ones scrubbed
        when asked) and ``cold = (cold_table, stage_k, stage_v)`` for demoted pages."""
        C = self.page_size
        table = np.asarray(cache.page_table)
        M = table.shape[1]
        live = (np.arange(M)[None, :] < -(-last // C)[:, None]) & (table != 0)
        if retention is None:
            n = live.sum(1)
            return cache, None, self._info(cache, n, n, 0, 0, None)
        view = PromptView(cache.k_pages, cache.v_pages, cache.page_table, cache.lengths,
                          prompt_mass, window_mass, C)  # fmt: skip
        keep = np.array(retention.rule()(view), bool)
        if keep.shape != table.shape:
            raise ValueError(f"generate: retention.select: expected keep {table.shape}, got {keep.shape}")  # fmt: skip
        # The page holding the prompt's last token is where the decode writes: keep it.
        index = np.arange(len(last))
        writing = last // C
        keep[index, writing] |= live[index, writing]
        # A page kept by one row stays for every row that holds it (a shared prefix).
        keep = np.asarray(offload.keep_shared_pages(table, keep)) & live
        evicted = live & ~keep
        if not evicted.any():
            return cache, None, self._info(cache, live.sum(1), keep.sum(1), 0, 0, None)
        cold, moved = None, 0
        if retention.mode == "demote":
            # Each distinct demoted page goes to pinned host memory once, then comes back into
            # a staging pool of just those pages that the decode reads (the result is exact).
            ids, cold_table = offload.staging_table(np.where(evicted, table, 0))
            if self.offload is None:
                host = offload.make_host_page_pool(cache.k_pages, cache.v_pages, self.num_pages)
                self.offload = offload.OffloadManager(host)
            rid = f"call-{self._ids}"
            out = self.offload.page_out(cache.k_pages, cache.v_pages, ids, request_id=rid)
            self.offload.wait(out)
            # Bucketed sizes: fewer decode compiles.
            stage_k, stage_v = offload.make_staging_pool(cache.k_pages, cache.v_pages, ids.size, bucket=16)  # fmt: skip
            back = self.offload.page_in(stage_k, stage_v, np.arange(1, ids.size + 1), request_id=rid)  # fmt: skip
            stage_k, stage_v = self.offload.wait(back)
            cold = (jnp.asarray(cold_table), stage_k, stage_v)
            moved = int(out.nbytes + back.nbytes)
        # The rows give the evicted pages back; those nobody else holds become free.
        freed = [self.allocator.release_pages(seq, np.flatnonzero(evicted[b])) for b, seq in enumerate(rows) if evicted[b].any()]  # fmt: skip
        freed = np.concatenate(freed)
        # Released slots inside a length hold the null page (attention masks them, or reads
        # them from the staging pool).
        cache = paged.with_page_table(cache, self.allocator.page_table(rows))
        if retention.scrub and freed.size:
            dead = jnp.asarray(freed)
            cache = cache._replace(k_pages=_scrub(cache.k_pages, dead), v_pages=_scrub(cache.v_pages, dead))  # fmt: skip
        info = self._info(cache, live.sum(1), keep.sum(1), moved, freed.size, cold)
        return cache, cold, info

    def _info(self, cache, prompt_pages, kept_pages, moved, freed, cold) -> GenerationInfo:
        """A :class:`GenerationInfo` whose tier bytes are measured from the arrays."""
        held = np.unique(np.asarray(cache.page_table))
        held = int((held != paged.NULL_PAGE).sum())
        staging = 0 if cold is None else sum(offload.measure_bytes(cold[1:]).values())
        device = held * offload.page_nbytes(cache.k_pages, cache.v_pages)
        tiers = {"device": device, "staging": staging}
        return GenerationInfo(prompt_pages, kept_pages, moved, int(freed), tiers)


def _scrub(pool, ids):
    """``pool`` with pages ``ids`` overwritten by NaN (a quantized pool: its scales, and a
    kivi2 pool's zero-points; its residual pages are per sequence and stay)."""
    if isinstance(pool, paged.QuantizedPages):
        zero = None if pool.zero is None else pool.zero.at[:, :, ids].set(jnp.nan)
        return dataclasses.replace(pool, scale=pool.scale.at[:, :, ids].set(jnp.nan), zero=zero)
    return pool.at[:, :, ids].set(jnp.nan)


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
