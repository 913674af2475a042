"""A finished request kept to a length below its newest ping-pong checkpoint (a stop before
the last committed token): the older checkpoint, still in the other entry, goes into the
tree, as SGLang's finish does (``tests/test_sglang_conformance.py``,
``test_mamba_finished_overshoot_checkpoint``); under overlap scheduling
(``finish_state="checkpoint"``) it does not, since a forward in flight may be overwriting
that entry (``docs/design.md``, "SGLang conformance"). The content oracle of ``cache_sim``
checks the inserted state is the state of exactly its tokens. No SGLang import."""

import unittest

from cache_sim import SimModel, make_cache
from sglang_mamba_ext.mem_cache import CacheReq


def seq(n, start=100):
    return list(range(start, start + n))


class TestFinishFallsBackToOlderCheckpoint(unittest.TestCase):
    def _two_checkpoints(self, finish_state):
        cache = make_cache(kv_size=256, mamba_size=16, mamba_track_interval=4, finish_state=finish_state)
        sim = SimModel(cache)
        r = CacheReq(rid="r", token_ids=seq(12))
        self.assertTrue(sim.admit(r))
        self.assertTrue(sim.extend_kv(r, 12))
        sim.forward(r, 8, chunk_end=True)  # checkpoint at 8 in entry 0
        sim.forward(r, 4, chunk_end=True)  # checkpoint at 12 in entry 1
        self.assertEqual((r.mamba_last_track_seqlen, r.mamba_next_track_idx), (12, 0))
        r.mamba_prev_track_seqlen = 8  # SGLang's bookkeeping of the older entry
        return cache, sim, r

    def test_working_finish_inserts_the_older_checkpoint(self):
        cache, sim, r = self._two_checkpoints("working")
        self.assertEqual(cache.checkpoint(r, up_to=10, finished=True), 8)
        self.assertEqual([(n.seq_len, n.mamba_value is not None) for n in cache.nodes()], [(8, True)])
        sim.release(r, checkpoint=False)
        sim.check_tree()  # the node's state is the state after exactly 8 tokens
        cache.sanity_check()
        cache.check_slot_accounting()
        self.assertEqual(cache.mamba_pool.available_size(), 16 - 1)

    def test_overlap_finish_does_not_read_the_other_entry(self):
        cache, sim, r = self._two_checkpoints("checkpoint")
        self.assertEqual(cache.checkpoint(r, up_to=10, finished=True), 0)
        self.assertEqual(cache.nodes(), [])
        sim.release(r, checkpoint=False)
        cache.sanity_check()
        cache.check_slot_accounting()
        self.assertEqual(cache.mamba_pool.available_size(), 16)

    def test_without_an_older_checkpoint_nothing_is_inserted(self):
        cache, sim, r = self._two_checkpoints("working")
        r.mamba_prev_track_seqlen = None
        self.assertEqual(cache.checkpoint(r, up_to=10, finished=True), 0)
        self.assertEqual(cache.nodes(), [])
        sim.release(r, checkpoint=False)
        cache.check_slot_accounting()


    def test_overlap_finish_state(self):
        """``finish_state="overlap"``: the working slot at the committed length (SGLang
        commits the step it still runs for a request finishing under overlap); a stop
        below the newest checkpoint never reads the older entry."""
        cache, sim, r = self._two_checkpoints("overlap")
        working = r.mamba_pool_idx
        self.assertEqual(cache.checkpoint(r, up_to=12, finished=True), 12)
        self.assertEqual([(n.seq_len, n.mamba_value) for n in cache.nodes()], [(12, working)])
        sim.release(r, checkpoint=False)
        sim.check_tree()  # the state after exactly 12 tokens
        cache.check_slot_accounting()
        self.assertEqual(cache.mamba_pool.available_size(), 16 - 1)

        cache, sim, r = self._two_checkpoints("overlap")
        self.assertEqual(cache.checkpoint(r, up_to=10, finished=True), 0)  # not the older entry
        self.assertEqual(cache.nodes(), [])
        sim.release(r, checkpoint=False)
        cache.check_slot_accounting()


class TestFinishWithWorkingLen(unittest.TestCase):
    """``CacheReq.mamba_working_len``: the deferred speculative verify replays a finishing
    request to exactly ``prompt + output[:-1]`` while the KV of drafts accepted past the stop
    stays committed; the working slot then goes into the tree at that length."""

    def _finished_at(self, working_len):
        cache = make_cache(kv_size=256, mamba_size=16)
        sim = SimModel(cache)
        r = CacheReq(rid="r", token_ids=seq(12))
        self.assertTrue(sim.admit(r))
        self.assertTrue(sim.extend_kv(r, 12))
        sim.forward(r, 12)  # KV of 12 tokens committed
        sim._write_state(r.mamba_pool_idx, r.token_ids[:10])  # the replay stopped at 10
        r.mamba_working_len = working_len
        return cache, sim, r

    def test_working_slot_at_its_own_length(self):
        cache, sim, r = self._finished_at(10)
        self.assertEqual(cache.checkpoint(r, up_to=10, finished=True), 10)
        sim.release(r, checkpoint=False)
        sim.check_tree()  # the state of exactly 10 tokens
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_without_it_the_working_slot_is_not_taken(self):
        # kv_committed_len (12) != 10: the working slot is not a state of 10 tokens
        cache, sim, r = self._finished_at(None)
        self.assertEqual(cache.checkpoint(r, up_to=10, finished=True), 0)
        sim.release(r, checkpoint=False)
        cache.check_slot_accounting()

if __name__ == "__main__":
    unittest.main()
