"""The core of sglang-mamba-ext (seed §1–§7): pools and the hybrid radix cache.

Depends on torch only; never imports SGLang (DESIGN.md layer rule).
"""

from .allocator import KVSlotAllocator
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
    "KVSlotAllocator",
    "MambaPool",
    "MambaRadixCache",
    "MatchResult",
    "RadixKey",
    "TreeNode",
]
