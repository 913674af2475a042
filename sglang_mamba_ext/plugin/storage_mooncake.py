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
warm-up) and the key prefix that keeps models (and ``extra_backend_tag``) apart. Calls go
to mooncake's client as SGLang's store makes them (``batch_is_exist``, ``batch_put_from``,
``batch_get_into``, ``remove_all``), not through SGLang's ``set`` / ``get`` / ``exists``:
those return a bool, and the tier needs the status (how many bytes a read got, since a
shorter stored value must read as a miss; ``RPC_FAIL`` when the master is gone, raised as
:class:`~sglang_mamba_ext.mem_cache.storage_guard.StoreUnavailable` so the tier's guard
answers misses at once instead of waiting on mooncake's retries, ``docs/flags.md``). A
stored key is not written again (as SGLang's ``set`` and ``HiCacheFile`` do).

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

from sglang_mamba_ext.mem_cache.storage_guard import StoreUnavailable

#: mooncake's status for a key it does not hold.
_NOT_FOUND = -704
#: mooncake's status when the master cannot be reached (``RPC_FAIL``).
_RPC_FAIL = -900


def _check(status: int, what: str) -> int:
    if status == _RPC_FAIL:
        raise StoreUnavailable(f"mooncake {what}: RPC_FAIL (master unreachable)")
    return status


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
        name = self.name(key)
        if _check(self.client.batch_is_exist([name])[0], "exists") == 1:
            return True
        buf[:n].copy_(data)
        return _check(self.client.batch_put_from([name], [buf.data_ptr()], [n])[0], "put") == 0

    def get(self, key: str, target: torch.Tensor) -> Optional[torch.Tensor]:
        """The bytes stored under ``key``: ``target`` filled when they are as many as
        ``target`` holds, a tensor of another length when not (the tier's check rejects
        it), ``None`` when nothing is stored.

        Raises:
            StoreUnavailable: the master is unreachable (the guard answers a miss).
            RuntimeError: mooncake failed the read otherwise (e.g. a value longer than the
                staging buffer); the tier reads it as a miss."""
        buf = self._buffer(target.numel())
        got = _check(self.client.batch_get_into([self.name(key)], [buf.data_ptr()], [buf.numel()])[0], "get")
        if got == _NOT_FOUND:
            return None
        if got < 0:
            raise RuntimeError(f"mooncake read of {key} failed with status {got}")
        if got == target.numel():
            target.copy_(buf[:got])
            return target
        return buf[:got].clone()

    def exists(self, key: str) -> bool:
        return _check(self.client.batch_is_exist([self.name(key)])[0], "exists") == 1

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are stored (one round trip)."""
        if not keys:
            return 0
        flags: List[int] = self.client.batch_is_exist([self.name(k) for k in keys])
        for i, f in enumerate(flags):
            if _check(f, "exists") != 1:
                return i
        return len(keys)

    def discard(self, key: str) -> None:
        """Remove ``key``'s value (one that failed its check), so a later write replaces it;
        forced past the lease mooncake gives a value it has just served."""
        _check(self.client.remove(self.name(key), True), "remove")

    def clear(self) -> bool:
        """Remove every value of the store (SGLang's ``POST /hicache/storage-backend/clear``)."""
        return _check(self.client.remove_all(True), "remove_all") >= 0

    def ping(self) -> bool:
        """True once the master answers (the guard's probe while it is unreachable)."""
        return _check(self.client.batch_is_exist([self.name("sglang-mamba-ext-ping")])[0], "ping") >= 0

    def close(self) -> None:
        if self._staging is not None:
            try:
                self.client.unregister_buffer(self._staging.data_ptr())
            except Exception:  # noqa: BLE001 - closing
                pass
            self._staging = None
