"""Session-aware eviction order in the core (``--enable-session-radix-cache``,
``docs/design.md``, "Sessions"; :mod:`sglang_mamba_ext.mem_cache.session_pins`): an open
session's pinned state and its path's KV go after every unpinned entry, in the policy's
order otherwise; a new turn's pin replaces the session's pin on its path; closing the
session restores plain order."""

import unittest

import torch

from cache_sim import make_cache


def tree(prompts, mamba_size=8, **kw):
    """A cache holding each prompt (list of token lists) as its own leaf with one state,
    inserted in order (so the first is the least recently used)."""
    cache = make_cache(kv_size=128, mamba_size=mamba_size, track_slots=0, branch_checkpoints=True, **kw)
    kv, pool = cache.token_to_kv_pool_allocator, cache.mamba_pool
    nodes = []
    for p in prompts:
        m = cache.match_prefix(p)
        n = m.prefix_len
        value = torch.cat([m.device_indices, kv.alloc(len(p) - n)])
        cache.insert(p, value, mamba_value=pool.alloc_list(1)[0], prev_prefix_len=n)
        nodes.append(cache.match_prefix(p).last_node)
    return cache, nodes


A, B, C = [1] * 4, [2] * 4, [3] * 4


class TestSessionPins(unittest.TestCase):
    def test_pinned_state_goes_after_unpinned_ones(self):
        for policy in ("lru", "recompute", "adaptive"):
            with self.subTest(policy=policy):
                cache, (a, b, c) = tree([A, B, C], eviction_policy=policy, kv_bytes_per_token=64)
                self.assertIs(cache.pin_session("s", a), a)
                res = cache.evict(mamba_num=2)
                self.assertEqual(res.mamba_num_evicted, 2)
                self.assertEqual((a.removed, b.removed, c.removed), (False, True, True))
                self.assertEqual(cache.match_prefix(A + [9]).prefix_len, 4)
                cache.sanity_check()
                cache.check_slot_accounting()

    def test_pinned_path_kv_goes_last(self):
        cache, (a, b) = tree([A, B])
        cache.pin_session("s", a)
        self.assertEqual(cache.evict(num_tokens=4).num_tokens_evicted, 4)
        self.assertEqual((a.removed, b.removed), (False, True))
        cache.sanity_check()

    def test_shortfall_takes_pinned_entries(self):
        cache, (a, b) = tree([A, B])
        cache.pin_session("s", a)
        res = cache.evict(mamba_num=2)
        self.assertEqual(res.mamba_num_evicted, 2)
        self.assertTrue(a.removed and b.removed)
        self.assertEqual(cache.pinned_nodes(), [])
        self.assertEqual(cache.release_session("s"), 0)
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_new_turn_replaces_the_pin_on_its_path_and_keeps_branches(self):
        cache, (a, ab, ac) = tree([A, A + B, A + C])
        cache.pin_session("s", a)
        cache.pin_session("s", ab)  # the next turn, extending the first: replaces it
        self.assertEqual(cache.pinned_nodes(), [ab])
        cache.pin_session("s", ac)  # a branch beside it: both kept
        self.assertEqual(cache.pinned_nodes(), [ab, ac])
        self.assertEqual(cache.release_session("s"), 2)
        self.assertEqual(cache.pinned_nodes(), [])

    def test_pin_walks_up_to_a_state(self):
        cache, (ab,) = tree([A + B])
        split = cache.match_prefix(A).kv_last_node  # splits: [1]*4 holds no state
        self.assertIsNone(split.mamba_value)
        self.assertIs(cache.pin_session("s", split), None)  # no state on its path
        self.assertEqual(cache.pinned_nodes(), [])
        self.assertIs(cache.pin_session("s", ab), ab)

    def test_closed_session_evicts_in_plain_order(self):
        cache, (a, b) = tree([A, B])
        cache.pin_session("s", a)
        self.assertEqual(cache.release_session("s"), 1)
        cache.evict(mamba_num=1)
        self.assertEqual((a.removed, b.removed), (True, False))

    def test_reset_drops_pins(self):
        cache, (a,) = tree([A])
        cache.pin_session("s", a)
        cache.reset()
        self.assertEqual(cache.pinned_nodes(), [])


class TestRadixSessionsProtocol(unittest.TestCase):
    """The adapter's side (``plugin/sessions.py``, :class:`RadixSessions`): SGLang's
    ``open_radix_session`` / ``ensure_session_generation`` / ``release_radix_session`` and
    the pin of a finished turn, which only the session's current incarnation makes."""

    def setUp(self):
        from types import SimpleNamespace

        from sglang_mamba_ext.plugin.sessions import RadixSessions

        self.cache, (self.a, self.b) = tree([A, B])
        self.sessions = RadixSessions(self.cache)
        self.req = lambda sid, gen, reason=None: SimpleNamespace(
            session=None, session_id=sid, session_generation=gen, finished_reason=reason)

    def test_current_incarnation_pins_and_close_unpins(self):
        gen = self.sessions.open("s")
        self.assertEqual(self.sessions.generation("s"), gen)
        self.sessions.pin_finished(self.req("s", gen), self.a)
        self.assertEqual(self.cache.pinned_nodes(), [self.a])
        self.assertEqual(self.sessions.close("s"), 1)
        self.assertEqual(self.cache.pinned_nodes(), [])
        self.assertEqual(self.sessions.close("s"), 0)  # closing twice is a no-op

    def test_stale_closed_aborted_and_sessionless_turns_pin_nothing(self):
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        old = self.sessions.open("s")
        self.sessions.close("s")
        self.sessions.pin_finished(self.req("s", old), self.a)  # finished after the close
        new = self.sessions.generation("s")  # a late request reopens: a new incarnation
        self.assertNotEqual(new, old)
        self.sessions.pin_finished(self.req("s", old), self.a)  # an earlier incarnation's turn
        self.sessions.pin_finished(self.req("s", new, FINISH_ABORT()), self.a)
        self.sessions.pin_finished(self.req(None, None), self.a)
        self.assertEqual(self.cache.pinned_nodes(), [])
        self.sessions.pin_finished(self.req("s", new), self.b)
        self.assertEqual(self.cache.pinned_nodes(), [self.b])


if __name__ == "__main__":
    unittest.main()
