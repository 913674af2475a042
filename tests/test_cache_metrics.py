"""The hybrid cache's counters and their export (issue 11, item 6; ``docs/design.md``,
"Metrics"): the core's :class:`~sglang_mamba_ext.mem_cache.stats.CacheStats` (exact amounts
on the ``cache_sim`` oracle), the adapter's admission counting through SGLang's own
scheduler functions (a request matched twice before it gets its row counts once), the
Prometheus series (``plugin/metrics.py``, a private registry), the warm-up counters and the
``mamba_radix`` entry of ``/server_info``."""

import contextlib
import unittest
from types import SimpleNamespace

from cache_sim import SimModel, make_cache
from sglang_mamba_ext.mem_cache import CacheReq, RadixKey
from sglang_mamba_ext.mem_cache.stats import STATE_ORIGINS

SYS = list(range(1000, 1040))  # a 40-token shared prefix


def user(i, n=6):
    return [2000 + 100 * i + k for k in range(n)]


class _Core(unittest.TestCase):
    def setUp(self):
        # Track interval far beyond the prompts: no ping-pong checkpoint unless a chunk ends.
        self.cache = make_cache(kv_size=512, mamba_size=32, branch_checkpoints=True, mamba_track_interval=256)
        self.sim = SimModel(self.cache)

    def run_req(self, tokens, output, rid, chunk=None):
        """A whole request; its admission match is counted as the adapter counts it."""
        cache = self.cache
        req = CacheReq(rid=rid, token_ids=list(tokens))
        self.assertTrue(self.sim.admit(req))
        cache.count_hit(*cache.hit_of(len(tokens), self.sim.last_match))
        self.assertTrue(self.sim.prefill(req, chunk))
        self.sim.decode(req, output)
        self.sim.release(req)
        return self.sim.last_match

    def delta(self, before):
        now = self.cache.stats_snapshot()
        return {k: v - before[k] for k, v in now.items() if v != before[k]}


class TestCoreCounters(_Core):
    def test_cold_request_stores_prompt_end_and_finish(self):
        before = self.cache.stats_snapshot()
        self.run_req(SYS + user(1), [7, 7], "r1")
        # 46-token prompt, nothing cached: the prompt-end checkpoint (45) and the finish
        # state (46 + 1 fed output token = 47) go in; 47 KV tokens, 2 states, no tombstone.
        self.assertEqual(
            self.delta(before),
            {
                "matches": 1,
                "prompt_tokens": 46,
                "states_stored_prompt_end": 1,
                "states_stored_finish": 1,
                "kv_tokens": 47,
                "ssm_states": 2,
                "nodes": 2,
            },
        )

    def test_kv_match_without_state_is_not_a_hit_then_the_branch_state_is(self):
        self.run_req(SYS + user(1), [7, 7], "r1")
        before = self.cache.stats_snapshot()
        self.run_req(SYS + user(2), [8, 8], "r2")
        d = self.delta(before)
        # The shared 40 tokens are KV in the tree but with no state at 40: matched as KV,
        # not usable; r2 plants the branch checkpoint there.
        self.assertEqual(d["kv_match_tokens"], 40)
        self.assertNotIn("prefix_tokens", d)
        self.assertEqual(d["states_stored_branch"], 1)
        before = self.cache.stats_snapshot()
        self.run_req(SYS + user(3), [9], "r3")
        d = self.delta(before)
        self.assertEqual((d["kv_match_tokens"], d["prefix_tokens"], d["state_hits_branch"]), (40, 40, 1))
        self.assertEqual(d["cow_copies"], 1)

    def test_resent_prompt_hits_its_prompt_end_state(self):
        prompt = SYS + user(1)
        self.run_req(prompt, [7, 7], "r1")
        before = self.cache.stats_snapshot()
        self.run_req(prompt, [7], "again")
        d = self.delta(before)
        n = len(prompt) - 1  # a match never covers the last prompt token
        self.assertEqual(
            (d["matches"], d["prompt_tokens"], d["kv_match_tokens"], d["prefix_tokens"]), (1, len(prompt), n, n)
        )
        self.assertEqual((d["state_hits_prompt_end"], d["cow_copies"]), (1, 1))
        # Its own finish state lands at 46 (prompt, no output fed): a new state.
        self.assertEqual(d["states_stored_finish"], 1)
        self.assertEqual(sum(v for k, v in d.items() if k.startswith("state_hits_")), 1)

    def test_chunk_end_ping_pong_checkpoint_and_its_hit(self):
        self.run_req(SYS + user(1), [7], "r1")
        self.run_req(SYS + user(2), [7], "r2")  # branch state at 40
        long = SYS + user(4, 20)  # 60 tokens; from the branch state in chunks of 16: 56, 60
        before = self.cache.stats_snapshot()
        self.run_req(long, [7], "r5", chunk=16)
        d = self.delta(before)
        self.assertEqual(d["states_stored_ping_pong"], 1)  # the chunk end at 56
        self.assertEqual(d["state_hits_branch"], 1)
        before = self.cache.stats_snapshot()
        m = self.run_req(long[:58] + [5, 5, 5], [7], "r6")
        self.assertEqual(m.prefix_len, 56)
        self.assertEqual(self.delta(before)["state_hits_ping_pong"], 1)

    def test_evictions_and_tombstones(self):
        self.run_req(SYS + user(1), [7, 7], "r1")
        self.run_req(SYS + user(2), [8, 8], "r2")
        cache = self.cache
        snap = cache.stats_snapshot()
        self.assertEqual(snap["tombstones"], 0)
        # LRU over states: r1's prompt-end state (an inner node) is the oldest: tombstoned.
        res = cache.evict(mamba_num=1)
        self.assertEqual((res.mamba_num_evicted, res.num_tokens_evicted), (1, 0))
        d = self.delta(snap)
        self.assertEqual(d, {"evicted_ssm_states": 1, "ssm_states": -1, "tombstones": 1})
        # Everything: every leaf goes with its KV; the counters add up to what was held.
        snap = cache.stats_snapshot()
        res = cache.evict(num_tokens=10_000)
        d = self.delta(snap)
        self.assertEqual(d["evicted_kv_tokens"], snap["kv_tokens"])
        self.assertEqual(d["evicted_ssm_states"], snap["ssm_states"])
        after = cache.stats_snapshot()
        self.assertEqual((after["kv_tokens"], after["ssm_states"], after["tombstones"], after["nodes"]), (0, 0, 0, 0))

    def test_direct_insert_is_its_own_kind(self):
        cache = self.cache
        kv = cache.token_to_kv_pool_allocator.alloc(8)
        cache.insert(RadixKey(list(range(8))), kv, cache.mamba_pool.alloc_list(1)[0])
        self.assertEqual(cache.stats.states_stored["insert"], 1)
        m = cache.match_prefix(RadixKey(list(range(8)) + [99]))
        cache.count_hit(*cache.hit_of(9, m))
        self.assertEqual(cache.stats.state_hits["insert"], 1)
        self.assertEqual(set(cache.stats.states_stored), set(STATE_ORIGINS))


# ----------------------------------------------------------------------------- plugin
def _glue():
    import sglang_glue_fixtures as F
    from test_sglang_glue import INTERVAL, KV_SIZE, MAMBA_SIZE, _Harness

    return F, _Harness, INTERVAL, KV_SIZE, MAMBA_SIZE


class TestAdapterCounting(unittest.TestCase):
    """Admission counting and the Prometheus series through SGLang's own scheduler
    functions (the harness of ``test_sglang_glue``)."""

    @classmethod
    def setUpClass(cls):
        F, _, interval, _, mamba = _glue()
        cls.ctx, _ = F.scheduler_context(
            F.base_argv(
                "--enable-mamba-radix", "--mamba-track-interval", str(interval), "--chunked-prefill-size", "32",
                "--max-mamba-cache-size", str(mamba), "--served-model-name", "tiny-test",
            )
        )

    def setUp(self):
        from prometheus_client import CollectorRegistry

        from sglang_mamba_ext.plugin.metrics import MambaRadixMetricsCollector

        F, Harness, _, kv_size, _ = _glue()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(F.in_context(self.ctx))
        self.addCleanup(self._stack.close)
        self.F = F
        self.pool = F.build_req_pool(max_num_reqs=4)
        # The tiny model's backend writes states at any token: exact prompt-end checkpoints.
        self.pool.prefix_checkpoint_writer = True
        self.cache, self.allocator = F.build_tree_cache(self.pool, kv_size)
        self.h = Harness(self, self.pool, self.cache, self.allocator)
        self.registry = CollectorRegistry()
        self.labels = {"model_name": "tiny-test", "tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}
        self.cache.hybrid_metrics = MambaRadixMetricsCollector(self.labels, "lru", registry=self.registry)
        self.cache.sync_metrics()

    def sample(self, name, **extra):
        value = self.registry.get_sample_value("sglang:mamba_radix_" + name, {**self.labels, **extra})
        self.assertIsNotNone(value, name)
        return value

    def serve(self, rid, ids, outs):
        req = self.F.make_req(rid, ids)
        self.h.admit(req)
        self.h.prefill(req)
        self.h.decode(req, outs)
        self.h.finish(req)
        return req

    def test_labels_are_sglangs(self):
        from sglang.srt.runtime_context import get_parallel

        from sglang_mamba_ext.plugin.metrics import cache_metric_labels

        with get_parallel().override(tp_rank=0, pp_rank=0):
            labels = cache_metric_labels("MambaRadixCacheAdapter")
        self.assertEqual(labels, {"model_name": "tiny-test", "tp_rank": 0, "pp_rank": 0, "dp_rank": 0})

    def test_every_series_is_exported_from_the_start(self):
        from sglang_mamba_ext.plugin.metrics import iter_series_names

        names = {m.name for m in self.registry.collect()}
        # prometheus-client names a counter's family without its _total suffix.
        want = {n[: -len("_total")] if n.endswith("_total") else n for n in iter_series_names() if "warmup" not in n}
        self.assertEqual(names, want)
        for origin in STATE_ORIGINS:
            self.assertEqual(self.sample("checkpoints_total", kind=origin), 0.0)
        self.assertEqual(self.sample("evicted_ssm_states_total", policy="lru"), 0.0)

    def test_resend_moves_the_series_by_exact_amounts(self):
        prompt = list(range(10, 50))  # 40 tokens: chunks of 32 + 8
        outs = list(range(300, 305))
        self.serve("a", prompt, outs)
        before = {m: self.sample(m) for m in ("matches_total", "kv_match_tokens_total", "prefix_tokens_total")}
        hits_before = self.sample("checkpoint_hits_total", kind="prompt_end")
        cow_before = self.sample("cow_copies_total")
        self.serve("b", prompt, [1, 2])
        self.assertEqual(self.sample("matches_total") - before["matches_total"], 1)
        self.assertEqual(self.sample("kv_match_tokens_total") - before["kv_match_tokens_total"], len(prompt) - 1)
        self.assertEqual(self.sample("prefix_tokens_total") - before["prefix_tokens_total"], len(prompt) - 1)
        self.assertEqual(self.sample("checkpoint_hits_total", kind="prompt_end") - hits_before, 1)
        self.assertEqual(self.sample("cow_copies_total") - cow_before, 1)
        snap = self.cache.core.stats_snapshot()
        self.assertEqual(self.sample("ssm_states"), snap["ssm_states"])
        self.assertEqual(self.sample("kv_tokens"), snap["kv_tokens"])
        self.assertEqual(self.sample("prompt_tokens_total"), 2 * len(prompt))

    def test_a_request_matched_twice_before_admission_counts_once(self):
        """SGLang's scheduler matches a waiting request again each round until it is
        admitted (``init_next_round_input``); only the admission (its row) counts."""
        from sglang.srt.mem_cache.allocation import alloc_req_slots

        prompt = list(range(10, 50))
        self.serve("a", prompt, [1, 2])
        b = self.F.make_req("b", prompt + [7, 7, 7])
        b.init_next_round_input(self.cache)  # a round that could not admit it
        self.cache.req_to_token_pool.mamba_allocator.free(b.kv.mamba_pool_idx.unsqueeze(-1))  # as SGLang's rejection
        b.kv.mamba_pool_idx = None
        b.kv.mamba_cow_src_index = None
        self.assertEqual(self.cache.core.stats.matches, 1)
        b.init_next_round_input(self.cache)  # the admitting round
        b.lock = self.cache.lock(b.last_node)
        alloc_req_slots(self.pool, [b], self.cache)
        self.assertEqual(self.cache.core.stats.matches, 2)
        self.assertEqual(self.sample("matches_total"), 2)
        # a's sequence is the prompt + 1 fed output token (1); b diverges after the prompt.
        self.assertEqual(self.cache.core.stats.prefix_tokens, len(prompt))
        self.h.prefill(b)
        self.h.finish(b)
        self.assertEqual(self.cache.core.stats.matches, 2)
        self.h.check_idle()

    def test_matched_but_never_admitted_is_not_counted(self):
        from sglang.srt.mem_cache.common import release_kv_cache

        prompt = list(range(10, 50))
        self.serve("a", prompt, [1, 2])
        c = self.F.make_req("c", prompt + [9])
        c.init_next_round_input(self.cache)
        release_kv_cache(c, self.cache, checkpoint=False)  # aborted while waiting
        self.assertEqual((self.cache.core.stats.matches, self.sample("matches_total")), (1, 1))
        self.h.check_idle()

    def test_eviction_series_by_policy(self):
        self.serve("a", list(range(10, 50)), [1, 2])
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        held = self.cache.core.stats_snapshot()
        self.cache.evict(EvictParams(num_tokens=10_000, mamba_num=0))
        self.assertEqual(self.sample("evicted_kv_tokens_total", policy="lru"), held["kv_tokens"])
        self.assertEqual(self.sample("evicted_ssm_states_total", policy="lru"), held["ssm_states"])
        self.assertEqual((self.sample("kv_tokens"), self.sample("ssm_states")), (0, 0))

    def test_flush_empties_the_gauges_and_keeps_the_counters(self):
        self.serve("a", list(range(10, 50)), [1, 2])
        stored = self.sample("checkpoints_total", kind="finish")
        self.assertEqual(stored, 1)
        self.assertGreater(self.sample("ssm_states"), 0)
        self.cache.reset()  # Scheduler.flush_cache; the pools are cleared right after
        self.pool.clear()
        self.allocator.clear()
        self.assertEqual((self.sample("kv_tokens"), self.sample("ssm_states"), self.sample("tombstones")), (0, 0, 0))
        self.assertEqual(self.sample("checkpoints_total", kind="finish"), stored)
        self.assertEqual(self.sample("matches_total"), 1)

    def test_server_info_entry(self):
        from sglang_mamba_ext.plugin.metrics import server_info_after

        self.serve("a", list(range(10, 50)), [1, 2])
        result = SimpleNamespace(internal_state={"page_size": 1})
        controller = SimpleNamespace(scheduler=SimpleNamespace(tree_cache=self.cache))
        self.assertIs(server_info_after(result, controller, None), result)
        info = result.internal_state["mamba_radix"]
        core = self.cache.core
        self.assertEqual(info["backend"], "mamba_radix_ext")
        self.assertEqual(info["mamba_track_interval"], 16)
        self.assertEqual(info["eviction_policy"], "adaptive")  # the default policy
        self.assertTrue(info["ping_pong_tracking"])
        self.assertEqual(info["ssm_states"], core.mamba_total_size())
        self.assertEqual(info["kv_tokens"], core.total_size())
        self.assertEqual(info["ssm_slots_free"] + info["ssm_states"], info["ssm_slots_total"])
        self.assertEqual(info["kv_slots_free"] + info["kv_tokens"], info["kv_slots_total"])
        self.assertEqual(info["matches"], 1)
        # Another cache (SGLang's own): the state is left as it was.
        other = SimpleNamespace(internal_state={"page_size": 1})
        server_info_after(other, SimpleNamespace(scheduler=SimpleNamespace(tree_cache=object())), None)
        self.assertEqual(other.internal_state, {"page_size": 1})


class TestWarmupCounters(unittest.TestCase):
    def test_record_warmup(self):
        from prometheus_client import CollectorRegistry

        from sglang_mamba_ext.plugin.metrics import record_warmup

        reg = CollectorRegistry()
        record_warmup({"prompts": 3, "tokens": 836, "skipped": 0, "second_pass_cached_tokens": 836}, "m", registry=reg)
        record_warmup({"prompts": 1, "tokens": 10, "skipped": 1, "second_pass_cached_tokens": 0}, "m", registry=reg)
        get = lambda n: reg.get_sample_value("sglang:mamba_radix_" + n, {"model_name": "m"})  # noqa: E731
        self.assertEqual((get("warmup_prompts_total"), get("warmup_tokens_total")), (4, 846))
        self.assertEqual(get("warmup_hit_tokens_total"), 836)


if __name__ == "__main__":
    unittest.main()
