"""A Llama-family decoder in Flax NNX whose attention is jax-longctx's.

Token embedding, pre-norm blocks of RMSNorm -> GQA attention with rotary embeddings at
explicit positions -> RMSNorm -> SwiGLU MLP, a final RMSNorm and an output layer (tied to the
embedding when the checkpoint has none, as SmolLM2's). Everything runs in float32 by default.

The attention is a function passed in at call time (``examples.longctx_lm.attention``'s
factories: dense, blockwise, sharded over a mesh), so the same weights run every path, and the
module exposes the same pieces as ``examples.longctx_lm.model.Transformer``
(``embed_inputs``, ``blocks[i].attn.project`` / ``.output``, ``logits``), which is what the
paged serving loop in ``examples.longctx_lm.generate`` drives.

Rotary convention: the Hugging Face one (``rotate_half``: the first and second halves of each
head are the pairs), applied to Q/K weights in Hugging Face row order. GGUF files store Q and
K rows permuted for llama.cpp's interleaved rotary pairs; :mod:`examples.llama.weights` undoes
that when it reads them (checked against transformers' logits in the tests).

Shapes: ``B`` batch, ``T`` tokens, ``D`` model width, ``N`` query heads, ``K`` kv heads,
``H`` head dim, ``F`` MLP width, ``V`` vocabulary.
"""

import dataclasses

import jax
from einops import rearrange
from flax import nnx

from examples.longctx_lm.model import AttendFn, RMSNorm, rope

__all__ = ["Llama", "LlamaConfig"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model shape (frozen: a static argument).

    Attributes:
      vocab_size: ``V``.
      width: ``D``.
      num_layers: decoder blocks.
      num_heads: ``N``.
      num_kv_heads: ``K`` (``N % K == 0``).
      head_dim: ``H`` (even).
      mlp_width: ``F``, the SwiGLU hidden width.
      rope_base: rotary base (SmolLM2: 100000).
      norm_eps: RMSNorm epsilon.
      tie_embeddings: the output layer is the embedding's transpose.
      max_len: the context the checkpoint was trained for (informational).
    """

    vocab_size: int
    width: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_width: int
    rope_base: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_len: int = 8192

    def __post_init__(self):
        for name in ("vocab_size", "width", "num_layers", "num_heads", "num_kv_heads",
                     "mlp_width", "max_len"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig: {name}: expected an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig: num_heads: expected a multiple of num_kv_heads="
                f"{self.num_kv_heads}, got {self.num_heads}"
            )
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim: expected an even int >= 2, got {self.head_dim!r}")  # fmt: skip
        if not self.norm_eps > 0 or not self.rope_base > 0:
            raise ValueError("LlamaConfig: norm_eps, rope_base: expected > 0")


class Attention(nnx.Module):
    """GQA projections around a pluggable attention function."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, N, K, H = cfg.width, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = nnx.Linear(D, N * H, use_bias=False, rngs=rngs)
        self.wk = nnx.Linear(D, K * H, use_bias=False, rngs=rngs)
        self.wv = nnx.Linear(D, K * H, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(N * H, D, use_bias=False, rngs=rngs)

    def project(self, x, positions):
        """``x [B, T, D]`` -> ``q [B, T, N, H]``, ``k, v [B, T, K, H]`` (rotary on q and k)."""
        H, base = self.cfg.head_dim, self.cfg.rope_base
        q = rearrange(self.wq(x), "b t (n h) -> b t n h", h=H)
        k = rearrange(self.wk(x), "b t (k h) -> b t k h", h=H)
        v = rearrange(self.wv(x), "b t (k h) -> b t k h", h=H)
        return rope(q, positions, base), rope(k, positions, base), v

    def output(self, o):
        return self.wo(rearrange(o, "b t n h -> b t (n h)"))

    def __call__(self, x, positions, attend: AttendFn):
        q, k, v = self.project(x, positions)
        return self.output(attend(q, k, v, positions))


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.gate = nnx.Linear(cfg.width, cfg.mlp_width, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(cfg.width, cfg.mlp_width, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp_width, cfg.width, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.width, eps=cfg.norm_eps)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.width, eps=cfg.norm_eps)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, attend: AttendFn):
        x = x + self.attn(self.attn_norm(x), positions, attend)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    """The decoder: ``model(tokens [B, T], positions [B, T], attend) -> logits [B, T, V]``.

    Build it with random weights (``Llama(cfg, rngs=nnx.Rngs(0))``) or from a checkpoint with
    :func:`examples.llama.weights.load_gguf` / :func:`~examples.llama.weights.load_safetensors`.

    Example:
      >>> from examples.longctx_lm.attention import blockwise
      >>> cfg = LlamaConfig(vocab_size=64, width=32, num_layers=2, num_heads=4,
      ...                   num_kv_heads=2, head_dim=8, mlp_width=64)
      >>> model = Llama(cfg, rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((1, 8), jnp.int32), jnp.arange(8)[None], blockwise()).shape
      (1, 8, 64)
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.width, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.width, eps=cfg.norm_eps)
        self.lm_head = nnx.data(None)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Linear(cfg.width, cfg.vocab_size, use_bias=False, rngs=rngs)

    def embed_inputs(self, tokens, prev_tokens=None):
        """``[B, T, D]`` input embeddings (``prev_tokens`` is accepted and unused: the serving
        loop of ``examples.longctx_lm`` passes it for its own model's previous-token input)."""
        del prev_tokens
        return self.embed(tokens)

    def logits(self, x):
        x = self.final_norm(x)
        return self.embed.attend(x) if self.lm_head is None else self.lm_head(x)

    def __call__(self, tokens, positions, attend: AttendFn, prev_tokens=None):
        x = self.embed_inputs(tokens)
        for block in self.blocks:
            x = block(x, positions, attend)
        return self.logits(x)
