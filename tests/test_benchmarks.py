"""The benchmarks' own correctness checks, at tiny sizes (no timing).

``bench_train`` and ``bench_decode`` check, before timing, that every method they time computes
the same thing (the same training-step loss and gradient norm; the same greedy tokens). These
tests run those checks on a tiny model so a broken benchmark path shows up in CI.
"""

from flax import nnx

from benchmarks import bench_decode, bench_train
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
