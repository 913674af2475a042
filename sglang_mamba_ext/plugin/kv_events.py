"""KV events of the hybrid cache (``docs/design.md``, "KV events"): with
``--kv-events-config``, the core tree's change notifications
(:attr:`~sglang_mamba_ext.mem_cache.MambaRadixCache.event_sink`) become SGLang 0.5.23's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (``disaggregation/kv_events.py``),
queued in SGLang's own ``KVCacheEventRecorder`` (``mem_cache/events.py``) — the queue the
scheduler drains through ``BasePrefixCache.take_events`` after each prefill batch, every
``--decode-log-interval`` decode steps and when it goes idle. Block hashes, parent links,
one block per page, ``medium`` (``GPU``), ``cache_salt`` / LoRA namespaces, the ``dynamo``
format and the coalescing of consecutive events are therefore exactly SGLang's.

The hybrid rule: a block is published while its KV is in the tree *and* it lies on the
root path of a node holding an SSM state (that node or one below it), so every published
chain ends at a state a request can resume from. A state dropped where no deeper state
covers the KV withdraws the blocks past the last remaining state (``BlockRemoved``); a
state stored on such KV publishes them again (``BlockStored``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from sglang.srt.mem_cache.events import KVCacheEventRecorder, KvEventLoraNames
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import split_node_hash_value


class _EventNode:
    """What SGLang's recorder reads of a tree node: ``key`` (SGLang's ``RadixKey`` of the
    edge, with the node's ``extra_key`` / ``cache_salt``), ``parent``, and the per-page
    hash strings it computes once and keeps (``hash_value``, ``event_hash_value``).
    ``published``: the node's blocks are announced now."""

    __slots__ = ("key", "parent", "hash_value", "event_hash_value", "published")

    def __init__(self, key: RadixKey, parent: Optional["_EventNode"]):
        self.key = key
        self.parent = parent
        self.hash_value = None
        self.event_hash_value = None
        self.published = False


def _radix_key(node) -> RadixKey:
    """SGLang's key of a core node: its token list (shared, not copied) and the namespace
    the plugin stores as ``(extra_key, cache_salt)`` (``plugin/req_bridge.py::namespace``)."""
    ns = node.extra_key
    if ns is None:
        return RadixKey(node.key)
    return RadixKey(node.key, ns[0], cache_salt=ns[1])


class HybridKVEvents:
    """The core's ``event_sink``: keeps one :class:`_EventNode` per tree node and records
    SGLang's events under the hybrid rule (module docstring) into ``recorder``.

    Args:
        recorder: SGLang's ``KVCacheEventRecorder`` (enabled) whose queue the adapter's
            ``take_events`` drains.
    """

    def __init__(self, recorder: KVCacheEventRecorder):
        self.recorder = recorder
        self.page_size = recorder.page_size
        self._root = _EventNode(RadixKey([]), None)
        self._root.hash_value = []
        #: core ``TreeNode.id`` -> its event node, for every node in the tree.
        self._nodes: Dict[int, _EventNode] = {}
        self._handlers = {
            "stored": self._stored,
            "split": self._split,
            "state_stored": self._state_stored,
            "state_dropped": self._state_dropped,
            "removed": self._removed,
            "reset": self._reset,
        }

    def __call__(self, kind: str, node, other=None) -> None:
        self._handlers[kind](node, other)

    # -- notifications -----------------------------------------------------------------
    def _stored(self, node, _other) -> None:
        self._nodes[node.id] = _EventNode(_radix_key(node), self._event_node(node.parent))
        self._publish_path(node)

    def _split(self, upper, lower) -> None:
        low = self._nodes[lower.id]
        up = _EventNode(_radix_key(upper), self._event_node(upper.parent))
        n = len(upper.key)
        up.hash_value, low.hash_value = split_node_hash_value(low.hash_value, n, self.page_size)
        up.event_hash_value, low.event_hash_value = split_node_hash_value(low.event_hash_value, n, self.page_size)
        # The upper part is covered exactly when its only child is.
        up.published = low.published
        low.key = _radix_key(lower)
        low.parent = up
        self._nodes[upper.id] = up

    def _state_stored(self, node, _other) -> None:
        if not self._nodes[node.id].published:
            self._publish_path(node)

    def _state_dropped(self, node, _other) -> None:
        self._withdraw_bare(node)

    def _removed(self, node, _other) -> None:
        ev = self._nodes.pop(node.id)
        if ev.published:
            self.recorder.record_remove(ev)
        self._withdraw_bare(node.parent)

    def _reset(self, _node, _other) -> None:
        self._nodes.clear()
        self.recorder.record_all_cleared()

    # -- the hybrid rule -----------------------------------------------------------------
    def _event_node(self, node) -> _EventNode:
        return self._root if node.parent is None else self._nodes[node.id]

    def _publish_path(self, node) -> None:
        """Announce ``node`` (now covered by a state) and every ancestor not announced,
        root first, so each ``BlockStored`` links to a published parent block."""
        pending = []
        while node.parent is not None:
            ev = self._nodes[node.id]
            if ev.published:
                break
            pending.append(ev)
            node = node.parent
        record = self.recorder.record_store
        for ev in reversed(pending):
            record(ev)
            ev.published = True

    def _withdraw_bare(self, node) -> None:
        """Withdraw ``node`` and then its ancestors while each holds no state and no
        announced child: KV that no state at or below it makes usable."""
        nodes = self._nodes
        while node.parent is not None:
            ev = nodes[node.id]
            if not ev.published or node.mamba_value is not None:
                return
            for child in node.children.values():
                if nodes[child.id].published:
                    return
            self.recorder.record_remove(ev)
            ev.published = False
            node = node.parent


def attach(
    core: Any,
    *,
    enabled: bool,
    dynamo_format: bool = False,
    lora_names: Optional[KvEventLoraNames] = None,
) -> Optional[KVCacheEventRecorder]:
    """SGLang's event recorder for ``core`` (the value of ``BasePrefixCache.kv_events``),
    or ``None`` when events are off (``--kv-events-config`` not given, or a rank that does
    not publish): then the core gets no sink and pays nothing.

    Args:
        core: the :class:`~sglang_mamba_ext.mem_cache.MambaRadixCache` (empty).
        enabled: SGLang's ``CacheInitParams.enable_kv_cache_events``.
        dynamo_format: ``CacheInitParams.dynamo_kv_event_format`` (``"format": "dynamo"``).
        lora_names: ``CacheInitParams.kv_event_lora_names`` (the scheduler's table).

    The first event is ``AllBlocksCleared``, as SGLang's caches record one at construction.
    """
    if not enabled:
        return None
    recorder = KVCacheEventRecorder(
        enabled=True, page_size=core.page_size, dynamo_format=dynamo_format, lora_names=lora_names
    )
    sink = HybridKVEvents(recorder)
    core.event_sink = sink
    recorder.record_all_cleared()
    return recorder
