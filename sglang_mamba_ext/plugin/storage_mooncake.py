"""``--hicache-storage-backend mooncake`` under ``--enable-mamba-radix`` (``docs/design.md``,
"Storage tier"): the tier's value interface over SGLang's ``MooncakeStore``.

The storage tier (:mod:`sglang_mamba_ext.mem_cache.storage_tier`) stores one sealed byte
string per key: ``set(key, value)``, ``get(key, target)``, ``exists(key)`` and
``batch_exists(keys)`` (how many of ``keys``, from the first, are stored). SGLang's
``MooncakeStore`` moves bytes zero-copy between the store and host buffers registered with
mooncake, and its batch calls speak SGLang's KV page layout (``<key>_<rank>_k`` /
``_v`` objects). :class:`MooncakeValues` keeps one registered host staging buffer, copies a
value into it before a write and out of it after a read, and addresses one mooncake object
per key.

What comes from SGLang: the store's construction (its ``MooncakeStoreConfig`` from
``--hicache-storage-backend-extra-config``, ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` or the
``MOONCAKE_*`` environment variables; the client's ``setup`` against the master and its
warm-up), the key prefix that keeps models (and ``extra_backend_tag``) apart, ``set``
(skips a key that is stored already, as ``HiCacheFile`` does), ``exists`` and ``clear``.
Reads go through mooncake's client (``batch_get_into``) because SGLang's ``get`` returns
only whether a read succeeded, not how many bytes it read (a shorter stored value must read
as a miss, so the length is needed).

Where the values live: in the ``global_segment_size`` bytes that the server process itself
mounts into the store (mooncake's client hosts its share of the store in its own memory),
so they go when the server stops; a master with other clients (e.g. a standalone
``mooncake_client``) can hold them elsewhere. Mooncake evicts objects when its segments
fill up: an evicted value is a miss.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

#: mooncake's status for a key it does not hold.
_NOT_FOUND = -704


class MooncakeValues:
    """The storage tier's backend over SGLang's ``MooncakeStore`` (module docstring).

    Args:
        backend: what SGLang's ``StorageBackendFactory.create_backend("mooncake", ...)``
            returned (the store, or SGLang's test failure injector around it).
    """

    def __init__(self, backend):
        self.backend = backend
        self.store = getattr(backend, "_backend", backend)  # SGLang's MooncakeStore
        self.client = self.store.store  # mooncake's MooncakeDistributedStore
        self._staging: Optional[torch.Tensor] = None

    # ---------------------------------------------------------------- keys / buffer
    def name(self, key: str) -> str:
        """The mooncake object name of ``key`` (SGLang's model / backend-tag prefix)."""
        return self.store._tag_keys([key])[0]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """The registered staging buffer, grown (and registered anew) to ``nbytes``."""
        if self._staging is None or self._staging.numel() < nbytes:
            old = self._staging
            size = max(nbytes, 2 * old.numel() if old is not None else 0, 1 << 16)
            buf = torch.empty(size, dtype=torch.uint8)
            self.store.register_buffer(buf)  # raises if mooncake refuses it
            self._staging = buf
            if old is not None:
                self.client.unregister_buffer(old.data_ptr())
        return self._staging

    # ---------------------------------------------------------------- the tier's interface
    def set(self, key: str, value: torch.Tensor) -> bool:
        """Store ``value`` (bytes) under ``key``; True if it is stored (also when it was
        already: like ``HiCacheFile``, a stored key is not written again)."""
        data = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        n = data.numel()
        buf = self._buffer(n)
        buf[:n].copy_(data)
        return bool(self.backend.set(self.name(key), target_location=buf.data_ptr(), target_sizes=n))

    def get(self, key: str, target: torch.Tensor) -> Optional[torch.Tensor]:
        """The bytes stored under ``key``: ``target`` filled when they are as many as
        ``target`` holds, a tensor of another length when not (the tier's check rejects
        it), ``None`` when nothing is stored.

        Raises:
            RuntimeError: mooncake failed the read (e.g. a value longer than the staging
                buffer, or the master gone); the tier reads it as a miss."""
        buf = self._buffer(target.numel())
        got = self.client.batch_get_into([self.name(key)], [buf.data_ptr()], [buf.numel()])[0]
        if got == _NOT_FOUND:
            return None
        if got < 0:
            raise RuntimeError(f"mooncake read of {key} failed with status {got}")
        if got == target.numel():
            target.copy_(buf[:got])
            return target
        return buf[:got].clone()

    def exists(self, key: str) -> bool:
        return bool(self.backend.exists(self.name(key)))

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are stored (one round trip)."""
        if not keys:
            return 0
        flags: List[int] = self.client.batch_is_exist([self.name(k) for k in keys])
        for i, f in enumerate(flags):
            if f != 1:
                return i
        return len(keys)

    def discard(self, key: str) -> None:
        """Remove ``key``'s value (one that failed its check), so a later write replaces it;
        forced past the lease mooncake gives a value it has just served."""
        self.client.remove(self.name(key), True)

    def clear(self) -> bool:
        """Remove every value of the store (SGLang's ``POST /hicache/storage-backend/clear``)."""
        self.client.remove_all(True)
        return True

    def close(self) -> None:
        if self._staging is not None:
            try:
                self.client.unregister_buffer(self._staging.data_ptr())
            except Exception:  # noqa: BLE001 - closing
                pass
            self._staging = None
