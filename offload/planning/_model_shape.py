"""The planner's model description: :class:`ModelShape` and the KV format names it takes.

:class:`ModelShape` holds L, N, K, H, the KV format and the parameter count, and
answers bytes per token, per page and per request's residual window in any format
(:data:`KV_FORMATS`: the float formats by item size, then the quantized ones). Pure Python.
"""

import dataclasses

from offload import _checks
from paged import KVFormat

__all__ = ["FLOAT_FORMATS", "KV_FORMATS", "ModelShape", "QUANTIZED_FORMATS"]


#: KV formats stored as plain floats, with their bytes per element.
FLOAT_FORMATS = {"float32": 4, "bfloat16": 2, "float16": 2}


#: Quantized KV formats: every ``paged.KVFormat`` kind (``paged.KVFormat.KINDS``).
QUANTIZED_FORMATS = KVFormat.KINDS


#: Every KV format a :class:`ModelShape` accepts.
KV_FORMATS = (*FLOAT_FORMATS, *QUANTIZED_FORMATS)


def _group_size_of(fn: str, kv_format: KVFormat, model) -> int:
    """The ``group_size`` a :class:`ModelShape` keeps for ``kv_format`` (a ``KVFormat``):
    its own for int4 (``ValueError`` if the model names another one), else the model's."""
    refuse_kivi2_window(fn, "kv_format", kv_format)
    if kv_format.kind != "int4":
        return model.group_size
    if model.group_size not in (32, kv_format.group_size):
        raise ValueError(
            f"{fn}: group_size: expected the int4 KVFormat's group_size={kv_format.group_size} "
            f"(or the default 32), got {model.group_size}"
        )
    return kv_format.group_size


def refuse_kivi2_window(fn: str, name: str, kv_format: KVFormat) -> None:
    """``NotImplementedError`` for a ``KVFormat("kivi2", residual=R > 0)``: the planner sizes
    kivi2's float32 window as the open page only."""
    if kv_format.kind == "kivi2" and kv_format.residual:
        raise NotImplementedError(
            f"{fn}: {name}: the planner sizes kivi2's float32 window as the open page only, "
            f"got {kv_format!r}; pass KVFormat('kivi2') (residual=0) and count the window with "
            "ModelShape.residual_bytes(KVFormat('kivi2', residual=R))"
        )


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The attention shape of a model and how its KV is stored.

    Attributes:
      layers: ``L``, attention layers.
      query_heads: ``N``.
      kv_heads: ``K`` (``N % K == 0``; ``K < N`` is GQA, ``K == N`` multi-head).
      head_dim: ``H``.
      kv_format: one of :data:`KV_FORMATS`: ``"float32"``, ``"bfloat16"``, ``"float16"``,
        or a quantized format: a ``paged.KVFormat`` or its kind ``"int8"``, ``"fp8"``,
        ``"int4"``, ``"kivi2"``. A KVFormat is stored as its kind (and, for int4, its
        ``group_size``), so ``kv_format=KVFormat("int8")`` and ``"int8"`` give equal shapes.
      group_size: int4's group along ``H`` (``paged.KVFormat``'s ``group_size``, default 32;
        taken from ``kv_format`` when that is a ``KVFormat("int4", group_size=g)``).
      params: parameters of the whole model (its weights), or ``None`` when not given. The
        planner subtracts the weights' share (``params * weight_itemsize / TP``) from each
        device's memory and counts ``2 * params`` FLOPs per token for the linear layers; with
        ``None`` it counts neither and says so in the plan.
      weight_itemsize: bytes per weight (2: bf16/fp16, 1: int8/fp8 weights, 4: float32).

    Raises:
      ValueError: on a non-positive size, ``N % K != 0``, an unknown format, a head dim the
        format cannot store (int4: ``H % group_size``; kivi2: ``H % 4``), ``params`` not a
        positive int, ``weight_itemsize`` not 1, 2 or 4, or an int4 KVFormat whose
        ``group_size`` differs from a ``group_size`` also given.
      NotImplementedError: a ``KVFormat("kivi2", residual=R)`` with ``R > 0`` (the planner
        sizes kivi2's float32 window as the open page only).

    Example:
      >>> llama = ModelShape(layers=80, query_heads=64, kv_heads=8, head_dim=128)
      >>> llama.bytes_per_token(), llama.bytes_per_token("int4")
      (327680, 92160)
    """

    layers: int
    query_heads: int
    kv_heads: int
    head_dim: int
    kv_format: str | KVFormat = "bfloat16"
    group_size: int = 32
    params: int | None = None
    weight_itemsize: int = 2

    def __post_init__(self):
        fn = "ModelShape"
        for name in ("layers", "query_heads", "kv_heads", "head_dim", "group_size"):
            _checks.check_int(fn, name, getattr(self, name), low=1)
        if self.params is not None:
            _checks.check_int(fn, "params", self.params, low=1)
        if _checks.check_int(fn, "weight_itemsize", self.weight_itemsize, low=1) not in (1, 2, 4):
            raise ValueError(
                f"{fn}: weight_itemsize: expected 1, 2 or 4 bytes per weight, got "
                f"{self.weight_itemsize}"
            )
        if self.query_heads % self.kv_heads:
            raise ValueError(
                f"{fn}: kv_heads: expected a divisor of query_heads={self.query_heads}, "
                f"got {self.kv_heads}"
            )
        if isinstance(self.kv_format, KVFormat):
            object.__setattr__(self, "group_size", _group_size_of(fn, self.kv_format, self))
            object.__setattr__(self, "kv_format", self.kv_format.kind)
        _checks.check_choice(fn, "kv_format", self.kv_format, KV_FORMATS)
        if self.kv_format in QUANTIZED_FORMATS:
            self.kv_spec(self.kv_format).check_head_dim(fn, "head_dim", self.head_dim)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights, ``params * weight_itemsize`` (0 when ``params`` is ``None``)."""
        return 0 if self.params is None else self.params * self.weight_itemsize

    def kv_heads_per_device(self, tensor_parallel: int = 1) -> int:
        """KV heads one device of a tensor-parallel group of ``tensor_parallel`` holds.

        ``K / TP`` when ``TP`` divides ``K``; when ``K < TP`` and ``K`` divides ``TP`` every
        device holds one kv head, each replicated on ``TP / K`` devices (what vLLM and
        Megatron do).

        Raises:
          ValueError: when neither ``K % TP == 0`` nor ``TP % K == 0``.
        """
        fn = "ModelShape.kv_heads_per_device"
        _checks.check_int(fn, "tensor_parallel", tensor_parallel, low=1)
        if self.kv_heads % tensor_parallel == 0:
            return self.kv_heads // tensor_parallel
        if tensor_parallel % self.kv_heads == 0:
            return 1
        raise ValueError(
            f"{fn}: tensor_parallel: expected a divisor or a multiple of kv_heads="
            f"{self.kv_heads} (kv heads are split over the group, or replicated when fewer), "
            f"got {tensor_parallel}"
        )

    def kv_spec(self, kv_format: str | KVFormat) -> KVFormat:
        """The ``paged.KVFormat`` of a quantized ``kv_format``: a kind (with this model's
        group size), or a KVFormat, returned as it is."""
        if isinstance(kv_format, KVFormat):
            return kv_format
        if kv_format == "int4":
            return KVFormat("int4", group_size=self.group_size)
        return KVFormat(kv_format)

    def supports(self, kv_format: str | KVFormat) -> bool:
        """Whether ``kv_format`` (a name of :data:`KV_FORMATS` or a ``paged.KVFormat``) can
        store this model's head dim."""
        if isinstance(kv_format, str) and kv_format in FLOAT_FORMATS:
            return True
        try:
            self.kv_spec(kv_format).check_head_dim("ModelShape", "head_dim", self.head_dim)
        except ValueError:
            return False
        return True

    def bytes_per_token(
        self,
        kv_format: str | KVFormat | None = None,
        page_size: int = 16,
        tensor_parallel: int = 1,
    ) -> int | float:
        """KV bytes of one token, keys and values, all layers and kv heads, scales included.

        ``2 * L * K * b`` (on one device of a tensor-parallel group: ``K`` is
        :meth:`kv_heads_per_device`) where ``b`` is ``H * itemsize`` for a float format or
        ``paged.KVFormat.bytes_per_token(H, page_size)`` for a quantized one (so the numbers
        are the library's real pools'). kivi2's per-sequence float32 window is not per token:
        see :meth:`residual_bytes`.

        Args:
          kv_format: a format of :data:`KV_FORMATS` or a ``paged.KVFormat`` (its own
            ``group_size``; default: this model's format).
          page_size: ``C`` (kivi2's key scales are per page).
          tensor_parallel: ``TP``: the bytes one device of a tensor-parallel group holds.
        """
        kv_format = self.kv_format if kv_format is None else kv_format
        if not isinstance(kv_format, KVFormat):
            _checks.check_choice("ModelShape.bytes_per_token", "kv_format", kv_format, KV_FORMATS)
        heads = self.kv_heads_per_device(tensor_parallel)
        if isinstance(kv_format, str) and kv_format in FLOAT_FORMATS:
            per_head = self.head_dim * FLOAT_FORMATS[kv_format]
        else:
            per_head = self.kv_spec(kv_format).bytes_per_token(self.head_dim, page_size)
        return 2 * self.layers * heads * per_head

    def residual_bytes(
        self,
        kv_format: str | KVFormat | None = None,
        page_size: int = 16,
        tensor_parallel: int = 1,
    ) -> int:
        """Bytes per sequence of kivi2's float32 window (``residual_pages(C)`` pages of keys
        and values, all layers and kv heads of one device; a ``KVFormat("kivi2",
        residual=R)`` counts its own window); 0 for the other formats."""
        kv_format = self.kv_format if kv_format is None else kv_format
        spec = kv_format if isinstance(kv_format, KVFormat) else None
        if (spec.kind if spec else kv_format) != "kivi2":
            return 0
        heads = self.kv_heads_per_device(tensor_parallel)
        pages = self.kv_spec(spec or "kivi2").residual_pages(page_size)
        return 2 * self.layers * heads * pages * page_size * self.head_dim * 4

    @property
    def itemsize(self) -> int:
        """Bytes per element of activations and of K/V on the wire: 4 for a float32 model,
        2 otherwise."""
        return 4 if self.kv_format == "float32" else 2
