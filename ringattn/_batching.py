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


def _fold(x, batched: bool, size: int, axis: int):
    """``[V, ..., B, ...]`` (``B`` at ``axis`` once ``V`` is removed) → ``V * B`` at ``axis``."""
    if x is None:
        return None
    if not batched:
        x = jnp.broadcast_to(x, (size, *x.shape))
    if axis:
        x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], size * x.shape[axis + 1], *x.shape[axis + 2 :])


def _unfold(y, size: int, axis: int):
    y = y.reshape(*y.shape[:axis], size, y.shape[axis] // size, *y.shape[axis + 1 :])
    return jnp.moveaxis(y, axis, 0) if axis else y


def fold_vmap(fn, in_axes=None, out_axes=None):
    """``fn(*args)`` (pytrees of arrays, each with the batch ``B`` as axis 0, returning such a
    pytree), vmapped by running ``fn`` once on ``[V * B, ...]`` arrays.

    ``in_axes`` (one int per positional argument, for all its leaves, or a tuple of them for a
    tuple argument) and ``out_axes`` (one int
    per element of the returned tuple) name where ``B`` is when it is not axis 0, as in the
    block-major ``[n, B, ...]`` layouts a kernel is handed once per call.
    """
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def rule(axis_size, in_batched, *args):
        axes = (0,) * len(args) if in_axes is None else in_axes

        def fold(arg, batched, a):
            if isinstance(a, tuple):  # a tuple argument, one axis per element
                return tuple(fold(*xs) for xs in zip(arg, batched, a, strict=True))
            return jax.tree.map(lambda x, b: _fold(x, b, axis_size, a), arg, batched)

        folded = tuple(fold(*xs) for xs in zip(args, in_batched, axes, strict=True))
        out = fn(*folded)
        if out_axes is None:
            out = jax.tree.map(lambda y: _unfold(y, axis_size, 0), out)
        else:
            out = tuple(
                jax.tree.map(lambda y, a=a: _unfold(y, axis_size, a), o)
                for o, a in zip(out, out_axes, strict=True)
            )
        return out, jax.tree.map(lambda _: True, out)

    return wrapped
