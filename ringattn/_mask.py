"""Mask semantics shared by every attention function in the library, and input checks.

A query at position ``p`` in segment ``s`` sees a key at position ``p'`` in segment ``s'`` iff

* ``s == s'`` (when segment ids are given: packed documents never see each other),
* ``p' <= p`` (when ``causal``),
* ``p' > p - window`` (when ``window`` is given: the ``window`` most recent positions,
  the query's own included).

Positions default to ``arange`` of each sequence. For a chunk of ``T`` queries at the end of
``S`` keys, pass ``q_positions = arange(S - T, S)``.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

__all__ = ["MaskSpec", "attention_mask"]


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Static mask options (hashable, so usable as a ``jit`` static argument).

    Attributes:
      causal: hide keys at later positions.
      window: if set, also hide keys at positions ``<= p - window``; ``window >= 1``.
      softcap: if set, logits become ``softcap * tanh(logits / softcap)``; ``> 0``.
      scale: logit scale; ``None`` means ``1 / sqrt(H)``.
    """

    causal: bool = False
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None

    def __post_init__(self):
        if self.window is not None and (
            isinstance(self.window, bool)
            or not isinstance(self.window, (int, np.integer))
            or self.window < 1
        ):
            raise ValueError(f"window: expected a positive int or None, got {self.window!r}")
        if self.softcap is not None and not (
            isinstance(self.softcap, (int, float)) and self.softcap > 0
        ):
            raise ValueError(f"softcap: expected a positive float or None, got {self.softcap!r}")
        if self.scale is not None and not (
            isinstance(self.scale, (int, float)) and np.isfinite(self.scale)
        ):
            raise ValueError(f"scale: expected a finite float or None, got {self.scale!r}")


def attention_mask(
    q_positions: Int[Array, "B T"],
    kv_positions: Int[Array, "B S"],
    *,
    causal: bool = False,
    window: int | None = None,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
) -> Bool[Array, "B T S"]:
    """The boolean visibility mask ``[B, T, S]`` (True = the query sees the key).

    Args:
      q_positions: ``[B, T]`` integer positions of the queries.
      kv_positions: ``[B, S]`` integer positions of the keys.
      causal: hide keys at positions after the query's.
      window: hide keys at positions ``<= p - window``.
      q_segment_ids: ``[B, T]`` segment ids of the queries, or None.
      kv_segment_ids: ``[B, S]`` segment ids of the keys, or None (both or neither).

    Returns:
      ``[B, T, S]`` bool.
    """
    MaskSpec(causal=causal, window=window)  # validates window
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    qp = q_positions[:, :, None]
    kp = kv_positions[:, None, :]
    mask = jnp.ones(jnp.broadcast_shapes(qp.shape, kp.shape), bool)
    if causal:
        mask &= kp <= qp
    if window is not None:
        mask &= kp > qp - window
    if q_segment_ids is not None:
        mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return mask


def _shape_str(x) -> str:
    return f"shape {tuple(x.shape)} dtype {x.dtype}"


def check_qkv(fn: str, q, k, v) -> tuple[int, int, int, int, int, int]:
    """Checks ``q [B, T, N, H]``, ``k, v [B, S, K, H]``; returns ``(B, T, S, N, K, H)``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{fn}: {name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(
                f"{fn}: {name} must have rank 4 ([B, T|S, N|K, H]), got {_shape_str(x)}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{fn}: {name} must be floating point, got {_shape_str(x)}")
    B, T, N, H = q.shape
    Bk, S, K, Hk = k.shape
    if k.shape != v.shape:
        raise ValueError(f"{fn}: k and v must have the same shape, got k {k.shape} and v {v.shape}")
    if Bk != B:
        raise ValueError(f"{fn}: batch of k/v ({Bk}) must equal batch of q ({B})")
    if Hk != H:
        raise ValueError(f"{fn}: head dim of k/v ({Hk}) must equal head dim of q ({H})")
    if K < 1 or N % K != 0:
        raise ValueError(
            f"{fn}: query heads N={N} must be a multiple of kv heads K={K} (MHA, GQA or MQA)"
        )
    if T < 1 or S < 1:
        raise ValueError(f"{fn}: sequence lengths must be >= 1, got T={T} (q) and S={S} (k/v)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{fn}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return B, T, S, N, K, H


def check_ids(fn: str, name: str, x, shape: tuple[int, ...]):
    """Checks an integer id/position array of the given shape; returns it as int32."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{fn}: {name} must be an integer array, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{fn}: {name} must have shape {tuple(shape)}, got {_shape_str(x)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{fn}: {name} must be an integer array, got {_shape_str(x)}")
    return jnp.asarray(x, jnp.int32)


def normalize_mask_inputs(
    fn: str,
    B: int,
    T: int,
    S: int,
    *,
    q_segment_ids,
    kv_segment_ids,
    q_positions,
    kv_positions,
):
    """Validates segment ids and positions; fills default positions (``arange``)."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(
            f"{fn}: q_segment_ids and kv_segment_ids must be given together "
            f"(got q_segment_ids={'set' if q_segment_ids is not None else None}, "
            f"kv_segment_ids={'set' if kv_segment_ids is not None else None})"
        )
    if q_segment_ids is not None:
        q_segment_ids = check_ids(fn, "q_segment_ids", q_segment_ids, (B, T))
        kv_segment_ids = check_ids(fn, "kv_segment_ids", kv_segment_ids, (B, S))
    if q_positions is None:
        q_positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    else:
        q_positions = check_ids(fn, "q_positions", q_positions, (B, T))
    if kv_positions is None:
        kv_positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    else:
        kv_positions = check_ids(fn, "kv_positions", kv_positions, (B, S))
    return q_segment_ids, kv_segment_ids, q_positions, kv_positions


def resolve_scale(scale: float | None, head_dim: int) -> float:
    return float(scale) if scale is not None else 1.0 / float(np.sqrt(head_dim))
