"""The planner's workload description: :class:`LengthDistribution` and :class:`Workload`.

Request lengths (from samples or from p50 / p95 / p99, with the sizing length of rule 1), and
the workload (model, lengths, prefix reuse, tensor parallelism, opt-in lossy formats). Validated
when built. Pure Python.
"""

import dataclasses
import math

import numpy as np

from offload import _checks
from offload.planning._model_shape import QUANTIZED_FORMATS, ModelShape, refuse_kivi2_window
from paged import KVFormat

__all__ = ["LengthDistribution", "Workload"]


# Normal quantiles of the 95th and 99th percentiles (for a log-normal through p50 and p99).
_Z95, _Z99 = 1.6448536269514722, 2.3263478740408408


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Context lengths (tokens per request) as a few statistics.

    Build it with :meth:`from_samples` (observed lengths) or :meth:`from_percentiles`.

    Attributes:
      p50, p95, p99: percentiles in tokens (``1 <= p50 <= p95 <= p99``).
      sigma: standard deviation in tokens (``>= 0``).
      mean: mean in tokens (``> 0``).
      max_length: the longest request (samples) or the longest allowed (``>= p99``), or
        ``None`` when unknown.
      count: number of samples, or ``None``.

    Raises:
      ValueError: on percentiles out of order, non-positive lengths, a negative or non-finite
        sigma, or ``max_length < p99``.
    """

    p50: float
    p95: float
    p99: float
    sigma: float
    mean: float
    max_length: int | None = None
    count: int | None = None

    def __post_init__(self):
        fn = "LengthDistribution"
        for name in ("p50", "p95", "p99", "mean"):
            _checks.check_float(fn, name, getattr(self, name), low=0.0, low_open=True)
        _checks.check_float(fn, "sigma", self.sigma, low=0.0)
        if not self.p50 <= self.p95 <= self.p99:
            raise ValueError(
                f"{fn}: percentiles: expected p50 <= p95 <= p99, got p50={self.p50}, "
                f"p95={self.p95}, p99={self.p99}"
            )
        if self.p50 < 1:
            raise ValueError(f"{fn}: p50: expected at least 1 token, got {self.p50}")
        if self.max_length is not None:
            _checks.check_int(fn, "max_length", self.max_length, low=1)
            if self.max_length < self.p99:
                raise ValueError(
                    f"{fn}: max_length: expected >= p99={self.p99}, got {self.max_length}"
                )
        if self.count is not None:
            _checks.check_int(fn, "count", self.count, low=1)

    @classmethod
    def from_samples(cls, samples) -> "LengthDistribution":
        """Statistics of observed lengths (numpy's linear percentiles, population ``std``).

        Args:
          samples: a non-empty 1-D sequence of positive integer lengths in tokens.

        Raises:
          ValueError: on an empty, non-1-D, non-integer or non-positive sample set.

        Example:
          >>> LengthDistribution.from_samples([100, 200, 300]).p50
          200.0
        """
        fn = "LengthDistribution.from_samples"
        x = np.asarray(samples)
        if x.ndim != 1 or x.size == 0:
            raise ValueError(f"{fn}: samples: expected a non-empty 1-D sequence, got {x.shape}")
        if x.dtype.kind not in "iu":
            if x.dtype.kind != "f" or not np.all(np.isfinite(x)) or np.any(x != np.round(x)):
                raise ValueError(f"{fn}: samples: expected integer lengths, got dtype {x.dtype}")
        if np.any(x < 1):
            raise ValueError(f"{fn}: samples: expected lengths >= 1, got min {x.min()}")
        x = x.astype(np.float64)
        p50, p95, p99 = (float(v) for v in np.percentile(x, [50, 95, 99]))
        return cls(
            p50=p50,
            p95=p95,
            p99=p99,
            sigma=float(np.std(x)),
            mean=float(np.mean(x)),
            max_length=int(x.max()),
            count=int(x.size),
        )

    @classmethod
    def from_percentiles(
        cls, p50, p95, p99, *, sigma=None, mean=None, max_length=None
    ) -> "LengthDistribution":
        """Statistics from percentiles; ``sigma`` and ``mean`` default to those of the
        log-normal through ``p50`` and ``p99`` (production lengths are long-tailed, rule 3).

        With ``s = ln(p99 / p50) / z99``: ``mean = p50 * exp(s**2 / 2)``, ``sigma = p50 *
        sqrt(exp(s**2) * (exp(s**2) - 1))``.

        Args:
          p50, p95, p99: percentiles in tokens, ``1 <= p50 <= p95 <= p99``.
          sigma, mean: override the log-normal estimates.
          max_length: the longest request allowed (caps the sizing length), or ``None``.

        Raises:
          ValueError: as the class.
        """
        fn = "LengthDistribution.from_percentiles"
        named = (("p50", p50), ("p95", p95), ("p99", p99))
        p50, p95, p99 = (_checks.check_float(fn, n, v, low=0.0, low_open=True) for n, v in named)
        if not p50 <= p95 <= p99:
            raise ValueError(
                f"{fn}: percentiles: expected p50 <= p95 <= p99, got p50={p50}, p95={p95}, "
                f"p99={p99}"
            )
        s2 = (math.log(p99 / p50) / _Z99) ** 2
        if sigma is None:
            sigma = p50 * math.sqrt(math.exp(s2) * math.expm1(s2))
        if mean is None:
            mean = p50 * math.exp(s2 / 2)
        sigma = _checks.check_float(fn, "sigma", sigma, low=0.0)
        mean = _checks.check_float(fn, "mean", mean, low=0.0, low_open=True)
        return cls(p50=p50, p95=p95, p99=p99, sigma=sigma, mean=mean, max_length=max_length)

    @property
    def sizing_length(self) -> int:
        """Rule 1: ``ceil(p95 + 2 sigma)``, capped at ``max_length`` when it is known."""
        length = self.p95 + 2.0 * self.sigma
        if self.max_length is not None:
            length = min(length, float(self.max_length))
        return math.ceil(length)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What is served and how: the model, the lengths, the prefix reuse, tensor parallelism
    and which lossy KV formats (if any) are allowed.

    Attributes:
      model: a :class:`ModelShape`.
      lengths: a :class:`LengthDistribution` of context lengths.
      prefix_reuse: share of requests that start with the same shared prefix, in ``[0, 1]``.
      prefix_tokens: tokens of that shared prefix (``>= 0``).
      quantization: lossy quantized KV formats the planner may switch to when the model's own
        format does not fit (tried from the most bytes to the fewest): ``paged.KVFormat``
        values or their kinds, stored as kinds (an int4 KVFormat must have the model's
        ``group_size``). Default ``()``: only
        the model's own format. Lossy formats are opt-in: their accuracy loss was measured only
        on this repo's 400K-parameter toy model, not on a real one; measure yours first.
      latency_tolerant: whether requests tolerate disk (NVMe) latency (the article's case C:
        batch document analysis yes, real-time chat no).
      tensor_parallel: ``TP``, devices one copy of the weights is split over (each holds
        ``N / TP`` query heads, ``K / TP`` kv heads, or one replicated kv head when
        ``K < TP``); sequence parallelism then runs over groups of ``TP`` devices.

    Raises:
      ValueError: on a share outside ``[0, 1]``, negative tokens, an unknown format, a
        non-positive ``tensor_parallel``, ``N % TP != 0``, or a ``TP`` that is neither a
        divisor nor a multiple of ``K``.
    """

    model: ModelShape
    lengths: LengthDistribution
    prefix_reuse: float = 0.0
    prefix_tokens: int = 0
    quantization: tuple[str | KVFormat, ...] = ()
    latency_tolerant: bool = False
    tensor_parallel: int = 1

    def __post_init__(self):
        fn = "Workload"
        if not isinstance(self.model, ModelShape):
            raise ValueError(f"{fn}: model: expected a ModelShape, got {self.model!r}")
        if not isinstance(self.lengths, LengthDistribution):
            raise ValueError(f"{fn}: lengths: expected a LengthDistribution, got {self.lengths!r}")
        _checks.check_float(fn, "prefix_reuse", self.prefix_reuse, low=0.0, high=1.0)
        _checks.check_int(fn, "prefix_tokens", self.prefix_tokens, low=0)
        if not isinstance(self.quantization, tuple):
            raise ValueError(f"{fn}: quantization: expected a tuple, got {self.quantization!r}")
        kinds = []
        for kind in self.quantization:
            if isinstance(kind, KVFormat):
                refuse_kivi2_window(fn, "quantization", kind)
                if kind != self.model.kv_spec(kind.kind):
                    raise ValueError(
                        f"{fn}: quantization: expected {self.model.kv_spec(kind.kind)!r} (int4 "
                        f"takes the model's group_size; set it on ModelShape), got {kind!r}"
                    )
                kind = kind.kind
            _checks.check_choice(fn, "quantization", kind, QUANTIZED_FORMATS)
            kinds.append(kind)
        object.__setattr__(self, "quantization", tuple(kinds))
        if not isinstance(self.latency_tolerant, bool):
            raise ValueError(
                f"{fn}: latency_tolerant: expected a bool, got {self.latency_tolerant!r}"
            )
        tp = _checks.check_int(fn, "tensor_parallel", self.tensor_parallel, low=1)
        if self.model.query_heads % tp:
            raise ValueError(
                f"{fn}: tensor_parallel: expected a divisor of query_heads="
                f"{self.model.query_heads} (each device computes whole heads), got {tp}"
            )
        if self.model.kv_heads % tp and tp % self.model.kv_heads:
            raise ValueError(
                f"{fn}: tensor_parallel: expected a divisor or a multiple of kv_heads="
                f"{self.model.kv_heads} (kv heads are split, or replicated when fewer than "
                f"TP), got {tp}"
            )
