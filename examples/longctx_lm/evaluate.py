"""Accuracy of a checkpoint on fresh samples.

``python -m examples.longctx_lm.evaluate --task passkey --samples 64 --seed 1`` loads the
committed checkpoint, evaluates fresh samples drawn with the seed at the context it was last trained
at (or ``--length``), and prints one JSON object as its last line with ``task``, ``length``,
``samples``, ``accuracy`` (exact match: a passkey sample counts when all its digits are right,
a recall query when its value is right) and ``checkpoint``.
"""

import argparse
import json
import os

from examples.longctx_lm import attention
from examples.longctx_lm.train import evaluate, load_checkpoint

CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", choices=("passkey", "recall"), required=True)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--length", type=int, default=None, help="context; default: trained length")
    p.add_argument("--checkpoint", default=CHECKPOINT)
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error(f"--samples: expected >= 1, got {args.samples}")
    model, meta = load_checkpoint(args.checkpoint)
    length = args.length or meta["history"][-1]["context"]  # the context it was trained at last
    accuracy = evaluate(model, args.task, length, args.samples, args.seed, attention.blockwise())
    result = {
        "task": args.task,
        "length": length,
        "samples": args.samples,
        "seed": args.seed,
        "accuracy": accuracy,
        "checkpoint": os.path.relpath(args.checkpoint),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
