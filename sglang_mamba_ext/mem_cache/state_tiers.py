"""Where the tree's SSM states live besides the active pool (``docs/design.md``, "int8
checkpoints" and "Host tier"): the int8 checkpoint pool a state is quantized into when it
enters the tree, and the host tier that keeps a copy of a state the device tier gives up,
with its write policies, its eviction in the policy's order and the copy back into a
request's slot on a hit. :class:`StateTiers` is mixed into
:class:`~.radix_cache.MambaRadixCache` and uses its tree operations.
"""

from __future__ import annotations

from typing import Optional

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
            ValueError: a bad ``hicache_write_policy``, or both tiers given."""
        #: Where tree states live when they are stored compressed (``docs/design.md``, "int8
        #: checkpoints"): a state entering the tree is quantized into a slot of this pool
        #: and its active slot given back; ``None``: the tree holds active slots.
        self.mamba_ckpt_pool = getattr(req_to_token_pool, "mamba_ckpt_pool", None)
        #: The pool the tree's ``mamba_value`` slots belong to.
        self.state_pool = self.mamba_ckpt_pool if self.mamba_ckpt_pool is not None else self.mamba_pool
        #: The host tier of the states (``mamba_host_value`` slots), or ``None``.
        self.mamba_host_pool = getattr(req_to_token_pool, "mamba_host_pool", None)
        if hicache_write_policy not in HOST_WRITE_POLICIES:
            raise ValueError(
                f"hicache_write_policy must be one of {', '.join(HOST_WRITE_POLICIES)}, got {hicache_write_policy!r}"
            )
        if self.mamba_host_pool is not None and self.mamba_ckpt_pool is not None:
            raise ValueError("int8 checkpoints and a host tier cannot be combined (SGLang refuses it too)")
        self.hicache_write_policy = hicache_write_policy
        #: Host-tier totals since construction: states copied to the host, states a request
        #: resumed from the host, device states the device tier gave up for their host copy,
        #: host copies evicted.
        self.host_backups_total = 0
        self.host_loads_total = 0
        self.host_demotions_total = 0
        self.host_evicted_total = 0

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
    def _backup(self, node: TreeNode) -> bool:
        """Give ``node``'s device state a host copy (evicting the host tier's least recently
        used copy if it is full; ``node`` is locked meanwhile). False if no host slot."""
        if node.mamba_host_value is not None:
            return True
        host = self.mamba_host_pool
        got = host.alloc_list(1)
        if got is None:
            self.inc_lock_ref(node)
            self._evict_host(1)
            self.dec_lock_ref(node)
            got = host.alloc_list(1)
            if got is None:
                return False
        host.store_from_active(self.mamba_pool, [node.mamba_value], got)
        node.mamba_host_value = got[0]
        self.host_lru_list.push_front(node.host_link)
        self.host_backups_total += 1
        return True

    def _demote(self, node: TreeNode) -> bool:
        """The device tier evicts ``node``'s (unlocked) state: with a host tier it keeps its
        host copy (made now under ``write_back`` and ``write_through`` if it has none; under
        ``write_through_selective`` a state without one is dropped) and gives its device slot
        back. False when the state is not kept (the caller drops it as without a host tier)."""
        if self.mamba_host_pool is None:
            return False
        if node.mamba_host_value is None:
            if self.hicache_write_policy == "write_through_selective" or not self._backup(node):
                return False
        self.mamba_pool.free([node.mamba_value])
        node.mamba_value = None
        self._mamba_evictable -= 1
        self.mamba_lru_list.remove(node.mamba_link)
        self.host_lru_list.push_front(node.host_link)
        self.host_demotions_total += 1
        return True

    def _drop_host(self, node: TreeNode) -> None:
        self.mamba_host_pool.free([node.mamba_host_value])
        node.mamba_host_value = None
        self.host_lru_list.remove(node.host_link)

    def _evict_host(self, num: int) -> int:
        """Free ``num`` host slots if possible, victims in the eviction policy's order
        (``host_victim``: LRU, or the recompute / adaptive priority): a copy whose node also
        holds a device state, or an inner node's, is dropped; a leaf whose state is on the
        host only is removed with its KV; locked nodes are skipped. Returns slots freed."""
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
        self._count_evicted(res)
        self.host_evicted_total += freed
        return freed

    def _load_from_host(self, node: TreeNode, req: Optional[CacheReq]) -> Optional[int]:
        """A copy-on-write match ending at ``node``, whose state is in the host tier only: the
        request's working slot (its own, or one allocated now) gets the state copied from the
        host. ``None`` (nothing copied) if no slot can be had."""
        if req is not None and req.mamba_pool_idx is not None:
            slot = req.mamba_pool_idx
        else:
            slot = self._alloc_mamba_slot(protect=node)
            if slot is None:
                return None
        self.mamba_host_pool.load_to_active(self.mamba_pool, [node.mamba_host_value], [slot])
        self.host_loads_total += 1
        return slot

    def host_states(self) -> int:
        """States with a host copy (O(1))."""
        return len(self.host_lru_list)
