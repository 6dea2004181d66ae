"""The article the planner follows and the measurements its reasons cite.

:data:`ARTICLE` (by its title), where each rule sits in it (:data:`ARTICLE_SECTIONS`), the rules
paraphrased (:data:`ARTICLE_RULES`), the thresholds the rules set, this repository's benchmark
numbers the reasons quote (:data:`MEASURED`), and the helpers that fill in a reason's source.
Pure Python; no arrays.
"""

import dataclasses

from offload.planning._hardware import Hardware
from offload.planning._planner_types import Reason

__all__ = [
    "ARTICLE",
    "ARTICLE_RULES",
    "ARTICLE_SECTIONS",
    "IRON_RULE_1_TOKENS",
    "IRON_RULE_3_TOKENS",
    "MEASURED",
    "PAGE_SIZE_SHORT_TOKENS",
    "PREFIX_REUSE_THRESHOLD",
]


#: The article the decision procedure comes from, by its title (English, then the original).
ARTICLE = (
    '"The engineering truth of long-context inference, 2026: PagedAttention, Ring Attention '
    'and KV cache offloading in practice, from 128K to 1M context" '
    "(长上下文推理的工程真相 2026：从 128K 到 1M context 的 PagedAttention、Ring Attention 与 KV "
    "cache 卸载实战)"
)


_DECISION_TREE = "section 5, the practical decision tree (2026 edition)"


_TWELVE_RULES = "section 7, the twelve engineering rules for production"


_INCIDENTS = "section 8, typical incidents and their post-mortems"


#: Where in :data:`ARTICLE` each rule id is, in words.
ARTICLE_SECTIONS = {
    "iron rule 1": f"{_DECISION_TREE}, iron rule 1",
    "iron rule 2": f"{_DECISION_TREE}, iron rule 2",
    "iron rule 3": f"{_DECISION_TREE}, iron rule 3",
    "rule 1": f"{_TWELVE_RULES}, rule 1",
    "rule 2": f"{_TWELVE_RULES}, rule 2",
    "rule 4": f"{_TWELVE_RULES}, rule 4",
    "rule 5": f"{_TWELVE_RULES}, rule 5",
    "rule 6": f"{_TWELVE_RULES}, rule 6",
    "rule 11": f"{_TWELVE_RULES}, rule 11",
    "incident B": f"{_INCIDENTS}, case B (a legal SaaS's 1M-token trial on 32 H100s)",
    "incident C": f"{_INCIDENTS}, case C (an e-commerce chat service's NVMe offload)",
}


#: The article's rules the planner applies, by id (paraphrased; see :data:`ARTICLE_SECTIONS`).
ARTICLE_RULES = {
    "iron rule 1": "under 128K tokens do not use sequence parallelism",
    "iron rule 2": "with prefix reuse above 50% force page size 64 (claimed: saves 30-40%)",
    "iron rule 3": "above 512K tokens combine offload with sequence parallelism",
    "rule 1": "size for p95 + 2 sigma of the length distribution, not for the max",
    "rule 2": "with system-prompt reuse above 50% enable prefix caching and page size 64",
    "rule 4": "page size 16 by default, 64 with heavy prefix reuse, 4 under 2K tokens",
    "rule 5": "max_num_seqs 64-128 per H100",
    "rule 6": "CPU swap space of 16-32 GB for long contexts; NVMe offload is off by default",
    "rule 11": "NVMe above 100k IOPS becomes the bottleneck",
    "incident B": "a 32-GPU cross-node ring at 1M tokens spent 60% of its time communicating",
    "incident C": "NVMe offload saturated IOPS at peak: only for latency-tolerant work",
}


IRON_RULE_1_TOKENS = 128 * 1024  #: no sequence parallelism below this sizing length


IRON_RULE_3_TOKENS = 512 * 1024  #: above this, offload + sequence parallelism within a node


PAGE_SIZE_SHORT_TOKENS = 2048  #: rule 4: page size 4 below this sizing length


PREFIX_REUSE_THRESHOLD = 0.5  #: iron rule 2 / rule 2: page size 64 above this share


#: Measurements the reasons cite, by name: (file, number).
MEASURED = {
    "prefix saving C=64, 50% share": ("paged_memory.md (c)", 0.1603),
    "prefix saving C=64, 80% share": ("paged_memory.md (c)", 0.2490),
    "waste under 2K, C=4": ("paged_memory.md (b)", 0.0014),
    "waste under 2K, C=16": ("paged_memory.md (b)", 0.0070),
    "waste under 2K, C=64": ("paged_memory.md (b)", 0.0278),
    "h2o mass at 20%, concentrated": ("policies.md", 0.974),
    "h2o mass at 20%, mild": ("policies.md", 0.596),
    "h2o mass at 20%, drifting": ("policies.md", 0.789),
    "h2o mass at 20%, uniform": ("policies.md", 0.207),
    "passkey accuracy, all pages": ("quality.md", 0.94),
    "passkey accuracy, h2o drop at 20%": ("quality.md", 0.80),
    "passkey accuracy, demote and fetch back": ("quality.md", 0.94),
    "accuracy float32": ("quality.md, KV formats", 0.938),
    "accuracy int8": ("quality.md, KV formats", 0.938),
    "accuracy fp8": ("quality.md, KV formats", 0.938),
    "accuracy int4": ("quality.md, KV formats", 0.925),
    "accuracy kivi2": ("quality.md, KV formats", 0.850),
    "bytes vs bf16 int8": ("kvquant.md, Llama-3-70B", 0.516),
    "bytes vs bf16 fp8": ("kvquant.md, Llama-3-70B", 0.516),
    "bytes vs bf16 int4": ("kvquant.md, Llama-3-70B", 0.281),
    "bytes vs bf16 kivi2": ("kvquant.md, Llama-3-70B", 0.195),
}


def _measured(name: str) -> tuple[str, float]:
    return MEASURED[name]


def _results(*where: str) -> str:
    """A :data:`MEASURED` source in words: the results file(s) in this repository."""
    files = "; ".join(f"benchmarks/results/{w}" for w in dict.fromkeys(where))
    return f"this repository's benchmark results ({files}, in the source repository)"


def _cite(reason: Reason, hardware: Hardware) -> Reason:
    """``reason`` with its source filled in from its rule when it has none."""
    if reason.source:
        return reason
    if reason.rule in ARTICLE_SECTIONS:
        source = f"the article {ARTICLE}, {ARTICLE_SECTIONS[reason.rule]}"
    elif reason.rule == "cost model":
        source = "offload's cost model on the hardware description: " + "; ".join(
            f"{name} {hardware.label(name)}"
            for name in ("device_flops", "memory_bandwidth", "attention_efficiency")
        )
    else:
        return reason
    return dataclasses.replace(reason, source=source)


def _size(n: int | float) -> str:
    """Bytes in binary units, for reasons' text."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"
