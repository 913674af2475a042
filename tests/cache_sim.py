"""A deterministic stand-in for a hybrid model and for SGLang's scheduler side, driving the
real core pools and cache, for the core's tests (no SGLang, no neural network).

The scheduler side does what SGLang 0.5.23 does around the cache's lifecycle
(``MambaRadixCache.checkpoint`` / ``on_release``): allocate KV with evict-if-short
(:meth:`SimModel.alloc_kv`), run the pending copy-on-write copies and clears at forward
start (:meth:`SimModel.run_deferred_cow`), plan the ping-pong checkpoint of a forward
(:meth:`SimModel.plan_track`), and release a request (:meth:`SimModel.release`: checkpoint
if finished, free its KV tail, unlock, free the row, ``on_release``).

The "model" writes into the real pools:

- KV: slot ``s`` of the KV pool records the token id and the position written there
  (``kv_token[s]``, ``kv_pos[s]``);
- SSM: each linear layer's temporal state is ``[count, hash]`` of the tokens seen (int64,
  exact), and its conv window is the last ``W - 1`` tokens (+1, 0 = empty).

So every state and every KV slot can be checked exactly against the tokens it claims to
summarise: :meth:`SimModel.check_tree` verifies that every node's KV slots hold its path's
tokens at the right positions and that its SSM slot holds the state of exactly its
root-to-node sequence; :meth:`SimModel.forward` verifies, before computing, that the
request's prefix KV and working state are right (catching a missing copy-on-write, a wrong
``req_to_token`` write-back or a state holding draft tokens).
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch

from sglang_mamba_ext.mem_cache import (
    CacheReq,
    HybridReqToTokenPool,
    KVSlotAllocator,
    MambaPool,
    MambaRadixCache,
    RadixKey,
)
from sglang_mamba_ext.mem_cache.checkpoint_pool import HostStatePool, copy_on_write
from sglang_mamba_ext.mem_cache.kv_host_pool import HostKVPool
from sglang_mamba_ext.mem_cache.mamba_pool import SlotPool

MOD = (1 << 31) - 1
MUL = 1000003
CONV_W = 3  # conv window keeps W - 1 = 2 tokens


def state_of(tokens: List[int], layer: int = 0):
    """(count, hash, conv window) of a token sequence, for linear layer ``layer``."""
    h = 0
    for t in tokens:
        h = (h * MUL + t + 1 + layer) % MOD
    window = [0] * (CONV_W - 1)
    tail = [t + 1 for t in tokens[-(CONV_W - 1):]] if tokens else []
    window[len(window) - len(tail):] = tail
    return len(tokens), h, window


class ExactCheckpointPool(SlotPool):
    """A separate pool for the tree's states, like the int8 checkpoint pool
    (``mem_cache/checkpoint_pool.py``) but storing exact copies, so the oracle's hash states
    survive: it tests the two-pool lifecycle (quantize-on-store and dequantize-on-hit
    replaced by copies), while ``test_int8_checkpoints`` tests the numerics."""

    #: States stored by every instance (the randomized test checks the path ran).
    total_stores = 0

    def __init__(self, size: int, active: MambaPool):
        self.size = size
        self.device = active.device
        self.num_layers = active.num_layers
        self.temporal_state = torch.zeros_like(active.temporal_state[:, :1]).repeat(1, size + 1, *[1] * (active.temporal_state.dim() - 2))
        self.conv_state = torch.zeros_like(active.conv_state[:, :1]).repeat(1, size + 1, *[1] * (active.conv_state.dim() - 2))
        self.stores = 0
        self.clear_all()

    def slot_bytes(self) -> int:
        return self.num_layers * (self.temporal_state[0, 0].nbytes + self.conv_state[0, 0].nbytes)

    def state_tensors(self):
        """As :meth:`MambaPool.state_tensors` (the host tier copies these)."""
        return [self.conv_state, self.temporal_state]

    def store_from_active(self, active, active_slots, ckpt_slots) -> None:
        self.stores += len(ckpt_slots)
        ExactCheckpointPool.total_stores += len(ckpt_slots)
        self.temporal_state[:, list(ckpt_slots)] = active.temporal_state[:, list(active_slots)]
        self.conv_state[:, list(ckpt_slots)] = active.conv_state[:, list(active_slots)]

    def load_to_active(self, active, ckpt_slots, active_slots) -> None:
        active.temporal_state[:, list(active_slots)] = self.temporal_state[:, list(ckpt_slots)]
        active.conv_state[:, list(active_slots)] = self.conv_state[:, list(ckpt_slots)]


def make_cache(
    kv_size: int = 256,
    mamba_size: int = 16,
    page_size: int = 1,
    track_slots: int = 2,
    rows: int = 8,
    max_context_len: int = 512,
    mamba_track_interval: Optional[int] = None,
    num_layers: int = 2,
    finish_state: str = "working",
    ckpt_size: int = 0,
    host_size: int = 0,
    kv_host_size: int = 0,
    **cache_kwargs,
):
    """``ckpt_size > 0``: the tree keeps its states in an :class:`ExactCheckpointPool` of
    that many slots (the int8 checkpoint lifecycle); ``host_size > 0``: a host tier of that
    many states (:class:`HostStatePool`, exact copies of the tree's pool, the checkpoint
    pool's with ``ckpt_size``); ``kv_host_size > 0`` (with
    ``host_size``): a host tier of that many KV tokens (:class:`HostKVPool`; a
    :class:`SimModel` gives it its KV buffers)."""
    kv = KVSlotAllocator(kv_size, page_size)
    mp = MambaPool(mamba_size, num_layers, (CONV_W - 1,), (2,), dtype=torch.int64)
    ckpt = ExactCheckpointPool(ckpt_size, mp) if ckpt_size > 0 else None
    host = HostStatePool(host_size, ckpt if ckpt is not None else mp) if host_size > 0 else None
    kv_host = HostKVPool(kv_host_size, page_size) if kv_host_size > 0 else None
    rp = HybridReqToTokenPool(
        rows, max_context_len, mp, track_slots_per_req=track_slots, mamba_ckpt_pool=ckpt, mamba_host_pool=host,
        kv_host_pool=kv_host,
    )
    cache = MambaRadixCache(
        kv, rp, page_size=page_size, mamba_track_interval=mamba_track_interval or 4 * page_size,
        finish_state=finish_state,
        **cache_kwargs,
    )
    return cache


class _PoolView:
    def __init__(self, conv_state, temporal_state):
        self.conv_state = conv_state
        self.temporal_state = temporal_state


class SimModel:
    """The fake model + a minimal scheduler over one :class:`MambaRadixCache`."""

    def __init__(self, cache: MambaRadixCache):
        self.cache = cache
        kv = cache.token_to_kv_pool_allocator
        self.kv_token = torch.full((kv.size + kv.page_size,), -1, dtype=torch.int64)
        self.kv_pos = torch.full((kv.size + kv.page_size,), -1, dtype=torch.int64)
        host = cache.kv_host_pool
        if host is not None:  # the host KV tier copies this "KV" (token id, position)
            host.__init__(host.size, host.page_size, [self.kv_token, self.kv_pos])
        self.pool = cache.req_to_token_pool
        self.mamba = cache.mamba_pool
        self.page_size = cache.page_size

    # ------------------------------------------------------------------ oracle checks
    def check_state(self, slot: int, tokens: List[int], what: str = "", pool=None) -> None:
        pool = self.mamba if pool is None else pool
        for layer in range(self.mamba.num_layers):
            count, h, window = state_of(tokens, layer)
            got = pool.temporal_state[layer, slot].tolist()
            assert got == [count, h], f"{what}: SSM slot {slot} layer {layer} holds {got}, want {[count, h]}"
            assert pool.conv_state[layer, slot].tolist() == window, f"{what}: conv window of slot {slot}"

    def check_kv(self, slots: torch.Tensor, tokens: List[int], start: int, what: str = "") -> None:
        if not tokens:
            return
        want_tok = torch.tensor(tokens, dtype=torch.int64)
        want_pos = torch.arange(start, start + len(tokens), dtype=torch.int64)
        s = slots.to(torch.int64)
        assert torch.equal(self.kv_token[s], want_tok), f"{what}: KV slots hold the wrong tokens"
        assert torch.equal(self.kv_pos[s], want_pos), f"{what}: KV slots hold the wrong positions"

    def check_tree(self) -> None:
        """Every node's KV and SSM slots summarise exactly its root-to-node tokens."""
        stack = [(self.cache.root_node, [])]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                full = path + child.key
                if child.value is None:
                    host = self.cache.kv_host_pool.host_buffers
                    idx = child.host_value
                    assert host[0][idx].tolist() == child.key, f"node {child.id}: host KV holds the wrong tokens"
                    assert host[1][idx].tolist() == list(range(len(path), len(full))), f"node {child.id}: host KV positions"
                else:
                    self.check_kv(child.value, child.key, len(path), f"node {child.id}")
                if child.mamba_value is not None:
                    self.check_state(child.mamba_value, full, f"node {child.id}", self.cache.state_pool)
                if child.mamba_host_value is not None:
                    host = self.cache.mamba_host_pool
                    view = _PoolView(conv_state=host.layer_major(0), temporal_state=host.layer_major(1))
                    self.check_state(child.mamba_host_value, full, f"node {child.id} host copy", view)
                stack.append((child, full))

    # ------------------------------------------------------------------ scheduler side
    def admit(self, req: CacheReq, cap_one: bool = True, prompt_len: Optional[int] = None, boundaries=()) -> bool:
        """match_prefix (capped at len - 1) with COW, lock, alloc the row and SSM slots
        (evicting SSM states if short), then plan the branch / prompt-end checkpoints (and
        those at ``boundaries``, message boundaries in tokens).
        Returns False (and releases everything) when the pools cannot take the request."""
        cache = self.cache
        n = len(req.token_ids) - (1 if cap_one else 0)
        m = cache.match_prefix(RadixKey(req.token_ids[:n], req.extra_key), cow_mamba=True, req=req)
        cache.inc_lock_ref(m.last_node)
        req.last_node = m.last_node
        p = m.prefix_len
        rows = self.pool.alloc([req])
        if rows is None:
            need = self.pool.mamba_slots_per_req() - (1 if req.mamba_pool_idx is not None else 0)
            cache.evict(mamba_num=need - self.mamba.available_size())
            rows = self.pool.alloc([req])
        if rows is None:
            self.release(req, checkpoint=False)
            return False
        self.pool.req_to_token[req.req_pool_idx, :p] = m.device_indices.to(torch.int32)
        req.prefix_indices = m.device_indices
        req.cache_protected_len = p
        req.kv_allocated_len = p
        req.kv_committed_len = p
        self.last_match = m
        cache.plan_prefix_checkpoints(
            req, len(req.token_ids) if prompt_len is None else prompt_len, m.mamba_branching_seqlen, boundaries
        )
        return True

    def extend_kv(self, req: CacheReq, new_len: int) -> bool:
        """Give the request KV slots for positions ``[kv_allocated_len, new_len)``, page by
        page, evicting if short. False if the pool cannot."""
        a = req.kv_allocated_len
        if new_len <= a:
            return True
        ps = self.page_size
        row = req.req_pool_idx
        first_new_page = -(-a // ps)
        pages = -(-new_len // ps) - first_new_page
        fresh = None
        if pages:
            fresh = self.alloc_kv(pages * ps)
            if fresh is None:
                return False
        pos = a
        if a % ps:
            base = int(self.pool.req_to_token[row, a - 1]) + 1
            k = min(ps - a % ps, new_len - a)
            self.pool.req_to_token[row, a : a + k] = torch.arange(base, base + k, dtype=torch.int32)
            pos += k
        if fresh is not None:
            self.pool.req_to_token[row, pos:new_len] = fresh[: new_len - pos].to(torch.int32)
        req.kv_allocated_len = new_len
        return True

    def forward(self, req: CacheReq, num_tokens: int, chunk_end: bool = False) -> None:
        """Process ``num_tokens`` tokens from ``kv_committed_len``: check the prefix KV and
        the working state first, then write KV and advance the state, writing the planned
        ping-pong checkpoint."""
        self.run_deferred_cow([req])
        row = req.req_pool_idx
        s = req.kv_committed_len
        toks = req.token_ids
        self.check_kv(self.pool.req_to_token[row, :s], toks[:s], 0, f"req {req.rid} prefix")
        self.check_state(req.mamba_pool_idx, toks[:s], f"req {req.rid} working state")
        assert req.kv_allocated_len >= s + num_tokens, "KV not allocated before the forward"
        plan = self.plan_track(req, s, num_tokens, chunk_end=chunk_end)
        new_slots = self.pool.req_to_token[row, s : s + num_tokens].to(torch.int64)
        self.kv_token[new_slots] = torch.tensor(toks[s : s + num_tokens], dtype=torch.int64)
        self.kv_pos[new_slots] = torch.arange(s, s + num_tokens, dtype=torch.int64)
        work = req.mamba_pool_idx
        if plan is not None:
            slot, c = plan
            self._write_state(slot, toks[:c])
        for slot, c in self.pool.prefix_checkpoints_in(req, s, num_tokens):
            self._write_state(slot, toks[:c])
        self._write_state(work, toks[: s + num_tokens])
        req.kv_committed_len = s + num_tokens

    def _write_state(self, slot: int, tokens: List[int]) -> None:
        for layer in range(self.mamba.num_layers):
            count, h, window = state_of(tokens, layer)
            self.mamba.temporal_state[layer, slot] = torch.tensor([count, h])
            self.mamba.conv_state[layer, slot] = torch.tensor(window)

    def alloc_kv(self, num_tokens: int) -> Optional[torch.Tensor]:
        """KV slots, evicting unlocked KV first if the pool is short (the scheduler's
        evict-if-short rule, SGLang's ``alloc_token_slots``). ``None`` if still short."""
        alloc = self.cache.token_to_kv_pool_allocator
        short = num_tokens - alloc.available_size()
        if short > 0:
            self.cache.evict(num_tokens=short)
        return alloc.alloc(num_tokens)

    def run_deferred_cow(self, reqs: Iterable[CacheReq]) -> int:
        """At forward start (SGLang: ``_execute_deferred_mamba_cow_and_clear``): copy each
        pending copy-on-write source into the request's working slot and zero each fresh
        working slot, one batched copy and one batched clear. Returns the states copied.

        Raises:
            RuntimeError: a request has a COW source but no working slot."""
        src: List[int] = []
        dst: List[int] = []
        clear: List[int] = []
        for r in reqs:
            if r.mamba_cow_src_index is not None:
                if r.mamba_pool_idx is None:
                    raise RuntimeError(f"request {r.rid!r} has a COW source but no working slot")
                src.append(r.mamba_cow_src_index)
                dst.append(r.mamba_pool_idx)
                r.mamba_cow_src_index = None
            elif r.mamba_needs_clear:
                clear.append(r.mamba_pool_idx)
            r.mamba_needs_clear = False
        if src:
            copy_on_write(self.mamba, self.cache.mamba_ckpt_pool, src, dst)
        if clear:
            self.mamba.clear(clear)
        return len(src)

    def plan_track(
        self, req: CacheReq, seq_len_before: int, num_new_tokens: int, chunk_end: bool = False
    ) -> Optional[Tuple[int, int]]:
        """Where this forward writes the request's next ping-pong checkpoint: the largest
        ``c`` in ``(seq_len_before, seq_len_before + num_new_tokens]`` that is a multiple of
        ``mamba_track_interval`` or, when ``chunk_end``, the chunk's last page boundary,
        whichever is larger. On a plan the entry flips and ``mamba_last_track_seqlen``
        becomes ``c``. Returns ``(slot, c)`` or ``None`` (no checkpoint, or no slot)."""
        if not self.pool.track_slots_per_req or num_new_tokens <= 0:
            return None
        end = seq_len_before + num_new_tokens
        interval = self.cache.mamba_track_interval
        c = (end // interval) * interval
        if chunk_end:
            c = max(c, (end // self.page_size) * self.page_size)
        if c <= seq_len_before:
            return None
        entry = req.mamba_next_track_idx
        slot = req.mamba_ping_pong_track_buffer[entry]
        if slot < 0:
            return None
        req.mamba_next_track_idx = 1 - entry
        req.mamba_last_track_seqlen = c
        return slot, c

    def release(self, req: CacheReq, checkpoint: bool = True) -> None:
        """Finish (``checkpoint``) or abort / reject / retract a request as SGLang's
        ``release_kv_cache`` does: ``checkpoint(req, finished=True)`` first when asked and
        the request has a row, then free its KV above ``cache_protected_len``, free the
        row, unlock its node and call ``on_release``. Safe at any stage."""
        cache = self.cache
        row = req.req_pool_idx
        if row is not None:
            if checkpoint:
                cache.checkpoint(req, finished=True)
            p, a = req.cache_protected_len, req.kv_allocated_len
            if a > p:
                cache.token_to_kv_pool_allocator.free(self.pool.req_to_token[row, p:a].to(torch.int64))
            self.pool.free_rows([row])
            req.req_pool_idx = None
        if req.last_node is not None:
            cache.dec_lock_ref(req.last_node)
        cache.on_release(req)
        req.last_node = None
        req.prefix_indices = None
        req.cache_protected_len = 0
        req.kv_allocated_len = 0
        req.kv_committed_len = 0

    # ------------------------------------------------------------------ whole lifecycles
    def prefill(self, req: CacheReq, chunk: Optional[int] = None) -> bool:
        """Prefill the prompt (``req.token_ids``) in chunks; ``checkpoint`` after every chunk
        but the last. False if KV ran out (the request is then released)."""
        total = len(req.token_ids)
        while req.kv_committed_len < total:
            k = total - req.kv_committed_len if chunk is None else min(chunk, total - req.kv_committed_len)
            if not self.extend_kv(req, req.kv_committed_len + k):
                self.release(req, checkpoint=False)
                return False
            last = req.kv_committed_len + k == total
            self.forward(req, k, chunk_end=not last)
            if not last:
                self.cache.checkpoint(req)
        return True

    def decode(self, req: CacheReq, new_tokens: List[int]) -> bool:
        """Generate ``new_tokens`` one by one (the first is the prefill's output)."""
        for i, t in enumerate(new_tokens):
            req.token_ids.append(t)
            if i == len(new_tokens) - 1:
                break
            if not self.extend_kv(req, req.kv_committed_len + 1):
                self.release(req, checkpoint=False)
                return False
            self.forward(req, 1)
        return True

    def run(self, tokens: List[int], output: List[int], chunk: Optional[int] = None, rid=None, extra_key=None) -> CacheReq:
        """A whole request: admit, prefill, decode, finish. Returns the request record."""
        req = CacheReq(rid=rid, token_ids=list(tokens), extra_key=extra_key)
        assert self.admit(req), f"request {rid} rejected"
        assert self.prefill(req, chunk), f"request {rid} ran out of KV"
        assert self.decode(req, output), f"request {rid} ran out of KV in decode"
        self.release(req)
        return req


def state_lengths(cache) -> List[int]:
    """Sorted ``seq_len`` of every tree node holding an SSM state."""
    out, stack = [], [cache.root_node]
    while stack:
        n = stack.pop()
        for c in n.children.values():
            if c.mamba_value is not None:
                out.append(c.seq_len)
            stack.append(c)
    return sorted(out)
