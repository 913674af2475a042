"""The decode side of PD disaggregation with the plugin (``plugin/pd_decode.py``), against
real SGLang 0.5.23 objects on CPU (no server; the served path is
``tests/e2e/test_pd_decode_cache.py``):

- ``--disaggregation-mode decode --disaggregation-decode-enable-radix-cache`` parses with
  ``--enable-mamba-radix`` and the decode pool builder gives the plugin's pool with the
  pre-allocated rows; SGLang's own decode pool without the flag;
- a decode request's life as ``DecodePreallocQueue`` runs it (SGLang's own
  ``_match_prefix_and_lock`` through the hook, the pool's ``alloc``, the received prompt,
  decode steps, ``release_kv_cache``): the finished request's path stays in the tree, the
  next turn matches it exactly, and no staged state copy or clear is left on the request
  (sglang #32995); a transfer failure after the match gives every row, SSM slot and KV slot
  back; tenants do not share decode-side prefixes;
- the transfer counters behind ``/server_info``.
"""

import contextlib
import inspect
import unittest
from types import SimpleNamespace

import torch

import sglang_glue_fixtures as F

DECODE = ("--disaggregation-mode", "decode", "--disaggregation-decode-enable-radix-cache")


def _configurator():
    from transformers import AutoConfig

    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    hf = AutoConfig.from_pretrained(F.tiny_model_dir())
    conf = object.__new__(KVCacheConfigurator)
    conf.mambaish_config = hf
    conf.layer_info = SimpleNamespace(start_layer=0, end_layer=hf.num_hidden_layers)
    conf.model_config = SimpleNamespace(context_len=256)
    conf.device = "cpu"
    conf.hybrid_kda_config = None
    conf.hybrid_gdn_config = None
    return conf


def _decode_pool(max_num_reqs=4, pre_alloc_size=3):
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    return KVCacheConfigurator._build_hybrid_mamba_decode_req_pool(
        _configurator(), max_num_reqs=max_num_reqs, extra_max_context_len=0, pre_alloc_size=pre_alloc_size)


class TestDecodeFlagsAndPool(unittest.TestCase):
    def test_decode_with_sglangs_switch_parses(self):
        sa = F.parse_args(F.base_argv("--enable-mamba-radix", *DECODE))
        self.assertEqual(sa.disaggregation_mode, "decode")
        self.assertEqual(sa.radix_cache_backend, "mamba_radix_ext")
        self.assertFalse(sa.disable_radix_cache)

    def test_plugin_pool_with_pre_allocated_rows(self):
        from sglang_mamba_ext.plugin.pool import MambaRadixReqToTokenPool

        F.apply_plugin_hooks()
        ctx, _ = F.scheduler_context(F.base_argv("--enable-mamba-radix", *DECODE))
        with F.in_context(ctx):
            pool = _decode_pool(4, 3)
        self.assertIsInstance(pool, MambaRadixReqToTokenPool)
        self.assertEqual(pool.available_size(), 4 + 3)
        # as SGLang's decode pool: running rows and in-flight rows (its idle leak check)
        self.assertEqual((pool.size, pool.pre_alloc_size), (4, 3))

    def test_sglangs_decode_pool_without_the_flag(self):
        from sglang.srt.disaggregation.decode import HybridMambaDecodeReqToTokenPool

        F.apply_plugin_hooks()
        ctx, _ = F.scheduler_context(F.base_argv(*DECODE))
        with F.in_context(ctx):
            pool = _decode_pool(4, 3)
        self.assertIs(type(pool), HybridMambaDecodeReqToTokenPool)


class TestDecodeRequestLife(unittest.TestCase):
    def setUp(self):
        F.apply_plugin_hooks()
        ctx, _ = F.scheduler_context(F.base_argv("--enable-mamba-radix", *DECODE))
        stack = contextlib.ExitStack()
        stack.enter_context(F.in_context(ctx))
        self.addCleanup(stack.close)
        self.pool = _decode_pool(4, 3)
        self.cache, self.alloc = F.build_tree_cache(self.pool, 1024)
        from sglang.srt.disaggregation.decode import DecodePreallocQueue
        from sglang.srt.disaggregation.decode_hicache_mixin import DecodeHiCachePreallocMixin

        q = SimpleNamespace(tree_cache=self.cache, scheduler=SimpleNamespace(enable_decode_hicache=False),
                            _uses_swa_tail_prealloc=lambda: False)
        q._build_decode_prefix_match = (
            lambda req, result, max_prefix_len=None: DecodeHiCachePreallocMixin._build_decode_prefix_match(
                q, req, result, max_prefix_len=max_prefix_len))
        self.queue = q
        self.match = lambda req: DecodePreallocQueue._match_prefix_and_lock(q, req)

    def free_counts(self):
        return (self.pool.available_size(), self.pool.core_mamba_pool.available_size() + self.cache.core.mamba_evictable_size(),
                self.alloc.available_size() + self.cache.core.full_evictable_size())

    def admit(self, req):
        """``DecodePreallocQueue``'s steps up to the transfer: match and lock, row and slots,
        KV slots for the prompt past the prefix. Returns the decode prefix length."""
        m = self.match(req)
        self.assertIsNone(req.kv.mamba_cow_src_index, "a staged copy would overwrite the received state")
        self.assertFalse(req.kv.mamba_needs_clear)
        prefix = m.decode_prefix_len
        from sglang_mamba_ext.plugin.pd_decode import pre_alloc_around

        # DecodePreallocQueue._pre_alloc's pool call, through the plugin's hook on it
        pre_alloc_around(lambda q, r: self.pool.alloc([r]), self.queue, req)
        self.assertIsNotNone(req.kv.mamba_pool_idx)  # the slot the transfer fills
        self.assertIsNone(req.kv.mamba_cow_src_index)
        self.assertFalse(req.kv.mamba_needs_clear, "a staged clear would zero the received state")
        n = len(req.origin_input_ids)
        row = req.kv.req_pool_idx
        if prefix:
            self.pool.write((row, slice(0, prefix)), m.prefix_indices)
        self.pool.req_to_token[row, prefix:n] = self.alloc.alloc(n - prefix).to(torch.int32)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = n
        req.kv.cache_protected_len = prefix
        req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids
        req.prefix_len = prefix
        req.extend_end = n
        return prefix

    def decode_and_finish(self, req, new_tokens):
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        row = req.kv.req_pool_idx
        for i, tok in enumerate(new_tokens):
            req.output_ids.append(tok)
            if i == len(new_tokens) - 1:
                break
            pos = req.kv.kv_committed_len
            self.pool.req_to_token[row, pos] = self.alloc.alloc(1).to(torch.int32)
            req.kv.kv_allocated_len = req.kv.kv_committed_len = pos + 1
            req.refresh_fill_ids()
        req.finished_reason = FINISH_LENGTH(len(req.output_ids))
        release_kv_cache(req, self.cache, checkpoint=True)

    def turn(self, rid, ids, out, salt=None):
        req = F.make_req(rid, ids, max_new_tokens=len(out), cache_salt=salt)
        prefix = self.admit(req)
        self.decode_and_finish(req, out)
        return prefix

    def test_turns_hit_what_the_decode_side_finished(self):
        before = self.free_counts()
        ids1 = list(range(3, 48))
        out1 = [100 + i for i in range(8)]
        self.assertEqual(self.turn("t1", ids1, out1), 0)
        ids2 = ids1 + out1 + list(range(500, 512))
        # the finished turn's path up to its last KV (prompt + output - 1), with its state
        self.assertEqual(self.turn("t2", ids2, [200 + i for i in range(8)]), len(ids1) + len(out1) - 1)
        ids3 = ids2 + [200 + i for i in range(8)] + list(range(600, 610))
        self.assertEqual(self.turn("t3", ids3, [300]), len(ids2) + 8 - 1)
        self.assertEqual(self.cache.core.full_protected_size(), 0)
        self.assertEqual(self.cache.core.mamba_protected_size(), 0)
        self.assertEqual(self.free_counts(), before)

    def test_tenants_apart(self):
        ids1, out1 = list(range(3, 40)), [100 + i for i in range(6)]
        ids2 = ids1 + out1 + [7, 8, 9]
        self.assertEqual(self.turn("a1", ids1, out1, salt="a"), 0)
        self.assertEqual(self.turn("b2", ids2, [1, 2], salt="b"), 0)
        self.assertEqual(self.turn("n2", ids2, [1, 2]), 0)
        self.assertEqual(self.turn("a2", ids2, [1, 2], salt="a"), len(ids1) + len(out1) - 1)

    def test_no_planned_checkpoint_on_the_decode_side(self):
        # The pool's alloc plans prefix checkpoints (prompt length - 1, the branch point) for
        # the forward of a prefill to write; a decode-side request runs no forward over its
        # prompt, so planned slots would enter the tree at its finish holding whatever they
        # held before (a resend of the same prompt then "hit" len - 1 on a stale state).
        # The pre-alloc hook frees them: the resend hits only the previous turn's finish.
        self.pool.prefix_checkpoint_writer = True  # as the server's backends set it
        ids1, out1 = list(range(3, 40)), [100 + i for i in range(6)]
        self.turn("p1", ids1, out1)
        ids2 = ids1 + out1 + [5, 6, 7, 8]
        req = F.make_req("p2", ids2, max_new_tokens=3)
        self.admit(req)
        self.assertEqual(self.pool.prefix_checkpoints, {}, "no planned checkpoint on a decode-side request")
        self.decode_and_finish(req, [1, 2, 3])
        self.assertEqual(self.turn("p3", ids2, [4]), len(ids1) + len(out1) - 1)
        self.assertEqual(self.cache.core.mamba_protected_size(), 0)

    def test_transfer_failure_after_match_frees_everything(self):
        from sglang.srt.mem_cache.common import release_kv_cache

        ids1, out1 = list(range(3, 40)), [100 + i for i in range(6)]
        self.turn("t1", ids1, out1)
        before = self.free_counts()
        req = F.make_req("t2", ids1 + out1 + [5, 6], max_new_tokens=4)
        self.assertEqual(self.admit(req), len(ids1) + len(out1) - 1)
        self.assertGreater(self.cache.core.full_protected_size(), 0)  # the hit is locked
        # DecodeTransferQueue / handle_failed_transfer: released without insert
        release_kv_cache(req, self.cache, checkpoint=False)
        self.assertEqual(self.cache.core.full_protected_size(), 0)
        self.assertEqual(self.cache.core.mamba_protected_size(), 0)
        self.assertEqual(self.free_counts(), before)


class TestDecodeHostTierRestoreGate(unittest.TestCase):
    """``--enable-hierarchical-cache`` on the decode server: SGLang gates each transfer on a
    host-tier restore status that its ``_process_hicache_local_restores`` moves on only for
    a tree with a cache controller; the plugin's tree loads host KV inside its match, so the
    hook marks the requests ready (``plugin/pd_decode.py``)."""

    def test_ready_under_the_plugin_pending_under_sglangs_method(self):
        from sglang.srt.disaggregation.decode_hicache_mixin import (
            DecodeHiCacheTransferMixin, DecodePrefixMatch, HiCacheRestoreGatedKVReceiver, HiCacheRestoreResult)
        from sglang.srt.disaggregation.base import KVPoll

        from sglang_mamba_ext.plugin import pd_decode

        F.apply_plugin_hooks()
        ctx, _ = F.scheduler_context(F.base_argv("--enable-mamba-radix", *DECODE, "--enable-hierarchical-cache"))
        original = inspect.unwrap(DecodeHiCacheTransferMixin._process_hicache_local_restores)

        def reqs():
            device_hit = DecodePrefixMatch(prefix_indices=torch.arange(5), l2_host_hit_length=0,
                                           l3_storage_hit_length=0, last_device_node=None)
            return [SimpleNamespace(hicache_restore_status=HiCacheRestoreResult.PENDING, prefix_match=m,
                                    hicache_load_consumer_index=-1, req=SimpleNamespace(rid=f"r{i}"),
                                    kv_receiver=SimpleNamespace(poll=lambda: KVPoll.Success))
                    for i, m in enumerate((None, device_hit))]

        from sglang_mamba_ext.plugin.cache import MambaRadixCacheAdapter

        self.assertFalse(hasattr(MambaRadixCacheAdapter, "is_load_back_event_done"))
        queue = SimpleNamespace(tree_cache=object())  # as the plugin's tree: no is_load_back_event_done
        with F.in_context(ctx):
            stuck = reqs()
            original(queue, stuck)  # SGLang's method alone: the transfers would wait forever
            self.assertEqual([HiCacheRestoreGatedKVReceiver(dr).poll() for dr in stuck], [KVPoll.Transferring] * 2)
            served = reqs()
            pd_decode.process_hicache_local_restores_around(original, queue, served)
            self.assertEqual([dr.hicache_restore_status for dr in served], [HiCacheRestoreResult.READY] * 2)
            self.assertEqual([HiCacheRestoreGatedKVReceiver(dr).poll() for dr in served], [KVPoll.Success] * 2)
            # a host or storage hit (never reported by the plugin's tree) fails its transfer
            host_hit = reqs()[1]
            host_hit.prefix_match.l2_host_hit_length = 3
            pd_decode.process_hicache_local_restores_around(original, queue, [host_hit])
            self.assertEqual(host_hit.hicache_restore_status, HiCacheRestoreResult.FAILED)


class TestSglangDecodePathUnchanged(unittest.TestCase):
    def test_what_the_hooks_rely_on(self):
        # When one of these fails, SGLang's decode path changed: re-read plugin/pd_decode.py.
        import inspect

        from sglang.srt.disaggregation.decode import DecodePreallocQueue
        from sglang.srt.disaggregation import prefill

        match = inspect.getsource(inspect.unwrap(DecodePreallocQueue._match_prefix_and_lock))
        self.assertIn("cow_mamba=self.tree_cache.supports_mamba()", match)
        pre = inspect.getsource(inspect.unwrap(DecodePreallocQueue._pre_alloc))
        self.assertIn("self.req_to_token_pool.alloc([req])", pre)
        # the prefill server starts sending KV at decode_prefix_len (the state: whole)
        src = inspect.getsource(prefill)
        self.assertIn("decode_prefix_len = req.disagg_kv_sender.pop_decode_prefix_len()", src)
        self.assertIn("req.start_send_idx = decode_prefix_len", src)


class TestTransferCounters(unittest.TestCase):
    def test_counted_and_forwarded(self):
        from sglang_mamba_ext.plugin import pd_decode

        cache = SimpleNamespace(server_info=lambda: {})
        queue = SimpleNamespace(tree_cache=cache)
        seen = []

        def original(q, decode_req, kv_indices, page_size, state_indices=None, **kw):
            seen.append((len(kv_indices), page_size, kw))
            return "sent"

        F.apply_plugin_hooks()
        ctx, _ = F.scheduler_context(F.base_argv("--enable-mamba-radix", *DECODE))
        with F.in_context(ctx):
            self.assertEqual(pd_decode.send_kv_metadata_around(
                original, queue, None, torch.arange(10), 1, [torch.tensor([3])], decode_prefix_len=44), "sent")
            pd_decode.send_kv_metadata_around(original, queue, None, torch.arange(54), 1, [None], decode_prefix_len=0)
        self.assertEqual(seen[0], (10, 1, {"decode_prefix_len": 44}))
        info = pd_decode.server_info_fields(cache, kv_bytes_per_token=8, state_bytes=100)
        self.assertEqual(info, {"pd_decode_transfers": 2, "pd_decode_prefix_tokens": 44,
                                "pd_decode_kv_tokens_received": 64, "pd_decode_states_received": 1,
                                "pd_decode_bytes_received": 64 * 8 + 100})


if __name__ == "__main__":
    unittest.main()
