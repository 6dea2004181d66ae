"""Memory tiers of a JAX device: moving pytrees between device and host memory kinds.

A JAX device exposes *memory kinds*: ``device`` (HBM on an accelerator), ``pinned_host``
(page-locked host DRAM that DMA engines can read directly) and ``unpinned_host`` (ordinary
pageable DRAM). :func:`to_host` and :func:`to_device` move every array of a pytree between
them; each array keeps its sharding (a multi-device ``NamedSharding`` included) and changes
only its memory kind, so values are bit-exact.

Transfers are asynchronous: ``jax.device_put`` returns at once and the data lands later.
Every transfer of ``offload`` (:func:`to_host`, :func:`to_device` and the page transfers
``page_out``, ``page_in``, ``prefetch_layer``) takes its source first and its destination
after, and returns one :class:`TransferHandle` whose ``value`` is what was written;
:func:`ready` polls it with ``jax.Array.is_ready`` and :func:`wait` blocks until it has
landed and returns ``value``.

On CPU, "device" and "host" memory are the same DRAM: a transfer is a memcpy, so the numbers
measured on CPU bound the bookkeeping overhead, not PCIe bandwidth.
"""

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import jax

__all__ = [
    "DEVICE_MEMORY_KIND",
    "PINNED_HOST",
    "UNPINNED_HOST",
    "TransferHandle",
    "host_memory_kind",
    "ready",
    "to_device",
    "to_host",
    "wait",
]

PINNED_HOST = "pinned_host"
UNPINNED_HOST = "unpinned_host"
DEVICE_MEMORY_KIND = "device"
# Host memory kinds in order of preference: pinned memory allows asynchronous DMA.
HOST_MEMORY_KINDS = (PINNED_HOST, UNPINNED_HOST)


def _memory_kinds(device) -> set[str]:
    return {memory.kind for memory in device.addressable_memories()}


def host_memory_kind(device) -> str:
    """The host memory kind to offload to from ``device``: pinned if present, else unpinned.

    Args:
      device: a ``jax.Device``, or an iterable of devices (all must offer the chosen kind,
        e.g. ``sharding.device_set``).

    Returns:
      ``"pinned_host"`` when every device exposes it, else ``"unpinned_host"``.

    Raises:
      ValueError: if some device exposes neither host memory kind.

    Example:
      >>> host_memory_kind(jax.devices()[0])
      'pinned_host'
    """
    devices = list(device) if isinstance(device, Iterable) else [device]
    if not devices:
        raise ValueError("host_memory_kind: device: expected at least one device, got none")
    kinds = [_memory_kinds(d) for d in devices]
    for kind in HOST_MEMORY_KINDS:
        if all(kind in k for k in kinds):
            return kind
    missing = [f"{d} offers {sorted(k)}" for d, k in zip(devices, kinds, strict=True)]
    raise ValueError(
        f"host_memory_kind: device: expected a device exposing one of {list(HOST_MEMORY_KINDS)}, "
        f"got {'; '.join(missing)}"
    )


def _check_leaves(fn: str, tree) -> list[jax.Array]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in leaves:
        if not isinstance(leaf, jax.Array):
            raise ValueError(
                f"{fn}: tree: expected every leaf to be a jax.Array, got "
                f"{type(leaf).__name__} at {jax.tree_util.keystr(path) or '<root>'}"
            )
    return [leaf for _, leaf in leaves]


def to_host(
    tree: Any, *, memory_kind: str | None = None, request_id: str | None = None
) -> "TransferHandle":
    """Copies every array of ``tree`` to host memory, keeping its sharding (asynchronous).

    Not jittable (``jit(..., out_shardings=...)`` with a host memory kind is the in-graph
    equivalent); call it eagerly.

    Args:
      tree: a pytree of ``jax.Array`` leaves of any shape and dtype, e.g. ``k_pages
        [L, K, P, C, H]``.
      memory_kind: ``"pinned_host"`` or ``"unpinned_host"``; ``None`` picks
        :func:`host_memory_kind` of each leaf's devices.
      request_id: recorded on the handle for accounting.

    Returns:
      A :class:`TransferHandle` (``direction="device_to_host"``, ``nbytes`` the bytes of all
      leaves) whose ``value`` is a pytree of the same structure; each leaf has the same
      shape, dtype, values and sharding (up to its memory kind). The call returns before the
      copies complete.

    Raises:
      ValueError: if a leaf is not a ``jax.Array``, ``memory_kind`` is not a host kind, or a
        device has no host memory kind.

    Example:
      >>> h = wait(to_host({"k": jnp.ones((2, 4, 8, 16))}))
      >>> h["k"].sharding.memory_kind
      'pinned_host'
    """
    if memory_kind is not None and memory_kind not in HOST_MEMORY_KINDS:
        raise ValueError(
            f"to_host: memory_kind: expected one of {list(HOST_MEMORY_KINDS)} or None, "
            f"got {memory_kind!r}"
        )
    leaves = _check_leaves("to_host", tree)
    shardings = [
        leaf.sharding.with_memory_kind(memory_kind or host_memory_kind(leaf.sharding.device_set))
        for leaf in leaves
    ]
    treedef = jax.tree_util.tree_structure(tree)
    moved = jax.device_put(leaves, shardings)
    nbytes = sum(leaf.nbytes for leaf in leaves)
    value = jax.tree_util.tree_unflatten(treedef, moved)
    return TransferHandle(value, "device_to_host", nbytes, request_id=request_id)


def to_device(tree: Any, *, request_id: str | None = None) -> "TransferHandle":
    """Copies every array of ``tree`` to device memory, keeping its sharding (asynchronous).

    Not jittable; call it eagerly.

    Args:
      tree: a pytree of ``jax.Array`` leaves, typically ``wait(to_host(...))``.
      request_id: recorded on the handle for accounting.

    Returns:
      A :class:`TransferHandle` (``direction="host_to_device"``) whose ``value`` is a pytree
      of the same structure, each leaf in its devices' default memory kind with the same
      sharding otherwise. The call returns before the copies complete.

    Raises:
      ValueError: if a leaf is not a ``jax.Array``.

    Example:
      >>> d = wait(to_device(wait(to_host(jnp.ones(3)))))
      >>> d.sharding.memory_kind
      'device'
    """
    leaves = _check_leaves("to_device", tree)
    shardings = [
        leaf.sharding.with_memory_kind(next(iter(leaf.sharding.device_set)).default_memory().kind)
        for leaf in leaves
    ]
    treedef = jax.tree_util.tree_structure(tree)
    moved = jax.device_put(leaves, shardings)
    nbytes = sum(leaf.nbytes for leaf in leaves)
    value = jax.tree_util.tree_unflatten(treedef, moved)
    return TransferHandle(value, "host_to_device", nbytes, request_id=request_id)


@dataclasses.dataclass(frozen=True)
class TransferHandle:
    """One asynchronous transfer in flight: the one result type of every offload transfer.

    Host-side bookkeeping, not a pytree. :func:`to_host`, :func:`to_device`,
    :func:`~offload.page_out`, :func:`~offload.page_in` and :func:`~offload.prefetch_layer`
    all return one; ``value`` is what the transfer wrote (a host pytree, a device pytree, the
    new :class:`~offload.HostPagePool`, the new ``(k_pages, v_pages)``, the prefetched
    ``(k, v)``), so ``k, v = handle.value`` unpacks every page transfer alike.

    Attributes:
      value: the pytree of destination arrays; valid to use at once (JAX orders later
        operations after the copy), complete once :func:`ready` is true. If a later call
        donates these arrays (e.g. the next :func:`~offload.page_out` on the same host pool),
        they become deleted; the handle itself stays valid.
      direction: ``"device_to_host"``, ``"host_to_device"``, ``"host_to_disk"`` or
        ``"disk_to_host"``.
      nbytes: bytes moved.
      issued_at: ``time.perf_counter()`` when the transfer was issued.
      request_id: the request the bytes belong to, if any.
      done: arrays produced by the same computations as ``value`` and never donated, whose
        readiness marks completion; ``None`` means the leaves of ``value``.
    """

    value: Any
    direction: str
    nbytes: int
    issued_at: float = dataclasses.field(default_factory=time.perf_counter)
    request_id: str | None = None
    done: Any = None

    def _events(self) -> list:  # jax.Arrays, or anything with is_ready()
        return jax.tree_util.tree_leaves(self.value if self.done is None else self.done)


def _check_handle(fn: str, handle) -> None:
    if not isinstance(handle, TransferHandle):
        raise ValueError(f"{fn}: handle: expected a TransferHandle, got {type(handle).__name__}")


def ready(handle: TransferHandle) -> bool:
    """Whether every array of a transfer has landed (never blocks). Host-side, not jittable.

    Args:
      handle: a :class:`TransferHandle`.

    Returns:
      ``True`` once all destination arrays are ready.

    Raises:
      ValueError: if ``handle`` is not a :class:`TransferHandle`.

    Example:
      >>> h = to_host(jnp.ones(3))
      >>> _ = wait(h); ready(h)
      True
    """
    _check_handle("ready", handle)
    return all(leaf.is_ready() for leaf in handle._events())


def wait(handle: TransferHandle) -> Any:
    """Blocks until a transfer has landed and returns its destination arrays (host-side).

    Args:
      handle: a :class:`TransferHandle`.

    Returns:
      ``handle.value``, every array landed (deleted arrays stay deleted: see
      :class:`TransferHandle`).

    Raises:
      ValueError: if ``handle`` is not a :class:`TransferHandle`.

    Example:
      >>> wait(to_host(jnp.ones(3))).shape
      (3,)
    """
    _check_handle("wait", handle)
    jax.block_until_ready(handle._events())
    return handle.value
