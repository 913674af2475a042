"""Plain integer counters of the hybrid cache (``docs/design.md``, "Metrics"): what was
matched, which SSM states the tree took and which of them later served a hit. The core only
counts (torch-free, no clock, no I/O); the plugin exports the numbers to Prometheus
(``plugin/metrics.py``) and ``/server_info``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from .tree_node import MatchResult

#: Where a state in the tree came from (``TreeNode.mamba_origin``, the ``kind`` label):
#: ``ping_pong`` a ping-pong checkpoint inserted after a prefill chunk (SGLang's grid);
#: ``chunk`` the working state copied at a chunk end without ping-pong tracking
#: (``no_buffer``); ``branch`` / ``prompt_end`` the prefix checkpoints at the branch point
#: and at prompt length - 1 (``docs/design.md``, "Prefix checkpoints"); ``boundary`` a
#: prefix checkpoint at a message boundary the request named (same section); ``finish`` the state
#: a finished request donated; ``insert`` a direct :meth:`MambaRadixCache.insert` (tests,
#: benchmarks).
STATE_ORIGINS = ("ping_pong", "chunk", "branch", "prompt_end", "boundary", "finish", "insert")


def _per_origin() -> Dict[str, int]:
    return {origin: 0 for origin in STATE_ORIGINS}


@dataclasses.dataclass
class CacheStats:
    """Counters since the cache was built (never reset, also not by ``reset()``).

    Attributes:
        matches: admitted prefills counted by :meth:`MambaRadixCache.count_hit`.
        prompt_tokens: their prompt lengths (tokens).
        kv_match_tokens: tokens of those prompts present as KV in the tree
            (``MatchResult.kv_match_len``).
        prefix_tokens: tokens usable as a hit, KV plus the SSM state at their end
            (``MatchResult.prefix_len``); ``<= kv_match_tokens``.
        states_stored: states the tree took, by origin (:data:`STATE_ORIGINS`); a state
            offered where the tree already had one is not counted.
        state_hits: counted matches whose usable prefix ended on a state of that origin.
    """

    matches: int = 0
    prompt_tokens: int = 0
    kv_match_tokens: int = 0
    prefix_tokens: int = 0
    states_stored: Dict[str, int] = dataclasses.field(default_factory=_per_origin)
    state_hits: Dict[str, int] = dataclasses.field(default_factory=_per_origin)


class CacheCounters:
    """The counting side of :class:`~.radix_cache.MambaRadixCache` (mixed in; uses its
    ``stats``, size counters and LRU lists)."""

    def tombstone_count(self) -> int:
        """Nodes holding KV but no SSM state (O(1): nodes minus states)."""
        return self.full_lru_list.size + self.host_kv_lru_list.size - self.mamba_lru_list.size

    @staticmethod
    def hit_of(prompt_len: int, result: MatchResult) -> Tuple[int, int, int, Optional[str]]:
        """The arguments of :meth:`count_hit` for a match ``result`` of a prompt of
        ``prompt_len`` tokens (taken at match time: the origin is the matched state's)."""
        prefix = result.prefix_len
        origin = (result.last_node.mamba_origin or "insert") if prefix else None
        return prompt_len, result.kv_match_len, prefix, origin

    def count_hit(self, prompt_len: int, kv_match_len: int, prefix_len: int, origin: Optional[str]) -> None:
        """Count one admitted prefill (:class:`.stats.CacheStats`): its prompt length, the
        tokens its match found as KV and as a usable prefix, and the origin of the state the
        usable prefix ends on (``None`` without a hit); see :meth:`hit_of`. The caller
        decides which matches are admissions: SGLang's scheduler may match a request, fail
        to admit it and match it again later."""
        s = self.stats
        s.matches += 1
        s.prompt_tokens += prompt_len
        s.kv_match_tokens += kv_match_len
        s.prefix_tokens += prefix_len
        if origin is not None:
            s.state_hits[origin] += 1

    def stats_snapshot(self) -> dict:
        """Counters and sizes as a flat dict of ints (metrics, ``/server_info``): the
        :class:`.stats.CacheStats` fields (``states_stored_<origin>``,
        ``state_hits_<origin>``), ``evicted_kv_tokens``, ``evicted_ssm_states``,
        ``cow_copies`` (the request pool's), and the gauges ``kv_tokens``, ``ssm_states``,
        ``tombstones``, ``nodes``."""
        s = self.stats
        out = {
            "matches": s.matches,
            "prompt_tokens": s.prompt_tokens,
            "kv_match_tokens": s.kv_match_tokens,
            "prefix_tokens": s.prefix_tokens,
            "cow_copies": getattr(self.req_to_token_pool, "cow_copies_total", 0),
            "evicted_kv_tokens": self.evicted_tokens_total,
            "evicted_ssm_states": self.evicted_states_total,
            "kv_tokens": self._full_evictable + self._full_protected,
            "ssm_states": self._mamba_evictable + self._mamba_protected,
            "tombstones": self.tombstone_count(),
            "nodes": self.full_lru_list.size + self.host_kv_lru_list.size,
        }
        for origin, n in s.states_stored.items():
            out["states_stored_" + origin] = n
        for origin, n in s.state_hits.items():
            out["state_hits_" + origin] = n
        return out
