"""Checks and diagnostics of a :class:`~.radix_cache.MambaRadixCache` (``docs/design.md``,
"Invariants"): :func:`sanity_check` walks the tree and compares it with the cache's
counters and recency lists; :func:`check_slot_accounting` checks that every KV page and SSM
slot has exactly one owner — the free list, the tree or a live request; :func:`pretty_print`
renders the tree as text. All are O(tree size) and change nothing; tests and SGLang's idle
check (``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK=1``) call them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Sequence

import torch

from .req import CacheReq
from .tree_node import TreeNode

if TYPE_CHECKING:  # pragma: no cover
    from .radix_cache import MambaRadixCache


def sanity_check(cache: "MambaRadixCache") -> None:
    """Check every invariant of ``docs/design.md`` ("Invariants") that the tree can see:
    parent links, lengths, page alignment, child keys, namespaces, lock counts, no tombstone
    leaf, LRU membership and order, size counters, no slot in two nodes, session pins in the tree,
    host-only KV only below host-only KV, never locked and without a device state.

    Raises:
        AssertionError: naming the first broken invariant.
    """
    root = cache.root_node
    page_size = cache.page_size
    assert root.full_lock_ref == 1 and root.mamba_lock_ref == 1, "root must hold both locks"
    assert root.mamba_value is None and not root.key
    fe = fp = me = mp = host_kv = nodes = 0
    kv_seen: List[torch.Tensor] = []
    host_kv_seen: List[torch.Tensor] = []
    mamba_seen = set()
    host_seen = set()
    stack = [root]
    while stack:
        node = stack.pop()
        for ck, child in node.children.items():
            assert child.parent is node, f"{child!r} has a wrong parent"
            assert child.seq_len == node.seq_len + len(child.key), f"{child!r} has a wrong seq_len"
            assert not child.removed, f"removed node {child!r} still in the tree"
            assert len(child.key) > 0, f"{child!r} has an empty key"
            assert len(child.key) % page_size == 0, f"{child!r} key not page aligned"
            if child.value is None:  # KV in the host tier only
                assert child.host_value is not None and child.host_value.numel() == len(child.key), (
                    f"{child!r}: host-only KV without host slots of its length"
                )
                assert child.mamba_value is None, f"{child!r}: host-only KV with a device state"
                assert child.full_lock_ref == 0, f"{child!r}: host-only KV is locked"
                host_kv += len(child.key)
                host_kv_seen.append(child.host_value)
            else:
                assert child.host_value is None, f"{child!r}: KV on the device and the host"
                assert child.value.numel() == len(child.key), f"{child!r} key/value length mismatch"
                assert node is root or node.value is not None, f"{child!r}: device KV below host-only KV"
            assert ck == cache._child_key(child.key, 0, child.extra_key), (
                f"{child!r} is registered under a stale key {ck!r}"
            )
            assert child.extra_key == node.extra_key or node is root, "namespace changes below root"
            assert child.full_lock_ref >= 0 and child.mamba_lock_ref >= 0, f"negative lock {child!r}"
            assert child.mamba_lock_ref == 0 or child.full_lock_ref > 0, (
                f"{child!r}: mamba_lock_ref > 0 requires full_lock_ref > 0"
            )
            assert node is root or node.full_lock_ref >= child.full_lock_ref, (
                f"{child!r} holds more KV locks than its parent"
            )
            if not child.children:
                assert child.has_state or child.full_lock_ref > 0, f"leaf {child!r} is a tombstone"
            assert child.full_link.linked, f"{child!r} missing from the KV LRU list"
            _check_state_slot(child, "SSM", child.mamba_value, child.mamba_link, mamba_seen, cache.state_pool)
            _check_state_slot(child, "host", child.mamba_host_value, child.host_link, host_seen, cache.mamba_host_pool)
            if child.mamba_value is not None:
                if child.mamba_lock_ref > 0:
                    mp += 1
                else:
                    me += 1
            if child.value is not None:
                if child.full_lock_ref > 0:
                    fp += len(child.key)
                else:
                    fe += len(child.key)
                kv_seen.append(child.value)
            nodes += 1
            stack.append(child)
    kv_counts = (cache.full_evictable_size(), cache.full_protected_size())
    assert kv_counts == (fe, fp), f"KV counters {kv_counts} != tree {(fe, fp)}"
    ssm_counts = (cache.mamba_evictable_size(), cache.mamba_protected_size())
    assert ssm_counts == (me, mp), f"SSM counters {ssm_counts} != tree {(me, mp)}"
    assert len(cache.full_lru_list) + len(cache.host_kv_lru_list) == nodes, "KV LRU list size != node count"
    assert cache.host_kv_tokens() == host_kv, f"host KV counter {cache.host_kv_tokens()} != tree {host_kv}"
    if host_kv_seen:
        allhost = torch.cat(host_kv_seen)
        assert torch.unique(allhost).numel() == allhost.numel(), "a host KV slot is in two nodes"
    assert len(cache.mamba_lru_list) == len(mamba_seen), "SSM LRU list size != state count"
    if kv_seen:
        allkv = torch.cat(kv_seen)
        assert torch.unique(allkv).numel() == allkv.numel(), "a KV slot is in two nodes"
    # Recency: every node is at least as recent as its descendants in its KV list (device KV
    # in full_lru_list, host-only KV in host_kv_lru_list, whose parents may be on the device).
    seen = set()
    for lru, host in ((cache.full_lru_list, False), (cache.host_kv_lru_list, True)):
        for link in lru:
            node = link.owner
            assert (node.value is None) == host, f"{node!r} is in the wrong KV LRU list"
            parent = node.parent
            assert parent is root or parent.id in seen or (host and parent.value is not None), (
                f"{node!r} is more recent than its parent in the KV LRU list"
            )
            seen.add(node.id)
    # Session pins (session_pins.py): each one in the tree (removed ones are skipped).
    for pin in cache.pinned_nodes():
        assert pin.id in seen, f"session pin {pin!r} is not in the tree"


def _check_state_slot(node, what: str, slot, link, seen: set, pool) -> None:
    """A node's state slot of one tier (``what``: "SSM" or "host"): in that tier's LRU list
    exactly when it has one, in no other node, not on the pool's free list."""
    if slot is None:
        assert not link.linked, f"{node!r} without a {what} state in the {what} LRU list"
        return
    assert link.linked, f"{node!r} missing from the {what} LRU list"
    assert slot not in seen, f"{what} slot {slot} in two nodes"
    assert not pool.is_free(slot), f"{what} slot {slot} of {node!r} is on the free list"
    seen.add(slot)


def check_slot_accounting(cache: "MambaRadixCache", live_reqs: Sequence[CacheReq] = ()) -> None:
    """Exact leak check: every KV page (slot when ``page_size == 1``) and every SSM slot is
    in exactly one place — the free list, one tree node, or one live request of
    ``live_reqs`` (its KV ``[cache_protected_len, kv_allocated_len)`` of its row, whose last
    page may be partly used, and its working, ping-pong and planned checkpoint slots). At an
    idle point (no live requests) this is ``free + evictable + protected == size`` for both
    pools (with int8 checkpoints, three: KV, active SSM slots held by requests only, and
    checkpoint slots held by the tree only).

    Raises:
        AssertionError: naming the count of lost or doubly owned pages / slots.
    """
    kv = cache.token_to_kv_pool_allocator
    ps = cache.page_size
    places: List[torch.Tensor] = [kv.free_slots()]
    tree_mamba: List[int] = []
    host_kv: List[torch.Tensor] = []
    for node in cache.nodes():
        if node.value is not None:
            places.append(node.value)
        else:
            host_kv.append(node.host_value)
        if node.mamba_value is not None:
            tree_mamba.append(node.mamba_value)
    req_mamba: List[int] = []
    req_to_token = cache.req_to_token_pool.req_to_token
    for r in live_reqs:
        if r.req_pool_idx is not None and r.kv_allocated_len > r.cache_protected_len:
            places.append(req_to_token[r.req_pool_idx, r.cache_protected_len : r.kv_allocated_len].to(torch.int64))
        if r.mamba_pool_idx is not None:
            req_mamba.append(r.mamba_pool_idx)
        req_mamba.extend(s for s in r.mamba_ping_pong_track_buffer if s >= 0)
        req_mamba.extend(slot for _, slot in r.mamba_prefix_checkpoints)
    if ps > 1:
        # Each place owns whole pages (a request's last page may be partly used): count a
        # page once per place, then across places.
        places = [torch.unique(p // ps) for p in places]
        total = kv.size // ps
    else:
        total = kv.size
    owned = torch.cat(places)
    uniq = torch.unique(owned)
    unit = "pages" if ps > 1 else "slots"
    assert uniq.numel() == owned.numel(), f"{owned.numel() - uniq.numel()} KV {unit} are owned twice"
    assert uniq.numel() == total, f"KV slots lost: {total - uniq.numel()} {unit} of {total} not accounted for"
    if cache.kv_host_pool is not None:
        host_places = [cache.kv_host_pool.free_slots()] + host_kv
        if ps > 1:
            host_places = [torch.unique(p // ps) for p in host_places]
        owned = torch.cat(host_places)
        uniq = torch.unique(owned)
        host_total = cache.kv_host_pool.size // ps
        assert uniq.numel() == owned.numel(), f"{owned.numel() - uniq.numel()} host KV {unit} are owned twice"
        assert uniq.numel() == host_total, f"host KV slots lost: {host_total - uniq.numel()} {unit} of {host_total}"
    if cache.mamba_host_pool is not None:
        _check_slots("host SSM", cache.mamba_host_pool, [n.mamba_host_value for n in cache.nodes() if n.mamba_host_value is not None])
    if cache.mamba_ckpt_pool is None:
        _check_slots("SSM", cache.mamba_pool, tree_mamba + req_mamba)
    else:
        # int8 checkpoints: the tree owns checkpoint slots only, requests active slots only
        _check_slots("SSM", cache.mamba_pool, req_mamba)
        _check_slots("int8 checkpoint", cache.mamba_ckpt_pool, tree_mamba)


def _check_slots(what: str, pool, owned: List[int]) -> None:
    every = pool.free_slots() + owned
    assert len(every) == len(set(every)), f"an {what} slot is owned twice"
    assert len(every) == pool.size, f"{what} slots lost: {pool.size - len(every)} of {pool.size}"


def pretty_print(cache: "MambaRadixCache") -> str:
    """The tree as indented text, one node a line (first tokens, first KV slots, SSM slot,
    locks), then the size counters; also printed."""
    lines: List[str] = []

    def visit(node: TreeNode, depth: int) -> None:
        for child in node.children.values():
            head = child.key[:4]
            more = "..." if len(child.key) > 4 else ""
            kv = child.value if child.value is not None else child.host_value
            lines.append(
                f"{'  ' * depth}[{len(child.key)} tok {head}{more}] "
                f"{'kv' if child.value is not None else 'host kv'}={kv[:3].tolist()}"
                f"{'...' if kv.numel() > 3 else ''} ssm={child.mamba_value} "
                f"lock=({child.full_lock_ref},{child.mamba_lock_ref})"
            )
            visit(child, depth + 1)

    visit(cache.root_node, 0)
    lines.append(
        f"kv evictable={cache.full_evictable_size()} protected={cache.full_protected_size()} | "
        f"ssm evictable={cache.mamba_evictable_size()} protected={cache.mamba_protected_size()}"
    )
    text = "\n".join(lines)
    print(text)
    return text
