"""Plain integer counters of the hybrid cache (``docs/design.md``, "Metrics"): what was
matched, which SSM states the tree took and which of them later served a hit. The core only
counts (torch-free, no clock, no I/O); the plugin exports the numbers to Prometheus
(``plugin/metrics.py``) and ``/server_info``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict

#: Where a state in the tree came from (``TreeNode.mamba_origin``, the ``kind`` label):
#: ``ping_pong`` a ping-pong checkpoint inserted after a prefill chunk (SGLang's grid);
#: ``chunk`` the working state copied at a chunk end without ping-pong tracking
#: (``no_buffer``); ``branch`` / ``prompt_end`` the prefix checkpoints at the branch point
#: and at prompt length - 1 (``docs/design.md``, "Prefix checkpoints"); ``finish`` the state
#: a finished request donated; ``insert`` a direct :meth:`MambaRadixCache.insert` (tests,
#: benchmarks).
STATE_ORIGINS = ("ping_pong", "chunk", "branch", "prompt_end", "finish", "insert")


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
