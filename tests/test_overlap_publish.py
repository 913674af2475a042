"""``plugin/overlap_publish.py`` (issue 38): under overlap scheduling the prompts a launched
prefill batch completed go into the tree when the next batch is scheduled, before their result
is processed, so a request admitted in that next batch matches them (as SGLang does for a
chunked request's finished chunk). Through SGLang's own scheduler functions on the plugin's
pool and cache (the harness of ``test_sglang_glue``), page size 1."""

import unittest
from types import SimpleNamespace

import sglang_glue_fixtures as F
from test_sglang_glue import KV_SIZE, _ContextTest, _Harness, state_value

SYS = list(range(10, 50))  # 40 shared tokens
A = SYS + [60, 61, 62, 63, 64, 65]  # 46 tokens: its planned prompt - 1 checkpoint at 45
B = A[:-1] + [70, 71, 72]  # branches off A after 45 tokens


class _OverlapCase(_ContextTest):
    def setUp(self):
        super().setUp()
        self.pool = F.build_req_pool(max_num_reqs=4)
        self.pool.prefix_checkpoint_writer = True  # the tiny model's backend: any token
        self.cache, self.allocator = F.build_tree_cache(self.pool, KV_SIZE)
        self.h = _Harness(self, self.pool, self.cache, self.allocator)

    def _launched(self, rid, tokens):
        """A request admitted and prefilled in one chunk whose result is not processed."""
        req = F.make_req(rid, tokens)
        self.h.admit(req)
        self.h.forward_extend(req, len(tokens), process_result=False)
        return req

    def _publish(self, last_batch, **scheduler):
        from sglang_mamba_ext.plugin.overlap_publish import publish_launched_prefill_before

        sched = SimpleNamespace(tree_cache=self.cache, result_queue=[object()], chunked_req=None,
                                disaggregation_mode="DisaggregationMode.NULL")
        for k, v in scheduler.items():
            setattr(sched, k, v)
        self.assertIsNone(publish_launched_prefill_before(sched, None, last_batch=last_batch))

    @staticmethod
    def _batch(reqs, mode="EXTEND"):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        return SimpleNamespace(forward_mode=getattr(ForwardMode, mode), spec_algorithm=SpeculativeAlgorithm.NONE,
                               reqs=reqs)


class TestOverlapPublish(_OverlapCase):
    def test_next_batch_matches_the_launched_prompt(self):
        h = self.h
        a = self._launched("a", A)
        self.assertEqual(self.cache.core.total_size(), 0)  # nothing inserted yet
        self._publish(self._batch([a]))
        # what the result processor would insert: the prompt up to its newest state
        states = sorted(n.seq_len for n in self.cache.core.nodes() if n.mamba_value is not None)
        self.assertEqual(states, [len(A) - 1])
        self.assertEqual(self.cache.core.total_size(), len(A) - 1)
        self.assertEqual(a.kv.cache_protected_len, len(A) - 1)
        self.assertEqual(a.prefix_len, 0)  # the result processor advances it
        h.check_tree_states()
        # the ping-pong slots went back once the prompt was in (the finish takes the working state)
        self.assertEqual([int(s) for s in a.kv.mamba_ping_pong_track_buffer], [-1, -1])
        # a request admitted in the next batch resumes from that state (0 without the hook)
        b = F.make_req("b", B)
        h.admit(b)
        self.assertEqual(b.prefix_len, len(A) - 1)
        self.assertEqual(h.state_of(int(b.kv.mamba_cow_src_index[0])), state_value(A[:-1]))
        # then A's result is processed: nothing more to insert
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        checkpoint_kv_cache(a, self.cache)
        self.assertEqual(self.cache.core.total_size(), len(A) - 1)
        self.assertEqual(a.prefix_len, len(A))
        h.prefill(b)
        h.decode(a, [1, 2, 3])
        h.decode(b, [4, 5])
        h.finish(a)
        h.finish(b)
        h.check_tree_states()
        h.check_idle()

    def test_nothing_published_outside_its_case(self):
        """Not the overlap loop (no result pending), a decode or mixed batch, a chunked
        request (SGLang stashes it), a request about to finish, another tree cache."""
        a = self._launched("a", A)
        self._publish(self._batch([a]), result_queue=[])
        self._publish(self._batch([a], "DECODE"))
        self._publish(self._batch([a], "MIXED"))
        self._publish(self._batch([a]), chunked_req=a)
        self._publish(self._batch([a]), disaggregation_mode="DisaggregationMode.PREFILL")
        self._publish(self._batch([a]), tree_cache=object())
        a.to_finish = object()
        self._publish(self._batch([a]))
        a.to_finish = None
        self.assertEqual(self.cache.core.total_size(), 0)
        self._publish(self._batch([a]))
        self.assertEqual(self.cache.core.total_size(), len(A) - 1)
        self.h.decode(a, [1, 2])
        self.h.finish(a)
        self.h.check_idle()


class TestFinishDonatedEarly(_OverlapCase):
    """``donate_finishing_decodes``: the final state of a request the in-flight decode batch
    finishes by length goes into the tree when the next batch is scheduled (its result not
    processed), so the next admission can evict it or hit it; the result's release then
    inserts nothing more and leaves nothing behind."""

    def _decode_launched(self, req):
        """One decode step launched and not processed: the newest output token's KV and
        state are computed (``kv_committed_len`` counts it), the token it samples is not
        appended yet."""
        import torch

        pos = req.kv.kv_committed_len
        kv = self.h.alloc_token_slots(self.cache, 1)
        self.pool.req_to_token[req.kv.req_pool_idx, pos] = kv.to(torch.int32)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = pos + 1
        req.refresh_fill_ids()
        self.h.write_state(int(req.kv.mamba_pool_idx), list(req.full_untruncated_fill_ids)[: pos + 1])

    def _donate(self, batch, **scheduler):
        from sglang_mamba_ext.plugin.overlap_publish import donate_finishing_decodes

        sched = SimpleNamespace(tree_cache=self.cache, result_queue=[(batch, None)], chunked_req=None,
                                enable_skip_finishing_decode=True, disaggregation_mode="DisaggregationMode.NULL")
        for k, v in scheduler.items():
            setattr(sched, k, v)
        return donate_finishing_decodes(sched, self.cache)

    def test_final_state_donated_before_the_result(self):
        h = self.h
        a = F.make_req("a", A)
        a.sampling_params.max_new_tokens = 4
        h.admit(a)
        h.prefill(a, chunk=len(A))
        h.decode(a, [1, 2, 3])  # outputs 1, 2, 3; 3 not yet fed
        self._decode_launched(a)  # feeds 3; its result (the 4th, last token) is in flight
        n = len(A) + 3
        self.assertEqual(a.kv.kv_committed_len, n)
        self.assertEqual(self._donate(self._batch([a], "DECODE")), 1)
        self.assertEqual(self.cache.finish_states_donated_early, 1)
        states = sorted(node.seq_len for node in self.cache.core.nodes() if node.mamba_value is not None)
        self.assertEqual(states, [len(A) - 1, n])
        self.assertIsNone(a.lock)
        self.assertIsNone(a.kv.mamba_pool_idx)
        self.assertEqual(self.cache.core.mamba_evictable_size(), 2)  # the final state is a candidate now
        h.check_tree_states()
        self.assertEqual(self._donate(self._batch([a], "DECODE")), 0)  # once
        # the next turn, admitted before a's result is processed, resumes from it
        b = F.make_req("b", A + [1, 2, 3, 4, 80, 81])
        h.admit(b)
        self.assertEqual(b.prefix_len, n)
        # a's result: its last token, then SGLang's release finds nothing more to insert
        a.output_ids.append(4)
        total = self.cache.core.total_size()
        h.finish(a)
        self.assertEqual(self.cache.core.total_size(), total)
        h.prefill(b)
        h.decode(b, [5, 6])
        h.finish(b)
        h.check_tree_states()
        h.check_idle()

    def test_not_donated_outside_its_case(self):
        """Not a decode batch, not finishing by length, speculative, PD, SGLang not skipping
        finishing requests (the non-overlap loop), more than one result pending."""
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        h = self.h
        a = F.make_req("a", A)
        a.sampling_params.max_new_tokens = 4
        h.admit(a)
        h.prefill(a, chunk=len(A))
        h.decode(a, [1, 2])
        self._decode_launched(a)  # 3 output tokens after it: not its last
        self.assertEqual(self._donate(self._batch([a], "DECODE")), 0)
        a.output_ids.append(3)  # its result processed
        self._decode_launched(a)  # now the 4th and last is in flight
        batch = self._batch([a], "DECODE")
        self.assertEqual(self._donate(self._batch([a], "MIXED")), 0)
        self.assertEqual(self._donate(batch, enable_skip_finishing_decode=False), 0)
        self.assertEqual(self._donate(batch, disaggregation_mode="DisaggregationMode.PREFILL"), 0)
        self.assertEqual(self._donate(batch, result_queue=[(batch, None), (batch, None)]), 0)
        spec = self._batch([a], "DECODE")
        spec.spec_algorithm = SpeculativeAlgorithm.EAGLE
        self.assertEqual(self._donate(spec), 0)
        self.assertEqual(self.cache.finish_states_donated_early, 0)
        a.output_ids.append(4)
        h.finish(a)
        h.check_tree_states()
        h.check_idle()


if __name__ == "__main__":
    unittest.main()
