"""RULER-style synthetic tasks, generated from a seed (no data files).

Six of RULER's synthetic tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of
Your Long-Context Language Models?"), with its templates for base models (no chat template):

* ``niah_single``: one needle ("One of the special magic numbers for {key} is: {7 digits}.")
  in a haystack of the repeated noise sentences; asked for that key's number.
* ``niah_multikey``: the same, with three distractor needles of other keys around it.
* ``niah_multivalue``: four needles for the same key; every value must come back.
* ``niah_multiquery``: four needles of four keys; all four are asked for at once.
* ``variable_tracking``: a chain ``VAR A = 12345``, ``VAR B = VAR A`` ... hidden in noise;
  every variable that holds the value must be named.
* ``common_words``: a list of words where ten occur far more often than the rest; the ten
  must be named.

A :class:`Sample` is a context (compressed by a press before the question, in kvpress's
question-agnostic mode), a question, an answer prefix the model continues, and the expected
strings. Scoring is RULER's: the fraction of expected strings found in the output
(``niah_single`` and ``niah_multikey`` have one, so exact match).

Lengths are in tokens of the given tokenizer: the haystack grows sentence by sentence until
context + question + answer prefix reach ``length`` (within one sentence below).

Use (any tokenizer: ``count`` maps a text to its number of tokens)::

    from examples.llama import ruler

    sample = ruler.make_sample("niah_single", 4096, seed=0, count=lambda t: len(tok.encode(t).ids))
    prompt = sample.context + sample.question + sample.answer_prefix   # == sample.prompt
    ruler.score(sample, generated_text)   # in [0, 1]

``benchmarks/bench_ruler.py`` (the harness) and ``notebooks/real_model.py`` use it.
"""

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

__all__ = ["NOISE", "TASKS", "Sample", "make_sample", "score"]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_WORDS = (
    "apple river stone cloud tiger lamp garden violin pepper candle marble forest rocket "
    "silver harbor meadow falcon copper lantern basket island mirror orchard pencil saddle "
    "thunder velvet whisper anchor blossom canyon dagger ember feather glacier hammer "
    "jasmine kettle ladder magnet needle oyster parrot quartz ribbon saffron tunnel umbrella "
    "walnut yarrow zephyr bamboo cobalt dolphin elbow fossil granite hazel igloo jigsaw "
    "kernel lemon mango nectar olive pillow quiver raven spruce tulip urchin vessel willow "
    "acorn beacon cactus drizzle easel fiddle goblet hollow ivory juniper koala lotus "
    "mosaic nutmeg opal pebble quill radish sequoia thistle vapor wombat yodel zinnia"
).split()
PREFIX_NIAH = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards.\n"
)


@dataclasses.dataclass(frozen=True)
class Sample:
    """One task instance: ``context + question`` is the prompt, the model continues
    ``answer_prefix``; ``expected`` are the strings to find in its output."""

    task: str
    context: str
    question: str
    answer_prefix: str
    expected: tuple[str, ...]

    @property
    def prompt(self) -> str:
        return self.context + self.question + self.answer_prefix


def score(sample: Sample, output: str) -> float:
    """RULER's score: the fraction of ``sample.expected`` found in ``output``."""
    return sum(e in output for e in sample.expected) / len(sample.expected)


def _number(rng) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _keys(rng, n: int) -> list[str]:
    words = rng.choice(len(_WORDS), size=2 * n, replace=False)
    return [f"{_WORDS[words[2 * i]]}-{_WORDS[words[2 * i + 1]]}" for i in range(n)]


def _fill(count: Callable[[str], int], length: int, build: Callable[[int], str]) -> str:
    """``build(n)`` with the largest ``n`` noise repeats whose token count is at most
    ``length`` (a binary search over ``n``)."""
    if count(build(0)) > length:
        raise ValueError(f"make_sample: length: {length} tokens cannot hold the task's text")
    lo, hi = 0, 1
    while count(build(hi)) <= length:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(build(mid)) <= length else (lo, mid)
    return build(lo)


def _haystack(n: int, needles: list[str], depths: list[float]) -> str:
    """``n`` noise paragraphs with each needle inserted at its depth (fraction of ``n``)."""
    parts = [NOISE] * n
    for needle, depth in sorted(zip(needles, depths, strict=True), key=lambda x: -x[1]):
        parts.insert(round(depth * n), needle)
    return " ".join(parts)


def _niah(rng, count, length, *, keys: int, values: int, queries: int, task: str) -> Sample:
    names = _keys(rng, keys)
    needles, answers = [], {}
    for key in names:
        vals = [_number(rng) for _ in range(values if key == names[0] else 1)]
        answers[key] = vals
        needles += [f"One of the special magic numbers for {key} is: {v}." for v in vals]
    depths = list(rng.uniform(0.0, 1.0, size=len(needles)))
    order = rng.permutation(len(needles))
    needles = [needles[i] for i in order]
    asked = names[:queries]
    expected = tuple(v for key in asked for v in answers[key])
    if queries > 1:
        who = ", ".join(asked[:-1]) + f", and {asked[-1]}"
        question = f"\nWhat are all the special magic numbers for {who} mentioned in the provided text?"  # fmt: skip
        prefix = f" The special magic numbers for {who} mentioned in the provided text are"
    elif values > 1:
        question = f"\nWhat are all the special magic numbers for {asked[0]} mentioned in the provided text?"  # fmt: skip
        prefix = f" The special magic numbers for {asked[0]} mentioned in the provided text are"
    else:
        question = f"\nWhat is the special magic number for {asked[0]} mentioned in the provided text?"  # fmt: skip
        prefix = f" The special magic number for {asked[0]} mentioned in the provided text is"
    tail = question + prefix

    def build(n):
        return PREFIX_NIAH + _haystack(n, needles, depths) + "\n"

    context = _fill(lambda c: count(c + tail), length, build)
    return Sample(task, context, question, prefix, expected)


def _variable_tracking(rng, count, length) -> Sample:
    value = str(int(rng.integers(10_000, 100_000)))
    names = ["".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), size=5)) for _ in range(5)]
    chain = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))
    ]
    depths = sorted(rng.uniform(0.0, 1.0, size=len(chain)))
    question = (
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above."
    )
    prefix = (
        f" Answer: According to the chain(s) of variable assignment in the text above, "
        f"{len(names)} variables are assgined the value {value}, they are:"
    )

    def build(n):
        return (
            "Memorize and track the chain(s) of variable assignment hidden in the following "
            "text.\n\n" + _haystack(n, chain, depths) + "\n"
        )

    context = _fill(lambda c: count(c + question + prefix), length, build)
    return Sample("variable_tracking", context, question, prefix, tuple(names))


def _common_words(rng, count, length) -> Sample:
    pool = rng.permutation(len(_WORDS))
    common = [_WORDS[i] for i in pool[:10]]
    rare = [_WORDS[i] for i in pool[10:]]
    question = "\nQuestion: What are the 10 most common words in the above list?"
    prefix = " Answer: The top 10 words that appear most often in the list are:"

    def build(n):
        words = common * max(3, n // 15) + [rare[i % len(rare)] for i in range(n)]
        words = [words[i] for i in np.random.default_rng(n).permutation(len(words))]
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        return "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n" + listing + "\n"  # fmt: skip

    context = _fill(lambda c: count(c + question + prefix), length, build)
    return Sample("common_words", context, question, prefix, tuple(common))


_NIAH = {  # (keys, values per asked key, keys asked)
    "niah_single": (1, 1, 1),
    "niah_multikey": (4, 1, 1),
    "niah_multivalue": (1, 4, 1),
    "niah_multiquery": (4, 1, 4),
}
TASKS: dict[str, Callable] = {
    **{
        name: functools.partial(_niah, keys=k, values=v, queries=q, task=name)
        for name, (k, v, q) in _NIAH.items()
    },
    "variable_tracking": _variable_tracking,
    "common_words": _common_words,
}


def make_sample(task: str, length: int, seed: int, count: Callable[[str], int]) -> Sample:
    """A :class:`Sample` of ``task`` whose prompt is at most ``length`` tokens by ``count``
    (a function ``text -> number of tokens``), drawn from ``seed``."""
    if task not in TASKS:
        raise ValueError(f"make_sample: task: expected one of {sorted(TASKS)}, got {task!r}")
    if length < 64:
        raise ValueError(f"make_sample: length: expected >= 64 tokens, got {length}")
    return TASKS[task](np.random.default_rng(seed), count, length)
