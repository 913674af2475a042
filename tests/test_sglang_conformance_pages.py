"""Page flooring through the adapter (issue 11, item 2): the plugin's
``MambaRadixCacheAdapter`` over its ``MambaRadixReqToTokenPool`` and SGLang's own
``PagedTokenToKVPoolAllocator`` (``mem_cache/allocator/paged.py``: whole pages, a page freed
as one), driven by SGLang's scheduler functions as ``test_sglang_glue`` drives them
(``init_next_round_input`` → ``match_kv_cache``, ``alloc_req_slots``, SGLang's extra_buffer
track decision, ``checkpoint_kv_cache``, ``release_kv_cache``), at ``--page-size`` 4 and 16.

SGLang's ``MambaRadixCache.cache_finished_req`` inserts a finished request at its newest
checkpoint, floored to the page, and frees the KV past it; these tests check the adapter
does the same: every node a whole number of pages, every node's state the state of
exactly its tokens, the tail's pages back on the free list, and the core's exact slot
accounting at idle. Each case uses a prompt that is not a whole number of pages.
"""

import unittest

import torch

import sglang_glue_fixtures as F
from test_sglang_glue import _Harness

KV_SIZE = 512
MAMBA_SIZE = 16


def page_slots(allocator) -> torch.Tensor:
    """Every free KV slot of SGLang's allocator (its free list holds pages)."""
    pages = allocator.get_all_free_pages().to(torch.int64)
    ps = allocator.page_size
    if ps == 1:
        return pages
    return (pages[:, None] * ps + torch.arange(ps)).reshape(-1)


class PagedHarness(_Harness):
    """``_Harness`` with KV handed out as SGLang's paged allocation does: a request's
    positions continue its last page, new positions take whole fresh pages
    (``alloc_token_slots`` with a page-multiple size, evicting if short)."""

    def __init__(self, test, pool, cache, allocator):
        super().__init__(test, pool, cache, allocator)
        from sglang.srt.mem_cache.allocation import alloc_token_slots

        self._alloc_pages = alloc_token_slots
        self.alloc_token_slots = self._paged_alloc
        self._at = None  # (req, first new position) of the next allocation

    def _paged_alloc(self, cache, n):
        req, pos = self._at
        ps = self.allocator.page_size
        row = req.kv.req_pool_idx
        out = []
        k = 0
        if pos % ps:
            k = min(ps - pos % ps, n)
            base = int(self.pool.req_to_token[row, pos - 1]) + 1
            out.append(torch.arange(base, base + k, dtype=torch.int64))
        if n > k:
            got = self._alloc_pages(cache, -(-(n - k) // ps) * ps)
            out.append(got[: n - k].to(torch.int64))
        return torch.cat(out)

    def forward_extend(self, req, end):
        self._at = (req, req.prefix_len)
        super().forward_extend(req, end)

    def decode(self, req, new_tokens):
        for i, tok in enumerate(new_tokens):
            if i == len(new_tokens) - 1:
                req.output_ids.append(tok)
                break
            self._at = (req, req.kv.kv_committed_len)
            super().decode(req, [tok, -1])  # one step; the placeholder is never fed
            req.output_ids.pop()

    def check_idle(self):
        super().check_idle()
        alloc = self.allocator
        alloc.free_slots = lambda: page_slots(alloc)  # the core's leak check reads this
        try:
            self.cache.core.check_slot_accounting([])
        finally:
            del alloc.free_slots


class _PagedCase(unittest.TestCase):
    PAGE_SIZE = 16

    @classmethod
    def setUpClass(cls):
        ps = cls.PAGE_SIZE
        cls.ctx, _ = F.scheduler_context(
            F.base_argv(
                "--enable-mamba-radix", "--page-size", str(ps), "--mamba-track-interval", str(max(16, ps)),
                "--max-mamba-cache-size", str(MAMBA_SIZE), "--chunked-prefill-size", str(2 * ps),
                "--radix-eviction-policy", "lru",  # SGLang's order, which the cases compare with
            )
        )

    def setUp(self):
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.runtime_context import get_exec, mamba_checkpoint_grid

        from sglang_mamba_ext.plugin.cache import MambaRadixCacheAdapter

        ps = self.PAGE_SIZE
        cm = F.in_context(self.ctx)
        cm.__enter__()
        self.addCleanup(cm.__exit__, None, None, None)
        self.pool = F.build_req_pool(max_num_reqs=4)
        self.pool.prefix_checkpoint_writer = True  # the tiny model's backend
        self.allocator = PagedTokenToKVPoolAllocator(KV_SIZE, ps, torch.float32, "cpu", None, False)
        self.cache = MambaRadixCacheAdapter(
            req_to_token_pool=self.pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=ps,
            mamba_track_interval=get_exec().mamba.mamba_track_interval,
            enable_mamba_extra_buffer=True,
            checkpoint_grid=mamba_checkpoint_grid(ps),
        )
        self.h = PagedHarness(self, self.pool, self.cache, self.allocator)
        self.base = list(range(100, 100 + 2 * ps + ps // 2 + 1))  # 2.5 pages + 1 token

    def nodes(self):
        return sorted((n.seq_len, n.mamba_value is not None) for n in self.cache.core.nodes())

    def run_req(self, rid, prompt, outs=(1, 2, 3)):
        from sglang_glue_fixtures import make_req

        r = make_req(rid, prompt)
        self.h.admit(r)
        planned = [c for c, _ in self.pool.prefix_checkpoints.get(r.kv.req_pool_idx, [])]
        r.hit_at_admission = r.prefix_len
        self.h.prefill(r, chunk=2 * self.PAGE_SIZE)
        self.h.decode(r, list(outs))
        self.h.finish(r)
        self.h.check_tree_states()
        self.h.check_idle()
        return r, planned

    def test_finished_request_with_unaligned_length(self):
        """A prompt of 2.5 pages + 1 with 3 outputs (committed ``2p + p/2 + 3``): the tree
        keeps one node of 2 pages (the chunk checkpoint, which is also the page floor of
        prompt length - 1), the last partial page's KV is freed."""
        ps = self.PAGE_SIZE
        r, planned = self.run_req("a", self.base)
        self.assertEqual(planned, [2 * ps])
        self.assertEqual(self.nodes(), [(2 * ps, True)])
        self.assertEqual(self.allocator.available_size(), KV_SIZE - 2 * ps)
        self.assertEqual(self.cache.full_evictable_size(), 2 * ps)
        self.assertEqual(self.cache.mamba_evictable_size(), 1)

    def test_resend_hits_page_floor_of_len_minus_one(self):
        ps = self.PAGE_SIZE
        self.run_req("a", self.base)
        r, planned = self.run_req("resend", self.base)
        self.assertEqual(r.hit_at_admission, (len(self.base) - 1) // ps * ps)
        self.assertEqual(planned, [])  # the floor is the matched prefix: nothing to save
        self.assertEqual(self.nodes(), [(2 * ps, True)])

    def test_branch_point_inside_a_page(self):
        """B shares 1.5 pages with A: its KV match and branch point are 1 page; C, sharing
        the same 1.5 pages, hits that page with its exact state."""
        ps = self.PAGE_SIZE
        self.run_req("a", self.base)
        b_prompt = self.base[: ps + ps // 2] + [901, 902, 903, 904, 905]
        b, planned = self.run_req("b", b_prompt)
        self.assertEqual(b.hit_at_admission, 0)
        self.assertEqual(b.mamba_branching_seqlen, ps)
        self.assertEqual(planned, sorted({ps, (len(b_prompt) - 1) // ps * ps}))
        c, _ = self.run_req("c", self.base[: ps + ps // 2] + [7, 7, 7])
        self.assertEqual(c.hit_at_admission, ps)
        for n, has_state in self.nodes():
            self.assertEqual(n % ps, 0)


class TestPageSize16(_PagedCase):
    PAGE_SIZE = 16


class TestPageSize4(_PagedCase):
    PAGE_SIZE = 4


del _PagedCase

if __name__ == "__main__":
    unittest.main()
