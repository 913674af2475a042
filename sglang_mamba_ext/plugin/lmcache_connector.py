"""``--enable-lmcache`` under ``--enable-mamba-radix``: a second fetch-and-store path of the
plugin's tree, driving LMCache's ``UnifiedLMCacheMPConnector``
(``lmcache/integration/sglang/unified_lmcache_mp_connector.py``, lmcache 0.5.6) against a
standalone ``lmcache server`` (``docs/flags.md``, "LMCache").

SGLang 0.5.23 builds that connector only into its own ``LMCacheUnifiedRadixCache``
(``mem_cache/registry.py:101-124``, ``mem_cache/storage/lmcache/lmcache_unified_radix_cache.py``),
a ``UnifiedRadixCache`` whose lookup and load run across several scheduler passes
(``prefetch_from_storage`` / ``check_prefetch_progress`` / ``init_load_back`` /
``check_hicache_events``). The plugin's tree does its tier moves inside the cache's own calls
(``docs/design.md``, "Host tier"), and so does this connector:

* **fetch** (:meth:`LMCacheTreeConnector.fetch`, from the adapter's copy-on-write match, i.e.
  when the scheduler admits a request): past the tree's own usable hit ``L0``, LMCache is asked
  for the prompt's chunk-aligned prefix (``submit_lookup`` / ``poll_lookup``, waited for); a
  hit ``T > L0`` gets ``T - L0`` fresh KV slots and one fresh SSM slot (evicting from the tree
  if needed, the matched path locked meanwhile), LMCache copies the KV and the state at ``T``
  into them (``submit_load``, waited for, ``complete_load``), and the prefix is hung in the
  tree with its state (``MambaRadixCache.insert``, which frees the loaded KV the tree already
  held). The adapter's match then hits it like any tree prefix. On any failure (an exception
  anywhere in the path, a failed or refused transfer) every slot is freed and the request
  simply misses.
* **store** (:meth:`LMCacheTreeConnector.store`, after each ``checkpoint`` of a request): the
  deepest chunk-aligned prefix of the request's sequence whose state the tree holds on the
  device (``MambaRadixCache.device_states_on_path``) is written from its tree slots
  (``get_store_start`` / ``submit_store``, waited for, ``complete_store``), the node locked
  meanwhile. SGLang's cache keeps states only on its ``mamba_checkpoint_grid``, so it stores
  only chunks that end on one (``_submit_store``); the plugin's states are exact at any token,
  so the connector registers the state group with one token per block and the pool plans a
  state at the deepest chunk end inside each prompt (:meth:`LMCacheTreeConnector.boundary`,
  a prefix checkpoint like a message boundary), which is then stored.

Keys are the token ids in the namespace ``build_cache_salt(cache_salt, extra_key)``, as
SGLang's. Each transfer is waited for inside the call (the scheduler does not run a batch
meanwhile): nothing is in flight between calls, so an abort, a ``/flush_cache`` or a failure
never leaves a slot with LMCache. The one exception is a transfer that outlives its timeout
(``operation_timeout``): its KV slots, SSM slot and node lock are then held (quarantined) until
its future completes, checked at each later call, so LMCache never copies into or out of a slot
that was handed to someone else. The LMCache session of a request ends when its transfer does
(and its store position is forgotten when the request is released, aborted ones included).

``lmcache`` stays optional: this module imports it only when a connector is built.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import time
from typing import Any, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

#: LMCache's transfer mode variable (``lmcache/v1/multiprocess/transfer_context/worker_transfer.py:53``).
TRANSFER_MODE_ENV = "LMCACHE_MP_TRANSFER_MODE"


def lmcache_installed() -> bool:
    """Whether the ``lmcache`` package can be imported (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("lmcache") is not None


class _StateGrid:
    """What LMCache's ``SGLangUnifiedKVAdapter`` reads of SGLang's Mamba tree component: the
    token span of one state block. The plugin's states are exact at any token, so a block is
    one page: a state can be stored at any chunk end."""

    def __init__(self, grid: int):
        self.mamba_checkpoint_grid = int(grid)


class LMCacheTreeConnector:
    """The fetch-and-store path between the plugin's tree and an LMCache server (module
    docstring).

    Args:
        core: the plugin's :class:`~sglang_mamba_ext.mem_cache.MambaRadixCache`.
        connector: a built ``UnifiedLMCacheMPConnector`` (or an object with its methods).
        kv_allocator: SGLang's KV allocator (``alloc`` / ``free`` / ``available_size``).
        translate_mamba: maps tree SSM slots to the pool's physical ones
            (``HybridReqToTokenPool.translate_mamba_indices``).
    """

    def __init__(self, core, connector, kv_allocator, translate_mamba=None):
        self.core = core
        self.connector = connector
        self.kv_allocator = kv_allocator
        self._translate = translate_mamba
        self.chunk_size = int(connector.chunk_size)
        self.timeout = float(getattr(connector, "operation_timeout", 300.0))
        #: totals since start: lookups sent, hit tokens they reported, prefixes loaded into
        #: the tree and their new tokens, stores and their tokens, transfers that failed
        self.lookups = 0
        self.lookup_hit_tokens = 0
        self.loads = 0
        self.loaded_tokens = 0
        self.stores = 0
        self.stored_tokens = 0
        self.failures = 0
        self._closed = False
        #: transfers past their timeout: ``(future, release)``, ``release()`` run once the
        #: future is done (:meth:`_reap`)
        self._quarantined = []

    # ------------------------------------------------------------------ planning
    def boundary(self, prompt_len: int) -> Optional[int]:
        """The deepest chunk end strictly inside a prompt of ``prompt_len`` tokens (where the
        pool plans a prefix checkpoint so the prompt can be stored), or ``None``."""
        c = (int(prompt_len) - 1) // self.chunk_size * self.chunk_size
        return c if c > 0 else None

    def salt(self, cache_salt, extra_key) -> str:
        """The LMCache key namespace of a request (``build_cache_salt``, as SGLang's)."""
        return self.connector.build_cache_salt(cache_salt, extra_key)

    # ------------------------------------------------------------------ timeouts
    @staticmethod
    def _done(future) -> bool:
        done = getattr(future, "done", None)
        if callable(done):
            return bool(done())
        try:
            future.result(timeout=0)
        except TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - finished, with an error
            return True
        return True

    def _quarantine(self, future, release) -> None:
        """Hold a timed-out transfer's resources until its future is done (module docstring)."""
        self._quarantined.append((future, release))

    def _reap(self) -> None:
        """Release the resources of quarantined transfers that have finished."""
        keep = []
        for future, release in self._quarantined:
            if self._done(future):
                try:
                    release()
                except Exception:  # noqa: BLE001
                    logger.warning("sglang-mamba-ext: releasing a timed-out LMCache transfer failed", exc_info=True)
            else:
                keep.append((future, release))
        self._quarantined = keep

    @property
    def quarantined(self) -> int:
        """Transfers past their timeout whose slots are still held."""
        return len(self._quarantined)

    # ------------------------------------------------------------------ fetch
    def fetch(self, rid: str, tokens, key, salt: str) -> int:
        """Load into the tree LMCache's prefix of ``tokens`` past the tree's usable hit
        (module docstring). ``key``: the tree's key of ``tokens`` (namespace included).
        Returns the tokens added (0 on a miss or a failure)."""
        from sglang_mamba_ext.mem_cache import RadixKey

        self._reap()
        chunk = self.chunk_size
        aligned = len(tokens) // chunk * chunk
        if aligned <= 0:
            return 0
        local = self.core.match_prefix(RadixKey(list(tokens[:aligned]), key.extra_key))
        have = int(local.prefix_len)
        if aligned <= have:
            return 0
        conn = self.connector
        self.lookups += 1
        try:
            lookup = conn.submit_lookup(rid, list(tokens[:aligned]), local_hit_tokens=have, cache_salt=salt)
            hit = self._wait_lookup(lookup)
        except Exception:  # noqa: BLE001 - LMCache is best effort: a miss
            logger.warning("sglang-mamba-ext: LMCache lookup failed for %s", rid, exc_info=True)
            self.failures += 1
            self._end(rid)
            return 0
        self.lookup_hit_tokens += hit
        if hit <= have:
            self._unlock(rid, hit)
            self._end(rid)
            return 0
        try:
            return self._load(rid, lookup, tokens, key, local, have, hit)
        finally:
            self._end(rid)

    def _wait_lookup(self, lookup) -> int:
        deadline = time.monotonic() + self.timeout
        pause = 0.0005
        while True:
            hit = self.connector.poll_lookup(lookup)
            if hit is not None:
                return int(hit)
            if time.monotonic() > deadline:
                raise TimeoutError(f"LMCache lookup not answered in {self.timeout:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)  # fewer status queries while a slow server answers

    def _unlock(self, rid: str, end: int) -> None:
        """Release the server's read locks of a lookup that will not be retrieved."""
        if end > 0:
            try:
                self.connector.free_lookup_locks(rid, start=0, end=end)
            except Exception:  # noqa: BLE001
                logger.warning("sglang-mamba-ext: LMCache lock release failed for %s", rid, exc_info=True)

    def _end(self, rid: str) -> None:
        try:
            self.connector.end_session(rid)
        except Exception:  # noqa: BLE001
            logger.debug("LMCache end_session failed for %s", rid, exc_info=True)

    def _load(self, rid, lookup, tokens, key, local, have: int, hit: int) -> int:
        """Retrieve ``hit - have`` tokens' KV and the state at ``hit`` into fresh slots and hang
        them in the tree. Any exception or failed transfer frees what was allocated and
        releases the lookup's locks (a miss, 0); a transfer past its timeout keeps them until
        it finishes (:meth:`_quarantine`). Returns the tokens added."""
        from sglang_mamba_ext.mem_cache import RadixKey

        core, conn, chunk = self.core, self.connector, self.chunk_size
        start = have // chunk * chunk
        kv, slot = None, None

        def give_back():
            if kv is not None:
                self.kv_allocator.free(kv)
            if slot is not None:
                core.mamba_pool.free([slot])
            self._unlock_from(rid, lookup, hit)  # a no-op once the retrieve consumed them

        try:
            if start > 0:
                # the chunks the tree holds already are not retrieved: their locks go now
                conn.free_lookup_locks(rid, start=0, end=start)
            anchor = local.last_node
            core.inc_lock_ref(anchor)  # the allocations below may evict, never the matched path
            try:
                kv = self._alloc_kv(hit - have)
                slot = core._alloc_mamba_slot(protect=anchor) if kv is not None else None
            finally:
                core.dec_lock_ref(anchor)
            if kv is None or slot is None:
                logger.info("sglang-mamba-ext: LMCache hit of %d tokens for %s skipped: no free slots", hit, rid)
                give_back()
                return 0
            slot_t = torch.tensor([slot], dtype=torch.int64, device=kv.device)
            physical = self._translate(slot_t) if self._translate is not None else slot_t
            if hasattr(conn, "reset_mamba_checkpoint_metadata"):
                conn.reset_mamba_checkpoint_metadata(physical)
            groups = conn.device_indices_by_group(kv, mamba_value=slot_t, mamba_transfer_tokens=hit - start)
            load = conn.submit_load(lookup, groups, local_hit_tokens=have, owned_device_indices=kv)
        except Exception:  # noqa: BLE001 - nothing submitted: a miss
            logger.warning("sglang-mamba-ext: LMCache retrieve failed for %s", rid, exc_info=True)
            self.failures += 1
            give_back()
            return 0
        try:
            ok = self._wait(load.future)
        except TimeoutError:
            logger.warning("sglang-mamba-ext: LMCache retrieve for %s past %.0f s: its slots are held until it "
                           "ends", rid, self.timeout)
            self.failures += 1
            self._quarantine(load.future, give_back)
            return 0
        except Exception:  # noqa: BLE001 - the transfer ended with an error
            logger.warning("sglang-mamba-ext: LMCache retrieve failed for %s", rid, exc_info=True)
            ok = False
        try:
            ok = bool(conn.complete_load(load)) and ok  # always completed: LMCache's bookkeeping
        except Exception:  # noqa: BLE001
            logger.warning("sglang-mamba-ext: LMCache complete_load failed for %s", rid, exc_info=True)
            ok = False
        if ok:
            try:
                value = torch.cat([local.device_indices.to(kv.device), kv]) if have else kv
                res = core.insert(RadixKey(list(tokens[:hit]), key.extra_key), value, slot, prev_prefix_len=have)
            except Exception:  # noqa: BLE001
                logger.warning("sglang-mamba-ext: inserting LMCache's prefix for %s failed", rid, exc_info=True)
                ok = False
        if not ok:
            self.failures += 1
            give_back()
            return 0
        if res.mamba_exist:  # the tree has a state there already: ours is not needed
            core.mamba_pool.free([slot])
        self.loads += 1
        self.loaded_tokens += hit - have
        return hit - have

    def _unlock_from(self, rid, lookup, hit: int) -> None:
        start = int(getattr(lookup, "lock_start", 0))
        if hit > start:
            try:
                self.connector.free_lookup_locks(rid, start=start, end=hit)
            except Exception:  # noqa: BLE001
                logger.warning("sglang-mamba-ext: LMCache lock release failed for %s", rid, exc_info=True)

    def _alloc_kv(self, n: int) -> Optional[torch.Tensor]:
        alloc = self.kv_allocator
        if alloc.available_size() < n:
            self.core.evict(num_tokens=n - alloc.available_size())
        if alloc.available_size() < n:
            return None
        return alloc.alloc(n)

    def _wait(self, future) -> bool:
        """Wait for a transfer's future (at most ``operation_timeout``; ``TimeoutError`` past it)
        and, on an accelerator, for the device's copies; True when the transfer succeeded."""
        if future is None:
            return False
        result = future.result(timeout=self.timeout)
        dev = getattr(self.connector, "device", None)
        if dev is not None and torch.device(dev).type not in ("cpu",):
            torch.get_device_module(torch.device(dev)).synchronize()
        return bool(result)

    # ------------------------------------------------------------------ store
    def store(self, rid: str, tokens, key, salt: str) -> int:
        """Store the deepest chunk-aligned prefix of ``tokens`` (token ids; ``key``: the core's
        :class:`~sglang_mamba_ext.mem_cache.RadixKey` of them) whose state the tree holds on the
        device, past what this request stored or found already, from its tree slots (the node
        locked meanwhile; past the timeout, until the transfer ends). Best effort: an exception
        or failed transfer is logged and counted. Returns the tokens sent (0 if none)."""
        from sglang_mamba_ext.mem_cache import RadixKey

        self._reap()
        conn, chunk = self.connector, self.chunk_size
        aligned = len(tokens) // chunk * chunk
        if aligned <= 0:
            return 0
        node, op, timed_out = None, None, False
        try:
            points = [(n, nd) for n, nd in self.core.device_states_on_path(RadixKey(list(tokens[:aligned]),
                                                                                    key.extra_key))
                      if n % chunk == 0]
            if not points:
                return 0
            end, nd = points[-1]
            start = conn.get_store_start(rid, end)
            if end <= start:
                return 0
            node = nd
            self.core.inc_lock_ref(node)
            kv = self.core.path_device_indices(node)[start:end]
            slot_t = torch.tensor([node.mamba_value], dtype=torch.int64, device=kv.device)
            groups = conn.device_indices_by_group(kv, mamba_value=slot_t)
            op = conn.submit_store(rid, list(tokens[:end]), groups, device_indices_start=start, cache_salt=salt)
            if op is None:
                return 0
            try:
                ok = self._wait(op.future)
            except TimeoutError:
                timed_out, ok = True, False
            if not timed_out:
                ok = bool(conn.complete_store(op)) and ok  # always completed: a failed range is retried
        except Exception:  # noqa: BLE001 - a failed store costs a later miss only
            logger.warning("sglang-mamba-ext: LMCache store failed for %s", rid, exc_info=True)
            ok = False
        finally:
            if node is not None:
                if timed_out:  # LMCache may still read the node's slots: locked until it ends
                    logger.warning("sglang-mamba-ext: LMCache store for %s past %.0f s: its node stays locked "
                                   "until it ends", rid, self.timeout)
                    held = node
                    self._quarantine(op.future, lambda: (self.core.dec_lock_ref(held), self._complete_quietly(op)))
                else:
                    self.core.dec_lock_ref(node)
            self._end(rid)
        if not ok:
            self.failures += 1
            return 0
        self.stores += 1
        self.stored_tokens += end - start
        return end - start

    def _complete_quietly(self, op) -> None:
        try:
            self.connector.complete_store(op)
        except Exception:  # noqa: BLE001
            logger.debug("LMCache complete_store failed", exc_info=True)

    # ------------------------------------------------------------------ lifecycle
    def release(self, rid: str) -> None:
        """The request is done: forget its store position and end its session."""
        try:
            self.connector.finish_request(rid)
        except Exception:  # noqa: BLE001
            logger.debug("LMCache finish_request failed for %s", rid, exc_info=True)

    def reset(self) -> None:
        """The tree was emptied (``/flush_cache``): LMCache keeps its data; sessions end."""
        try:
            self.connector.end_all_sessions()
        except Exception:  # noqa: BLE001
            logger.debug("LMCache end_all_sessions failed", exc_info=True)

    def clear(self) -> bool:
        """Empty the LMCache server (``POST /hicache/storage-backend/clear``)."""
        return bool(self.connector.clear())

    def close(self) -> None:
        """Unregister from the LMCache server (graceful shutdown); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.connector.close()
        except Exception:  # noqa: BLE001
            logger.debug("LMCache close failed", exc_info=True)

    def info(self) -> dict:
        """The ``lmcache`` entry of ``/server_info``'s ``mamba_radix``."""
        return {
            "chunk_size": self.chunk_size,
            "lookups": self.lookups,
            "lookup_hit_tokens": self.lookup_hit_tokens,
            "loads": self.loads,
            "loaded_tokens": self.loaded_tokens,
            "stores": self.stores,
            "stored_tokens": self.stored_tokens,
            "failures": self.failures,
            "quarantined": self.quarantined,
        }


def _server_address(config_file: Optional[str]) -> Tuple[str, int]:
    """``(host, port)`` of the LMCache server the config names (LMCache's own loader)."""
    from lmcache.v1.config import load_engine_config_with_overrides

    config = load_engine_config_with_overrides(config_file_path=config_file)
    host = str(getattr(config, "mp_host", "") or "")
    if not host:
        raise ValueError(
            "--enable-lmcache: the LMCache config names no server (mp_host); pass --lmcache-config-file F "
            "with 'mp_host: 127.0.0.1' and 'mp_port: P' (docs/flags.md, \"LMCache\")"
        )
    host = host.split("://", 1)[-1].rstrip(":")
    return host, int(getattr(config, "mp_port"))


def check_server(config_file: Optional[str], timeout_s: float = 5.0) -> Tuple[str, int]:
    """Fail at start-up, with the way to fix it, when no LMCache server listens where the
    config says (LMCache's client would otherwise wait its 300 s message timeout).

    Raises:
        RuntimeError: nothing accepts a connection there."""
    host, port = _server_address(config_file)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise RuntimeError(
            f"--enable-lmcache: no LMCache server at {host}:{port} ({e.strerror or e}; from "
            f"{config_file or 'LMCache defaults'}). Start one first, e.g. 'lmcache server --host {host} "
            f"--port {port} --l1-size-gb 1 --eviction-policy LRU --separate-object-groups --chunk-size 8' (docs/flags.md, \"LMCache\")"
        ) from None
    return host, port


def share_moved_state_storage(mamba_pool, storage_ptrs, registered) -> int:
    """Point SGLang's SSM state buffers at the shared memory LMCache moved them to.

    On CPU, LMCache-driven transfer copies each registered tensor's backing storage into POSIX
    shared memory and re-points the tensor object it was given at it
    (``lmcache/v1/platform/devices/cpu/shm.py``, ``tensor.set_``). SGLang's KV buffers are
    registered as they are, so the pool's own tensors move; its state buffers are registered as
    per-layer views made for the connector (``lmcache/integration/sglang/unified_kv_adapter.py``,
    ``_resolve_mamba_pool_tensors`` and ``tensor.view``), so only those views moved, and the
    pool (and every state the model writes) stayed on the old storage: LMCache stored and loaded
    a stale copy (measured: a state loaded from LMCache was not the state stored, its KV was).
    Each ``mamba_pool.mamba_cache`` tensor on a moved storage is re-pointed at the new one
    (same offset, shape and strides; the copy was made whole at registration), in place, so the
    plugin's pool, which holds the same tensor objects, follows.

    Args:
        storage_ptrs: data pointers of the state entries' storages before the connector was built.
        registered: the connector's tensors for those entries, in the same order.

    Returns:
        the tensors re-pointed."""
    moved = {}
    for ptr, wire in zip(storage_ptrs, registered):
        storage = wire.untyped_storage()
        if storage.data_ptr() != ptr:
            moved[ptr] = storage
    if not moved:
        return 0
    n = 0
    for value in vars(mamba_pool.mamba_cache).values():
        for t in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in moved:
                with torch.no_grad():
                    t.set_(moved[t.untyped_storage().data_ptr()], t.storage_offset(), t.size(), t.stride())
                n += 1
    return n


def build_connector(cache, ctx, config_file: Optional[str]) -> LMCacheTreeConnector:
    """Connect the adapter ``cache`` (``plugin/cache.py``) to the LMCache server of
    ``config_file`` (SGLang's ``--lmcache-config-file``), registering SGLang's KV and state
    buffers with it. On CPU, LMCache's default engine-driven transfer refuses a hybrid
    model's two buffer groups ("engine-driven transfer does not support multiple KV transfer
    groups now", ``worker_transfer.py:805``): :data:`TRANSFER_MODE_ENV` is set to
    ``lmcache_driven`` there unless the user set it.

    Raises:
        RuntimeError / ValueError: no server, no ``lmcache`` package, or LMCache refused the
            registration (its message)."""
    if not lmcache_installed():
        raise RuntimeError("--enable-lmcache needs the lmcache package (pip install lmcache; docs/flags.md, \"LMCache\")")
    params = ctx.params
    device = str(getattr(cache, "device", "cpu"))
    if device.startswith("cpu") and not os.environ.get(TRANSFER_MODE_ENV):
        os.environ[TRANSFER_MODE_ENV] = "lmcache_driven"
        logger.info("sglang-mamba-ext: %s=lmcache_driven (LMCache's CPU default serves one buffer group only)",
                    TRANSFER_MODE_ENV)
    check_server(config_file)
    from lmcache.integration.sglang.unified_lmcache_mp_connector import UnifiedLMCacheMPConnector
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    pool = cache.req_to_token_pool
    states = [t for _, t, _, _ in pool.mamba_pool._iter_transfer_state_entries()]
    before = [t.untyped_storage().data_ptr() for t in states]
    conn = UnifiedLMCacheMPConnector(
        config_file=config_file,
        model_config=ctx.model_config,
        tp_size=ctx.tp_size,
        tp_rank=ctx.tp_rank,
        tp_group=getattr(params, "tp_cache_group", None),
        pp_size=getattr(params, "pp_size", 1) or 1,
        pp_rank=getattr(params, "pp_rank", 0) or 0,
        pp_group=getattr(params, "pp_cache_group", None),
        page_size=cache.page_size,
        token_to_kv_pool_allocator=cache.token_to_kv_pool_allocator,
        req_to_token_pool=pool,
        tree_components=(ComponentType.FULL, ComponentType.MAMBA),
        mamba_component=_StateGrid(cache.page_size),
        sliding_window_size=None,
    )
    rebound = share_moved_state_storage(pool.mamba_pool, before, list(conn._kv_caches.values())[-len(states):])
    if rebound:
        logger.info("sglang-mamba-ext: %d SSM state buffers moved onto LMCache's shared memory", rebound)
    out = LMCacheTreeConnector(cache.core, conn, cache.token_to_kv_pool_allocator,
                               translate_mamba=getattr(pool, "translate_mamba_indices", None))
    atexit.register(out.close)
    logger.info("sglang-mamba-ext: LMCache connector at %s, chunk size %d", conn.server_url, out.chunk_size)
    return out
