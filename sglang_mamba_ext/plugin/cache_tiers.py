"""The tier side of :class:`~sglang_mamba_ext.plugin.cache.MambaRadixCacheAdapter`: the calls
SGLang 0.5.23's scheduler makes on a hierarchical cache (``--enable-hierarchical-cache``,
``mem_cache/hiradix_cache.py``'s protocol) and under ``--enable-lmcache``
(``managers/scheduler.py``: ``_prefetch_kvcache``, ``check_prefetch_progress``,
``is_fully_idle``), answered for the plugin's tree, whose host tier, storage tier and LMCache
connector (:mod:`.lmcache_connector`) all complete inside the cache's own calls
(``docs/design.md``, "Host tier"; ``docs/flags.md``, "LMCache"). A mixin: it reads the
adapter's ``core``, ``lmcache``, ``tp_digest``, ``_lmcache_looked_up``,
``token_to_kv_pool_allocator``.
"""

from __future__ import annotations

from sglang_mamba_ext.mem_cache import RadixKey as CoreRadixKey


class TierProtocol:
    """SGLang's host / storage / LMCache scheduler calls on the plugin's tree (no transfer is
    ever in flight between the cache's calls)."""

    # -- SGLang's hierarchical-cache protocol (--enable-hierarchical-cache) -------------
    #: The host tier is the core's (``docs/design.md``, "Host tier"): its copies are made
    #: and loaded inside the cache's own calls, so there is no cache controller, no load to
    #: start before a batch and no transfer in flight.
    cache_controller = None
    enable_storage = False

    def check_hicache_events(self) -> None:
        """Nothing in flight: host copies complete inside the cache's calls."""

    def ready_to_load_host_cache(self) -> int:
        """``-1``: no layer-wise load for the forward to wait on (a hit on a host-tier
        state is copied into the request's slot at its match)."""
        return -1

    def clear_storage_backend(self) -> bool:
        """Empty the storage tier (``--hicache-storage-backend``) or the LMCache server
        (``--enable-lmcache``; SGLang's ``POST /hicache/storage-backend/clear``); False
        without one."""
        if self.lmcache is not None:
            return self.lmcache.clear()
        storage = self.core.storage
        return bool(storage.clear()) if storage is not None else False

    # -- SGLang's scheduler under --enable-lmcache (managers/scheduler.py: _prefetch_kvcache,
    # get_next_batch_to_run's check_prefetch_progress, is_fully_idle): the plugin's connector
    # looks up and loads inside the copy-on-write match (plugin/lmcache_connector.py), so there
    # is no prefetch to start, poll or wait for.
    hicache_storage_pass_prefix_keys = False

    def is_backuped(self, node) -> bool:
        """No node is backed up outside the cache's calls (the scheduler's storage checks)."""
        return False

    def is_root(self, node) -> bool:
        return node is self.core.root_node

    def get_last_hash_value(self, node):
        return None

    def get_prefix_hash_values(self, node):
        return []

    def prefetch_from_storage(self, *args, **kwargs) -> None:
        """Nothing ahead of admission: the lookup runs in the admitting match."""
        return None

    def check_prefetch_progress(self, handle) -> bool:
        return True

    def pop_prefetch_loaded_span(self, handle):
        """No tokens loaded outside the match (its split is set there, :meth:`_cache_breakdown`)."""
        return 0, None

    def has_pending_cache_operations(self) -> bool:
        """Transfers complete inside the cache's calls: never pending."""
        return False

    def release_host_resources(self) -> None:
        """Graceful shutdown: unregister from the LMCache server."""
        if self.lmcache is not None:
            self.lmcache.close()

    @property
    def token_to_kv_pool_host(self):
        """The host tier's KV pool (SGLang's host-tier metrics read ``logical_size`` and
        ``available_size()``), or ``None`` without ``--enable-hierarchical-cache``."""
        return self.core.kv_host_pool

    def flush_pending_backups(self) -> None:
        """Called by SGLang's scheduler once per processed batch (no host backups here):
        the step of the TP digest check (:mod:`.tp_digest`), if on."""
        if self.tp_digest is not None:
            self.tp_digest.step()

    def _lmcache_fetch(self, req, tokens, ns, key) -> int:
        """``--enable-lmcache``: load LMCache's prefix of the prompt past the tree's hit into
        the tree before the admitting match (:meth:`.lmcache_connector.LMCacheTreeConnector.fetch`);
        once per request and prompt length. Returns the tokens loaded."""
        try:
            if self._lmcache_looked_up.get(req, -1) >= len(tokens):
                return 0
            self._lmcache_looked_up[req] = len(tokens)
        except TypeError:  # a request object without weak references: looked up every time
            pass
        salt = self.lmcache.salt(key.cache_salt, key.extra_key)
        # no free group around it: the KV its allocation evicts must be free at once
        return self.lmcache.fetch(str(req.rid), tokens, CoreRadixKey(tokens, ns), salt)

    def release_aborted_request(self, handle) -> None:
        """SGLang's abort of a request still waiting (``Scheduler._release_aborted_request``:
        ``finish(handle, ABORT)``; ``BasePrefixCache.release_aborted_request``): under
        ``--enable-lmcache`` its LMCache request state is released, as at a normal release."""
        if self.lmcache is not None:
            self.lmcache.release(str(handle.rid))
