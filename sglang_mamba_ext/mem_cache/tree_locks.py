"""Locks of :class:`~.radix_cache.MambaRadixCache` (a mixin; ``docs/design.md``, "Locks"):
a request's lock pins its node's state and the KV of its root path against eviction, and
moves their sizes between the evictable and protected counters. Host-only KV (``value
None``, "Host tier") is not counted: only device KV is evictable or protected.
"""

from __future__ import annotations

from .tree_node import EvictResult, TreeNode


class TreeLocks:
    """Needs ``root_node``, the four size counters, ``_delete_leaf`` and ``_count_evicted``."""

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock ``node`` (SSM) and its root path (KV) against eviction, whether or not it
        holds a state now (``docs/design.md``, "Locks")."""
        if node is self.root_node:
            return
        if node.mamba_lock_ref == 0 and node.mamba_value is not None:
            self._mamba_evictable -= 1
            self._mamba_protected += 1
        node.mamba_lock_ref += 1
        root = self.root_node
        while node is not root:
            if node.full_lock_ref == 0 and node.value is not None:  # host-only KV: no count
                k = len(node.key)
                self._full_evictable -= k
                self._full_protected += k
            node.full_lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Release one :meth:`inc_lock_ref` of ``node``. A tombstone that is left an
        unlocked leaf is removed (counted in ``evicted_tokens_total``).

        Raises:
            RuntimeError: if ``node`` is not locked (an unbalanced release).
        """
        if node is self.root_node:
            return
        self._release_lock(node)
        # A tombstone locked directly may have lost its children meanwhile.
        if not node.has_state and not node.children and node.full_lock_ref == 0 and not node.removed:
            res = EvictResult()
            self._delete_leaf(node, res)
            self._count_evicted(res)

    def _release_lock(self, node: TreeNode) -> None:
        """:meth:`dec_lock_ref` without removing ``node`` if that leaves it a bare leaf (the
        caller does)."""
        if node.mamba_lock_ref <= 0 or node.full_lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref on an unlocked node {node!r}")
        node.mamba_lock_ref -= 1
        if node.mamba_lock_ref == 0 and node.mamba_value is not None:
            self._mamba_protected -= 1
            self._mamba_evictable += 1
        root = self.root_node
        while node is not root:
            node.full_lock_ref -= 1
            if node.full_lock_ref == 0 and node.value is not None:
                k = len(node.key)
                self._full_protected -= k
                self._full_evictable += k
            node = node.parent
