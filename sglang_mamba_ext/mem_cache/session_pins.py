"""Session-aware eviction order (``--enable-session-radix-cache``; ``docs/design.md``,
"Sessions"): the state each open session resumes from, and the KV on its path, are evicted
only after everything no open session holds.

The idea is SGLang's (``mem_cache/unified_cache/session_ref_tracker.py``: a finished turn
tags the node it ended on with its session id, closing the session drops the tag, and the
tree's eviction walks the tagged nodes last). Here a session holds a list of *pins*: the
deepest node with a state (on the device or in the host tier) at or above the node its last
turn ended on. A new pin replaces the session's pins on its own root path (the previous
turn's), so a session that branched keeps one pin per branch. Pins are not locks: an
eviction that cannot be met from unpinned entries takes pinned ones, in the policy's order.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from sglang_mamba_ext.mem_cache.tree_node import EvictResult, TreeNode


class SessionPins:
    """Mixin of :class:`~.radix_cache.MambaRadixCache`: ``_session_pins`` (session id ->
    pinned nodes), :meth:`pin_session`, :meth:`release_session`, and the two-pass
    :meth:`_evict_sessions_last` that ``evict`` runs."""

    _session_pins: Dict[str, List[TreeNode]]

    def pin_session(self, session_id: str, node: TreeNode) -> Optional[TreeNode]:
        """Pin, for ``session_id``, the deepest node with a state at or above ``node`` (the
        node a finished turn's insert ended on); its earlier pins on that node's root path
        are dropped. Returns the pinned node, or ``None`` when no node on the path holds a
        state (nothing to resume from: nothing pinned)."""
        root = self.root_node
        while node is not root and not (node.has_state and not node.removed):
            node = node.parent
        if node is root:
            return None
        kept = []
        for pin in self._session_pins.get(session_id, ()):
            if pin.removed or not pin.has_state or pin is node:
                continue
            up = node.parent
            while up is not root and up is not pin:
                up = up.parent
            if up is not pin:  # not an ancestor of the new pin: another branch, kept
                kept.append(pin)
        kept.append(node)
        self._session_pins[session_id] = kept
        return node

    def release_session(self, session_id: str) -> int:
        """Drop ``session_id``'s pins (the session closed). Returns how many it held."""
        return len([p for p in self._session_pins.pop(session_id, ()) if not p.removed and p.has_state])

    def pinned_nodes(self) -> List[TreeNode]:
        """Every node some open session pins, once each; pins whose node left the tree or
        whose state was evicted (a shortfall took it) are left out."""
        seen, out = set(), []
        for pins in self._session_pins.values():
            for pin in pins:
                if not pin.removed and pin.has_state and id(pin) not in seen:
                    seen.add(id(pin))
                    out.append(pin)
        return out

    def _evict_sessions_last(self, num_tokens: int, mamba_num: int, res: EvictResult) -> None:
        """``evict``'s work: first with every pinned node locked (its state, and the KV of
        its root path, out of reach), then, if that fell short, without."""
        pinned = self.pinned_nodes() if self._session_pins else []
        for node in pinned:
            self.inc_lock_ref(node)
        try:
            if mamba_num > 0:
                self._evict_mamba(mamba_num, res)
            if num_tokens > res.num_tokens_evicted:
                self._evict_full(num_tokens, res)
        finally:
            for node in pinned:
                self.dec_lock_ref(node)
        if pinned:
            if mamba_num > res.mamba_num_evicted:
                self._evict_mamba(mamba_num - res.mamba_num_evicted, res)
            if num_tokens > res.num_tokens_evicted:
                self._evict_full(num_tokens, res)
