"""int8 checkpoints in the core (issue 26, ``docs/design.md``, "int8 checkpoints"): the
quantizer's error bound, the pool's store / load round trip, the error against the
reference recurrence of the tiny model over a long continuation from a dequantized state,
and the tree keeping its states in the checkpoint pool (hits, eviction when the pool is full,
slot accounting of both pools)."""

import os
import tempfile
import unittest

import torch

from cache_sim import SimModel, make_cache
from sglang_mamba_ext.mem_cache import CacheReq, HybridReqToTokenPool, Int8CheckpointPool, KVSlotAllocator, MambaPool
from sglang_mamba_ext.mem_cache import MambaRadixCache, RadixKey
from sglang_mamba_ext.mem_cache.checkpoint_pool import (
    QMAX,
    copy_on_write,
    dequantize_int8,
    int8_slots_at_equal_bytes,
    quantize_int8,
)

#: Continuation length (tokens) the reference comparison decodes after the cached prefix.
CONTINUATION = 96
#: Stated tolerances of one int8 round trip on the tiny model (docs/flags.md): largest
#: next-token log-probability error over the continuation, and relative state error.
LOGPROB_TOL = 2e-2
STATE_REL_TOL = 2e-2


class TestQuantizer(unittest.TestCase):
    def test_error_is_at_most_half_a_step_per_channel(self):
        g = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.float16):
            x = (torch.randn(3, 4, 16, 8, generator=g) * torch.rand(3, 4, 1, 8, generator=g) * 5).to(dtype)
            q, scale = quantize_int8(x)
            self.assertEqual(q.dtype, torch.int8)
            self.assertEqual(tuple(scale.shape), (3, 4, 1, 8))
            self.assertEqual(scale.dtype, dtype)
            self.assertLessEqual(int(q.abs().max()), QMAX)
            back = dequantize_int8(q, scale, torch.float32)
            step = scale.float()
            err = (back - x.float()).abs()
            # half a step, plus the rounding of the stored scale's product in ``dtype``
            self.assertTrue(bool((err <= 0.5 * step + 1e-6).all()), f"{dtype}: max err/step {float((err / step).max())}")
            # the largest entry of each channel is exact to its scale's precision
            amax = x.float().abs().amax(dim=-2, keepdim=True)
            self.assertTrue(torch.allclose(back.abs().amax(dim=-2, keepdim=True), amax, rtol=2e-3 if dtype == torch.float16 else 1e-6))

    def test_zero_state_round_trips_to_zero(self):
        q, scale = quantize_int8(torch.zeros(2, 4, 3))
        self.assertTrue(bool((dequantize_int8(q, scale, torch.float32) == 0).all()))


class TestInt8CheckpointPool(unittest.TestCase):
    def setUp(self):
        self.active = MambaPool(4, 2, (6, 3), (2, 8, 4), dtype=torch.float32)
        g = torch.Generator().manual_seed(1)
        self.active.temporal_state.copy_(torch.randn(self.active.temporal_state.shape, generator=g))
        self.active.conv_state.copy_(torch.randn(self.active.conv_state.shape, generator=g))
        self.ckpt = Int8CheckpointPool(3, self.active)

    def test_bytes_per_state(self):
        # int8 data + one float32 scale per (head, last-axis channel) + the float32 conv window
        per_layer = 2 * 8 * 4 + 4 * 2 * 1 * 4 + 4 * 6 * 3
        self.assertEqual(self.ckpt.slot_bytes(), 2 * per_layer)
        self.assertEqual(self.active.slot_bytes(), 2 * (4 * 2 * 8 * 4 + 4 * 6 * 3))
        # at the bytes of 16 float32 states
        self.assertEqual(int8_slots_at_equal_bytes(self.active, 16), (16 * self.active.slot_bytes()) // self.ckpt.slot_bytes())

    def test_store_then_load_into_another_slot(self):
        a = self.active
        want_t = a.temporal_state[:, 2].clone()
        want_c = a.conv_state[:, 2].clone()
        self.ckpt.store_from_active(a, [2], [3])
        a.temporal_state[:, 4] = 0
        copy_on_write(a, self.ckpt, [3], [4])
        self.assertTrue(torch.equal(a.conv_state[:, 4], want_c))  # conv window: exact
        step = want_t.abs().amax(dim=-2, keepdim=True) / QMAX
        self.assertTrue(bool(((a.temporal_state[:, 4] - want_t).abs() <= 0.5 * step + 1e-7).all()))
        self.assertFalse(torch.equal(a.temporal_state[:, 4], want_t))  # it really went through int8

    def test_mismatched_slot_lists_are_refused(self):
        with self.assertRaisesRegex(ValueError, "2 sources for 1 destinations"):
            self.ckpt.store_from_active(self.active, [1, 2], [1])
        with self.assertRaisesRegex(ValueError, "must be >= 1"):
            Int8CheckpointPool(0, self.active)


class TestAgainstReferenceRecurrence(unittest.TestCase):
    """A 200-token prompt prefilled by the tiny model's torch reference, its linear layers'
    states stored int8 and loaded back, then ``CONTINUATION`` greedy tokens decoded from the
    exact and from the dequantized state (same tokens fed to both)."""

    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.models.tiny_builder import build_tiny_model
        from sglang_mamba_ext.models.tiny_hybrid import TinyHybridReference

        cls.tmp = tempfile.TemporaryDirectory()
        path = build_tiny_model(os.path.join(cls.tmp.name, "tiny"), seed=0)
        cls.model = TinyHybridReference.from_pretrained(path).eval()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_continuation_from_an_int8_state(self):
        model = self.model
        g = torch.Generator().manual_seed(2)
        prompt = torch.randint(5, model.config.vocab_size, (200,), generator=g).tolist()
        with torch.no_grad():
            logits, exact = model.prefill(prompt)
            layers = sorted(exact.temporal)
            shape = exact.temporal[layers[0]].shape
            active = MambaPool(2, len(layers), tuple(exact.conv[layers[0]].shape), tuple(shape))
            for j, i in enumerate(layers):
                active.temporal_state[j, 1] = exact.temporal[i]
                active.conv_state[j, 1] = exact.conv[i]
            ckpt = Int8CheckpointPool(1, active)
            ckpt.store_from_active(active, [1], [1])
            copy_on_write(active, ckpt, [1], [2])
            approx = exact.clone()
            for j, i in enumerate(layers):
                approx.temporal[i] = active.temporal_state[j, 2].clone()
                approx.conv[i] = active.conv_state[j, 2].clone()
            first = max(
                float((approx.temporal[i] - exact.temporal[i]).norm() / exact.temporal[i].norm()) for i in layers
            )
            nxt = int(logits[-1].argmax())
            worst_lp, worst_state, same = 0.0, 0.0, 0
            for _ in range(CONTINUATION):
                le, exact = model.decode_step(nxt, exact)
                la, approx = model.decode_step(nxt, approx)
                worst_lp = max(worst_lp, float((le.log_softmax(-1) - la.log_softmax(-1)).abs().max()))
                worst_state = max(
                    worst_state,
                    max(float((approx.temporal[i] - exact.temporal[i]).norm() / exact.temporal[i].norm()) for i in layers),
                )
                same += int(int(le.argmax()) == int(la.argmax()))
                nxt = int(le.argmax())
        print(f"int8 round trip: state rel err {first:.2e}, worst along continuation {worst_state:.2e}, logprob err {worst_lp:.2e}")
        self.assertGreater(first, 0.0)  # the state really went through int8
        self.assertLess(first, STATE_REL_TOL)
        # the error does not grow along the continuation (gated decay forgets it)
        self.assertLess(worst_state, STATE_REL_TOL)
        self.assertLess(worst_lp, LOGPROB_TOL, f"next-token logprob error {worst_lp}")
        self.assertEqual(same, CONTINUATION, "greedy tokens differ from the exact state's")


class TestTreeWithInt8Checkpoints(unittest.TestCase):
    """The tree keeps quantized states: each stored state takes a checkpoint slot and gives
    its active slot back; a hit dequantizes; a full checkpoint pool evicts its LRU state."""

    def make(self, ckpt_size=3):
        kv = KVSlotAllocator(512, 1)
        active = MambaPool(8, 1, (3, 2), (2, 4, 4), dtype=torch.float32)
        ckpt = Int8CheckpointPool(ckpt_size, active)
        pool = HybridReqToTokenPool(4, 256, active, track_slots_per_req=0, mamba_ckpt_pool=ckpt)
        return MambaRadixCache(kv, pool, mamba_track_interval=4), active, ckpt

    def insert(self, cache, tokens, value):
        active = cache.mamba_pool
        slot = active.alloc_list(1)[0]
        active.temporal_state[:, slot] = value
        kv = cache.token_to_kv_pool_allocator.alloc(len(tokens))
        res = cache.insert(RadixKey(tokens), kv, slot)
        self.assertFalse(res.mamba_exist)
        return res

    def test_store_hit_and_evict(self):
        cache, active, ckpt = self.make(ckpt_size=3)
        for i in range(3):
            self.insert(cache, [i] * 8 + [9], float(i + 1))
        self.assertEqual(active.available_size(), active.size)  # every active slot given back
        self.assertEqual(ckpt.available_size(), 0)
        self.assertEqual(cache.mamba_total_size(), 3)
        # a fourth state evicts the least recently used one (prompt 0)
        self.insert(cache, [3] * 8 + [9], 4.0)
        self.assertEqual(cache.mamba_total_size(), 3)
        self.assertEqual(cache.match_prefix(RadixKey([0] * 8 + [9, 1])).prefix_len, 0)
        req = CacheReq("r", [2] * 8 + [9, 1])
        m = cache.match_prefix(RadixKey(req.token_ids[:9]), cow_mamba=True, req=req)
        self.assertEqual(m.prefix_len, 9)
        self.assertEqual(req.mamba_cow_src_index, m.last_node.mamba_value)
        self.assertFalse(ckpt.is_free(req.mamba_cow_src_index))
        copy_on_write(active, ckpt, [req.mamba_cow_src_index], [req.mamba_pool_idx])
        self.assertTrue(torch.allclose(active.temporal_state[:, req.mamba_pool_idx], torch.full((1, 2, 4, 4), 3.0)))
        cache.on_release(req)
        cache.check_slot_accounting()
        cache.sanity_check()

    def test_full_pool_of_locked_states_refuses_insert(self):
        cache, active, ckpt = self.make(ckpt_size=1)
        res = self.insert(cache, [1] * 4, 1.0)
        cache.inc_lock_ref(res.last_node)
        slot = active.alloc_list(1)[0]
        kv = cache.token_to_kv_pool_allocator.alloc(4)
        with self.assertRaisesRegex(RuntimeError, "--int8-mamba-ckpt-size"):
            cache.insert(RadixKey([2] * 4), kv, slot)
        cache.dec_lock_ref(res.last_node)

    def test_requests_through_the_sim(self):
        # a finished request's state goes in int8; a resend of its prompt hits len - 1
        cache = make_cache(mamba_size=8, track_slots=2, ckpt_size=4, branch_checkpoints=True)
        sim = SimModel(cache)
        prompt = list(range(1, 30))
        for rid in ("a", "b"):
            req = CacheReq(rid, list(prompt))
            self.assertTrue(sim.admit(req, prompt_len=len(prompt)))
            if rid == "b":
                self.assertEqual(req.cache_protected_len, len(prompt) - 1)
            sim.extend_kv(req, len(prompt))
            sim.forward(req, len(prompt) - req.kv_committed_len)
            sim.release(req)
        sim.check_tree()
        cache.check_slot_accounting()
        self.assertEqual(cache.mamba_pool.available_size(), cache.mamba_pool.size)
        self.assertGreater(cache.mamba_total_size(), 0)


if __name__ == "__main__":
    unittest.main()
