"""SGLang 0.5.23's own host tier (``--enable-hierarchical-cache``) in the hit-rate benchmark.

:func:`make_host_driver` builds one of :mod:`.upstream`'s drivers (its
``UnifiedRadixCache`` with FULL + MAMBA, from SGLang's unit-test kit) and attaches
SGLang's HiCache to it the way ``mem_cache/registry.py::create_unified_radix_cache``
does for a served model: ``cache.init_hicache(server_args, params)``
(``unified_radix_cache.py:455``, which assembles the host pools and the
``HybridCacheController`` in ``hybrid_cache/hybrid_pool_assembler.py``), then the layer
transfer counter handed to the model worker. Server arguments: ``--hicache-ratio
<host_ratio>``, ``--hicache-write-policy write_through``, ``--hicache-io-backend
direct``, ``--hicache-mem-layout page_first_direct`` (SGLang's ``MambaPoolHost`` takes
only page-first layouts), no storage backend.

The request cycle adds what SGLang's scheduler does for HiCache around the
:class:`.scheduler.SchedulerDriver` ops of the base driver:

* match: first the scheduler step's ``check_hicache_events`` (``scheduler.py:3878``,
  ``unified_radix_cache.py:3651``: flush the queued backups, reap the write and load
  acks, which releases the locks the transfers held), then the base match. When the
  request has a host hit (``Req.needs_host_load_back``), admission's load-back as in
  ``schedule_policy.py:1470-1571``: with the best match pinned on device and host,
  ``init_load_back(InitLoadBackParams(best_match_node, host_hit_length, req))``; the
  loaded tokens join the prefix (``req.prefix_len += host_loaded_length``,
  ``req.last_node`` moves to the loaded node, ``cache_protected_len`` follows). The
  hit reported is that prefix: the tokens the request resumes from. The admission
  budget check before it (``memory_budget.prepare_load_back``) is not modelled: the
  benchmark's pools always fit one request.
* lock: the base lock, then the batch build's ``ready_to_load_host_cache``
  (``scheduler.py:4351``: the controller starts the queued H2D loads) and the forward's
  consumer side (``tp_worker.set_hicache_consumer`` and each layer's ``wait_until``).
* after_prefill / after_decode / finish: the base step, then
  ``flush_pending_backups`` (after every batch result, ``scheduler.py:5106``); after the
  prefill and the decode, the next scheduler step's ``check_hicache_events`` too.

On CPU every transfer is synchronous (torch's CPU streams and events do nothing), so an
ack is ready as soon as its transfer was submitted; the acks are still reaped only at
the points the scheduler reaps them, so a backed-up node stays locked until then.

Two CPU shims, active only while this driver is built (both) and replayed (the second),
through ``unittest.mock.patch``: (a) SGLang's host pools are allocated with
``pin_memory=False`` (pinning calls ``torch.cuda.cudart().cudaHostRegister``,
``mem_cache/pool_host/common.py:143``); (b) the three "direct" transfer ops that
``mem_cache/pool_host/mha.py`` and ``pool_host/mamba.py`` import from
``sgl_kernel.kvcacheio`` only on CUDA/ROCm (module names otherwise unbound) are given
torch implementations here (:func:`_direct_copy`, :func:`_direct_layer_first_to_page_first`,
:func:`_direct_page_first_to_layer_first`). The driver runs in its own SGLang runtime
context (``runtime_context.use_context``), so the server arguments it publishes do not
reach other drivers.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import warnings
from typing import Any
from unittest import mock

import torch

from sglang_mamba_ext.benchmarks.common import VariantUnavailable

#: ``--hicache-io-backend`` / ``--hicache-mem-layout`` of the host rows (see the module docstring).
IO_BACKEND = "direct"
MEM_LAYOUT = "page_first_direct"
WRITE_POLICY = "write_through"


# --------------------------------------------------------------- CPU transfer ops
# Signatures of sgl_kernel.kvcacheio's "direct" ops, as the host pools call them.


def _rows(indices: torch.Tensor, device) -> torch.Tensor:
    return indices.to(device=device, dtype=torch.int64).reshape(-1)


def _direct_copy(src_layers, dst_layers, src_indices, dst_indices, page_size=1):
    """``dst[dst_indices] = src[src_indices]`` for each (src, dst) pair of layer tensors
    indexed by token (or state slot) in their first dimension."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[_rows(dst_indices, dst.device)] = src[_rows(src_indices, src.device)].to(dst.device)


def _direct_layer_first_to_page_first(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """All layers, device -> host: ``src_ptrs`` holds per-layer tensors indexed by token,
    ``len(src_ptrs) / len(dst_ptrs)`` of them per destination, in layer order;
    each destination is page-first, ``[page, layer, offset in page, ...]``."""
    per_dst = len(src_ptrs) // len(dst_ptrs)
    assert per_dst * len(dst_ptrs) == len(src_ptrs), (len(src_ptrs), len(dst_ptrs))
    for j, dst in enumerate(dst_ptrs):
        pos = _rows(dst_indices, dst.device)
        page, off = pos // page_size, pos % page_size
        for layer in range(per_dst):
            src = src_ptrs[j * per_dst + layer]
            dst[page, layer, off] = src[_rows(src_indices, src.device)].to(dst.device)


def _direct_page_first_to_layer_first(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """One layer, host -> device: each source is page-first (as above), each destination
    the layer's tensor indexed by token."""
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        pos = _rows(src_indices, src.device)
        dst[_rows(dst_indices, dst.device)] = src[pos // page_size, layer_id, pos % page_size].to(dst.device)


_DIRECT_OPS = {
    "transfer_kv_direct": _direct_copy,
    "transfer_kv_all_layer_direct_lf_pf": _direct_layer_first_to_page_first,
    "transfer_kv_per_layer_direct_pf_lf": _direct_page_first_to_layer_first,
}


@contextlib.contextmanager
def _transfer_ops():
    """Shim (b): the torch ops bound in SGLang's host-pool modules, only where the module
    has none (on CUDA the real kernels stay)."""
    import sglang.srt.mem_cache.pool_host.mamba as pool_mamba
    import sglang.srt.mem_cache.pool_host.mha as pool_mha

    with contextlib.ExitStack() as stack:
        for module in (pool_mha, pool_mamba):
            for name, fn in _DIRECT_OPS.items():
                if not hasattr(module, name):
                    stack.enter_context(mock.patch.object(module, name, fn, create=True))
        yield


def _unpinned(init):
    """``init`` of a host pool class with ``pin_memory`` forced to False."""
    sig = inspect.signature(init)

    @functools.wraps(init)
    def wrapped(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.arguments["pin_memory"] = False
        return init(*bound.args, **bound.kwargs)

    return wrapped


@contextlib.contextmanager
def _unpinned_host_pools():
    """Shim (a): SGLang's KV and SSM host pools allocate unpinned memory."""
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    with contextlib.ExitStack() as stack:
        for cls in (MHATokenToKVPoolHost, MambaPoolHost):
            stack.enter_context(mock.patch.object(cls, "__init__", _unpinned(cls.__init__)))
        yield


# ------------------------------------------------------------------------- driver


class _HostTierMixin:
    """The HiCache additions to an :mod:`.upstream` driver (module docstring). Mixed in
    before the base driver class by :func:`make_host_driver`."""

    host_ratio: float = 2.0

    def __init__(self, kv_size: int, mamba_size: int, **kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from sglang.srt.runtime_context import create_context
            from sglang.srt.server_args import ServerArgs
        logging.getLogger("sglang").setLevel(logging.WARNING)
        self._hicache_args = dict(
            enable_hierarchical_cache=True,
            hicache_ratio=self.host_ratio,
            hicache_write_policy=WRITE_POLICY,
            hicache_io_backend=IO_BACKEND,
            hicache_mem_layout=MEM_LAYOUT,
        )
        self.context = create_context(
            ServerArgs(model_path="dummy", page_size=1, **self._hicache_args), role="scheduler"
        )
        #: requests whose prefix grew by a load-back, tokens it added (hits from the host tier)
        self.load_backs = 0
        self.host_loaded_tokens = 0
        #: load-backs started (``init_load_back`` called) that committed nothing
        self.load_backs_declined = 0
        with self._runtime(), _unpinned_host_pools():
            super().__init__(kv_size, mamba_size, **kw)

    @contextlib.contextmanager
    def _runtime(self):
        from sglang.srt.runtime_context import use_context

        with use_context(self.context), _transfer_ops():
            yield

    def activate(self):
        return self._runtime()

    # ---- build ---------------------------------------------------------------

    def build(self, kv_size: int, mamba_size: int, max_context_len: int) -> tuple:
        import atexit

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import sglang.test.kits.unified_radix_cache.fixtures as fixtures

        # The kit publishes its own ServerArgs (into this driver's context): add the
        # HiCache flags to them, as a launch with --enable-hierarchical-cache would.
        kit_args = functools.partial(fixtures.ServerArgs, **self._hicache_args)
        with mock.patch.object(fixtures, "ServerArgs", kit_args):
            cache, allocator, req_to_token_pool = super().build(kv_size, mamba_size, max_context_len)
        try:
            cache.init_hicache(self.context.server_args, cache.cache_init_params)
        except Exception as e:  # noqa: BLE001 - reported as the row's reason
            raise VariantUnavailable(
                f"SGLang's init_hicache failed on this machine: {type(e).__name__}: {e}"
            ) from e
        # init_hicache registers cache.shutdown at exit (joins the controller's threads).
        atexit.unregister(cache.shutdown)
        if cache.cache_controller is None:
            raise VariantUnavailable("SGLang's init_hicache attached no cache controller")
        # registry.py: tp_worker.register_hicache_layer_transfer_counter(...)
        self.layer_done_counter = cache.cache_controller.layer_done_counter
        return cache, allocator, req_to_token_pool

    def describe(self) -> str:
        cc = self.cache.cache_controller
        pools = ", ".join(
            f"{e.name.value}={e.host_pool.size}" for e in self.cache.host_pool_group.entries
        )
        return (
            super().describe()
            + f" hicache: ratio={self.host_ratio} write_policy={cc.write_policy}"
            f" io_backend={cc.io_backend} layout={MEM_LAYOUT} host pools: {pools}"
        )

    # ---- scheduler steps -----------------------------------------------------

    def _scheduler_step(self) -> None:
        """``Scheduler._process_hicache_events`` at the top of a scheduler step."""
        self.cache.check_hicache_events()

    def match(self, h) -> int:
        self._scheduler_step()
        super().match(h)
        req = h.req
        if req.needs_host_load_back():
            self._load_back(req)
        if req.prefix_len > h.n_prompt - 1:
            raise AssertionError(
                f"rid {req.rid}: load-back gave a prefix of {req.prefix_len} tokens for a "
                f"{h.n_prompt}-token prompt"
            )
        h.kv_match_len = max(h.kv_match_len, req.prefix_len)
        return req.prefix_len

    def _load_back(self, req) -> None:
        """Admission's load-back (``schedule_policy.py:1470-1571``), budget assumed."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        cache = self.cache
        node = req.best_match_node
        # PrefillAdder._lock_node(best_match_node, lock_host=True)
        host_params = cache.inc_host_lock_ref(node).to_dec_params()
        try:
            lock = cache.lock(node)
            try:
                promised = req.host_hit_length
                loaded = cache.init_load_back(
                    InitLoadBackParams(best_match_node=node, host_hit_length=promised, req=req)
                )
            finally:
                cache.unlock(lock)
        finally:
            cache.dec_host_lock_ref(node, host_params)
        assert loaded is not None  # None only in buffer_only host mode
        req.host_loaded_length, req.last_node = loaded
        if 0 < req.host_loaded_length < promised:
            raise RuntimeError(
                f"rid {req.rid}: load-back committed {req.host_loaded_length} of the "
                f"{promised} promised host tokens"
            )
        req.prefix_len += req.host_loaded_length
        if cache.load_back_is_cache_owned():
            req.kv.cache_protected_len = req.prefix_len
        if req.host_loaded_length > 0:
            self.load_backs += 1
            self.host_loaded_tokens += req.host_loaded_length
        else:
            self.load_backs_declined += 1

    def lock(self, h) -> None:
        super().lock(h)
        # get_new_batch_prefill: the new batch's hicache_consumer_index.
        consumer = self.cache.ready_to_load_host_cache()
        # The forward: TpModelWorker.set_hicache_consumer, then each layer waits for its load.
        counter = self.layer_done_counter
        counter.set_consumer(consumer)
        for layer in range(counter.num_layers):
            counter.wait_until(layer)
        counter.set_consumer(-1)  # the decode batches load nothing

    def after_prefill(self, h) -> None:
        super().after_prefill(h)
        self.cache.flush_pending_backups()
        self._scheduler_step()

    def after_decode(self, h) -> None:
        super().after_decode(h)
        self.cache.flush_pending_backups()
        self._scheduler_step()

    def finish(self, h) -> None:
        super().finish(h)
        self.cache.flush_pending_backups()

    # ---- end of run ------------------------------------------------------------

    def host_accounting(self) -> list[tuple[str, int, int, int]]:
        """Per host pool: ``(name, free, held by the tree, size)``; the tree's share is
        the sum of the host values of that pool's component over every node."""
        from sglang.srt.mem_cache.pool_host.group import PoolName
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

        component = {PoolName.KV: ComponentType.FULL, PoolName.MAMBA: ComponentType.MAMBA}
        nodes = self.cache.tree_core._collect_all_nodes()
        rows = []
        for entry in self.cache.host_pool_group.entries:
            ct = component[entry.name]
            held = sum(
                len(n.component_data[ct].host_value)
                for n in nodes
                if n.component_data[ct].host_value is not None
            )
            rows.append((entry.name.value, entry.host_pool.available_size(), held, entry.host_pool.size))
        return rows

    def leak_check(self) -> tuple[bool, str]:
        """The next scheduler step reaps what the last request left in flight; then the
        device pools' counts (:meth:`.scheduler.SchedulerDriver.leak_check`), no transfer
        pending, each host pool's ``free + held by the tree == size``, and SGLang's own
        tree invariant check (``UnifiedRadixCache.sanity_check``)."""
        self._scheduler_step()
        ok, details = super().leak_check()
        cache = self.cache
        pending = len(cache.ongoing_write_through), len(cache.ongoing_load_back)
        if any(pending):
            ok = False
        details += f"; pending writes={pending[0]} loads={pending[1]}"
        for name, free, held, size in self.host_accounting():
            ok &= free + held == size
            details += f"; host {name}: free={free} held={held} size={size}"
        try:
            cache.sanity_check()
        except AssertionError as e:
            ok = False
            details += f"; sanity_check: {str(e)[:300]}"
        details += (
            f"; load-backs={self.load_backs} ({self.host_loaded_tokens} tokens, "
            f"{self.load_backs_declined} declined)"
        )
        return ok, details


def make_host_driver(base: str, kv_size: int, mamba_size: int, host_ratio: float, **kw):
    """SGLang's ``UnifiedRadixCache`` with its HiCache host tier over the strategy of
    ``upstream.<base>`` (``"UpstreamDriver"`` or ``"UpstreamExtraBufferDriver"``), the
    same device pools (``kv_size`` tokens, ``mamba_size`` SSM slots) and a host tier of
    ``host_ratio`` times each (``--hicache-ratio``). ``kw`` goes to the base driver
    (e.g. ``prompt_checkpoint=True``).

    Raises:
        VariantUnavailable: SGLang could not attach its host tier here (the reason)."""
    from sglang_mamba_ext.benchmarks import upstream

    base_cls = getattr(upstream, base)
    cls = type(
        base_cls.__name__ + "HiCache",
        (_HostTierMixin, base_cls),
        {"host_ratio": float(host_ratio), "name": base_cls.name + "-host", "__module__": __name__},
    )
    return cls(kv_size, mamba_size, **kw)
