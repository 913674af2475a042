"""The storage tier of the tree (``--hicache-storage-backend``; ``docs/design.md``, "Storage
tier"): below the device and host tiers, a key-value store (SGLang's ``HiCacheStorage``
backends, e.g. ``HiCacheFile``; any object with ``get(key, target)``, ``set(key, value)``,
``exists(key)`` and ``batch_exists(keys)``) keeps the states, and the KV of their prefixes,
that leave the tree's last tier.

Keys are SGLang's: one hash per KV page, chained from the start of the sequence and seeded
by the request's namespace (``extra_key`` / ``cache_salt``), so a page's key names the whole
page-aligned prefix it ends and tenants never share one. A page's KV is stored under its
key, a state under the key of the page it ends plus ``state_suffix`` (``".mamba"``, SGLang's
pool name for SSM states). Each value is the raw bytes followed by a trailer of the payload
length and a digest over the layout tag, the key and the payload, so a short, corrupted,
swapped or foreign file reads as a miss, never as a wrong state.

Writes happen when a state leaves the last tier (:meth:`StorageTier._spill`: the host copy
of a state the host tier evicts, or a device state dropped without a host copy), with the
KV of the pages of its prefix the store lacks (also when the state is stored already: a page
a size cap or a failed check removed is written again). A copy-on-write match whose deepest usable
state is shallower than what the store holds reads back the longest stored prefix that ends
on a state (KV pages past the tree's KV match, then the state) into host slots and hangs it
in the tree as host-only KV and a host-only state; the host tier's own load then copies
both to the device before the match returns. The core imports no SGLang: the plugin passes
the backend and SGLang's page hasher (``plugin/host_tier.py::attach_storage_tier``).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Callable, List, Optional, Sequence

import torch

from .tree_node import EvictResult, TreeNode

logger = logging.getLogger(__name__)

#: Bytes after each stored payload: 8 bytes of payload length, 8 of magic, 16 of digest.
TRAILER_BYTES = 32
_MAGIC = b"SMXST001"

#: ``page_hasher(tokens, extra_key)``: one key per whole page of ``tokens``, chained.
PageHasher = Callable[[Sequence[int], object], List[str]]


def _digest(tag: bytes, key: str, payload: torch.Tensor) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(tag)
    h.update(key.encode())
    h.update(memoryview(payload.numpy()))
    return h.digest()


def seal(tag: bytes, key: str, payload: torch.Tensor) -> torch.Tensor:
    """``payload`` (uint8, 1-D, CPU) followed by its trailer: what is stored under ``key``."""
    n = payload.numel()
    trailer = n.to_bytes(8, "little") + _MAGIC + _digest(tag, key, payload)
    return torch.cat([payload, torch.frombuffer(bytearray(trailer), dtype=torch.uint8)])


def unseal(tag: bytes, key: str, value: torch.Tensor, payload_bytes: int) -> Optional[torch.Tensor]:
    """The payload of ``value`` if its trailer matches (length, magic, digest), else ``None``."""
    if value is None or value.numel() != payload_bytes + TRAILER_BYTES:
        return None
    payload = value[:payload_bytes]
    trailer = bytes(value[payload_bytes:].numpy())
    if int.from_bytes(trailer[:8], "little") != payload_bytes or trailer[8:16] != _MAGIC:
        return None
    if trailer[16:] != _digest(tag, key, payload):
        return None
    return payload


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


class StorageTier:
    """The storage tier of :class:`~.radix_cache.MambaRadixCache` (module docstring)."""

    def _init_storage_tier(self) -> None:
        #: The store (``None``: no storage tier), set by :meth:`attach_storage`.
        self.storage = None
        self._page_hasher: Optional[PageHasher] = None
        self._storage_tag = b""
        self._storage_discard = None
        self.state_suffix = ".mamba"
        #: Storage totals: states and KV pages written, states (with their KV pages) read
        #: back into the tree, values that failed their check (read as a miss).
        self.storage_states_written_total = 0
        self.storage_kv_pages_written_total = 0
        self.storage_loads_total = 0
        self.storage_kv_pages_loaded_total = 0
        self.storage_rejected_total = 0

    def attach_storage(
        self,
        backend,
        page_hasher: PageHasher,
        layout_tag: bytes = b"",
        discard: Optional[Callable[[str], None]] = None,
        state_suffix: str = ".mamba",
    ) -> None:
        """Give the tree a storage tier below its host tier.

        Args:
            backend: the store (``get(key, target_location)`` filling a uint8 tensor,
                ``set(key, value)``, ``exists(key)``, ``batch_exists(keys)``).
            page_hasher: keys of a sequence's whole pages in a namespace (SGLang's
                ``get_storage_hash_str``).
            layout_tag: bytes naming the stored layout (shapes, dtypes, page size); part of
                every digest, so a value written under another layout fails its check.
            discard: removes a key whose value failed its check (so a later write can
                replace it), or ``None``.
            state_suffix: appended to a page's key for the state that ends it.

        Raises:
            ValueError: without a host tier of states and of KV (the storage tier reads
                back through it)."""
        if self.mamba_host_pool is None or self.kv_host_pool is None:
            raise ValueError("a storage tier needs the host tier (--enable-hierarchical-cache)")
        self.storage = backend
        self._page_hasher = page_hasher
        self._storage_tag = bytes(layout_tag)
        self._storage_discard = discard
        self.state_suffix = state_suffix

    # ---------------------------------------------------------------- layout
    def _state_bytes(self) -> int:
        return self.mamba_host_pool.slot_bytes()

    def _page_bytes(self) -> int:
        return self.kv_host_pool.token_bytes() * self.page_size

    @staticmethod
    def _path_to(node: TreeNode) -> List[TreeNode]:
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def _reject(self, key: str) -> None:
        self.storage_rejected_total += 1
        logger.warning("sglang-mamba-ext: storage value %s failed its check; read as a miss", key)
        if self._storage_discard is not None:
            try:
                self._storage_discard(key)
            except Exception:  # noqa: BLE001 - a stale value only costs a miss
                pass

    def _read(self, key: str, payload_bytes: int) -> Optional[torch.Tensor]:
        """The checked payload stored under ``key``, or ``None`` (absent, unreadable, bad)."""
        target = torch.empty(payload_bytes + TRAILER_BYTES, dtype=torch.uint8)
        try:
            got = self.storage.get(key, target)
        except Exception:  # noqa: BLE001 - e.g. HiCacheFile's short read: a miss
            try:
                there = self.storage.exists(key)
            except Exception:  # noqa: BLE001
                there = False
            if there:
                self._reject(key)
            return None
        if got is None:
            return None
        payload = unseal(self._storage_tag, key, got, payload_bytes)
        if payload is None:
            self._reject(key)
        return payload

    def _write(self, key: str, payload: torch.Tensor) -> bool:
        try:
            return bool(self.storage.set(key, seal(self._storage_tag, key, payload)))
        except Exception:  # noqa: BLE001 - storage is best effort
            logger.warning("sglang-mamba-ext: storage write of %s failed", key, exc_info=True)
            return False

    # ---------------------------------------------------------------- write
    def _spill(self, node: TreeNode) -> None:
        """``node``'s state leaves the tree's last tier: write it, and the KV pages of its
        prefix that the store lacks, under their keys (nothing if the state is stored
        already). The node's path still holds its KV (device or host slots)."""
        if self.storage is None or node.removed:
            return
        path = self._path_to(node)
        tokens = [t for n in path for t in n.key]
        keys = self._page_hasher(tokens, node.extra_key)
        if not keys:
            return
        state_key = keys[-1] + self.state_suffix
        try:  # pages a size cap or a failed check removed are written again
            have_state = self.storage.exists(state_key)
            missing = [i for i, k in enumerate(keys) if not self.storage.exists(k)]
        except Exception:  # noqa: BLE001
            return
        if missing:
            page = self.page_size
            slots = self._path_slots(path)
            want = [s for i in missing for s in slots[i * page : (i + 1) * page]]
            rows = self._kv_rows(want)  # one gather per buffer for every missing page
            for j, i in enumerate(missing):
                payload = torch.cat([_flat_bytes(r[j * page : (j + 1) * page]) for r in rows]) if rows else \
                    torch.empty(0, dtype=torch.uint8)
                if not self._write(keys[i], payload):
                    return  # a state is useless without its prefix's KV
                self.storage_kv_pages_written_total += 1
        if not have_state and self._write(state_key, self._state_payload(node)):
            self.storage_states_written_total += 1

    def _path_slots(self, path: List[TreeNode]):
        """Per token of the path: ``(on_host, slot)``."""
        out = []
        for n in path:
            if n.value is not None:
                out.extend((False, s) for s in n.value.tolist())
            else:
                out.extend((True, s) for s in n.host_value.tolist())
        return out

    def _kv_rows(self, slots) -> List[torch.Tensor]:
        """The KV of ``slots`` (``(on_host, slot)`` per token), one CPU tensor per buffer."""
        pool = self.kv_host_pool
        on_host = torch.tensor([h for h, _ in slots], dtype=torch.bool)
        idx = torch.tensor([s for _, s in slots], dtype=torch.int64)
        dev_idx, host_idx = idx[~on_host], idx[on_host]
        out = []
        for dev, host in zip(pool.device_buffers, pool.host_buffers):
            rows = torch.empty((len(slots), *host.shape[1:]), dtype=host.dtype)
            if dev_idx.numel():
                rows[~on_host] = dev[dev_idx.to(dev.device)].to("cpu")
            if host_idx.numel():
                rows[on_host] = host[host_idx]
            out.append(rows)
        return out

    def _state_payload(self, node: TreeNode) -> torch.Tensor:
        if node.mamba_host_value is not None:
            tensors = [h[node.mamba_host_value] for h in self.mamba_host_pool.host]
        else:
            tensors = [t[:, node.mamba_value] for t in self.state_pool.state_tensors()]
        return torch.cat([_flat_bytes(t) for t in tensors])

    # ---------------------------------------------------------------- read back
    def _fetch_from_storage(self, tokens: List[int], extra_key, n: int, usable: int, kv_len: int) -> bool:
        """Hang in the tree the longest stored prefix of ``tokens[:n]`` that ends on a state
        deeper than ``usable`` (the tree's usable match), its KV pages past ``kv_len`` (the
        tree's KV match) and the state as host-only slots. True if something was added."""
        if self.storage is None or n <= usable:
            return False
        page = self.page_size
        keys = self._page_hasher(tokens[:n], extra_key)
        first_kv = kv_len // page
        try:
            kv_pages = first_kv + self.storage.batch_exists(keys[first_kv:])
        except Exception:  # noqa: BLE001
            return False
        kv_bytes, state_bytes = self._page_bytes(), self._state_bytes()
        loaded = {}
        for end in range(kv_pages, usable // page, -1):
            if end > kv_pages:
                continue  # a KV page on the way failed its check
            state_key = keys[end - 1] + self.state_suffix
            try:
                if not self.storage.exists(state_key):
                    continue
            except Exception:  # noqa: BLE001
                return False
            for i in range(first_kv, end):
                if i not in loaded:
                    payload = self._read(keys[i], kv_bytes)
                    if payload is None:
                        kv_pages = i
                        break
                    loaded[i] = payload
            if end > kv_pages:
                continue
            state = self._read(state_key, state_bytes)
            if state is None:
                continue
            if self._hang(tokens, extra_key, end * page, kv_len, [loaded[i] for i in range(first_kv, end)], state):
                self.storage_loads_total += 1
                self.storage_kv_pages_loaded_total += max(end - first_kv, 0)
                return True
            return False
        return False

    def _hang(self, tokens, extra_key, length: int, kv_len: int, kv_payloads, state: torch.Tensor) -> bool:
        """Put the read-back prefix in the tree: a host-only node for ``tokens[kv_len:length]``
        (KV ``kv_payloads``) under the node the tree's match ends on, or, when ``length`` lies
        within the tree's KV match, the node ending there (split if needed); the state in a
        host slot. False (nothing changed) if the host tiers have no room."""
        path, pos = self._walk(self.root_node, tokens, 0, min(length, kv_len), extra_key)
        if pos != min(length, kv_len):
            return False  # the tree changed under the match
        anchor = path[-1] if path else self.root_node
        if anchor is not self.root_node:
            self.inc_lock_ref(anchor)  # the host evictions below may not take the path
        try:
            host_kv = None
            if length > pos:
                pool = self.kv_host_pool
                need = length - pos
                if need > pool.size:
                    return False
                host_kv = pool.alloc(need)
                if host_kv is None:
                    res = EvictResult()
                    self._evict_host_kv(need - pool.available_size(), res)
                    self._count_evicted(res)
                    host_kv = pool.alloc(need)
                    if host_kv is None:
                        return False
            slot = self.mamba_host_pool.alloc_list(1)
            if slot is None:
                self._evict_host(1)
                slot = self.mamba_host_pool.alloc_list(1)
            if slot is None or anchor.removed:
                if host_kv is not None:
                    self.kv_host_pool.free(host_kv)
                if slot is not None:
                    self.mamba_host_pool.free(slot)
                return False
            slot = slot[0]
            off = 0
            for h in self.mamba_host_pool.host:
                nb = h[slot].numel() * h.element_size()
                h[slot].view(-1).view(torch.uint8).copy_(state[off : off + nb])
                off += nb
            if host_kv is not None:
                self._fill_host_kv(host_kv, kv_payloads)
                node = TreeNode(tokens[pos:length], None, anchor, extra_key)
                node.host_value = host_kv
                anchor.children[self._child_key(node.key, 0, extra_key)] = node
                self.host_kv_lru_list.push_front(node.full_link)
                node.mamba_host_value = slot
                node.mamba_origin = "insert"
                self._touch_state(node, "stored")
                if self.event_sink is not None:
                    self.event_sink("stored", node)
                return True
            node = anchor
            if node.has_state or node is self.root_node:
                self.mamba_host_pool.free([slot])
                return False
            node.mamba_host_value = slot
            node.mamba_origin = "insert"
            self._touch_state(node, "stored")
            if self.event_sink is not None:
                self.event_sink("state_stored", node)
            return True
        finally:
            if anchor is not self.root_node:
                self._release_lock(anchor)

    def _fill_host_kv(self, host_slots: torch.Tensor, payloads) -> None:
        pool = self.kv_host_pool
        page = self.page_size
        for p, payload in enumerate(payloads):
            idx = host_slots[p * page : (p + 1) * page]
            off = 0
            for host in pool.host_buffers:
                nb = page * host[0].numel() * host.element_size()
                rows = payload[off : off + nb].view(host.dtype).view(page, *host.shape[1:])
                host[idx] = rows
                off += nb
