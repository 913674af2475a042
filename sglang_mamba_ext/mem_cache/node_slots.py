"""Node bookkeeping of :class:`~.radix_cache.MambaRadixCache` (a mixin, split from
:mod:`.radix_cache`): recency of a node's KV and state in the LRU lists, a state slot placed in
or dropped from a node, an unlocked leaf removed with what it holds, and one SSM slot got by
evicting a state if the pool is empty (``docs/design.md``, "Tree and match", "Eviction").
The attributes and the other methods it uses are the tree's."""

from __future__ import annotations

from typing import Optional

import torch

from .tree_node import EMPTY_INDICES, EvictResult, TreeNode


class NodeSlots:
    """Mixin: per-node slot and recency bookkeeping (see the module docstring)."""

    def _touch_path(self, node: TreeNode) -> None:
        """Mark ``node`` and its ancestors used now, deepest first, so that every node stays
        at least as recent as its descendants in its KV LRU list (the device's, or the host
        tier's for host-only KV)."""
        self._clock += 1
        now = self._clock
        root = self.root_node
        push = self.full_lru_list.push_front
        while node is not root:
            node.last_access_time = now
            if node.value is None:
                self.host_kv_lru_list.push_front(node.full_link)
            else:
                push(node.full_link)
            node = node.parent

    def _touch_state(self, node: TreeNode, event: str) -> None:
        """A state was ``"stored"`` (its ``mamba_origin`` already set), ``"hit"`` (a
        request resumes from it) or ``"touched"`` (matched without a copy): most recent in
        the SSM LRU list, and the eviction policy told (``state_used(node, event)``) if it
        keeps more. A node whose state is in the host tier only is moved up that tier's list."""
        if node.mamba_value is None:
            self.host_lru_list.push_front(node.host_link)
            if self._state_used is not None:  # the host tier evicts by the same priority
                self._state_used(node, event)
        else:
            self.mamba_lru_list.push_front(node.mamba_link)
            if (
                event == "hit"
                and self.mamba_host_pool is not None
                and self.hicache_write_policy == "write_through_selective"
            ):
                self._backup(node)
        if self._state_used is not None:
            self._state_used(node, event)

    def _path_values(self, node: TreeNode) -> torch.Tensor:
        vals = []
        root = self.root_node
        while node is not root:
            vals.append(node.value)
            node = node.parent
        if not vals:
            return EMPTY_INDICES
        if len(vals) == 1:
            return vals[0]
        vals.reverse()
        return torch.cat(vals)

    def _set_state(self, node: TreeNode, slot: int) -> None:
        node.mamba_value = slot
        if node.mamba_lock_ref > 0:
            self._mamba_protected += 1
        else:
            self._mamba_evictable += 1
        self._touch_state(node, "stored")
        if self.event_sink is not None:
            self.event_sink("state_stored", node)

    def _drop_state(self, node: TreeNode) -> None:
        """Tombstone ``node``: free its SSM slot (caller checked it is unlocked); a state
        without a host copy goes to the storage tier first, if there is one."""
        if self.storage is not None and node.mamba_host_value is None:
            self._spill(node)
        self.state_pool.free([node.mamba_value])
        node.mamba_value = None
        self._mamba_evictable -= 1
        self.mamba_lru_list.remove(node.mamba_link)
        if self.event_sink is not None:
            self.event_sink("state_dropped", node)

    def _delete_leaf(self, node: TreeNode, res: EvictResult) -> None:
        """Remove an unlocked leaf with its KV (device or host) and state, then every
        ancestor that became an unlocked tombstone leaf; add what was freed to ``res``."""
        root = self.root_node
        kv_free = self.token_to_kv_pool_allocator.free
        while True:
            parent = node.parent
            if node.mamba_value is not None:
                self._drop_state(node)
                res.mamba_num_evicted += 1
            if node.mamba_host_value is not None:
                self._drop_host(node)
            k = len(node.key)
            if node.value is not None:
                kv_free(node.value)
                self._full_evictable -= k
                res.num_tokens_evicted += k
                self.full_lru_list.remove(node.full_link)
            else:  # KV in the host tier
                self.kv_host_pool.free(node.host_value)
                res.host_tokens_evicted += k
                self.host_kv_evicted_total += k
                self.host_kv_lru_list.remove(node.full_link)
            del parent.children[self._child_key(node.key, 0, node.extra_key)]
            node.removed = True
            if self.event_sink is not None:
                self.event_sink("removed", node)
            if parent is root or parent.children or parent.has_state or parent.full_lock_ref > 0:
                return
            node = parent

    def _count_evicted(self, res: EvictResult) -> None:
        self.evicted_tokens_total += res.num_tokens_evicted
        self.evicted_states_total += res.mamba_num_evicted

    def _alloc_mamba_slot(self, protect: Optional[TreeNode] = None) -> Optional[int]:
        """One SSM slot, evicting one unlocked state if the pool is empty (``protect`` is
        locked meanwhile so the eviction cannot take it). ``None`` if none can be freed
        (with int8 checkpoints the tree holds no active slot, so nothing is evicted)."""
        pool = self.mamba_pool
        got = pool.alloc_list(1)
        if got is None:
            if self.mamba_ckpt_pool is not None:
                return None  # the tree holds no active slot: evicting frees none
            if protect is not None:
                self.inc_lock_ref(protect)
            self.evict(mamba_num=1)
            if protect is not None:
                self.dec_lock_ref(protect)
            got = pool.alloc_list(1)
            if got is None:
                return None
        return got[0]
