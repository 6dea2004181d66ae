"""The planner's outputs: frozen dataclasses, each field with the reasons that decided it.

:class:`Plan`, whose every field is a :class:`Decision` ``(value, reasons)``; a
:class:`Reason` is ``(rule, text, numbers, source)``; :class:`Tiers` are bytes per tier;
:meth:`Plan.rows` yields :class:`PlanRow` objects. The inputs live beside them:
:mod:`offload.planning._model_shape` (:class:`ModelShape`), :mod:`offload.planning._workload`
(:class:`LengthDistribution`, :class:`Workload`) and :mod:`offload.planning._hardware`
(:class:`Hardware`).
"""

import dataclasses
import textwrap
from typing import NamedTuple

__all__ = ["Decision", "Plan", "PlanRow", "Reason", "Tiers"]


@dataclasses.dataclass(frozen=True)
class Reason:
    """Why a value was chosen.

    Attributes:
      rule: the rule's id: an article rule (``"rule 1"``, ``"iron rule 3"``, ``"incident B"``),
        ``"measured"`` (a benchmark of this repository decides), ``"model"`` (plain
        arithmetic on the inputs) or ``"cost model"``.
      text: one sentence with the numbers in words.
      numbers: the numbers the text uses, by name.
      source: where the rule or the numbers come from, in words a reader can follow: the
        article's title and section, a results file of this repository, or the hardware
        description's labels (``""``: arithmetic on the inputs).
    """

    rule: str
    text: str
    numbers: dict = dataclasses.field(default_factory=dict)
    source: str = ""

    def __str__(self) -> str:
        return f"[{self.rule}] {self.text}" + (f" (source: {self.source})" if self.source else "")


@dataclasses.dataclass(frozen=True)
class Decision:
    """A planned value and the reasons that produced it (at least one)."""

    value: object
    reasons: tuple[Reason, ...]


@dataclasses.dataclass(frozen=True)
class Tiers:
    """Bytes of one request's KV in each tier (they sum to the request's KV bytes)."""

    device: int
    host: int
    disk: int

    @property
    def total(self) -> int:
        """Bytes placed in all tiers (less than the request's bytes when it does not fit)."""
        return self.device + self.host + self.disk


class PlanRow(NamedTuple):
    """One row of :meth:`Plan.rows`: a field's name, its value and its reasons."""

    field: str
    value: object
    reasons: tuple[Reason, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's answer; every field is a :class:`Decision` (``.value``, ``.reasons``).

    Attributes:
      sizing_length: tokens one request is sized for (rule 1: p95 + 2 sigma, not max).
      page_size: ``C`` in tokens, 4, 16 or 64 (rules 2 and 4).
      kv_format: the planned KV format (the model's, or a quantized one that makes it fit).
      kv_bytes_per_token: KV bytes per token in ``kv_format`` (all layers, keys and values, the
        model's ``K`` kv heads; one device's share is ``kv_bytes_per_token_per_device``).
      kv_bytes_per_token_all_heads: the same in the model's format with ``K = N`` (how the
        article counts Llama-3-70B: 2.5 MB instead of 320 KB).
      kv_bytes_per_request: KV bytes the devices of a TP group store for one request at
        ``sizing_length`` (whole pages; replicated kv heads counted on every device).
      pages_per_request: pages of one request (on each device of a TP group).
      sequence_parallel: whether the sequence is sharded over devices (iron rule 1).
      degree: groups of ``TP`` devices the sequence is sharded over (1 without).
      strategy: ``"ring"``, ``"ulysses"``, ``"usp"``, ``"allgather"`` or ``None``.
      max_pages_per_device: pages of ``page_size`` one device's memory holds after the
        weights' share (the pool's ``P``, page 0 being the reserved null page).
      max_sequences_per_device: requests of ``sizing_length`` one device holds at once (each
        request's share of the group's pages; 0 when one does not fit).
      tiers: a :class:`Tiers` of one request's bytes on devices, pinned host and disk.
      retention: how cold pages are handled (``"none"``: all resident; ``"fetch back"``).
      prefix_saving: expected share of pages a prefix cache saves on this workload.
      cost: a :class:`CostEstimate` of one prefill and one decode token.
      fits: whether one request of ``sizing_length`` fits the cluster (all tiers).
      tensor_parallel: ``TP``, devices one copy of the weights is split over (``degree``
        counts groups of ``TP`` devices, so one request uses ``TP * degree`` devices).
      weight_bytes_per_device: the weights' share on each device, subtracted from its memory.
      kv_bytes_per_token_per_device: KV bytes per token one device of a tensor-parallel group
        holds (its ``K / TP`` kv heads, or one replicated head).
    """

    sizing_length: Decision
    page_size: Decision
    kv_format: Decision
    kv_bytes_per_token: Decision
    kv_bytes_per_token_all_heads: Decision
    kv_bytes_per_request: Decision
    pages_per_request: Decision
    sequence_parallel: Decision
    degree: Decision
    strategy: Decision
    max_pages_per_device: Decision
    max_sequences_per_device: Decision
    tiers: Decision
    retention: Decision
    prefix_saving: Decision
    cost: Decision
    fits: Decision
    tensor_parallel: Decision
    weight_bytes_per_device: Decision
    kv_bytes_per_token_per_device: Decision

    def rows(self) -> list[PlanRow]:
        """One :class:`PlanRow` ``(field, value, reasons)`` per field, in field order."""
        return [
            PlanRow(f.name, getattr(self, f.name).value, getattr(self, f.name).reasons)
            for f in dataclasses.fields(self)
        ]

    def format(self, width: int = 100) -> str:
        """The plan as text: one line per field, then each reason indented and wrapped."""
        lines = []
        for row in self.rows():
            lines.append(f"{row.field}: {row.value}")
            for reason in row.reasons:
                lines.extend(
                    textwrap.wrap(
                        str(reason), width, initial_indent="    ", subsequent_indent="      "
                    )
                )
        return "\n".join(lines)
