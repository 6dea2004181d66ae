"""Per-layer pools: a cache's keys (or values) as one buffer per layer.

:class:`LayerPools` holds ``L`` pools ``[K, P, C, H]`` (float arrays or
:class:`paged.QuantizedPages`), one buffer each, so that a step writes layer ``l`` with a
scatter into that layer's buffer (in place under ``jit`` with the cache donated) and reads it
with a gather from the same buffer: a decode step costs what it reads and writes, whatever the
pool holds. One stacked ``[L, K, P, C, H]`` buffer cannot do that on XLA: a read of one layer
followed by a write into the stack makes XLA copy a layer (or the stack) each layer, so a
step's time grows with the pool (``benchmarks/bench_decode_scaling.py`` measures both).

It still reads like the stacked pool it replaced: ``shape`` is ``(L, K, P, C, H)``, ``dtype``,
``ndim`` (5), ``nbytes``, ``format`` (quantized pools) and ``sharding`` are the layers',
``pools[l]`` is layer ``l``'s pool (no copy) and ``pools[l, ...]`` indexes into it. Any other
index (``pools[:, :, ids]``), ``jnp.asarray(pools)`` and ``np.asarray(pools)`` build the
stacked array first: a copy of every layer, for tests and debugging.

It is a pytree whose children are the layers, so it passes through ``jit`` (donate it),
``vmap``, ``lax`` loops and ``jax.tree.map``.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged._checks import is_int, layer_index

__all__ = ["LayerPools", "as_layer_pools", "on_layer", "read_layer", "unit_stack"]


@jax.tree_util.register_pytree_node_class
class LayerPools:
    """``L`` per-layer pools ``[K, P, C, H]``, standing for the stacked ``[L, K, P, C, H]``.

    Attributes:
      layers: a tuple of ``L`` pools of one shape, dtype and kind: float arrays
        ``[K, P, C, H]`` or :class:`paged.QuantizedPages` of one format.

    Example:
      >>> pools = LayerPools((jnp.zeros((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8))))
      >>> pools.shape, len(pools), float(pools[1][0, 3, 1, 7]), float(pools[1, 0, 3, 1, 7])
      ((2, 1, 4, 2, 8), 2, 1.0, 1.0)
    """

    __slots__ = ("layers",)

    def __init__(self, layers):
        self.layers = tuple(layers)

    def tree_flatten(self):
        return self.layers, None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(children)

    def __repr__(self) -> str:
        first = self.layers[0] if self.layers else None
        kind = getattr(getattr(first, "format", None), "kind", None) or getattr(first, "dtype", "")
        return f"LayerPools(L={len(self.layers)}, shape={self.shape}, {kind})"

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.layers), *self.layers[0].shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.layers[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(int(x.nbytes) for x in self.layers)

    @property
    def format(self):
        """The layers' :class:`paged.KVFormat` (quantized pools; AttributeError on floats)."""
        return self.layers[0].format

    @property
    def sharding(self):
        return self.layers[0].sharding

    def __getitem__(self, index) -> Any:
        if is_int(index):
            return self.layers[_layer(index, len(self.layers))]
        if isinstance(index, tuple) and index and is_int(index[0]):
            layer = self.layers[_layer(index[0], len(self.layers))]
            return layer[index[1:]] if len(index) > 1 else layer
        return self.stacked()[index]

    # Quantized layers' leaves, stacked (copies; for tests and export, as for the stack).
    _STACKED_LEAVES = ("data", "scale", "zero", "residual", "residual_len")

    def __getattr__(self, name):
        if name in LayerPools._STACKED_LEAVES or name == "grouping":
            value = getattr(self.layers[0], name)  # AttributeError for float layers
            if value is None or name == "grouping":
                return value
            return jnp.stack([getattr(layer, name) for layer in self.layers])
        raise AttributeError(f"'LayerPools' object has no attribute {name!r}")

    @property
    def at(self):
        """``pools.at[index].set(x)`` (and ``add``, ``get``, ...) as on the stacked float pool:
        the stack is built, updated and split into new per-layer pools (copies; for tests)."""
        return _StackedAt(self)

    def stacked(self):
        """The stacked ``[L, K, P, C, H]`` pool (a copy of every layer; tests and export)."""
        return jax.tree.map(lambda *xs: jnp.stack(xs), *self.layers)

    def __jax_array__(self):
        return self.stacked()

    def __array__(self, dtype=None, copy=None):
        del copy
        return np.asarray(self.stacked(), dtype=dtype)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The decoded stacked pool ``[L, K, P, C, H]`` (quantized layers; a full copy)."""
        return jnp.stack([x.dequantize(dtype) for x in self.layers])


class _StackedAt:
    """``pools.at[index]``: an update of the stacked pool, split back into layers."""

    def __init__(self, pools: "LayerPools"):
        self._pools = pools

    def __getitem__(self, index):
        return _StackedUpdate(self._pools.stacked().at[index])


class _StackedUpdate:
    def __init__(self, at):
        self._at = at

    def get(self, **kwargs):
        return self._at.get(**kwargs)

    def __getattr__(self, op):  # set, add, multiply, min, max, ...
        update = getattr(self._at, op)
        return lambda *args, **kwargs: as_layer_pools(update(*args, **kwargs))


def _layer(index, L: int) -> int:
    index = int(index)
    if not -L <= index < L:
        raise IndexError(f"LayerPools: layer {index} is out of range for {L} layers")
    return index % L


def as_layer_pools(pool) -> LayerPools:
    """``pool`` as per-layer pools: a :class:`LayerPools` as it is; a stacked
    ``[L, K, P, C, H]`` array or ``QuantizedPages`` split into its layers (a copy)."""
    if isinstance(pool, LayerPools):
        return pool
    return LayerPools(pool[i] for i in range(pool.shape[0]))


def unit_stack(pool):
    """A per-layer pool with a leading layer axis of 1 (a free reshape under ``jit``), for the
    stacked kernels; ``x[0]`` of their result takes it off again."""
    return jax.tree.map(lambda x: x[None], pool)


def read_layer(fn: str, k_pages, v_pages, layer, call):
    """``call(k, v)`` on layer ``layer`` of per-layer pools, read in place (see
    :func:`on_layer`).

    Raises:
      ValueError: if only one of ``k_pages`` / ``v_pages`` is a :class:`LayerPools`, their
        ``L`` differ, ``layer`` is None, not an int / integer scalar, or out of range.
    """
    if not (isinstance(k_pages, LayerPools) and isinstance(v_pages, LayerPools)):
        raise ValueError(
            f"{fn}: k_pages, v_pages: expected both paged.LayerPools (a cache's k_pages and "
            f"v_pages) or both pools, got {type(k_pages).__name__} and {type(v_pages).__name__}"
        )
    L = len(k_pages)
    if len(v_pages) != L:
        raise ValueError(f"{fn}: v_pages: expected {L} layers (k_pages'), got {len(v_pages)}")
    if layer is None:
        raise ValueError(
            f"{fn}: layer: per-layer pools (a cache's k_pages / v_pages) need layer= (an int "
            f"in [0, {L}) or a traced integer scalar); or pass one layer's pools, "
            f"cache.k_pages[layer]"
        )
    layer = layer_index(fn, layer, L, traced_ok=True)
    return on_layer(L, layer, lambda i: call(k_pages[i], v_pages[i]))


def on_layer(num_layers: int, layer, fn):
    """``fn(i)`` for layer ``i = layer``: called once with a static int; for a traced integer
    scalar (clamped into ``[0, L)``), ``lax.switch`` over ``fn(0) ... fn(L - 1)``, each branch
    reading its own layer's buffers (no stacking, no copy)."""
    if is_int(layer):
        return fn(int(layer))
    index = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1)
    return jax.lax.switch(index, [functools.partial(fn, i) for i in range(num_layers)])
