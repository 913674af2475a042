"""Two "sides" the conformance scenarios run on, with one small interface (the calls
SGLang's public hybrid-cache unit tests make):

- :class:`SGLangSide`: SGLang 0.5.23's own hybrid mamba cache (``UnifiedRadixCache`` with
  the FULL and MAMBA components over ``HybridReqToTokenPool``, ``HybridLinearKVPool`` and
  ``TokenToKVPoolAllocator``), built on CPU by SGLang's installed test kit
  (``sglang.test.kits.unified_radix_cache.fixtures.build_fixture``), in a runtime context
  of its own;
- :class:`OursSide`: this project's ``MambaRadixCacheAdapter`` over the plugin's
  ``MambaRadixReqToTokenPool`` and SGLang's ``TokenToKVPoolAllocator``, built through
  SGLang's ``create_tree_cache`` with ``--enable-mamba-radix`` (``sglang_glue_fixtures``).

Nodes are named by their token path from the root (a tuple), so the two trees can be
compared although SGLang's hands out node ids and ours node objects. ``insert`` is the
tree insert SGLang's tests call (``InsertParams``); SGLang 0.5.23's scheduler never calls
it (it calls ``checkpoint``), so the adapter has none and ours goes to the core's
``insert`` with the same arguments (``docs/design.md``, "SGLang conformance").
"""

from __future__ import annotations

import contextlib
from array import array
from typing import Dict, List, Optional, Tuple
from unittest import mock

import torch

import sglang_glue_fixtures as F


def make_req(pool, rid=0, tokens=()):
    """SGLang's dummy request of the upstream tests, given a row and SSM slot(s) by
    ``pool.alloc``."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", tokens),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
    )
    pool.alloc([req])
    return req


class _Side:
    name = "?"
    cache = allocator = pool = ctx = None

    @contextlib.contextmanager
    def active(self):
        with F.in_context(self.ctx):
            yield self

    # -- the calls of the upstream tests ------------------------------------------------
    def new_req(self, tokens=()):
        self._rid = getattr(self, "_rid", 0) + 1
        return make_req(self.pool, self._rid, tokens)

    def insert(self, tokens, req, prev_prefix_len=0, value=None) -> Tuple[int, bool]:
        raise NotImplementedError

    def match(self, tokens, req=None, cow=False):
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return self.cache.match_prefix(
            MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req, cow_mamba=cow)
        )

    def evict(self, num_tokens=0, mamba_num=0) -> Tuple[int, int]:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        r = self.cache.evict(EvictParams(num_tokens=num_tokens, mamba_num=mamba_num))
        return r.num_tokens_evicted, r.mamba_num_evicted

    def sizes(self) -> Dict[str, int]:
        c = self.cache
        return {
            "kv_available": self.allocator.available_size(),
            "mamba_available": self.pool.mamba_allocator.available_size(),
            "full_evictable": c.full_evictable_size(),
            "full_protected": c.full_protected_size(),
            "mamba_evictable": c.mamba_evictable_size(),
            "mamba_protected": c.mamba_protected_size(),
        }

    def root(self):
        """The root node handle (SGLang's ``BasePrefixCache.root_node_handle``)."""
        return self.cache.root_node_handle()

    def events(self) -> list:
        """The KV events the scheduler would publish now (``take_events``), packed into
        SGLang's ``KVEventBatch`` and decoded as its ZMQ subscribers decode them
        (``tests/test_kv_events.py``, ``decoded``)."""
        from test_kv_events import decoded

        return decoded(self.cache.take_events())

    # -- node naming ----------------------------------------------------------------------
    def path(self, node) -> tuple:
        raise NotImplementedError

    def state_slot(self, node) -> Optional[int]:
        raise NotImplementedError

    def nodes(self) -> Dict[tuple, bool]:
        """Every node but the root: token path → holds an SSM state."""
        raise NotImplementedError

    def mamba_lru(self) -> List[tuple]:
        """Nodes holding a state, most recently used first."""
        raise NotImplementedError

    def run_deferred_cow(self, req) -> None:
        """SGLang's deferred copy-on-write of ``req`` as the forward start runs it
        (``ScheduleBatch._collect_deferred_mamba_cow_and_clear``,
        ``ModelRunner._maybe_execute_deferred_mamba_cow_and_clear``)."""
        F.run_deferred_cow(self.pool, [req])

    def state(self, slot: int) -> Tuple[torch.Tensor, torch.Tensor]:
        cache = self.pool.mamba_pool.mamba_cache
        return cache.conv[0][:, slot].clone(), cache.temporal[:, slot].clone()

    def write_state(self, slot: int, value: float) -> None:
        cache = self.pool.mamba_pool.mamba_cache
        cache.conv[0][:, slot] = value
        cache.temporal[:, slot] = value


class SGLangSide(_Side):
    """SGLang's own hybrid mamba cache (module docstring). ``kit_config`` overrides fields
    of the kit's ``CacheConfig`` (FULL + MAMBA components); ``fixture_kwargs`` go to
    ``build_fixture``."""

    name = "sglang"

    def __init__(self, fixture_kwargs=None, **kit_config):
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.runtime_context import create_context
        from sglang.srt.server_args import ServerArgs
        from sglang.test.kits.unified_radix_cache import fixtures
        from sglang.test.kits.unified_radix_cache.config import CacheConfig

        self.MAMBA = ComponentType.MAMBA
        cfg = CacheConfig(components=(ComponentType.FULL, ComponentType.MAMBA), **kit_config)
        # The kit publishes its own server arguments: into this context, not the process's.
        self.ctx = create_context(ServerArgs(model_path="dummy", page_size=cfg.page_size), role="scheduler")
        with self.active(), mock.patch.object(fixtures, "get_device", return_value="cpu"):
            self.cache, self.allocator, self.pool = fixtures.build_fixture(cfg, **(fixture_kwargs or {}))
        self.core = self.cache.tree_core

    def insert(self, tokens, req, prev_prefix_len=0, value=None):
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        value = self.allocator.alloc(len(tokens)) if value is None else value
        r = self.cache.insert(
            InsertParams(
                key=RadixKey(array("q", tokens)),
                value=value,
                mamba_value=req.kv.mamba_pool_idx.unsqueeze(0),
                prev_prefix_len=prev_prefix_len,
            )
        )
        return r.prefix_len, r.mamba_exist

    def path(self, node) -> tuple:
        root = self.cache.root_node_handle()
        parts = []
        while node != root:
            parts.append(self.core.get_node_token_ids(node))
            node = self.core.get_parent_node_id(node)
        return tuple(t for p in reversed(parts) for t in p)

    def state_slot(self, node):
        v = self.core.get_component_device_value(node, self.MAMBA)
        return None if v is None else int(v.reshape(-1)[0])

    def nodes(self):
        root = self.cache.root_node_handle()
        return {
            self.path(n): self.state_slot(n) is not None for n in self.core.get_all_node_ids() if n != root
        }

    def mamba_lru(self):
        return [self.path(n) for n in self.core.get_component_device_lru_node_ids(self.MAMBA)]


class OursSide(_Side):
    """This project's adapter (module docstring): ``--enable-mamba-radix`` on the tiny
    model, ``kv_size`` KV slots, ``--max-mamba-cache-size mamba_size``, ``rows`` request
    rows; ``extra_argv`` adds flags (default: ``--mamba-radix-cache-strategy no_buffer``,
    one SSM slot per request as in the upstream tests); ``kv_events``: built with
    ``CacheInitParams.enable_kv_cache_events`` under ``--kv-events-config``."""

    name = "ours"

    def __init__(self, kv_size=256, mamba_size=20, rows=10, extra_argv=None, kv_events=False):
        if extra_argv is None:
            extra_argv = ("--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule")
        if kv_events:
            # As a scheduler under --kv-events-config (null publisher: the test drains).
            extra_argv = (*extra_argv, "--kv-events-config", '{"publisher": "null"}')
        self.ctx, _ = F.scheduler_context(
            # SGLang's eviction order (LRU), named: the plugin's default policy is adaptive
            F.base_argv("--enable-mamba-radix", "--max-mamba-cache-size", str(mamba_size),
                        "--radix-eviction-policy", "lru", *extra_argv)
        )
        with self.active():
            self.pool = F.build_req_pool(max_num_reqs=rows, context_len=512)
            events = {"enable_kv_cache_events": True} if kv_events else {}
            self.cache, self.allocator = F.build_tree_cache(self.pool, kv_size, **events)
        self.core = self.cache.core

    def insert(self, tokens, req, prev_prefix_len=0, value=None):
        from sglang_mamba_ext.mem_cache import RadixKey as CoreRadixKey

        value = self.allocator.alloc(len(tokens)) if value is None else value
        r = self.core.insert(CoreRadixKey(list(tokens), None), value, req.kv.mamba_pool_idx, prev_prefix_len)
        return r.prefix_len, r.mamba_exist

    def path(self, node) -> tuple:
        parts = []
        while node is not self.core.root_node:
            parts.append(node.key)
            node = node.parent
        return tuple(t for p in reversed(parts) for t in p)

    def state_slot(self, node):
        return node.mamba_value

    def nodes(self):
        return {self.path(n): n.mamba_value is not None for n in self.core.nodes()}

    def mamba_lru(self):
        return [self.path(link.owner) for link in self.core.mamba_lru_list]
