"""KV storage and attention over pages (see README)."""

__all__: list[str] = []
