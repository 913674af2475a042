"""The core of sglang-mamba-ext: the KV and SSM pools and the hybrid radix cache
(``docs/design.md``). Depends on torch only and never imports SGLang (the layer rule): the
SGLang-facing adapter in ``sglang_mamba_ext/plugin/`` translates SGLang's objects into these.
"""

from .allocator import KVSlotAllocator
from .checkpoint_pool import Int8CheckpointPool
from .mamba_pool import MambaPool
from .radix_cache import MambaRadixCache
from .req import CacheReq
from .req_to_token_pool import HybridReqToTokenPool
from .tree_node import EvictResult, InsertResult, MatchResult, RadixKey, TreeNode

__all__ = [
    "CacheReq",
    "EvictResult",
    "HybridReqToTokenPool",
    "InsertResult",
    "Int8CheckpointPool",
    "KVSlotAllocator",
    "MambaPool",
    "MambaRadixCache",
    "MatchResult",
    "RadixKey",
    "TreeNode",
]
