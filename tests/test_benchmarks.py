"""The benchmarks' own correctness checks, at tiny sizes (no timing).

``bench_train`` and ``bench_decode`` check, before timing, that every method they time computes
the same thing (the same training-step loss and gradient norm; the same greedy tokens). These
tests run those checks on a tiny model so a broken benchmark path shows up in CI.
"""

import numpy as np
import pytest
from flax import nnx

from benchmarks import bench_decode, bench_quality, bench_train
from examples.longctx_lm.model import ModelConfig, Transformer
from ringattn import BlockSizes

TINY = ModelConfig(width=32, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, mlp_width=64)


def test_bench_train_strategies_agree_with_the_one_device_step():
    errors = bench_train.check_agreement(
        context=128, batch=2, model_cfg=TINY, block_sizes=BlockSizes(block_q=16, block_kv=16)
    )
    assert set(errors) == set(bench_train.METHODS)


def test_bench_decode_methods_emit_the_same_greedy_tokens():
    model = Transformer(TINY, rngs=nnx.Rngs(3))
    tokens = bench_decode.check_greedy_agreement(model, context=40, new_tokens=6)
    assert tokens.shape == (6,)


@pytest.mark.slow
def test_bench_quality_demote_is_exact_and_drop_is_scored():
    """The harness on a tiny model, scored against its own full-KV greedy output: every rule
    is exact when demoting (all pages come back), and full budget is exact when dropping."""
    from examples.longctx_lm import generate

    model = Transformer(TINY, rngs=nnx.Rngs(4))
    prompts, _ = bench_quality.passkey_prompts(120, 0.5, 3, seed=0)
    server = generate.Server(model, num_pages=64, page_size=16, max_len=160, batch=3, chunk=64)
    answers = np.stack(server.generate(list(prompts), 4))
    for kind in bench_quality.KINDS:
        select = bench_quality.make_rule(kind, 0.2)
        acc, mass, moved = bench_quality.evaluate_rule(model, select, "demote", prompts, answers, batch=3)  # fmt: skip
        assert acc == 1.0 and 0.0 <= mass <= 1.0 and moved > 0, kind
    full = bench_quality.make_rule("h2o", 1.0)
    acc, mass, moved = bench_quality.evaluate_rule(model, full, "drop", prompts, answers, batch=3)
    assert acc == 1.0 and abs(mass - 1.0) < 1e-5 and moved == 0
