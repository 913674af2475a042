"""An in-memory stand-in for SGLang's ``HiCacheStorage`` and a chained page hasher, for the
core's storage tier (``mem_cache/storage_tier.py``) under ``cache_sim`` (the randomized
test): what the tier needs of a store, with a way to damage stored values."""

from __future__ import annotations

import hashlib
import random
from typing import Dict, List

import torch


class MemoryStore:
    """``get`` / ``set`` / ``exists`` / ``batch_exists`` as ``HiCacheFile`` answers them (``set``
    keeps an existing key's value; ``get`` fills ``target_location``, ``None`` if absent, and
    raises on a value of another length, as ``HiCacheFile``'s short read does)."""

    def __init__(self):
        self.values: Dict[str, torch.Tensor] = {}

    def exists(self, key: str) -> bool:
        return key in self.values

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        n = 0
        for k in keys:
            if k not in self.values:
                break
            n += 1
        return n

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        self.values.setdefault(key, value.clone())
        return True

    def get(self, key: str, target_location=None, target_sizes=None):
        v = self.values.get(key)
        if v is None:
            return None
        if v.numel() < target_location.numel():
            raise IOError(f"short read for {key}")
        target_location.copy_(v[: target_location.numel()])
        return target_location

    def discard(self, key: str) -> None:
        self.values.pop(key, None)

    def damage(self, rng: random.Random) -> None:
        """Flip one byte of a random value, or cut its end off."""
        if not self.values:
            return
        key = rng.choice(sorted(self.values))
        v = self.values[key].clone()
        if rng.random() < 0.5 and v.numel() > 1:
            v = v[:-1]
        else:
            i = rng.randrange(v.numel())
            v[i] ^= 0x5A
        self.values[key] = v


def page_keys(page_size: int):
    """``page_hasher(tokens, namespace)``: a SHA-256 per whole page, chained, seeded by the
    namespace (what SGLang's ``get_storage_hash_str`` does)."""

    def keys(tokens, namespace):
        h = hashlib.sha256(repr(namespace).encode()).hexdigest() if namespace is not None else ""
        out = []
        for i in range(0, len(tokens) - len(tokens) % page_size, page_size):
            h = hashlib.sha256((h + repr(list(tokens[i : i + page_size]))).encode()).hexdigest()
            out.append(h)
        return out

    return keys
