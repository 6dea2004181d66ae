"""A long-context Flax NNX language model built from jax-longctx (user code, public API only).

* :mod:`~examples.longctx_lm.data`: passkey retrieval and associative recall, made by the code.
* :mod:`~examples.longctx_lm.model`: a small Llama-style decoder (RMSNorm, RoPE from explicit
  positions, GQA, SwiGLU) whose attention is passed in.
* :mod:`~examples.longctx_lm.attention`: the switch: dense, blockwise, ring over a mesh.
* :mod:`~examples.longctx_lm.train`: optax AdamW, jitted (and sharded) steps, orbax checkpoints.
* :mod:`~examples.longctx_lm.generate`: prefill into pages, jitted greedy decode from the cache.
* :mod:`~examples.longctx_lm.evaluate`: accuracy of the shipped checkpoint on fresh samples.
"""
