"""The one varying-axes helper for code inside ``jax.shard_map(check_vma=True)``.

Under ``check_vma=True`` every value inside ``shard_map`` carries the set of manual mesh axes
it varies along; loop carries, ``switch`` branches and a ``custom_vjp``'s cotangents must
agree on it. :func:`match_varying` casts arrays to the union of their varying axes (the
transpose of that cast is the ``psum`` a replicated input's gradient needs). Outside
``shard_map`` everything is a no-op. This is the only place that reads the varying axes
from JAX's abstract values.
"""

import jax
from jax import lax

__all__ = ["cast_varying", "match_varying", "varying_axes", "varying_struct"]


def _axes_of(x) -> frozenset:
    aval = jax.typeof(x)
    for attr in ("mat", "manual_axis_type"):  # JAX 0.10: ManualAxisType(varying=...)
        mat = getattr(aval, attr, None)
        if mat is not None:
            return frozenset(getattr(mat, "varying", None) or ())
    return frozenset(getattr(aval, "vma", None) or ())  # earlier JAX


def varying_axes(*xs) -> frozenset:
    """Manual mesh axes along which any array of the pytrees ``xs`` varies (``None`` ok).

    Inside ``jax.shard_map(check_vma=True)`` an array sharded over a mesh axis varies along
    it, a replicated one does not; outside ``shard_map`` the result is empty.

    Args:
      *xs: arrays or pytrees of arrays (``None`` leaves are skipped).

    Returns:
      ``frozenset`` of axis names.

    Example:
      >>> import jax.numpy as jnp
      >>> varying_axes(jnp.ones(2), None)  # outside shard_map
      frozenset()
    """
    axes = frozenset()
    for leaf in jax.tree.leaves(xs):
        axes |= _axes_of(leaf)
    return axes


def cast_varying(tree, axes: frozenset):
    """``pcast`` every leaf of ``tree`` to vary along ``axes`` (no-op where it already does)."""

    def one(x):
        missing = tuple(sorted(axes - _axes_of(x), key=str))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def match_varying(*xs):
    """Casts every array (or pytree) to vary along the union of the varying axes of all.

    Use inside ``jax.shard_map(check_vma=True)`` before combining a replicated array (a
    decode query, a sink logit) with a sharded one in a loop, a ``switch`` or a
    ``custom_vjp``. ``None`` entries pass through. Outside ``shard_map`` it returns its inputs.

    Args:
      *xs: arrays or pytrees of arrays.

    Returns:
      A tuple of the inputs, cast (always a tuple, also for one input).

    Example:
      >>> import jax.numpy as jnp
      >>> a, b = match_varying(jnp.ones(2), jnp.zeros(2))  # outside shard_map: unchanged
    """
    axes = varying_axes(*xs)
    return tuple(cast_varying(x, axes) for x in xs)


def varying_struct(shape, dtype, *like) -> jax.ShapeDtypeStruct:
    """A ``jax.ShapeDtypeStruct`` that varies along the manual axes of the arrays ``like``.

    ``pallas_call`` inside ``jax.shard_map(check_vma=True)`` needs its ``out_shape`` to say
    how each output varies; a kernel's outputs vary along every axis one of its operands
    does. Outside ``shard_map`` the struct carries no axes (and ``pallas_call`` ignores them).

    Args:
      shape: the output's shape (a tuple of ints).
      dtype: its dtype.
      *like: arrays or pytrees whose varying axes the output takes (their union).

    Returns:
      ``jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=...)``.

    Example:
      >>> import jax.numpy as jnp
      >>> varying_struct((4, 8), jnp.float32, jnp.ones(3)).shape
      (4, 8)
    """
    mat = jax.sharding.ManualAxisType(varying=varying_axes(*like))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
