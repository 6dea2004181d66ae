"""A small Llama-style decoder in Flax NNX whose attention is jax-longctx's.

Token embedding (plus an embedding of the previous token, see below), pre-norm blocks of RMSNorm -> GQA attention with rotary embeddings computed
from explicit positions -> RMSNorm -> SwiGLU MLP, a final RMSNorm and a tied output layer.
The attention itself is a function passed in at call time (:mod:`attention`), so the same
weights run dense, blockwise, ring-sharded over a mesh, or decode from a paged cache.

The one departure from Llama is the previous-token embedding: the input of position ``t`` is
``embed(token[t]) + prev_embed(token[t - 1])``. A retrieval answer needs the copy circuit of an
induction head (find where the current token occurred before, copy what followed it), which
otherwise takes two attention layers, the first learning to look one position back. With the
previous token in the residual stream one layer can do it: on the passkey and recall tasks the
2-layer model went from chance after 400 steps without it to 100% at 128 tokens in 250 steps
with it (same run length, same seed, measured here). Decoding needs nothing extra: the previous
token is the one just emitted. Under a permuted sequence layout (zigzag), compute
``prev_tokens`` in natural order with :func:`previous_tokens` and permute it with the tokens.

Shapes: ``B`` batch, ``T`` tokens, ``D`` model width, ``N`` query heads, ``K`` kv heads,
``H`` head dim, ``V`` vocabulary.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx

from examples.longctx_lm.data import PAD, VOCAB_SIZE

# attend(q [B, T, N, H], k [B, T, K, H], v [B, T, K, H], positions [B, T]) -> [B, T, N, H]
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model shape (frozen, so it can be a static argument and a checkpoint's metadata).

    Attributes:
      vocab_size: ``V``.
      width: ``D``, the residual width.
      num_layers: decoder blocks.
      num_heads: ``N`` query heads.
      num_kv_heads: ``K`` key/value heads (``N % K == 0``: GQA).
      head_dim: ``H``.
      mlp_width: hidden width of the SwiGLU MLP.
      rope_base: rotary embedding base.
    """

    vocab_size: int = VOCAB_SIZE
    width: int = 128
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 16
    mlp_width: int = 384
    rope_base: float = 10_000.0

    def __post_init__(self):
        for name in ("vocab_size", "width", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig: {name}: expected >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig: num_heads: expected a multiple of num_kv_heads="
                f"{self.num_kv_heads}, got {self.num_heads}"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(
                f"ModelConfig: head_dim: expected an even int >= 2, got {self.head_dim}"
            )


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary embedding of ``x [B, T, heads, H]`` at integer ``positions [B, T]``.

    Positions are explicit, so a zigzag-permuted sequence or a decode step at position 5000
    gets the rotation of its true position.
    """
    H = x.shape[-1]
    inv_freq = base ** (-jnp.arange(0, H, 2, dtype=jnp.float32) / H)  # [H/2]
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, width: int, *, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((width,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        return (x * jax.lax.rsqrt(var + self.eps) * self.scale[...]).astype(x.dtype)


class Attention(nnx.Module):
    """GQA projections around a pluggable attention function."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, N, K, H = cfg.width, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = nnx.Linear(D, N * H, use_bias=False, rngs=rngs)
        self.wk = nnx.Linear(D, K * H, use_bias=False, rngs=rngs)
        self.wv = nnx.Linear(D, K * H, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(N * H, D, use_bias=False, rngs=rngs)

    def project(self, x, positions):
        """``q [B, T, N, H]``, ``k, v [B, T, K, H]`` with rotary embeddings applied."""
        cfg = self.cfg
        q = rearrange(self.wq(x), "b t (n h) -> b t n h", h=cfg.head_dim)
        k = rearrange(self.wk(x), "b t (k h) -> b t k h", h=cfg.head_dim)
        v = rearrange(self.wv(x), "b t (k h) -> b t k h", h=cfg.head_dim)
        return rope(q, positions, cfg.rope_base), rope(k, positions, cfg.rope_base), v

    def output(self, o):
        return self.wo(rearrange(o, "b t n h -> b t (n h)"))

    def __call__(self, x, positions, attend: AttendFn):
        q, k, v = self.project(x, positions)
        return self.output(attend(q, k, v, positions))


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.gate = nnx.Linear(cfg.width, cfg.mlp_width, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(cfg.width, cfg.mlp_width, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp_width, cfg.width, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.width)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.width)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, attend: AttendFn):
        x = x + self.attn(self.attn_norm(x), positions, attend)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
    """The decoder. ``model(tokens, positions, attend, prev_tokens) -> logits [B, T, V]``.

    ``tokens``, ``positions`` and ``prev_tokens`` are ``[B, T]`` int; ``prev_tokens`` defaults
    to :func:`previous_tokens` of ``tokens`` (right only when ``tokens`` is in natural order).

    Example:
      >>> from examples.longctx_lm.attention import dense
      >>> model = Transformer(ModelConfig(width=32, mlp_width=64), rngs=nnx.Rngs(0))
      >>> tokens = jnp.zeros((1, 8), jnp.int32)
      >>> model(tokens, jnp.arange(8)[None], dense()).shape
      (1, 8, 88)
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.width, rngs=rngs)
        self.prev_embed = nnx.Embed(cfg.vocab_size, cfg.width, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.width)

    def logits(self, x):
        return self.embed.attend(self.final_norm(x))  # tied output layer

    def embed_inputs(self, tokens, prev_tokens):
        return _lookup(self.embed, tokens) + _lookup(self.prev_embed, prev_tokens)

    def __call__(self, tokens, positions, attend: AttendFn, prev_tokens=None):
        if prev_tokens is None:
            prev_tokens = previous_tokens(tokens)
        x = self.embed_inputs(tokens, prev_tokens)
        for block in self.blocks:
            x = block(x, positions, attend)
        return self.logits(x)


def _lookup(embed: nnx.Embed, ids: jax.Array) -> jax.Array:
    """``embed(ids)``, also for ids sharded over a mesh of ``Explicit`` axes (where the gather
    needs its output sharding spelled out: the ids' sharding, features replicated)."""
    sharding = jax.typeof(ids).sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or jax.sharding.AxisType.Explicit not in getattr(mesh, "axis_types", ()):
        return embed(ids)
    table = embed.embedding[...]
    return table.at[ids].get(out_sharding=jax.P(*sharding.spec, None))


def previous_tokens(tokens: jax.Array) -> jax.Array:
    """``[B, T]`` the token before each position in natural order (``PAD`` before the first)."""
    return jnp.pad(tokens[:, :-1], ((0, 0), (1, 0)), constant_values=PAD)


def num_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
