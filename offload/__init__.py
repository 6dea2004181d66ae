"""KV offload tiers and retention policies over pages (see README)."""

__all__: list[str] = []
