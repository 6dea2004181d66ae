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

``Retention(policy, mode="retrieve")`` is query-aware instead (Quest): every page stays on
the device with its per-page key bounds (``paged.page_key_bounds`` after prefill,
``paged.refresh_key_bounds`` after every decode write), and each decode step's attention in
every layer reads only the ``budget`` pages its own query selects
(``paged.select_pages_by_query`` / ``paged.retrieval_attention``; sink pages and the page
being written always read), ``budget`` a static count from the policy's keep fraction.
With ``host=True`` the prompt's pages leave the device for pinned host memory, all but the
sink pages and the trailing pages every step reads; their bounds stay on the device, and each
step reads only the host pages its query selects, inside the jitted decode loop
(``offload.retrieval.retrieval_decode_attention_jit``; see
:mod:`examples.longctx_lm.host_retrieval`).

:class:`Server` keeps one allocator and one pool for many calls, so later requests hit the
prefix cache of earlier ones.

Example (the committed checkpoint, a 20% device budget chosen by SnapKV, the rest demoted)::

    model, _ = train.load_checkpoint("examples/longctx_lm/checkpoint")
    server = Server(model, num_pages=256, max_len=1100, batch=2)
    policy = offload.RetentionPolicy("snapkv", 0.2, page_size=16, recent=1)
    out = server.generate(prompts, 8, retention=Retention(policy, mode="demote"))
    server.last_info  # prompt pages, pages kept on device, bytes moved

    # Query-aware: each step reads the 20% of pages its query selects (sink page included).
    policy = offload.RetentionPolicy("streaming", 0.2, page_size=16, sink=1)
    out = server.generate(prompts, 8, retention=Retention(policy, mode="retrieve"))
    server.last_info.read_pages  # [B, 8] pages read per step, summed over layers

    # The same selection, the prompt's pages in pinned host memory: only the selected ones come back.
    out = server.generate(prompts, 8, retention=Retention(policy, mode="retrieve", host=True))
    server.last_info.tier_bytes  # device, staging, bounds and host bytes
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
import offload.retrieval
import paged
from examples.longctx_lm import host_retrieval
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


# The cache (and the decode's free-page stack) are donated: each layer's pool is written in
# place, so a chunk or a decode loop costs the tokens it touches, not a copy of the pools.
_prefill_chunk_jit = jax.jit(_prefill_chunk, static_argnums=(0, 7), donate_argnums=2)


@functools.partial(
    jax.jit, static_argnums=(0, 6), static_argnames=("retrieve",), donate_argnums=(2, 3)
)
def _decode(graphdef, state, cache, stack, token, prev, steps: int, active, cold=None,
            bounds=None, retrieve=None, host=None):  # fmt: skip
    """``steps`` greedy tokens for every ``active [B]`` row (the others are empty rows: no
    page, nothing written); returns ``(tokens [B, steps], cache, stack, read [B, steps])``,
    ``read`` the pages each step's attention read, summed over layers (0 unless retrieving).

    Table slots whose pages left the device (dropped or demoted by a retention policy) hold
    the null page: attention skips them there, and, with ``cold = (cold_table [B, M],
    stage_k [L, K, Ps, C, H], stage_v)``, reads them from the fetched staging pool instead
    (``offload.mixed_residency_attention``).

    With ``retrieve = (budget, sink, recent, per_kv_head)`` (static) and ``bounds`` the
    cache's ``paged.PageKeyBounds``, every layer reads only the ``budget`` pages its query
    selects (``paged.retrieval_attention``); the bounds of the page each step writes are
    refreshed (``paged.refresh_key_bounds``) after the step (that page is always read: it is
    the recent page, so the step's own selection does not need its new bound).

    With ``host = (host_k, host_v, host_bounds, host_table)`` too (the prompt pages moved to a
    per-layer pinned host pool, their bounds ``[L, K, P_host, H]`` on the device, the host
    slot of each table slot ``[B, M]``), the selection runs over both tiers and the program
    itself reads the selected host pages
    (``offload.retrieval.retrieval_decode_attention_jit``): the whole loop runs with no host
    round trip. ``read`` then counts pages read, and the fourth result is the bytes copied
    from host per step (``[steps]``; else zeros).
    """
    model = nnx.merge(graphdef, state)
    B = token.shape[0]
    C = cache.page_size

    def attend(q, cache, layer, table, bounds):
        # The new token is already written at position lengths: attend over lengths + 1 keys.
        lengths = cache.lengths + 1
        k, v = cache.k_pages[layer], cache.v_pages[layer]
        if host is not None:
            budget, sink, recent, _ = retrieve
            host_k, host_v, host_bounds, host_table = host
            res = offload.retrieval.retrieval_decode_attention_jit(
                q, k, v, bounds.layer(layer), table, host_k[layer], host_v[layer],
                host_bounds.layer(layer), host_table, lengths, budget=budget, sink_pages=sink,
                recent_pages=recent,
            )  # fmt: skip
            return res.out, (res.read_pages, res.fetched_bytes)
        if retrieve is not None:
            budget, sink, recent, per_kv_head = retrieve
            layer_bounds = bounds.layer(layer)
            sel = paged.select_pages_by_query(
                q, layer_bounds, table, lengths, page_size=C, budget=budget,
                sink_pages=sink, recent_pages=recent,
            )  # fmt: skip
            if per_kv_head:  # each kv head its own budget pages (Quest's granularity)
                out = paged.retrieval_attention(
                    q, k, v, layer_bounds, table, lengths, budget=budget, sink_pages=sink,
                    recent_pages=recent, per_kv_head=True,
                ).out  # fmt: skip
            else:
                rt = paged.retrieval_table(sel, table, lengths, page_size=C)
                out = paged.paged_attention(
                    q, paged.retrieval_pool(k, rt.offset), paged.retrieval_pool(v, rt.offset),
                    rt.page_table, rt.lengths, q_positions=cache.lengths[:, None] - rt.offset[:, None],
                ).out  # fmt: skip
            return out, sel.count
        if cold is None:
            return paged.paged_attention(q, k, v, table, lengths).out, None
        cold_table, cold_k, cold_v = cold
        res = offload.mixed_residency_attention(
            q, k, v, table, lengths,
            cold_table=cold_table, cold_k_pages=cold_k[layer], cold_v_pages=cold_v[layer],
        )  # fmt: skip
        return res.out, None

    def step(i, carry):
        cache, stack, bounds, token, prev, out, read, fetched = carry
        cache, stack, ok = paged.ensure_next_page(cache, stack, active=active)
        positions = cache.lengths[:, None]
        attend_step = functools.partial(attend, table=cache.page_table, bounds=bounds)
        logits, cache, counts = _cached_forward(model, cache, token[:, None], prev[:, None], positions, attend_step)  # fmt: skip
        if host is not None:
            fetched = fetched.at[i].set(sum(c[1] for c in counts))
            counts = [c[0] for c in counts]
        if retrieve is not None:
            read = read.at[:, i].set(sum(counts))
            for layer in range(len(model.blocks)):  # the written page's bounds, every layer
                bounds = paged.refresh_key_bounds(
                    bounds, cache, cache.lengths, 1, layer=layer, lengths=cache.lengths + 1
                )
        cache = paged.advance(cache, ok.astype(jnp.int32))
        nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        return cache, stack, bounds, nxt, token, out.at[:, i].set(nxt), read, fetched

    out = jnp.zeros((B, steps), jnp.int32)
    zeros = jnp.zeros((B, steps), jnp.int32), jnp.zeros(steps, jnp.int32)
    carry = (cache, stack, bounds, token, prev, out, *zeros)
    cache, stack, _, _, _, out, read, fetched = jax.lax.fori_loop(0, steps, step, carry)
    return out, cache, stack, read, fetched


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


_RETRIEVE_KINDS = ("streaming", "recency")


@dataclasses.dataclass(frozen=True)
class Retention:
    """Which prompt pages stay on the device after prefill, and what happens to the rest.

    Attributes:
      select: an ``offload.RetentionPolicy`` (see :func:`policy_select`) or any function
        ``PromptView -> keep [B, M] bool`` (the quality harness's hook: a rule of your own,
        an oracle).
      mode: ``"drop"``: the other pages are never read again (the decode's approximation);
        ``"demote"``: they are copied to pinned host memory (``offload.OffloadManager``),
        fetched back into a cold pool and read from there (exact); ``"retrieve"``
        (Quest-style, query-aware): no page leaves the device, and each decode step's
        attention in every layer reads only the ``budget`` pages its own query selects
        (``paged.select_pages_by_query`` over the pages' key bounds, ``paged.page_key_bounds``
        after prefill and ``paged.refresh_key_bounds`` after every write;
        ``paged.retrieval_attention``). ``select`` must then be a ``RetentionPolicy`` of kind
        ``"streaming"`` or ``"recency"`` that only sizes the selection (a scored policy's
        prefill ranking would go unused: the query ranks the pages): ``budget`` pages per
        step (``offload.budget_units`` of the live pages at the last decode step; a float
        1.0 reads every page, so the tokens equal no retention), its ``sink`` leading pages
        always read, and the page being written always read (``recent_pages = 1``; kivi2
        pages: the residual window's pages). ``GenerationInfo.read_pages`` holds the pages
        each step read.
      window: ``W``, prompt queries observed one by one at the end of prefill (unused by
        ``"retrieve"``).
      scrub: overwrite the device pages the retention freed (evicted by every row holding
        them, held by no other sequence, out of the prefix cache) with NaN, so nothing can
        read them by mistake (a testing aid; not with ``"retrieve"``, which frees nothing).
      per_kv_head: ``"retrieve"`` only: each kv head selects its own ``budget`` pages by its
        own query group's bound (Quest's granularity, ``retrieval_attention(...,
        per_kv_head=True)``) instead of one selection shared by the heads; the same pages
        read per step.
      host: ``"retrieve"`` only: the prompt's pages but the sink pages and the trailing
        ``recent`` ones move to pinned host memory and are freed on the device (their key
        bounds stay there); each step fetches only the host pages its query selects
        (``offload.retrieval.retrieval_decode_attention``, one selection shared by the heads). The
        tokens are those of ``host=False``; the decode is a Python loop over steps and layers
        (one synchronisation per layer and step). ``GenerationInfo.moved_bytes`` counts the
        copy to host and every fetch.
    """

    select: Any
    mode: str = "drop"
    window: int = 16
    scrub: bool = False
    per_kv_head: bool = False
    host: bool = False

    def __post_init__(self):
        if self.mode not in ("drop", "demote", "retrieve"):
            raise ValueError(
                f"Retention: mode: expected 'drop', 'demote' or 'retrieve', got {self.mode!r}"
            )
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"Retention: window: expected an int >= 1, got {self.window!r}")
        if not (isinstance(self.select, offload.RetentionPolicy) or callable(self.select)):
            raise ValueError(
                f"Retention: select: expected a RetentionPolicy or a callable, got {self.select!r}"
            )
        if self.per_kv_head and self.mode != "retrieve":
            raise ValueError(
                f"Retention: per_kv_head: only for mode='retrieve' (a per-step selection), got "
                f"mode={self.mode!r}; drop per_kv_head or use mode='retrieve'"
            )
        if self.host and self.mode != "retrieve":
            raise ValueError(
                f"Retention: host: only for mode='retrieve' (mode='demote' moves the evicted "
                f"pages to host already), got mode={self.mode!r}; drop host or use mode='retrieve'"
            )
        if self.host and self.per_kv_head:
            raise ValueError(
                "Retention: per_kv_head: the host tier fetches one selection shared by the "
                "heads (offload.retrieval.retrieval_decode_attention); drop per_kv_head or host"
            )
        if self.mode == "retrieve":
            self._check_retrieve()

    def _check_retrieve(self):
        policy = self.select
        hint = "e.g. offload.RetentionPolicy('streaming', 0.2, page_size=C, sink=1)"
        if not isinstance(policy, offload.RetentionPolicy):
            raise ValueError(
                "Retention: select: mode='retrieve' needs a RetentionPolicy to size the "
                f"per-step selection (its budget and sink), got {policy!r}; pass one, {hint}"
            )
        if policy.granularity != "page":
            raise ValueError(
                f"Retention: select: mode='retrieve' selects pages: expected a page policy, got "
                f"granularity={policy.granularity!r}; {hint}"
            )
        if policy.kind not in _RETRIEVE_KINDS:
            raise ValueError(
                f"Retention: select: mode='retrieve' ranks the pages by each step's query, so "
                f"the {policy.kind!r} policy's prefill scores would go unused: expected kind "
                f"'streaming' or 'recency' (the budget and sink only), {hint}; or keep "
                f"{policy.kind!r} with mode='drop' or 'demote'"
            )
        if self.scrub:
            raise ValueError(
                "Retention: scrub: mode='retrieve' frees no page, nothing to scrub; drop scrub"
            )

    def rule(self):
        if isinstance(self.select, offload.RetentionPolicy):
            return policy_select(self.select)
        return self.select

    def retrieval(self, live_pages: int, page_size: int, kv_format=None) -> tuple[int, int, int]:
        """``(budget, sink_pages, recent_pages)`` of ``mode="retrieve"`` for sequences of at
        most ``live_pages`` pages (the last decode step's) of ``page_size`` tokens."""
        policy = self.select
        if policy.page_size != page_size:
            raise ValueError(
                f"Retention: select: expected the server's page_size {page_size}, got a policy "
                f"with page_size={policy.page_size}; make the policy with page_size={page_size}"
            )
        recent = 1  # the page being written holds the query: always read
        if kv_format is not None and kv_format.kind == "kivi2":
            recent = max(recent, kv_format.residual_pages(page_size))
        sink = int(policy.sink)
        budget = max(sink + recent, int(offload.budget_units(policy, int(live_pages))))
        return budget, sink, recent


class GenerationInfo(NamedTuple):
    """What the last :meth:`Server.generate` did with the prompt pages.

    Attributes:
      prompt_pages: ``[B]`` live prompt pages per row.
      kept_pages: ``[B]`` of them resident on the device during decode (a page shared with a
        row that keeps it counts as kept).
      moved_bytes: bytes copied to host and back (demote; ``"retrieve"`` with ``host=True``:
        to host once, and every fetch of a selected page), 0 otherwise.
      freed_pages: device pages the retention gave back to the allocator (evicted by every
        holder); the decode's new pages may reuse them.
      tier_bytes: bytes by tier after the retention, measured from the arrays that hold them
        (``offload.page_nbytes``, ``offload.measure_bytes``): ``"device"`` the distinct pages
        the batch's rows hold, ``"staging"`` the staging pool the demoted pages were fetched
        into (0 without one; with ``host=True`` the largest one layer's step fetched into),
        ``"bounds"`` the key bounds of ``mode="retrieve"`` (0 else; with ``host=True`` those
        of the device pool and of the host slots), and with ``host=True`` ``"host"`` the
        pages in pinned host memory.
      read_pages: ``mode="retrieve"`` only (else None): ``[B, max_new_tokens]`` the pages each
        decode step's attention read, summed over the layers (the selections' counts: at most
        ``budget * num_layers``; 0 for empty rows).
      live_pages: ``mode="retrieve"`` only: ``[B, max_new_tokens]`` the pages each step could
        have read (the row's pages, summed over the layers): ``read_pages / live_pages`` is
        the fraction of the KV read.
      budget: ``mode="retrieve"`` only: the pages per layer each step selects.
    """

    prompt_pages: np.ndarray
    kept_pages: np.ndarray
    moved_bytes: int
    freed_pages: int = 0
    tier_bytes: dict | None = None
    read_pages: np.ndarray | None = None
    live_pages: np.ndarray | None = None
    budget: int | None = None


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
        decode are all kept. With ``retention.mode == "retrieve"`` no page leaves the device
        and no window is observed: every decode step reads, per layer, the pages its query
        selects. :attr:`last_info` says what happened. The server's cache is donated to the
        jitted prefill chunks and decode loop (each layer's pool written in place) and
        replaced by their result.
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
        retrieve = retention is not None and retention.mode == "retrieve"
        W = retention.window if retention is not None and not retrieve else 0
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
        if W:  # the observation window of the drop / demote policies
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
        bounds = options = host = None
        if retrieve:  # every page stays; each step reads what its query selects
            cache, cold, info = self._retain(cache, rows, None, prompt_mass, window_mass, last)
            live = -(-(last + max_new_tokens) // C)  # the pages of the last decode step
            options = retention.retrieval(int(live.max()), C, self.kv_format)
            options = (*options, bool(retention.per_kv_head))
            bounds = paged.page_key_bounds(cache)
            info = info._replace(
                tier_bytes={**info.tier_bytes, "bounds": bounds.nbytes}, budget=options[0]
            )
            if retention.host:
                cache, host, info = self._to_host(cache, rows, bounds, last, options, info)
        else:
            cache, cold, info = self._retain(cache, rows, retention, prompt_mass, window_mass, last)  # fmt: skip
        # Pages for the generated tokens come from an on-device stack (no host round trips).
        # The loop writes max_new_tokens tokens per request row from its last prompt token on.
        writes = np.array([max_new_tokens] * len(prompts) + [0] * pads)
        need = paged.pages_to_reserve(last, writes, page_size=C, max_pages_per_seq=self.max_pages)
        reserve = self.allocator.reserve(need)
        stack = paged.make_free_stack(reserve, capacity=self.num_pages)
        token = jnp.asarray(full[np.arange(B), last])
        prev = jnp.asarray(prev_full[np.arange(B), last])
        active = jnp.asarray(writes > 0)
        tier = None
        if host is not None:  # retrieve from the host tier, inside the jitted loop
            tier = (host.pool.k_pages, host.pool.v_pages, host.bounds, jnp.asarray(host.table))
        out, cache, stack, read, fetched = _decode(self.graphdef, self.state, cache, stack, token, prev, max_new_tokens, active, cold, bounds, retrieve=options, host=tier)  # fmt: skip
        if host is not None:
            # The program stages the budget's entries of every row per layer step.
            staging = (1 + B * options[0]) * host.pool.page_nbytes // self.model.cfg.num_layers
            tiers = {**info.tier_bytes, "staging": staging}
            info = info._replace(moved_bytes=info.moved_bytes + int(np.asarray(fetched).sum()), tier_bytes=tiers)  # fmt: skip
        if retrieve:
            # Step i attends over last + i + 1 tokens: its pages in every layer.
            steps = last[:, None] + np.arange(1, max_new_tokens + 1)[None]
            live = -(-steps // C) * self.model.cfg.num_layers * (writes > 0)[:, None]
            info = info._replace(read_pages=np.asarray(read), live_pages=live)
        self.last_info = info
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

    def _to_host(self, cache, rows, bounds, last, options, info):
        """``Retention(host=True)``: every live prompt page but the first ``sink`` and the
        last ``recent`` (counting the page the decode writes into) goes to a pinned host pool
        with its bounds, and the rows give it back to the allocator. Returns ``(cache, tier,
        info)``."""
        _, sink, recent, _ = options
        C = self.page_size
        table = np.asarray(cache.page_table)
        M = table.shape[1]
        j = np.arange(M)[None, :]
        live = (j < -(-last // C)[:, None]) & (table != paged.NULL_PAGE)
        evict = live & (j >= sink) & (j <= (last // C)[:, None] - recent)
        if not evict.any():  # prompts within the sink and recent pages: nothing to move
            return cache, None, info
        tier = host_retrieval.move_to_host(cache, bounds, table, evict)
        freed = [self.allocator.release_pages(seq, np.flatnonzero(evict[b])) for b, seq in enumerate(rows) if evict[b].any()]  # fmt: skip
        freed = np.concatenate(freed)
        cache = paged.with_page_table(cache, self.allocator.page_table(rows))
        measured = self._info(cache, info.prompt_pages, live.sum(1) - evict.sum(1), 0, freed.size, None)  # fmt: skip
        page = offload.page_nbytes(cache.k_pages, cache.v_pages)
        tiers = {**measured.tier_bytes, "bounds": bounds.nbytes + tier.bounds.nbytes, "host": tier.num_pages * page}  # fmt: skip
        info = measured._replace(moved_bytes=tier.moved_bytes, tier_bytes=tiers, budget=info.budget)  # fmt: skip
        return cache, tier, info

    def _info(self, cache, prompt_pages, kept_pages, moved, freed, cold) -> GenerationInfo:
        """A :class:`GenerationInfo` whose tier bytes are measured from the arrays."""
        held = np.unique(np.asarray(cache.page_table))
        held = int((held != paged.NULL_PAGE).sum())
        staging = 0 if cold is None else sum(offload.measure_bytes(cold[1:]).values())
        device = held * offload.page_nbytes(cache.k_pages, cache.v_pages)
        tiers = {"device": device, "staging": staging, "bounds": 0}
        return GenerationInfo(prompt_pages, kept_pages, moved, int(freed), tiers)


def _scrub(pool, ids):
    """``pool`` with pages ``ids`` overwritten by NaN (a quantized pool: its scales, and a
    kivi2 pool's zero-points; its residual pages are per sequence and stay)."""
    if isinstance(pool, paged.LayerPools):  # a cache's per-layer pools, layer by layer
        return paged.LayerPools(_scrub(layer[None], ids)[0] for layer in pool)
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
