"""Prefix-cache keys and the index of cached pages (host side, plain Python).

A FULL page of ``C`` tokens is identified by a chained hash, as in vLLM's automatic prefix
caching::

    key_0 = H(None,    tokens[0:C],   salt)
    key_i = H(key_i-1, tokens[iC:(i+1)C], salt)

so a key names the whole prefix up to and including its page, not just the page's own tokens.
``H`` is SHA-256 over a length-prefixed encoding of (parent key, salt, token ids as little-endian
int64), so no two different inputs share an encoding. The salt (a tenant id, a LoRA id...) enters
every page, so the same prompt under two salts shares nothing.

:class:`PrefixIndex` maps keys to physical pages and keeps the pages that no sequence references
any more in least-recently-used order, so they can be revived by a later prompt or evicted when
the free list runs dry. It knows nothing about reference counts; the allocator drives it.
"""

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["CachedPage", "PrefixIndex", "hash_page", "normalize_salt"]


def normalize_salt(salt, *, fn: str = "normalize_salt", name: str = "salt") -> bytes | None:
    """Checks a tenant salt and returns it as bytes (``str`` is UTF-8 encoded, so ``"a"`` and
    ``b"a"`` are the same salt).

    Raises:
      ValueError: if ``salt`` is not ``None``, ``str`` or ``bytes``.
    """
    if salt is None:
        return None
    if isinstance(salt, str):
        return salt.encode("utf-8")
    if isinstance(salt, (bytes, bytearray)):
        return bytes(salt)
    raise ValueError(
        f"{fn}: {name}: expected None, str or bytes, got {type(salt).__name__} {salt!r}"
    )


def hash_page(parent: bytes | None, tokens: Sequence[int], salt: bytes | None) -> bytes:
    """Chained SHA-256 key of one full page.

    Args:
      parent: key of the previous page of the same sequence, ``None`` for the first page.
      tokens: the page's ``C`` token ids.
      salt: a normalized salt (see :func:`normalize_salt`) or ``None``.

    Returns:
      A 32-byte digest.
    """
    h = hashlib.sha256()
    for part in (parent, salt):
        if part is None:
            h.update(b"\x00")
        else:
            h.update(b"\x01" + len(part).to_bytes(8, "little") + part)
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.digest()


@dataclasses.dataclass(frozen=True)
class CachedPage:
    """What the index remembers about a cached page: enough to recompute its key."""

    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    salt: bytes | None


class PrefixIndex:
    """Key → page map plus an LRU of cached pages that no sequence references.

    A page is *keyed* when it is in the map; a keyed page with no references is *evictable* and
    sits in the LRU (oldest first). Keys are unique: a second page with the same contents is
    simply not keyed.
    """

    def __init__(self):
        self._page_of: dict[bytes, int] = {}
        self._entry_of: dict[int, CachedPage] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._page_of)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def lookup(self, key: bytes) -> int | None:
        return self._page_of.get(key)

    def entry(self, page: int) -> CachedPage | None:
        return self._entry_of.get(page)

    def is_keyed(self, page: int) -> bool:
        return page in self._entry_of

    def is_evictable(self, page: int) -> bool:
        return page in self._lru

    def insert(self, page: int, entry: CachedPage) -> bool:
        """Keys ``page``; returns False (and does nothing) if the key or page is already keyed."""
        if entry.key in self._page_of or page in self._entry_of:
            return False
        self._page_of[entry.key] = page
        self._entry_of[page] = entry
        return True

    def park(self, page: int) -> None:
        """A keyed page lost its last reference: it becomes the most recently used evictable."""
        self._lru[page] = None

    def revive(self, page: int) -> None:
        """An evictable page is referenced again: take it out of the LRU."""
        del self._lru[page]

    def forget(self, page: int) -> None:
        """Un-keys a referenced page (not in the LRU): its contents are about to go."""
        entry = self._entry_of.pop(page)
        del self._page_of[entry.key]

    def evict_oldest(self) -> int:
        """Forgets the least recently used evictable page and returns it (now a free page)."""
        page, _ = self._lru.popitem(last=False)
        entry = self._entry_of.pop(page)
        del self._page_of[entry.key]
        return page

    def evictable_pages(self) -> list[int]:
        return list(self._lru)

    def items(self) -> list[tuple[int, CachedPage]]:
        return list(self._entry_of.items())

    def validate(self) -> None:
        """Checks the map is a bijection, LRU ⊆ keyed, and every key matches its contents.

        Raises:
          ValueError: naming the first broken invariant.
        """
        if len(self._page_of) != len(self._entry_of):
            raise ValueError("prefix index: key map and page map differ in size")
        for page, entry in self._entry_of.items():
            if self._page_of.get(entry.key) != page:
                raise ValueError(f"prefix index: page {page} is not the page of its key")
            if hash_page(entry.parent, entry.tokens, entry.salt) != entry.key:
                raise ValueError(f"prefix index: page {page} key does not match its tokens")
        for page in self._lru:
            if page not in self._entry_of:
                raise ValueError(f"prefix index: evictable page {page} is not keyed")
