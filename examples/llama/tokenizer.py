"""The byte-level BPE tokenizer of a GGUF file, built with ``tokenizers`` from its metadata.

GGUF files of GPT-2-style tokenizers (``tokenizer.ggml.model == "gpt2"``, SmolLM2's) carry the
vocabulary (``tokenizer.ggml.tokens``, byte-level strings: ``Ġ`` is a leading space), the merge
list (``tokenizer.ggml.merges``) and the token types (3 = control). The tokenizer built here
is what transformers builds from the same file: a byte-level BPE with the GPT-2 split regex,
no prefix space, no BOS added and no normalizer; control tokens (``<|im_start|>`` ...) are
special. The tests check the ids against transformers' on the reference prompts and the round
trip ``decode(encode(text)) == text``.
"""

__all__ = ["tokenizer_from_gguf"]

_CONTROL = 3  # llama.cpp's token type for control tokens


def tokenizer_from_gguf(path):
    """A ``tokenizers.Tokenizer`` from a local GGUF file of a ``gpt2``-model tokenizer, given
    as a path or as an open reader (:func:`examples.llama.weights.open_gguf`).

    Example:
      >>> tok = tokenizer_from_gguf(smollm2_path())  # doctest: +SKIP
      >>> tok.decode(tok.encode("The passkey is 42.").ids)  # doctest: +SKIP
      'The passkey is 42.'
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from examples.llama.weights import open_gguf

    reader = open_gguf(path)
    fields = reader.fields
    kind = fields["tokenizer.ggml.model"].contents()
    if kind != "gpt2":
        raise ValueError(f"tokenizer_from_gguf: tokenizer.ggml.model: expected 'gpt2', got {kind!r}")  # fmt: skip
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL]  # fmt: skip
    tok.add_special_tokens(special)
    return tok
