"""Long-context retrieval tasks made by the code: passkey retrieval and associative recall.

Every sample is a token sequence with a loss mask on the answer tokens; nothing is downloaded.
Both tasks are solved by the same circuit, an induction head (find the earlier occurrence of
the current token, copy the token after it), so the model must carry information across the
whole context:

* **passkey**: ``BOS filler.. MARK d1..dm filler.. MARK d1..dm``. The key (``m`` digits) sits at
  a random depth; the question is the marker token again, so answering is a pure copy.
* **recall** (multi-query associative recall): ``P`` key-value pairs ``k v`` scattered over the
  context at random depths in filler, then ``Q`` of the keys again at the end, each followed by
  its value. The loss is on the values after the queried keys.

Token ids (one vocabulary for both tasks, :data:`VOCAB_SIZE` ids):
``PAD=0``, ``BOS=1``, ``MARK=2``, filler ``[8, 8 + NUM_FILLER)``, digits/keys
``[KEY0, KEY0 + NUM_KEYS)``, values ``[VALUE0, VALUE0 + NUM_VALUES)``.
"""

import dataclasses
from typing import NamedTuple

import numpy as np

PAD, BOS, MARK = 0, 1, 2
FILLER0, NUM_FILLER = 8, 16
KEY0, NUM_KEYS = FILLER0 + NUM_FILLER, 32
VALUE0, NUM_VALUES = KEY0 + NUM_KEYS, 32
VOCAB_SIZE = VALUE0 + NUM_VALUES  # 88
TASKS = ("passkey", "recall")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """What one task's samples look like.

    Attributes:
      task: ``"passkey"`` or ``"recall"``.
      length: tokens per sample (the model's input is ``length - 1`` tokens).
      key_len: digits of a passkey.
      num_pairs: key-value pairs of a recall sample.
      num_queries: queried keys of a recall sample (``<= num_pairs``).
      depth: fixed depth of the passkey in ``[0, 1]`` (fraction of the context before it), or
        None for a uniformly random depth. In recall every pair is at a random depth.
    """

    task: str = "passkey"
    length: int = 512
    key_len: int = 8
    num_pairs: int = 16
    num_queries: int = 16
    depth: float | None = None

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"TaskConfig: task: expected one of {TASKS}, got {self.task!r}")
        if self.task == "passkey" and not 1 <= self.key_len <= NUM_KEYS:
            raise ValueError(f"TaskConfig: key_len: expected 1..{NUM_KEYS}, got {self.key_len}")
        if self.task == "recall" and not 1 <= self.num_queries <= self.num_pairs <= NUM_KEYS:
            raise ValueError(
                f"TaskConfig: expected 1 <= num_queries <= num_pairs <= {NUM_KEYS}, got "
                f"num_queries={self.num_queries}, num_pairs={self.num_pairs}"
            )
        if self.length < self.min_length:
            raise ValueError(
                f"TaskConfig: length: expected >= {self.min_length} for this task, got "
                f"{self.length}"
            )
        if self.depth is not None and not 0.0 <= self.depth <= 1.0:
            raise ValueError(f"TaskConfig: depth: expected None or in [0, 1], got {self.depth}")

    @property
    def min_length(self) -> int:
        if self.task == "passkey":
            return 2 * self.key_len + 4
        return 2 * self.num_pairs + 2 * self.num_queries + 2

    @property
    def answer_len(self) -> int:
        """Answer tokens per sample (the tokens the loss and the accuracy count)."""
        return self.key_len if self.task == "passkey" else self.num_queries


class Batch(NamedTuple):
    """A batch of samples.

    Attributes:
      tokens: ``[B, length]`` int32 token ids.
      loss_mask: ``[B, length]`` float32, 1 where ``tokens`` is an answer token (predicted
        from the tokens before it).
      answer_start: ``[B]`` int32, index of the first answer token (passkey: the ``m`` digits
        after it are the answer; recall: the answers are at ``loss_mask == 1``).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    answer_start: np.ndarray


def _filler(rng, n):
    return rng.integers(FILLER0, FILLER0 + NUM_FILLER, n)


def _passkey(rng, cfg: TaskConfig):
    L, m = cfg.length, cfg.key_len
    tokens = _filler(rng, L)
    tokens[0] = BOS
    key = rng.choice(NUM_KEYS, m, replace=False) + KEY0
    # Question at the end: MARK then the answer digits in the last m slots.
    q = L - m - 1
    tokens[q] = MARK
    tokens[q + 1 :] = key
    # The key block [MARK, d1..dm] lies in [1, q - m - 1].
    last = q - m - 1
    start = (
        1 + int(rng.integers(0, last)) if cfg.depth is None else 1 + round(cfg.depth * (last - 1))
    )
    tokens[start] = MARK
    tokens[start + 1 : start + 1 + m] = key
    mask = np.zeros(L, np.float32)
    mask[q + 1 :] = 1.0
    return tokens, mask, q + 1


def _recall(rng, cfg: TaskConfig):
    L, P, Q = cfg.length, cfg.num_pairs, cfg.num_queries
    tokens = _filler(rng, L)
    tokens[0] = BOS
    keys = rng.choice(NUM_KEYS, P, replace=False) + KEY0
    values = rng.integers(0, NUM_VALUES, P) + VALUE0
    tail = 2 * Q
    body = L - 1 - tail  # slots 1 .. body hold the pairs in filler
    # P non-overlapping pair slots: choose P starts among body - P positions, spread them.
    starts = np.sort(rng.choice(body - P, P, replace=False)) + np.arange(P) + 1
    order = rng.permutation(P)
    for s, i in zip(starts, order, strict=True):
        tokens[s], tokens[s + 1] = keys[i], values[i]
    asked = rng.choice(P, Q, replace=False)
    mask = np.zeros(L, np.float32)
    for j, i in enumerate(asked):
        pos = L - tail + 2 * j
        tokens[pos], tokens[pos + 1] = keys[i], values[i]
        mask[pos + 1] = 1.0
    return tokens, mask, L - tail + 1


def make_batch(cfg: TaskConfig, batch_size: int, seed: int | np.random.Generator) -> Batch:
    """``batch_size`` fresh samples of ``cfg``'s task, reproducible from ``seed``.

    Example:
      >>> b = make_batch(TaskConfig("passkey", length=32), 2, seed=0)
      >>> b.tokens.shape, int(b.loss_mask.sum())
      ((2, 32), 8)
    """
    if batch_size < 1:
        raise ValueError(f"make_batch: batch_size: expected >= 1, got {batch_size}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    make = _passkey if cfg.task == "passkey" else _recall
    rows = [make(rng, cfg) for _ in range(batch_size)]
    tokens = np.stack([r[0] for r in rows]).astype(np.int32)
    mask = np.stack([r[1] for r in rows]).astype(np.float32)
    start = np.array([r[2] for r in rows], np.int32)
    return Batch(tokens, mask, start)


def batches(cfg: TaskConfig, batch_size: int, seed: int):
    """An endless, seeded stream of :func:`make_batch` batches."""
    rng = np.random.default_rng(seed)
    while True:
        yield make_batch(cfg, batch_size, rng)
