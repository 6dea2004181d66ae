"""Planning a long-context deployment: :func:`plan` (workload, hardware) and its cost model.

``offload.planning`` is a public subpackage of ``offload`` (as ``optax.schedules`` is of
``optax``): ``import offload`` does not import it; ``from offload.planning import plan`` does.
It is pure Python over frozen dataclasses, with no arrays: a :class:`Workload` (request
lengths as a :class:`LengthDistribution`, a :class:`ModelShape`, prefix reuse, tensor
parallelism, the lossy KV formats allowed) and a :class:`Hardware` go in; a :class:`Plan`
comes out, every field with the :class:`Reason` s that decided it, each citing the article
(:data:`ARTICLE`, :data:`ARTICLE_SECTIONS`) or this repository's measurements
(:data:`MEASURED`). :class:`CostEstimate` is the cost model's answer for one strategy.

Shape legend (as in ``ringattn``, ``paged`` and ``offload``):

====  ==========================================
S     tokens of one request (its sizing length)
N     query heads
K     key/value heads
H     head dim
C     tokens per page
L     layers
====  ==========================================
"""

from offload.planning._article import ARTICLE, ARTICLE_RULES, ARTICLE_SECTIONS, MEASURED
from offload.planning._cost_model import CostEstimate
from offload.planning._hardware import Hardware
from offload.planning._model_shape import KV_FORMATS, ModelShape
from offload.planning._planner import plan
from offload.planning._planner_types import Decision, Plan, PlanRow, Reason, Tiers
from offload.planning._strategy import TIE_THRESHOLD
from offload.planning._workload import LengthDistribution, Workload

__all__: list[str] = [
    "ARTICLE",
    "ARTICLE_RULES",
    "ARTICLE_SECTIONS",
    "CostEstimate",
    "Decision",
    "Hardware",
    "KV_FORMATS",
    "LengthDistribution",
    "MEASURED",
    "ModelShape",
    "Plan",
    "PlanRow",
    "Reason",
    "Tiers",
    "TIE_THRESHOLD",
    "Workload",
    "plan",
]
