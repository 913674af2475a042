"""Where the tree's SSM states and KV live besides the device pools (``docs/design.md``, "int8
checkpoints" and "Host tier"): the int8 checkpoint pool a state is quantized into when it
enters the tree; the host tier that keeps a copy of a state the device tier gives up, with
its write policies, its eviction in the policy's order and the copy back into a request's
slot on a hit; and the host tier of attention KV, where a device leaf's KV moves when the
device KV pool evicts it and from which a copy-on-write match loads it back.
:class:`StateTiers` is mixed into :class:`~.radix_cache.MambaRadixCache` and uses its tree
operations.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .req import CacheReq
from .tree_node import EvictResult, TreeNode

#: ``hicache_write_policy`` values (SGLang's ``--hicache-write-policy``).
HOST_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class StateTiers:
    """The int8 checkpoint pool and the host tier of :class:`~.radix_cache.MambaRadixCache`
    (module docstring)."""

    def _init_state_tiers(self, req_to_token_pool, hicache_write_policy: str) -> None:
        """Take the request pool's ``mamba_ckpt_pool`` / ``mamba_host_pool``.

        Raises:
            ValueError: a bad ``hicache_write_policy``, or a KV host pool without a state one."""
        #: Where tree states live when they are stored compressed (``docs/design.md``, "int8
        #: checkpoints"): a state entering the tree is quantized into a slot of this pool
        #: and its active slot given back; ``None``: the tree holds active slots.
        self.mamba_ckpt_pool = getattr(req_to_token_pool, "mamba_ckpt_pool", None)
        #: The pool the tree's ``mamba_value`` slots belong to.
        self.state_pool = self.mamba_ckpt_pool if self.mamba_ckpt_pool is not None else self.mamba_pool
        #: The host tier of the states (``mamba_host_value`` slots), or ``None``: copies of
        #: ``state_pool``'s slots (int8 ones with int8 checkpoints).
        self.mamba_host_pool = getattr(req_to_token_pool, "mamba_host_pool", None)
        if hicache_write_policy not in HOST_WRITE_POLICIES:
            raise ValueError(
                f"hicache_write_policy must be one of {', '.join(HOST_WRITE_POLICIES)}, got {hicache_write_policy!r}"
            )
        #: The host tier of attention KV (:class:`~.kv_host_pool.HostKVPool`), or ``None``:
        #: KV eviction then removes leaves.
        self.kv_host_pool = getattr(req_to_token_pool, "kv_host_pool", None)
        if self.kv_host_pool is not None and self.mamba_host_pool is None:
            raise ValueError("a host tier of KV needs the host tier of states (mamba_host_pool)")
        self.hicache_write_policy = hicache_write_policy
        #: Host-tier totals since construction: states copied to the host, states a request
        #: resumed from the host, device states the device tier gave up for their host copy,
        #: host copies evicted.
        self.host_backups_total = 0
        self.host_loads_total = 0
        self.host_demotions_total = 0
        self.host_evicted_total = 0
        #: KV host-tier totals (tokens): moved to the host, loaded back, removed from the host.
        self.host_kv_demoted_total = 0
        self.host_kv_loaded_total = 0
        self.host_kv_evicted_total = 0

    def _state_room(self) -> bool:
        """With int8 checkpoints: make sure one checkpoint slot is free, evicting one
        unlocked tree state if none is; False if none can be freed. Always True without."""
        ckpt = self.mamba_ckpt_pool
        if ckpt is None or ckpt.available_size() > 0:
            return True
        self.evict(mamba_num=1)
        return ckpt.available_size() > 0

    def _stored_slot(self, active_slot: int, keep_active: bool = False) -> int:
        """The slot a node keeps for the state in active slot ``active_slot``: that slot, or
        with int8 checkpoints a checkpoint slot it is quantized into (the active slot is
        freed unless ``keep_active``). The caller made room (:meth:`_state_room`)."""
        ckpt = self.mamba_ckpt_pool
        if ckpt is None:
            return active_slot
        slot = ckpt.alloc_list(1)[0]
        ckpt.store_from_active(self.mamba_pool, [active_slot], [slot])
        if not keep_active:
            self.mamba_pool.free([active_slot])
        return slot

    # ================================================================ host tier
    # docs/design.md, "Host tier": a state's copy in host memory (``mamba_host_value``)
    def _backup(self, node: TreeNode, res: Optional[EvictResult] = None) -> bool:
        """Give ``node``'s device state a host copy (evicting the host tier's least recently
        used copy if it is full; ``node`` is locked meanwhile; what that frees is added to
        ``res`` if given). False if no host slot."""
        if node.mamba_host_value is not None:
            return True
        host = self.mamba_host_pool
        got = host.alloc_list(1)
        if got is None:
            self.inc_lock_ref(node)
            self._evict_host(1, res)
            self.dec_lock_ref(node)
            got = host.alloc_list(1)
            if got is None:
                return False
        host.store_from_active(self.state_pool, [node.mamba_value], got)
        node.mamba_host_value = got[0]
        self.host_lru_list.push_front(node.host_link)
        self.host_backups_total += 1
        return True

    def _demote(self, node: TreeNode, res: Optional[EvictResult] = None) -> bool:
        """The device tier evicts ``node``'s (unlocked) state: with a host tier it keeps its
        host copy (made now under ``write_back`` and ``write_through`` if it has none; under
        ``write_through_selective`` a state without one is dropped) and gives its device slot
        back. False when the state is not kept (the caller drops it as without a host tier).
        What the host tier evicts meanwhile is added to ``res`` if given (the caller's
        eviction reports it)."""
        if self.mamba_host_pool is None:
            return False
        if node.mamba_host_value is None:
            if self.hicache_write_policy == "write_through_selective" or not self._backup(node, res):
                return False
        self.state_pool.free([node.mamba_value])
        node.mamba_value = None
        self._mamba_evictable -= 1
        self.mamba_lru_list.remove(node.mamba_link)
        self.host_lru_list.push_front(node.host_link)
        self.host_demotions_total += 1
        return True

    def _drop_host(self, node: TreeNode) -> None:
        if self.storage is not None and node.mamba_value is None:
            self._spill(node)  # the state leaves its last tier (docs/design.md, "Storage tier")
        self.mamba_host_pool.free([node.mamba_host_value])
        node.mamba_host_value = None
        self.host_lru_list.remove(node.host_link)

    def _evict_host(self, num: int, res: Optional[EvictResult] = None) -> int:
        """Free ``num`` host slots if possible, victims in the eviction policy's order
        (``host_victim``: LRU, or the recompute / adaptive priority): a copy whose node also
        holds a device state, or an inner node's, is dropped; a leaf whose state is on the
        host only is removed with its KV (added to ``res`` if given, else counted here);
        locked nodes are skipped. Returns slots freed."""
        own = res is None
        if own:
            res = EvictResult()
        freed = 0
        while freed < num:
            node = self._eviction.host_victim()
            if node is None:
                break
            if node.mamba_value is not None or node.children:
                self._drop_host(node)
            else:
                self._delete_leaf(node, res)
            freed += 1
        if own:
            self._count_evicted(res)
        self.host_evicted_total += freed
        return freed

    def _load_from_host(self, node: TreeNode, req: Optional[CacheReq]) -> Optional[int]:
        """A copy-on-write match ending at ``node``, whose state is in the host tier only: the
        request's working slot (its own, or one allocated now) gets the state copied from the
        host (with int8 checkpoints through a checkpoint slot borrowed for the copy and
        dequantized from there, as a device hit is). ``None`` (nothing copied) if no slot can
        be had."""
        own = req is not None and req.mamba_pool_idx is not None
        slot = req.mamba_pool_idx if own else self._alloc_mamba_slot(protect=node)
        if slot is None:
            return None
        ckpt = self.mamba_ckpt_pool
        if ckpt is None:
            self.mamba_host_pool.load_to_active(self.mamba_pool, [node.mamba_host_value], [slot])
        else:
            staging = self._borrow_ckpt_slot(node)
            if staging is None:
                if not own:
                    self.mamba_pool.free([slot])
                return None
            self.mamba_host_pool.load_to_active(ckpt, [node.mamba_host_value], [staging])
            ckpt.load_to_active(self.mamba_pool, [staging], [slot])
            ckpt.free([staging])
        self.host_loads_total += 1
        return slot

    def _borrow_ckpt_slot(self, node: TreeNode) -> Optional[int]:
        """A free int8 checkpoint slot for a host load into ``node``'s request, evicting one
        unlocked tree state if none is free (``node`` locked meanwhile, so the host tier's
        eviction that the device one may cause cannot take its copy). ``None`` if none."""
        ckpt = self.mamba_ckpt_pool
        got = ckpt.alloc_list(1)
        if got is None:
            self.inc_lock_ref(node)
            self.evict(mamba_num=1)
            self.dec_lock_ref(node)
            got = ckpt.alloc_list(1)
        return got[0] if got is not None else None

    # ================================================================ host tier of KV
    # docs/design.md, "Host tier": a node's KV in host memory (``host_value``, ``value None``)
    @staticmethod
    def _is_device_leaf(node: TreeNode) -> bool:
        """``node`` has device KV and none of its children has: the device KV pool's leaf."""
        if node.value is None:
            return False
        for child in node.children.values():
            if child.value is not None:
                return False
        return True

    def _evict_kv_leaf(self, node: TreeNode, res: EvictResult) -> bool:
        """KV eviction of the unlocked device leaf ``node``: its KV (with its state, which
        goes to the host tier or, failing that, is dropped) moves to the host KV pool; if it
        cannot move (no host room: longer than the pool, or the rest locked), ``node`` is
        removed as without a host tier, with the host-only subtree below it. False if nothing
        was freed (a host-only descendant is locked)."""
        if self._demote_kv(node, res):
            return True
        if node.children:
            self._drop_host_subtree(node, res)
            if node.children:
                return False
        self._delete_leaf(node, res)
        return True

    def _drop_host_subtree(self, node: TreeNode, res: EvictResult) -> None:
        """Remove the (host-only) descendants of the device leaf ``node``, deepest first,
        skipping locked ones (and so their ancestors); ``node`` stays."""
        order: List[TreeNode] = []
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        self.inc_lock_ref(node)  # the removals' cascade stops below it
        for n in reversed(order):  # every node after its descendants
            if not n.removed and not n.children and n.full_lock_ref == 0:
                self._delete_leaf(n, res)
        self._release_lock(node)

    def _demote_kv(self, node: TreeNode, res: EvictResult) -> bool:
        """Move ``node``'s device KV to the host KV pool (evicting host-only leaves for room),
        its device state first to the host tier (dropped if it cannot go there and ``node``
        is inner). False (nothing changed) without a KV host pool or room, or for a leaf
        whose state cannot be kept."""
        pool = self.kv_host_pool
        if pool is None:
            return False
        k = len(node.key)
        if k > pool.size:
            return False  # never fits: keep the host tier as it is
        host = pool.alloc(k)
        if host is None:
            self.inc_lock_ref(node)  # the host eviction may not remove it as a bare ancestor
            self._evict_host_kv(k - pool.available_size(), res)
            self._release_lock(node)
            if not node.children and not node.has_state:
                # its host-only children went and it holds no state: a bare leaf, removed
                self._delete_leaf(node, res)
                return True
            host = pool.alloc(k)
            if host is None:
                return False
        if node.mamba_value is not None:
            if self._demote(node, res):
                res.mamba_num_evicted += 1
            elif node.children:
                self._drop_state(node)
                res.mamba_num_evicted += 1
            else:
                pool.free(host)
                return False
        pool.backup(node.value, host)
        self.token_to_kv_pool_allocator.free(node.value)
        node.value = None
        node.host_value = host
        self.full_lru_list.remove(node.full_link)
        self.host_kv_lru_list.push_front(node.full_link)  # after its (host-only) children
        self._full_evictable -= k
        res.num_tokens_evicted += k
        self.host_kv_demoted_total += k
        return True

    def _evict_host_kv(self, num_tokens: int, res: EvictResult) -> None:
        """Free ``num_tokens`` of the host KV pool if possible: unlocked host-only leaves go in
        the eviction policy's order (``host_kv_victim``), with their host state and the bare
        ancestors they leave (added to ``res``)."""
        target = res.host_tokens_evicted + num_tokens
        victim = self._eviction.host_kv_victim
        while res.host_tokens_evicted < target:
            node = victim()
            if node is None:
                return
            self._delete_leaf(node, res)

    def _load_kv(self, nodes: List[TreeNode]) -> bool:
        """Load the host-only KV of ``nodes`` (a path's consecutive host-only nodes, top
        first) into fresh device slots, evicting device KV for room; the path is locked
        meanwhile. The host copies are freed (a node's KV is in one place). False (nothing
        loaded) if the device KV pool cannot give the room."""
        total = sum(len(n.key) for n in nodes)
        kv = self.token_to_kv_pool_allocator
        last = nodes[-1]
        self.inc_lock_ref(last)
        try:
            dev = kv.alloc(total)
            if dev is None:
                self.evict(num_tokens=total - kv.available_size())
                if getattr(kv, "free_group", None) is not None:
                    # SGLang's allocator holds frees back in an open group: land them first
                    kv.free_group_end()
                    kv.free_group_begin()
                dev = kv.alloc(total)
                if dev is None:
                    return False
            dev = dev.to(torch.int64)
            host = torch.cat([n.host_value for n in nodes]) if len(nodes) > 1 else nodes[0].host_value
            self.kv_host_pool.load(host, dev)  # one copy per layer buffer for the whole path
            self.kv_host_pool.free(host)
            off = total
            for n in reversed(nodes):  # deepest first: each parent ends more recent
                k = len(n.key)
                n.value = dev[off - k : off]
                off -= k
                n.host_value = None
                self.host_kv_lru_list.remove(n.full_link)
                self.full_lru_list.push_front(n.full_link)
                self._full_protected += k  # locked just above
            self.host_kv_loaded_total += total
            return True
        finally:
            self.dec_lock_ref(last)

    def _adopt_kv(self, node: TreeNode, value: torch.Tensor) -> None:
        """An insert passes the host-only ``node`` with its own device slots ``value`` for
        the same tokens: the node takes them and frees its host copy (no copy needed)."""
        self.kv_host_pool.free(node.host_value)
        node.host_value = None
        node.value = value
        self.host_kv_lru_list.remove(node.full_link)
        self.full_lru_list.push_front(node.full_link)  # the insert touches its path after
        k = len(node.key)
        if node.full_lock_ref > 0:
            self._full_protected += k
        else:
            self._full_evictable += k

    def host_kv_tokens(self) -> int:
        """KV tokens the tree holds in the host tier (O(1): the host KV pool's used slots;
        only the tree holds them)."""
        pool = self.kv_host_pool
        return pool.size - pool.available_size() if pool is not None else 0

    def host_states(self) -> int:
        """States with a host copy (O(1))."""
        return len(self.host_lru_list)
