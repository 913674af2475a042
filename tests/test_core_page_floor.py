"""Page flooring of every state the core inserts (issue 11, item 2), at page sizes 4 and 16,
with the exact content oracle of ``cache_sim``: a node's key is a whole number of pages and
its SSM state is the state after exactly its last token; KV past the inserted length goes
back to the free list with the request (SGLang's ``MambaRadixCache.cache_finished_req``
floors the cached length to the page and frees the tail the same way).

Each request below has a length that is not a whole number of pages. No SGLang import."""

import unittest

from cache_sim import SimModel, make_cache
from sglang_mamba_ext.mem_cache import CacheReq

PAGE_SIZES = (4, 16)


def seq(n, start=100):
    return list(range(start, start + n))


def node_lengths(cache):
    """``(seq_len, has_state)`` of every node, sorted."""
    return sorted((n.seq_len, n.mamba_value is not None) for n in cache.nodes())


class _PageCase(unittest.TestCase):
    def check_all(self, cache, sim, live=()):
        sim.check_tree()
        cache.sanity_check()  # includes: every key a whole number of pages
        cache.check_slot_accounting(list(live))


class TestFinishedUnalignedLength(_PageCase):
    def test_finished_request_node_aligned_tail_freed(self):
        """A finished request of ``2p + 3 + 2`` committed tokens: with tracking, the
        prompt-end checkpoint (prompt ``2p + 3``, floored ``2p``) is the only state; the
        working state (not at a page boundary) is not donated; the unaligned tail's pages
        go back to the free list."""
        for ps in PAGE_SIZES:
            with self.subTest(page_size=ps):
                cache = make_cache(kv_size=64 * ps, mamba_size=32, page_size=ps, branch_checkpoints=True)
                sim = SimModel(cache)
                kv = cache.token_to_kv_pool_allocator
                free0 = kv.available_size()
                prompt = seq(2 * ps + 3)
                sim.run(prompt, [5, 6, 7], rid="a")
                self.assertEqual(node_lengths(cache), [(2 * ps, True)])
                self.assertEqual(cache.total_size(), 2 * ps)
                self.assertEqual(kv.available_size(), free0 - 2 * ps)
                self.assertEqual(cache.mamba_pool.available_size(), 32 - 1)
                self.check_all(cache, sim)

    def test_finished_request_on_a_page_boundary_donates_working_state(self):
        """Control: committed length a whole number of pages → the working state goes in at
        exactly that length."""
        for ps in PAGE_SIZES:
            with self.subTest(page_size=ps):
                cache = make_cache(kv_size=64 * ps, mamba_size=32, page_size=ps)
                sim = SimModel(cache)
                prompt = seq(2 * ps - 1)
                sim.run(prompt, [5, 6], rid="a")  # committed 2p - 1 + 1 = 2p
                self.assertEqual(node_lengths(cache), [(2 * ps, True)])
                self.check_all(cache, sim)


class TestNoBufferCheckpointAtUnalignedLength(_PageCase):
    """Without ping-pong slots (``track_slots_per_req == 0``, SGLang's ``no_buffer``) a
    running request's checkpoint copies its working state, which is the state after
    ``up_to`` tokens: it may only name a node ending at ``up_to``. When ``up_to`` is not a
    whole number of pages nothing is inserted (on main the state after ``up_to`` went into
    the node ending at the floored length: a wrong state).

    SGLang itself refuses ``no_buffer`` with ``--page-size > 1`` at start-up
    (``arg_groups/mamba_hook.py::validate_mamba_no_buffer``), so this is the core's contract
    for its other callers (benchmarks, tests)."""

    def test_chunk_end_inside_a_page_inserts_nothing(self):
        for ps in PAGE_SIZES:
            with self.subTest(page_size=ps):
                cache = make_cache(kv_size=64 * ps, mamba_size=32, page_size=ps, track_slots=0)
                sim = SimModel(cache)
                r = CacheReq(rid="a", token_ids=seq(2 * ps + 3))
                self.assertTrue(sim.admit(r))
                self.assertTrue(sim.extend_kv(r, ps + 2))
                sim.forward(r, ps + 2)
                self.assertEqual(cache.checkpoint(r), 0)  # up_to = p + 2: not a page end
                self.assertEqual(node_lengths(cache), [])
                self.assertTrue(sim.extend_kv(r, 2 * ps))
                sim.forward(r, ps - 2)
                self.assertEqual(cache.checkpoint(r), 2 * ps)  # a page end: inserted
                self.assertEqual(node_lengths(cache), [(2 * ps, True)])
                self.check_all(cache, sim, [r])
                self.assertTrue(sim.extend_kv(r, 2 * ps + 3))
                sim.forward(r, 3)
                self.assertEqual(cache.checkpoint(r), 2 * ps)  # the prompt end: unaligned
                self.assertEqual(node_lengths(cache), [(2 * ps, True)])
                self.check_all(cache, sim, [r])
                sim.release(r)
                self.check_all(cache, sim)

    def test_post_prefill_checkpoint_resend_hits_exact_state(self):
        """SGLang checkpoints a request after its whole prompt ran (it goes on decoding);
        with a prompt of ``2p + 3`` in one chunk, nothing is inserted then (its state is not
        at a page end; on main the state after ``2p + 3`` tokens went into a node of ``2p``),
        so a resent prompt starts from scratch."""
        for ps in PAGE_SIZES:
            with self.subTest(page_size=ps):
                cache = make_cache(kv_size=64 * ps, mamba_size=32, page_size=ps, track_slots=0)
                sim = SimModel(cache)
                prompt = seq(2 * ps + 3)
                r = CacheReq(rid="a", token_ids=list(prompt))
                self.assertTrue(sim.admit(r))
                self.assertTrue(sim.prefill(r))
                self.assertEqual(cache.checkpoint(r), 0)  # after the completed prefill
                self.assertEqual(node_lengths(cache), [])
                self.check_all(cache, sim, [r])
                sim.decode(r, [9])
                sim.release(r)
                again = CacheReq(rid="again", token_ids=list(prompt))
                self.assertTrue(sim.admit(again))
                self.assertEqual(again.cache_protected_len, 0)
                self.assertTrue(sim.prefill(again))  # checks the COW'd state is exact
                sim.release(again)
                self.check_all(cache, sim)


class TestBranchPointInsideAPage(_PageCase):
    def test_branch_inside_a_page_is_planned_at_the_floor(self):
        """R1 = S + u1 with ``|S| = 2p + p/2``, ``|u1| = p`` (its prompt-end state lies past
        S); R2 = S + u2 matches S's KV only to ``2p``
        (the page holding the branch differs): the branch checkpoint is planned at ``2p``,
        the prompt-end one at ``floor((|R2| - 1) / p) * p``; R3 = S + u3 then hits ``2p``."""
        for ps in PAGE_SIZES:
            with self.subTest(page_size=ps):
                cache = make_cache(kv_size=64 * ps, mamba_size=32, page_size=ps, branch_checkpoints=True)
                sim = SimModel(cache)
                s = seq(2 * ps + ps // 2, start=1000)
                sim.run(s + seq(ps, start=2000), [1, 2], rid="r1")
                r2 = CacheReq(rid="r2", token_ids=s + seq(ps + 1, start=3000))
                self.assertTrue(sim.admit(r2))
                self.assertEqual(r2.cache_protected_len, 0)
                self.assertEqual(sim.last_match.kv_match_len, 2 * ps)
                self.assertEqual(sim.last_match.mamba_branching_seqlen, 2 * ps)
                n2 = len(r2.token_ids)
                self.assertEqual(
                    [c for c, _ in r2.mamba_prefix_checkpoints], [2 * ps, (n2 - 1) // ps * ps]
                )
                self.assertTrue(sim.prefill(r2, chunk=ps))
                sim.release(r2)
                r3 = CacheReq(rid="r3", token_ids=s + seq(4, start=4000))
                self.assertTrue(sim.admit(r3))
                self.assertEqual(r3.cache_protected_len, 2 * ps)
                self.assertTrue(sim.prefill(r3))
                sim.release(r3)
                self.check_all(cache, sim)

    def test_floor_not_beyond_matched_prefix_is_not_planned(self):
        """A branch whose page floor is the matched prefix itself plans nothing there (its
        state exists); only a prompt-end checkpoint beyond it."""
        for ps in PAGE_SIZES:
            with self.subTest(page_size=ps):
                cache = make_cache(kv_size=64 * ps, mamba_size=32, page_size=ps, branch_checkpoints=True)
                sim = SimModel(cache)
                first = seq(2 * ps + 1, start=1000)  # prompt-end checkpoint at 2p
                sim.run(first, [1], rid="a")
                self.assertIn((2 * ps, True), node_lengths(cache))
                r = CacheReq(rid="b", token_ids=first[: 2 * ps + 2] + seq(ps, start=5000))
                self.assertTrue(sim.admit(r))
                self.assertEqual(r.cache_protected_len, 2 * ps)
                self.assertIsNone(sim.last_match.mamba_branching_seqlen)
                self.assertEqual([c for c, _ in r.mamba_prefix_checkpoints], [(3 * ps + 1) // ps * ps])
                # Planning directly with a branch at the matched prefix, or inside its last page.
                self.assertEqual(cache.plan_prefix_checkpoints(r, 2 * ps + 2, branching_seqlen=2 * ps + 1), [])
                sim.release(r, checkpoint=False)
                self.check_all(cache, sim)


class TestResend(_PageCase):
    def test_identical_prompt_hits_page_floor_of_len_minus_one(self):
        for ps in PAGE_SIZES:
            for extra in (1, 3, ps - 1):
                with self.subTest(page_size=ps, length=2 * ps + extra):
                    cache = make_cache(kv_size=64 * ps, mamba_size=32, page_size=ps, branch_checkpoints=True)
                    sim = SimModel(cache)
                    prompt = seq(2 * ps + extra)
                    sim.run(prompt, [5, 6], rid="first")
                    again = CacheReq(rid="again", token_ids=list(prompt))
                    self.assertTrue(sim.admit(again))
                    self.assertEqual(again.cache_protected_len, (len(prompt) - 1) // ps * ps)
                    self.assertTrue(sim.prefill(again))
                    sim.release(again)
                    self.check_all(cache, sim)


class TestUnalignedStateNeverInserted(_PageCase):
    """A state whose length is not a whole number of pages is never put into the tree:
    a ping-pong checkpoint reported at such a length (which SGLang's tracking never
    produces, ``mamba_checkpoint_grid`` is a multiple of the page) is skipped, for a
    running and for a finished request, instead of making a node of a partial page."""

    def _prefilled(self, ps, finish_state="working"):
        cache = make_cache(kv_size=64 * ps, mamba_size=32, page_size=ps, finish_state=finish_state)
        sim = SimModel(cache)
        r = CacheReq(rid="a", token_ids=seq(2 * ps + 3))
        self.assertTrue(sim.admit(r))
        self.assertTrue(sim.extend_kv(r, 2 * ps + 3))
        sim.forward(r, 2 * ps + 3)
        # Report the live state as a checkpoint at the unaligned prompt end.
        entry = r.mamba_next_track_idx
        cache.mamba_pool.copy_from([r.mamba_pool_idx], [r.mamba_ping_pong_track_buffer[entry]])
        r.mamba_next_track_idx = 1 - entry
        r.mamba_last_track_seqlen = 2 * ps + 3
        return cache, sim, r

    def test_running_request(self):
        for ps in PAGE_SIZES:
            with self.subTest(page_size=ps):
                cache, sim, r = self._prefilled(ps)
                self.assertEqual(cache.checkpoint(r), 0)
                self.assertEqual(node_lengths(cache), [])
                self.check_all(cache, sim, [r])
                sim.release(r, checkpoint=False)
                self.check_all(cache, sim)

    def test_finished_request(self):
        for ps in PAGE_SIZES:
            for fs in ("working", "checkpoint"):
                with self.subTest(page_size=ps, finish_state=fs):
                    cache, sim, r = self._prefilled(ps, fs)
                    sim.release(r)  # checkpoint(finished=True), then the tail freed
                    self.assertEqual(node_lengths(cache), [])
                    self.assertEqual(cache.token_to_kv_pool_allocator.available_size(), 64 * ps)
                    self.check_all(cache, sim)

    def test_insert_of_an_unaligned_prefix_raises(self):
        for ps in PAGE_SIZES:
            with self.subTest(page_size=ps):
                cache, sim, r = self._prefilled(ps)
                with self.assertRaises(ValueError):
                    cache._adopt_prefix(r, 2 * ps + 3, r.mamba_pool_idx)
                self.assertEqual(node_lengths(cache), [])
                sim.release(r, checkpoint=False)
                self.check_all(cache, sim)


if __name__ == "__main__":
    unittest.main()
