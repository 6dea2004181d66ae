"""``jax.vmap`` over the blockwise kernels: fold the mapped axis into the batch axis.

The kernels choose per block pair whether to skip, compute unmasked or compute masked, from
block summaries reduced over the batch: each row of blocks runs two loops whose trip counts
and block indices are computed (:func:`ringattn._blocks.visit_order`). Under ``vmap`` those
would be batched, which turns each loop into one over the most blocks of any batch member
with a select per step (no work skipped). The kernels are batch-polymorphic in their leading
``B`` axis, so a vmapped call is the same kernel on a batch of ``V * B`` rows:
:func:`fold_vmap` gives a kernel that custom batching rule.
"""

import jax
import jax.numpy as jnp


def _fold(x, batched: bool, size: int):
    if x is None:
        return None
    if not batched:
        x = jnp.broadcast_to(x, (size, *x.shape))
    return x.reshape(size * x.shape[1], *x.shape[2:])


def fold_vmap(fn):
    """``fn(*args)`` (pytrees of arrays, each with the batch ``B`` as axis 0, returning such a
    pytree), vmapped by running ``fn`` once on ``[V * B, ...]`` arrays."""
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def rule(axis_size, in_batched, *args):
        folded = jax.tree.map(lambda x, b: _fold(x, b, axis_size), args, tuple(in_batched))
        out = fn(*folded)
        unfold = lambda y: y.reshape(axis_size, y.shape[0] // axis_size, *y.shape[1:])
        out = jax.tree.map(unfold, out)
        return out, jax.tree.map(lambda _: True, out)

    return wrapped
