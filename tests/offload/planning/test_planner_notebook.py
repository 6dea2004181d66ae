"""notebooks/planner.ipynb runs end to end in a Jupyter kernel and computes the right numbers.

The notebook runs in a fresh kernel (tests/_notebooks.py) with ``NOTEBOOK_RESULTS`` pointing at a
JSON file; every number it writes is checked against arithmetic done here, independently of the
planner (numpy for the sizing percentile, bytes from the model shape, pages from the memory).
"""

import math

import numpy as np
import pytest

from tests._notebooks import execute_notebook

GiB = 2**30


def _usable_pages(memory: int, page_bytes: int) -> int:
    return memory // page_bytes - 1  # page 0 is the null page


@pytest.mark.slow  # a fresh kernel importing JAX: about 10 s on 2 shared cores
def test_planner_notebook_computes_the_right_numbers(tmp_path):
    got, _ = execute_notebook("planner", tmp_path, results_var="NOTEBOOK_RESULTS")

    # 1. Llama-3-70B at 256K, TP=8 over one node: 8 kv heads (real) and 64 (the article's count).
    L, N, K, H, bf16, tp = 80, 64, 8, 128, 2, 8
    assert got["article kv bytes per token"] == 2 * L * K * H * bf16 == 327_680
    assert got["article kv bytes per token, all heads"] == 2 * L * N * H * bf16 == 2_621_440
    assert got["article kv bytes per token per device"] == 2 * L * (K // tp) * H * bf16 == 40_960
    assert got["article kv bytes per request"] == 262_144 * 327_680 == 80 * GiB
    # 70,553,706,496 bf16 weights over 8 GPUs; the rest of 72e9 bytes per GPU holds the KV.
    weights = math.ceil(70_553_706_496 * 2 / tp)
    assert got["article weight bytes per device"] == weights
    per_device = _usable_pages(72 * 10**9 - weights, 16 * 40_960)
    assert 262_144 // 16 <= per_device  # one TP group holds the request: no ring
    assert got["article degree"] == 1 and got["article strategy"] is None
    # 64 kv heads: 8 per GPU; bf16 does not fit beside the weights (offloaded to host by
    # default), int8 (H + 4 bytes per head) fits once the workload allows it.
    kv_memory = 72 * 10**9 - weights
    bf16_pages = _usable_pages(kv_memory, 16 * 2 * L * 8 * H * bf16)
    int8_pages = _usable_pages(kv_memory, 16 * 2 * L * 8 * (H + 4))
    assert 262_144 // 16 > bf16_pages and 262_144 // 16 <= int8_pages
    assert got["64 kv heads, exact: kv format"] == "bfloat16"
    assert (
        got["64 kv heads, exact: host bytes"]
        == (262_144 // 16 - bf16_pages) * (16 * 2 * L * 8 * H * bf16) * tp
    )
    assert got["64 kv heads: kv format"] == "int8" and got["64 kv heads: degree"] == 1

    # 2. Your own numbers: the same samples, redrawn here.
    rng = np.random.default_rng(0)
    samples = np.minimum(np.ceil(rng.lognormal(np.log(4096), 1.45, size=2000)), 1 << 20)
    sizing = math.ceil(min(np.percentile(samples, 95) + 2 * np.std(samples), samples.max()))
    assert got["yours: sizing length"] == sizing < samples.max()
    assert got["yours: page size"] == 64  # 70% reuse > 50%
    assert got["yours: prefix saving"] == pytest.approx(0.7 * 2048 / samples.mean())
    token = 2 * 48 * 8 * 128 * 2
    pages = math.ceil(sizing / 64)
    assert got["yours: kv bytes per request"] == pages * 64 * token
    assert got["yours: max sequences per device"] == _usable_pages(40 * GiB, 64 * token) // pages

    # 3. The sweep: no parallelism under 128K; within one node (8) and host offload past 512K.
    page = 16 * token
    usable = _usable_pages(20 * GiB, page)
    for length, degree in got["sweep degrees"].items():
        length = int(length)
        request_pages = math.ceil(length / 16)
        host = got["sweep host bytes"][str(length)]
        if length < 128 * 1024:
            assert degree == 1 and host == 0
            continue
        limit = 8 if length > 512 * 1024 else 16
        fitting = [d for d in range(1, limit + 1) if 16 % d == 0 and d <= limit]
        fitting = [d for d in fitting if math.ceil(request_pages / d) <= usable]
        if fitting:
            assert degree == fitting[0] and host == 0, (length, degree, host)
        else:
            assert degree == 8
            assert host == (request_pages - 8 * usable) * page, (length, host)
    assert got["sweep host bytes"][str(1 << 20)] > 0
