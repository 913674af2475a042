"""Read-only queries of :class:`~.radix_cache.MambaRadixCache` (a mixin): its size counters
(KV tokens, SSM states; SGLang's ``full_evictable_size`` / ``mamba_evictable_size`` family),
the slots it holds (leak diagnostics) and the invariant checks of :mod:`.invariants`
(``docs/design.md``, "Invariants")."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from . import invariants
from .req import CacheReq
from .tree_node import EMPTY_INDICES, KeyLike, TreeNode, match_len, split_key


class TreeQueries:
    """Needs ``root_node``, the four counters ``_full_evictable`` / ``_full_protected`` /
    ``_mamba_evictable`` / ``_mamba_protected`` and ``_path_values``."""

    def full_evictable_size(self) -> int:
        """KV tokens in unlocked nodes."""
        return self._full_evictable

    def full_protected_size(self) -> int:
        """KV tokens in locked nodes."""
        return self._full_protected

    def mamba_evictable_size(self) -> int:
        """SSM states (slots) in unlocked nodes."""
        return self._mamba_evictable

    def mamba_protected_size(self) -> int:
        """SSM states (slots) in locked nodes."""
        return self._mamba_protected

    def total_size(self) -> int:
        """KV tokens in the tree."""
        return self._full_evictable + self._full_protected

    def mamba_total_size(self) -> int:
        """SSM states in the tree."""
        return self._mamba_evictable + self._mamba_protected

    def path_device_indices(self, node: TreeNode) -> torch.Tensor:
        """int64 KV slots of the tokens from the root to the end of ``node``."""
        return self._path_values(node)

    def device_states_on_path(self, key: KeyLike) -> List[Tuple[int, TreeNode]]:
        """``(seq_len, node)`` of each node on ``key``'s cached path whose state and KV are
        both on the device (no host-tier copy only), shallowest first. Walks whole nodes
        only (a node the key ends inside holds no state at the key's end), so it never
        splits a node and changes nothing (an external store's view: which prefixes of a
        sequence the tree can hand out with their state, ``plugin/lmcache_connector.py``)."""
        tokens, extra_key = split_key(key)
        out: List[Tuple[int, TreeNode]] = []
        node, pos, end = self.root_node, 0, len(tokens)
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos, extra_key))
            if child is None or child.value is None:
                break
            k = len(child.key)
            if pos + k > end or match_len(child.key, tokens, pos, end, self.page_size) != k:
                break
            pos += k
            node = child
            if node.mamba_value is not None:
                out.append((pos, node))
        return out

    def all_values_flatten(self) -> torch.Tensor:
        """int64 device KV slots of every node (leak diagnostics; O(tree size))."""
        vals = [n.value for n in self.nodes() if n.value is not None]
        return torch.cat(vals) if vals else EMPTY_INDICES

    def all_mamba_values_flatten(self) -> torch.Tensor:
        """int64 SSM slots held by the tree (leak diagnostics; O(tree size))."""
        return torch.tensor([n.mamba_value for n in self.nodes() if n.mamba_value is not None], dtype=torch.int64)

    def nodes(self) -> List[TreeNode]:
        """Every node but the root (O(tree size))."""
        out: List[TreeNode] = []
        stack = [self.root_node]
        while stack:
            for child in stack.pop().children.values():
                out.append(child)
                stack.append(child)
        return out

    def sanity_check(self) -> None:
        """:func:`.invariants.sanity_check` on this tree."""
        invariants.sanity_check(self)

    def check_slot_accounting(self, live_reqs: Sequence[CacheReq] = ()) -> None:
        """:func:`.invariants.check_slot_accounting` with these live requests."""
        invariants.check_slot_accounting(self, live_reqs)

    def pretty_print(self) -> str:
        """:func:`.invariants.pretty_print` of this tree."""
        return invariants.pretty_print(self)
