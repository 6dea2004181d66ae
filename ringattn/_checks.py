"""Input checks shared by every public function of ``ringattn``: one error format.

Every check raises ``ValueError(f"{fn}: {arg}: expected {X}, got {Y}")``. Scalar options
accept Python and numpy scalars of the right kind and are normalised to Python types (so they
can become static ``jit`` arguments); ``bool`` is never an int, and a float is never silently
truncated to an int.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FloatLike",
    "IntLike",
    "check_bool",
    "check_float",
    "check_ids",
    "check_int",
    "check_qkv",
    "refuse_bias",
    "check_static",
    "describe",
    "fail",
]

IntLike = int | np.integer
FloatLike = float | int | np.floating | np.integer


def fail(fn: str, arg: str, expected: str, got) -> ValueError:
    """The library's one error: ``fn: arg: expected X, got Y`` (returned, so ``raise fail()``)."""
    return ValueError(f"{fn}: {arg}: expected {expected}, got {got}")


def describe(x) -> str:
    """``shape (...) dtype ...`` for arrays, the type and value for anything else."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"shape {tuple(x.shape)} dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"


def check_static(fn: str, arg: str, value, what: str) -> None:
    """Raises the library's error for an option that arrived traced (``jax.jit(f)(...,
    causal=True)``): it says so, and how to bind the option before ``jit``."""
    if isinstance(value, jax.core.Tracer):
        name = arg.split("[")[0].split(".")[0]  # window[0] -> window
        raise fail(
            fn,
            arg,
            f"{what} known before tracing (options are static)",
            f"a traced value ({describe(value)}): bind it before jax.jit, "
            f"jax.jit(functools.partial({fn}, {name}=...)) or "
            f"jax.jit({fn}, static_argnames=({name!r},))",
        )


def fold_traced_scale(fn: str, q, scale):
    """``(q, scale)`` with a traced ``scale`` (a temperature under ``jit`` / ``grad`` /
    ``vmap``) folded into the queries: ``(q * scale).astype(q.dtype), 1.0``. The logits
    ``(q * s) k^T`` are ``s (q k^T)`` up to rounding in ``q``'s dtype, and autodiff reaches
    ``scale`` through the product. Any other ``scale`` (and a ``q`` that is no floating
    array, which the shape checks reject) comes back as it was."""
    if not isinstance(scale, jax.core.Tracer):
        return q, scale
    if scale.ndim != 0 or not jnp.issubdtype(scale.dtype, jnp.floating):
        raise fail(
            fn, "scale", "a float scalar (a traced scale must have shape ())", describe(scale)
        )
    if not hasattr(q, "dtype") or not jnp.issubdtype(q.dtype, jnp.floating):
        return q, scale
    return (q * scale).astype(q.dtype), 1.0


def check_int(fn: str, arg: str, value, *, minimum: int | None = None) -> int:
    """A Python or numpy integer (not ``bool``, not a float) ``>= minimum``, as a Python int."""
    what = "an int" if minimum is None else f"an int >= {minimum}"
    check_static(fn, arg, value, what)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise fail(fn, arg, what, describe(value))
    value = int(value)
    if minimum is not None and value < minimum:
        raise fail(fn, arg, what, value)
    return value


def check_float(fn: str, arg: str, value, *, positive: bool = False, finite: bool = True) -> float:
    """A Python or numpy int/float scalar (not ``bool``), as a Python float."""
    what = "a positive finite float" if positive else "a finite float" if finite else "a float"
    check_static(fn, arg, value, what)
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise fail(fn, arg, what, describe(value))
    value = float(value)
    if (finite or positive) and not math.isfinite(value):
        raise fail(fn, arg, what, value)
    if positive and not value > 0:
        raise fail(fn, arg, what, value)
    return value


def check_bool(fn: str, arg: str, value) -> bool:
    """A Python or numpy bool, as a Python bool."""
    check_static(fn, arg, value, "a bool")
    if not isinstance(value, (bool, np.bool_)):
        raise fail(fn, arg, "a bool", describe(value))
    return bool(value)


def _check_array(fn: str, arg: str, x, ndim: int, layout: str) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise fail(fn, arg, f"an array of rank {ndim} {layout}", type(x).__name__)
    if x.ndim != ndim:
        raise fail(fn, arg, f"rank {ndim} {layout}", describe(x))
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise fail(fn, arg, "a floating-point array", describe(x))


def check_qkv(fn: str, q, k, v) -> tuple[int, int, int, int, int, int]:
    """Checks ``q [B, T, N, H]``, ``k, v [B, S, K, H]``; returns ``(B, T, S, N, K, H)``.

    Batch ``0`` and lengths ``0`` are allowed (the result is then empty or all-masked); zero
    heads or a zero head dim are ValueErrors naming the argument.
    """
    _check_array(fn, "q", q, 4, "[B, T, N, H]")
    _check_array(fn, "k", k, 4, "[B, S, K, H]")
    _check_array(fn, "v", v, 4, "[B, S, K, H]")
    B, T, N, H = q.shape
    Bk, S, K, Hk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise fail(fn, "v", f"the shape of k {tuple(k.shape)}", describe(v))
    if Bk != B:
        raise fail(fn, "k", f"batch {B} (that of q)", describe(k))
    if Hk != H:
        raise fail(fn, "k", f"head dim {H} (that of q)", describe(k))
    if H < 1:
        raise fail(fn, "q", "head dim H >= 1", describe(q))
    if K < 1:
        raise fail(fn, "k", "kv heads K >= 1", describe(k))
    if N < 1 or N % K != 0:
        raise fail(fn, "q", f"query heads N a positive multiple of kv heads K={K}", describe(q))
    if not (q.dtype == k.dtype == v.dtype):
        raise fail(fn, "k, v", f"the dtype of q ({q.dtype})", f"{k.dtype} and {v.dtype}")
    return B, T, S, N, K, H


def check_ids(fn: str, arg: str, x, shape: tuple[int, ...]):
    """Checks an integer array (ids, positions, lengths) of ``shape``; returns it as int32."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise fail(fn, arg, f"an integer array of shape {tuple(shape)}", type(x).__name__)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise fail(fn, arg, f"an integer array of shape {tuple(shape)}", describe(x))
    if tuple(x.shape) != tuple(shape):
        raise fail(fn, arg, f"shape {tuple(shape)}", describe(x))
    return jnp.asarray(x, jnp.int32)


def refuse_bias(fn: str, bias) -> None:
    """The error of a path that takes no logit bias (``bias`` not None), naming those that do."""
    if bias is not None:
        raise fail(
            fn,
            "bias",
            "None (this path takes no logit bias; ringattn.blockwise_attention with "
            "impl='xla', ringattn.attention_reference and ringattn.dot_product_attention, "
            "single device, take one)",
            describe(bias),
        )
