"""The paged kernels take no logit bias: a ValueError naming the functions that do."""

import functools

import jax.numpy as jnp
import pytest

import paged


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    "fn",
    [
        functools.partial(paged.paged_attention, page_table=None, lengths=None),
        functools.partial(
            paged.ragged_paged_attention, page_table=None, lengths=None, cu_q_lens=None, num_seqs=1
        ),
    ],
    ids=["paged_attention", "ragged_paged_attention"],
)
def test_bias_is_refused(fn):
    q = jnp.zeros((1, 1, 4, 8))
    pages = jnp.zeros((2, 4, 16, 8))
    with pytest.raises(ValueError, match=r"bias: expected None .*ringattn.blockwise_attention"):
        fn(q, pages, pages, bias=jnp.zeros((1, 1, 1, 16)))
