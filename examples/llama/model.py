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

from flax import nnx

# The GQA projections (rotary at explicit positions) and the SwiGLU MLP are the small example
# model's: they read only the config fields both configs share.
from examples.longctx_lm.model import MLP, AttendFn, Attention, RMSNorm

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
      >>> import jax.numpy as jnp
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
