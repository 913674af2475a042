"""The SGLang glue on CPU against real SGLang 0.5.23 objects (no server).

- the plugin's flags parse and survive the pickling that hands ``ServerArgs`` to a
  scheduler, which then resolves them (strategy, backend, settings);
- bad combinations and a bad ``--warmups kda_cache`` set-up fail with messages naming flags;
- ``create_tree_cache`` returns the plugin's cache with the flag and SGLang's own without;
- the hybrid request pool is built through the hook on ``device="cpu"``, subclasses
  SGLang's, shares SGLang's tensors and has one free list per resource;
- a request lifecycle driven through SGLang's own functions (``Req.init_next_round_input``
  → ``match_kv_cache``, ``alloc_req_slots``, ``ScheduleBatch``'s deferred COW collection,
  ``ModelRunner``'s deferred COW execution, SGLang's extra_buffer track bookkeeping,
  ``checkpoint_kv_cache``, ``release_kv_cache``) leaves the right states in the tree and no
  leak, including an abort before allocation, a retraction and eviction under pressure.
"""

import contextlib
import json
import os
import tempfile
import unittest
from unittest import mock
from types import SimpleNamespace

import torch

import sglang_glue_fixtures as F

INTERVAL = 16  # --mamba-track-interval of these tests
KV_SIZE = 512
MAMBA_SIZE = 16


def state_value(tokens) -> float:
    """The fake model's state after ``tokens``: an exact float32 summary of the sequence."""
    h = 0
    for t in tokens:
        h = (h * 31 + int(t) + 1) % 1_000_003
    return float(h * 8 + len(tokens) % 8)


class _Harness:
    """A scheduler stand-in calling SGLang's own functions on the plugin's pool and cache;
    the "forward" writes :func:`state_value` into SGLang's Mamba pool tensors."""

    def __init__(self, test, pool, cache, allocator):
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache.allocation import alloc_token_slots

        self.alloc_token_slots = alloc_token_slots

        self.t = test
        self.pool = pool
        self.cache = cache
        self.allocator = allocator
        self.ScheduleBatch = ScheduleBatch
        self.conv = pool.mamba_pool.mamba_cache.conv[0]
        self.temporal = pool.mamba_pool.mamba_cache.temporal
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(F.tiny_model_dir())
        self.batch = SimpleNamespace(
            model_config=SimpleNamespace(hf_text_config=hf),
            tree_cache=cache,
            req_to_token_pool=pool,
        )

    # -- state I/O ----------------------------------------------------------------------
    def write_state(self, slot, tokens):
        v = state_value(tokens)
        self.conv[:, slot] = v
        self.temporal[:, slot] = v

    def state_of(self, slot) -> float:
        return float(self.temporal[0, slot].reshape(-1)[0])

    # -- scheduler steps -----------------------------------------------------------------
    def admit(self, req):
        from sglang.srt.mem_cache.allocation import alloc_req_slots

        req.init_next_round_input(self.cache)
        req.lock = self.cache.lock(req.last_node)
        alloc_req_slots(self.pool, [req], self.cache)

    def forward_extend(self, req, end, process_result=True):
        """One prefill chunk ``[prefix_len, end)``: KV slots, the deferred COW / clear as
        SGLang runs it, SGLang's track decision, then the fake forward; then the result
        processor's ``checkpoint_kv_cache`` unless ``process_result`` is False (a launched
        batch whose result the overlap scheduler has not processed yet)."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        row = req.kv.req_pool_idx
        start = req.prefix_len
        req.extend_end = end
        kv = self.alloc_token_slots(self.cache, end - start)  # evicts if short
        self.pool.req_to_token[row, start:end] = kv.to(torch.int32)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = end
        # ScheduleBatch.prepare_for_extend: track decision (extra_buffer), then COW/clear
        # collection.
        entry = None
        if self.pool.enable_mamba_extra_buffer:
            entry = self.ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend(self.batch, req)
        fb = F.run_deferred_cow(self.pool, [req])
        tokens = list(req.full_untruncated_fill_ids)
        work = int(req.kv.mamba_pool_idx)
        want = state_value(tokens[:start]) if start > 0 else 0.0
        self.t.assertEqual(self.state_of(work), want, f"{req.rid}: working state before the chunk")
        if entry is not None and entry.track_mask:
            slot = int(req.kv.mamba_ping_pong_track_buffer[entry.track_position])
            self.write_state(slot, tokens[: req.kv.mamba_last_track_seqlen])
        # The plugin pool's planned prefix checkpoints inside this chunk, read through the
        # backend plan API as the tiny model's backend reads it.
        plan = self.pool.prefix_checkpoint_plan(
            SimpleNamespace(
                forward_mode=fb.forward_mode,
                extend_prefix_lens_cpu=[start],
                extend_seq_lens_cpu=[end - start],
                req_pool_indices=torch.tensor([row]),
            )
        )
        for off, slot in plan.get(0, []):
            self.write_state(slot, tokens[: start + off])
        self.write_state(work, tokens[:end])
        if process_result and (end < len(req.origin_input_ids) or not req.finished()):
            checkpoint_kv_cache(req, self.cache)

    def prefill(self, req, chunk=32):
        while req.prefix_len < len(req.origin_input_ids):
            self.forward_extend(req, min(req.prefix_len + chunk, len(req.origin_input_ids)))

    def decode(self, req, new_tokens):
        """Decode steps as SGLang runs them with extra_buffer: the first token comes from
        the prefill; each step allocates KV, advances the state and, at a
        ``--mamba-track-interval`` boundary, writes the ping-pong checkpoint and records it
        the way ``_handle_finish_state_updated_req`` does."""
        row = req.kv.req_pool_idx
        for i, tok in enumerate(new_tokens):
            req.output_ids.append(tok)
            if i == len(new_tokens) - 1:
                break
            pos = req.kv.kv_committed_len
            kv = self.alloc_token_slots(self.cache, 1)
            self.pool.req_to_token[row, pos] = kv.to(torch.int32)
            req.kv.kv_allocated_len = req.kv.kv_committed_len = pos + 1
            req.refresh_fill_ids()
            tokens = list(req.full_untruncated_fill_ids)[: pos + 1]
            self.write_state(int(req.kv.mamba_pool_idx), tokens)
            if req.kv.mamba_ping_pong_track_buffer is not None and (pos + 1) % INTERVAL == 0:
                nxt = req.kv.mamba_next_track_idx
                self.write_state(int(req.kv.mamba_ping_pong_track_buffer[nxt]), tokens)
                req.kv.mamba_prev_track_seqlen = req.kv.mamba_last_track_seqlen
                req.kv.mamba_last_track_idx = nxt
                req.kv.mamba_last_track_seqlen = pos + 1
                req.kv.mamba_next_track_idx = 1 - nxt

    def finish(self, req):
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        req.finished_reason = FINISH_LENGTH(len(req.output_ids))
        release_kv_cache(req, self.cache, checkpoint=True)

    # -- checks --------------------------------------------------------------------------
    def check_tree_states(self):
        """Every node's SSM slot holds the state of exactly its root-to-node tokens."""
        stack = [(self.cache.root_node, [])]
        n = 0
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                full = path + list(child.key)
                if child.mamba_value is not None:
                    self.t.assertEqual(self.state_of(child.mamba_value), state_value(full), f"node at {len(full)}")
                    n += 1
                stack.append((child, full))
        return n

    def check_idle(self):
        """SGLang's idle invariants (``invariant_checker``) plus the core's exact checks."""
        c = self.cache
        self.t.assertEqual(c.full_protected_size(), 0)
        self.t.assertEqual(c.mamba_protected_size(), 0)
        self.t.assertEqual(self.allocator.available_size() + c.full_evictable_size(), self.allocator.size)
        self.t.assertEqual(
            self.pool.mamba_allocator.available_size() + c.mamba_evictable_size(), self.pool.mamba_pool.size
        )
        self.t.assertEqual(len(self.pool.free_slots), self.pool.size)
        c.sanity_check()
        self.t.assertEqual(
            sorted(self.pool.mamba_allocator.free_slots.tolist() + c.all_mamba_values_flatten().tolist()),
            list(range(1, self.pool.mamba_pool.size + 1)),
        )


class _ContextTest(unittest.TestCase):
    ARGV = (
        "--enable-mamba-radix", "--mamba-track-interval", str(INTERVAL), "--chunked-prefill-size", "32",
        "--max-mamba-cache-size", str(MAMBA_SIZE),
    )

    @classmethod
    def setUpClass(cls):
        cls.ctx, cls.server_args = F.scheduler_context(F.base_argv(*cls.ARGV))

    def setUp(self):
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(F.in_context(self.ctx))
        self.addCleanup(self._stack.close)


class TestFlags(unittest.TestCase):
    def test_flags_reach_scheduler_side_server_args(self):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(["You are a helpful assistant."], f)
        self.addCleanup(os.unlink, f.name)
        ctx, sa = F.scheduler_context(
            F.base_argv("--enable-mamba-radix", "--warmups", "kda_cache", "--warmup-prompts-file", f.name)
        )
        from sglang.srt.runtime_context import get_exec, get_memory, get_schedule

        from sglang_mamba_ext.plugin.settings import current_settings

        self.assertEqual(sa.radix_cache_backend, "mamba_radix_ext")
        with F.in_context(ctx):
            self.assertEqual(get_memory().radix_cache_backend, "mamba_radix_ext")
            self.assertTrue(get_exec().mamba.enable_mamba_extra_buffer)  # CPU refusal lifted
            self.assertFalse(get_schedule().disable_overlap_schedule)  # overlap on, as on a GPU
            settings = current_settings()
        self.assertEqual(settings["warmup_prompts_file"], f.name)
        self.assertTrue(settings["enable"])

    def test_flag_off_changes_nothing(self):
        sa = F.parse_args(F.base_argv())
        self.assertIsNone(sa.radix_cache_backend)
        self.assertEqual(sa.mamba_radix_cache_strategy, "auto")
        self.assertNotIn("_mamba_radix_ext", sa.__dict__)

    def test_user_strategy_wins(self):
        ctx, sa = F.scheduler_context(F.base_argv("--enable-mamba-radix", "--mamba-radix-cache-strategy", "no_buffer"))
        from sglang.srt.runtime_context import get_exec

        with F.in_context(ctx):
            self.assertFalse(get_exec().mamba.enable_mamba_extra_buffer)

    def test_bad_combinations_name_the_flags(self):
        cases = [
            (["--enable-mamba-radix", "--disable-radix-cache"], "--disable-radix-cache"),
            (["--enable-mamba-radix", "--radix-cache-backend", "other"], "--radix-cache-backend other"),
            (["--enable-mamba-radix", "--mamba-radix-cache-strategy", "extra_buffer_lazy"], "extra_buffer_lazy"),
            (["--warmups", "kda_cache"], "--warmup-prompts-file"),
            (["--enable-mamba-radix", "--max-mamba-cache-size", "0"], "--max-mamba-cache-size 0 is too small"),
            (["--enable-mamba-radix", "--max-mamba-cache-size", "-4"], "--max-mamba-cache-size -4 is too small"),
            (["--enable-mamba-radix", "--max-mamba-cache-size", "2"], "holds 3 SSM state slots"),
            # SGLang serves size // 4 requests: 3 slots would start a server that serves none.
            (["--enable-mamba-radix", "--max-mamba-cache-size", "3"], "give at least 5"),
            # overlap scheduling (on by default, on CPU too): 3 + 2 tracking slots per request
            (["--enable-mamba-radix", "--max-mamba-cache-size", "4"], "SGLang budgets 5 per running request"),
            (["--enable-mamba-radix", "--disable-overlap-schedule", "--max-mamba-cache-size", "3"],
             "give at least 4"),
        ]
        for extra, needle in cases:
            with self.subTest(extra=extra):
                with self.assertRaises(ValueError) as cm:
                    F.parse_args(F.base_argv(*extra))
                self.assertIn(needle, str(cm.exception))
                if "--enable-mamba-radix" in extra:
                    self.assertIn("--enable-mamba-radix", str(cm.exception))

    def test_bad_prompts_file_fails_at_parsing(self):
        with self.assertRaises(ValueError) as cm:
            F.parse_args(F.base_argv("--warmups", "kda_cache", "--warmup-prompts-file", "/nonexistent/p.json"))
        self.assertIn("/nonexistent/p.json", str(cm.exception))

    def test_out_of_vocabulary_warmup_ids_fail_at_parsing(self):
        """A token id outside the local model's ``vocab_size`` in an ``input_ids`` prompt fails
        while parsing (before the model loads), naming the file, the line and the size."""
        with open(os.path.join(F.tiny_model_dir(), "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        path = os.path.join(d.name, "p.jsonl")
        with open(path, "w") as f:
            f.write('{"input_ids": [1, 2]}\n{"input_ids": [1, %d]}\n' % vocab)
        with self.assertRaises(ValueError) as cm:
            F.parse_args(F.base_argv("--warmups", "kda_cache", "--warmup-prompts-file", path))
        self.assertIn(f"{path}:2: token id {vocab} is outside the vocabulary (size {vocab})", str(cm.exception))
        # The last valid id parses.
        with open(path, "w") as f:
            f.write('{"input_ids": [1, %d]}\n' % (vocab - 1))
        F.parse_args(F.base_argv("--warmups", "kda_cache", "--warmup-prompts-file", path))

    def test_page_size_off_the_state_chunk_is_refused_at_start_up(self):
        """SGLang asserts these in the scheduler process (a traceback); under the plugin's
        flag the resolution refuses them naming the flags (issue 11). The tiny model's
        linear-attention state chunk is 8 tokens."""
        cases = [
            (["--page-size", "12", "--mamba-track-interval", "48", "--chunked-prefill-size", "96"],
             "--page-size 12 must divide or be a multiple of the model's linear-attention state chunk (8 tokens"),
            # Named before the track interval (the default 256 is no multiple of 12), with
            # the nearest page sizes that work.
            (["--page-size", "12"], "state chunk (8 tokens, mamba_chunk_size in its config); use --page-size 8 or 16"),
            (["--page-size", "3", "--mamba-track-interval", "3"], "use --page-size 2 or 8"),
            (["--page-size", "16", "--chunked-prefill-size", "72"],
             "--chunked-prefill-size 72 must be a multiple of --page-size 16; use --chunked-prefill-size 64"),
        ]
        for extra, needle in cases:
            with self.subTest(extra=extra):
                with self.assertRaises(ValueError) as cm:
                    F.scheduler_context(F.base_argv("--enable-mamba-radix", *extra))
                self.assertIn(needle, str(cm.exception))
                self.assertIn("--enable-mamba-radix", str(cm.exception))
        # Served: a page size dividing the chunk, and one that is a multiple of it.
        for page in ("4", "16"):
            F.scheduler_context(F.base_argv("--enable-mamba-radix", "--page-size", page, "--mamba-track-interval", "32"))

    def test_track_interval_not_positive_is_refused_at_parse(self):
        """``-5 % page_size == 0``: the page check alone let it through to a traceback in the
        scheduler after the whole start-up."""
        for interval in ("-5", "0"):
            with self.subTest(interval=interval):
                with self.assertRaises(ValueError) as cm:
                    F.parse_args(F.base_argv("--enable-mamba-radix", "--mamba-track-interval", interval))
                self.assertIn(f"--mamba-track-interval ({interval}) must be a positive number of tokens",
                              str(cm.exception))

    def test_replayssm_refused_for_narrow_key_heads(self):
        """Issue 42: SGLang's ReplaySSM decode kernel needs key heads of at least 32 channels
        (it raises at the first decode step otherwise, with or without the plugin); a local
        model with narrower ones is refused at start-up, naming the dim and the kernel's error.
        Kimi-K3's tiny config (``linear_attn_config.head_dim`` 16) is refused; a 32-channel GDN
        model and the tiny model on the plugin's torch backend are not."""
        from sglang_mamba_ext.plugin import args_combos
        from sglang_mamba_ext.plugin.startup_errors import FlagError

        cases = [
            ({"model_type": "kimi_linear", "linear_attn_config": {"head_dim": 16}}, 16),
            ({"model_type": "qwen3_5", "text_config": {"linear_key_head_dim": 16}}, 16),
            ({"model_type": "qwen3_next", "linear_key_head_dim": 32}, None),
            ({"model_type": "tiny_hybrid", "architectures": ["TinyHybridGDNForCausalLM"]}, 16),
            ({"model_type": "tiny_hybrid", "architectures": ["TinyHybridGDNForCausalLM"],
              "linear_key_head_dim": 32}, None),
            ({"model_type": "tiny_hybrid", "architectures": ["TinyHybridForCausalLM"]}, None),
            ({"model_type": "llama"}, None),
        ]
        for cfg, refused_dim in cases:
            with self.subTest(cfg=cfg), tempfile.TemporaryDirectory() as d:
                with open(os.path.join(d, "config.json"), "w") as f:
                    json.dump(cfg, f)
                sa = SimpleNamespace(model_path=d)
                if refused_dim is None:
                    args_combos._check_replayssm_key_dim(sa)
                    continue
                with self.assertRaises(FlagError) as cm:
                    args_combos._check_replayssm_key_dim(sa)
                self.assertEqual(str(cm.exception),
                                 f"--enable-linear-replayssm: the model's linear key heads have {refused_dim} "
                                 "channels, and SGLang's ReplaySSM decode kernel needs at least 32 (it raises "
                                 "'BKT=8 must be >=16 for tl.dot' at the first decode step, kernels/ops/attention/"
                                 "linear/fused_recurrent_linear_replayssm.py:572); drop --enable-linear-replayssm "
                                 "for this model")

    def test_replayssm_flags(self):
        """Issue 42: the ReplaySSM decode ring runs with the plugin's cache under SGLang's
        strategy (no_buffer); an explicit extra_buffer is refused with SGLang's reason; the
        spec-verify flag runs as the plugin's deferred mode, whose requirements it keeps."""
        sa = F.parse_args(F.base_argv("--enable-mamba-radix", "--enable-linear-replayssm"))
        self.assertEqual((sa.mamba_radix_cache_strategy, sa.enable_linear_replayssm), ("no_buffer", True))
        self.assertTrue(sa.disable_overlap_schedule)  # no_buffer: SGLang's no_buffer path needs it off
        with self.assertRaises(ValueError) as cm:
            F.parse_args(F.base_argv("--enable-mamba-radix", "--enable-linear-replayssm",
                                     "--mamba-radix-cache-strategy", "extra_buffer"))
        self.assertIn("--enable-linear-replayssm cannot be combined with --mamba-radix-cache-strategy extra_buffer "
                      "(SGLang: 'requires --mamba-radix-cache-strategy no_buffer", str(cm.exception))
        sa = F.parse_args(F.base_argv("--enable-mamba-radix", "--enable-linear-replayssm-spec",
                                      "--speculative-algorithm", "FROZEN_KV_MTP", "--disable-overlap-schedule"))
        self.assertEqual((sa._mamba_spec_state_update, sa.enable_linear_replayssm_spec), ("deferred", False))
        with self.assertRaises(ValueError) as cm:
            F.parse_args(F.base_argv("--enable-mamba-radix", "--enable-linear-replayssm-spec"))
        self.assertIn("--enable-linear-replayssm-spec under --enable-mamba-radix runs as the plugin's "
                      "--mamba-spec-state-update deferred, which refuses this: --mamba-spec-state-update deferred "
                      "needs speculative decoding", str(cm.exception))

    def test_capacity_flags_accepted_or_refused_naming_both_flags(self):
        """Issue 26: int8 checkpoints, the host tier, streaming and radix sessions are accepted with
        the flag; what is still refused names both flags and says why."""
        for extra in (["--enable-int8-mamba-checkpoint", "--int8-mamba-ckpt-size", "16"],
                      ["--enable-hierarchical-cache", "--hicache-write-policy", "write_back"],
                      ["--enable-streaming-session"], ["--enable-session-radix-cache"],
                      # issue 42: the host tier keeps int8 states (SGLang's refusal is about its own
                      # host offload, which the plugin's cache does not use)
                      ["--enable-int8-mamba-checkpoint", "--enable-hierarchical-cache"],
                      # --hicache-size sizes the tier; the ratio is then not read, as in SGLang
                      ["--enable-hierarchical-cache", "--hicache-size", "1", "--hicache-ratio", "0"]):
            with self.subTest(extra=extra):
                F.parse_args(F.base_argv("--enable-mamba-radix", *extra))
        refused = {
            ("--enable-unified-memory",):
                "--enable-mamba-radix cannot be combined with --enable-unified-memory (SGLang builds its unified",
            ("--enable-hierarchical-cache", "--hicache-host-memory-mode", "buffer_only"):
                "--enable-mamba-radix cannot be combined with --hicache-host-memory-mode buffer_only (SGLang: "
                "'buffer_only requires a storage backend",
            # issue 42: --hicache-storage-backend file is served (tests/test_storage_tier.py);
            # without the host tier it is refused
            ("--hicache-storage-backend", "file"):
                "--enable-mamba-radix cannot be combined with --hicache-storage-backend file without "
                "--enable-hierarchical-cache (",
            ("--enable-hierarchical-cache", "--hicache-ratio", "0"):
                "--enable-mamba-radix cannot be combined with --enable-hierarchical-cache --hicache-ratio 0.0 (",
            # a fresh user's finds: NaN and infinity reached int() in a later check (tracebacks),
            # a negative size failed in the scheduler
            ("--enable-hierarchical-cache", "--hicache-ratio", "nan"):
                "--enable-mamba-radix cannot be combined with --enable-hierarchical-cache --hicache-ratio nan (",
            ("--enable-hierarchical-cache", "--hicache-ratio", "inf"):
                "--enable-mamba-radix cannot be combined with --enable-hierarchical-cache --hicache-ratio inf (",
            ("--enable-hierarchical-cache", "--hicache-size", "-1"):
                "--enable-mamba-radix cannot be combined with --enable-hierarchical-cache --hicache-size -1 (",
        }
        for extra, message in refused.items():
            with self.subTest(extra=extra):
                with self.assertRaises(ValueError) as cm:
                    F.parse_args(F.base_argv("--enable-mamba-radix", *extra))
                self.assertIn(message, str(cm.exception))
                self.assertTrue(str(cm.exception).endswith("drop one of them"), str(cm.exception))
        # issue 42: --enable-lmcache is served by the plugin's connector (plugin/lmcache_connector.py,
        # tests/e2e/test_lmcache_plugin.py); without the lmcache package it is refused naming it
        from sglang_mamba_ext.plugin.lmcache_connector import lmcache_installed

        if lmcache_installed():
            self.assertTrue(F.parse_args(F.base_argv("--enable-mamba-radix", "--enable-lmcache")).enable_lmcache)
        else:
            with self.assertRaises(ValueError) as cm:
                F.parse_args(F.base_argv("--enable-mamba-radix", "--enable-lmcache"))
            self.assertIn("--enable-mamba-radix --enable-lmcache needs the lmcache package", str(cm.exception))
        with self.assertRaises(ValueError) as cm:  # 0.1 x 8 slots rounds to no host state
            F.parse_args(F.base_argv("--enable-mamba-radix", "--enable-hierarchical-cache", "--hicache-ratio", "0.1",
                                     "--max-mamba-cache-size", "8"))
        self.assertIn("--hicache-ratio 0.1 x --max-mamba-cache-size 8 holds no SSM state", str(cm.exception))
        # a fresh user's find: a ratio that holds a state but no KV page got past the parse, then
        # the scheduler failed with a traceback (exit 137)
        for extra, message in (
            (("--page-size", "16", "--hicache-ratio", "0.01"),
             "--hicache-ratio 0.01 x --max-total-tokens 640 holds no KV page of --page-size 16 tokens in the "
             "host tier of --enable-mamba-radix: give a ratio of at least 0.025"),
            (("--max-mamba-cache-size", "1024", "--hicache-ratio", "0.001"),
             "--hicache-ratio 0.001 x --max-total-tokens 640 holds no KV page of --page-size 1 tokens"),
        ):
            with self.subTest(extra=extra):
                with self.assertRaises(ValueError) as cm:
                    F.parse_args(F.base_argv("--enable-mamba-radix", "--enable-hierarchical-cache",
                                             "--max-total-tokens", "640", *extra))
                self.assertIn(message, str(cm.exception))
        # 640 x 0.01 = 6 host KV tokens at page size 1, 1 host state of 128: served
        F.parse_args(F.base_argv("--enable-mamba-radix", "--enable-hierarchical-cache", "--max-total-tokens", "640",
                                 "--hicache-ratio", "0.01", "--max-mamba-cache-size", "128"))

    def test_non_hybrid_model_is_refused(self):
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
            "torch_dtype": "float32",
        }
        with open(os.path.join(d.name, "config.json"), "w") as f:
            json.dump(cfg, f)
        with self.assertRaises(ValueError) as cm:
            F.scheduler_context(["--model-path", d.name, "--device", "cpu", "--enable-mamba-radix"])
        self.assertIn("--enable-mamba-radix needs a hybrid model", str(cm.exception))


class TestEvictionPolicyFlag(unittest.TestCase):
    """``--radix-eviction-policy recompute`` (issue 6) and ``adaptive`` (issue 16) select
    the core's SSM eviction policies through SGLang's existing flag."""

    def test_recompute_policy_reaches_the_core_cache(self):
        from sglang.srt.runtime_context import get_memory

        from sglang_mamba_ext.mem_cache.eviction import AdaptiveEviction, RecomputeEviction

        for policy, cls in (("recompute", RecomputeEviction), ("adaptive", AdaptiveEviction)):
            with self.subTest(policy=policy):
                ctx, sa = F.scheduler_context(F.base_argv("--enable-mamba-radix", "--radix-eviction-policy", policy))
                self.assertEqual(sa.radix_eviction_policy, policy)
                with F.in_context(ctx):
                    self.assertEqual(get_memory().radix_eviction_policy, policy)
                    cache, _ = F.build_tree_cache(F.build_req_pool(), KV_SIZE)
                    self.assertEqual(cache.core.eviction_policy, policy)
                    self.assertIs(type(cache.core._eviction), cls)
        ctx, _ = F.scheduler_context(F.base_argv("--enable-mamba-radix", "--radix-eviction-policy", "lru"))
        with F.in_context(ctx):
            cache, _ = F.build_tree_cache(F.build_req_pool(), KV_SIZE)
            self.assertEqual(cache.core.eviction_policy, "lru")  # named: kept, although SGLang's default

    def test_default_policy_is_adaptive(self):
        """``--enable-mamba-radix`` alone selects ``adaptive`` (issue 38); the flag given in
        either argv form keeps the named policy; without the plugin's flag SGLang's ``lru``."""
        ctx, sa = F.scheduler_context(F.base_argv("--enable-mamba-radix"))
        self.assertEqual(sa.radix_eviction_policy, "adaptive")
        with F.in_context(ctx):
            cache, _ = F.build_tree_cache(F.build_req_pool(), KV_SIZE)
            self.assertEqual(cache.core.eviction_policy, "adaptive")
            self.assertEqual(cache.core.max_states_per_path, 0)  # SGLang's default -1: no bound
        for argv in (["--radix-eviction-policy=lru"], ["--radix-eviction-policy", "recompute"]):
            with self.subTest(argv=argv):
                sa = F.parse_args(F.base_argv("--enable-mamba-radix", *argv))
                self.assertEqual(sa.radix_eviction_policy, argv[-1].split("=")[-1])
        self.assertEqual(F.parse_args(F.base_argv()).radix_eviction_policy, "lru")

    def test_policy_config_is_reported_ignored(self):
        """``--radix-eviction-policy-config`` configures SGLang's policies: under the flag a
        start-up warning says the plugin's cache does not read it."""
        with self.assertLogs("sglang_mamba_ext.plugin.args", level="WARNING") as cm:
            F.parse_args(F.base_argv("--enable-mamba-radix", "--radix-eviction-policy-config", '{"x": 1}'))
        self.assertIn("--radix-eviction-policy-config is ignored", "\n".join(cm.output))
        self.assertIn("--radix-eviction-policy adaptive", "\n".join(cm.output))

    def test_max_states_per_path_reaches_the_core_cache(self):
        ctx, _ = F.scheduler_context(F.base_argv("--enable-mamba-radix", "--mamba-max-states-per-path", "3"))
        with F.in_context(ctx):
            cache, _ = F.build_tree_cache(F.build_req_pool(), KV_SIZE)
            self.assertEqual(cache.core.max_states_per_path, 3)

    def test_policy_refusals_name_the_flags(self):
        for policy in ("recompute", "adaptive"):
            with self.subTest(policy=policy):
                with self.assertRaises(ValueError) as cm:
                    F.parse_args(F.base_argv("--radix-eviction-policy", policy))
                self.assertIn("--enable-mamba-radix", str(cm.exception))
                self.assertIn(f"--radix-eviction-policy {policy}", str(cm.exception))
        for other in ("lfu", "tlru"):
            with self.subTest(policy=other):
                with self.assertRaises(ValueError) as cm:
                    F.parse_args(F.base_argv("--enable-mamba-radix", "--radix-eviction-policy", other))
                self.assertIn(f"--radix-eviction-policy {other}", str(cm.exception))


class TestPoolAndCacheCreation(_ContextTest):
    def test_pool_built_through_hook(self):
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

        from sglang_mamba_ext.plugin.pool import MambaRadixReqToTokenPool

        pool = F.build_req_pool(max_num_reqs=4)
        self.assertIsInstance(pool, MambaRadixReqToTokenPool)
        self.assertIsInstance(pool, HybridReqToTokenPool)
        self.assertEqual(pool.req_to_token.device.type, "cpu")
        # One set of tensors: the core reads SGLang's maps and state tensors.
        self.assertIs(pool.core.req_to_token, pool.req_to_token)
        self.assertIs(pool.core.req_index_to_mamba_index_mapping, pool.req_index_to_mamba_index_mapping)
        self.assertIs(pool.core_mamba_pool.conv_state, pool.mamba_pool.mamba_cache.conv[0])
        self.assertIs(pool.core_mamba_pool.temporal_state, pool.mamba_pool.mamba_cache.temporal)
        self.assertEqual(pool.mamba_initial_tracking_slots, 2)
        # One free list: a slot taken through SGLang's allocator API is gone from the core.
        a = pool.mamba_allocator
        self.assertEqual(a.available_size(), 16)
        got = a.alloc(3)
        self.assertEqual(got.dtype, torch.int64)
        self.assertEqual(pool.core_mamba_pool.available_size(), 13)
        self.assertNotIn(int(got[0]), a.free_slots.tolist())
        a.free(got)
        self.assertEqual(pool.core_mamba_pool.available_size(), 16)
        self.assertEqual(pool.available_size(), 4)
        self.assertEqual(len(pool.free_slots), 4)
        rows = pool.alloc_rows(2)
        self.assertEqual(pool.available_size(), 2)
        pool.free_rows(rows)
        self.assertEqual(pool.available_size(), 4)
        # The padding row maps to the padding SSM slot.
        self.assertEqual(int(pool.req_index_to_mamba_index_mapping[0]), 0)

    def test_create_tree_cache_returns_ours(self):
        from sglang_mamba_ext.plugin.cache import MambaRadixCacheAdapter

        pool = F.build_req_pool()
        cache, _ = F.build_tree_cache(pool, KV_SIZE)
        self.assertIsInstance(cache, MambaRadixCacheAdapter)
        self.assertTrue(cache.supports_mamba())
        self.assertEqual(cache.core.finish_state, "overlap")  # overlap on (the default)

    def test_cpu_overlap_environment(self):
        """``SGLANG_MAMBA_EXT_CPU_OVERLAP=0`` turns overlap off on CPU (the live-state finish);
        a value other than 0 or 1 fails at start-up naming the variable."""
        from sglang.srt.runtime_context import get_schedule

        from sglang_mamba_ext.plugin.args import CPU_OVERLAP_ENV

        with mock.patch.dict(os.environ, {CPU_OVERLAP_ENV: "0"}):
            ctx, _ = F.scheduler_context(F.base_argv("--enable-mamba-radix"))
        with F.in_context(ctx):
            self.assertTrue(get_schedule().disable_overlap_schedule)
            pool = F.build_req_pool()
            cache, _ = F.build_tree_cache(pool, KV_SIZE)
            self.assertEqual(cache.core.finish_state, "working")
        with mock.patch.dict(os.environ, {CPU_OVERLAP_ENV: "yes"}):
            with self.assertRaisesRegex(ValueError, f"{CPU_OVERLAP_ENV}='yes': expected 1"):
                F.scheduler_context(F.base_argv("--enable-mamba-radix"))

    def test_plugin_environment_switches_fail_at_start_up(self):
        """A value of the plugin's environment switches other than their choices fails at
        start-up naming the variable and the choices; the choices themselves pass."""
        from sglang_mamba_ext.plugin.startup_errors import PLUGIN_ENV_CHOICES

        for name, choices in PLUGIN_ENV_CHOICES.items():
            with mock.patch.dict(os.environ, {name: "bogus"}):
                with self.assertRaisesRegex(ValueError, f"{name}='bogus': expected one of {', '.join(choices)}"):
                    F.scheduler_context(F.base_argv("--enable-mamba-radix"))
        with mock.patch.dict(os.environ, {name: choices[-1] for name, choices in PLUGIN_ENV_CHOICES.items()}):
            F.scheduler_context(F.base_argv("--enable-mamba-radix"))

    def test_flag_off_gives_sglang_cache_and_pool(self):
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        from sglang_mamba_ext.plugin.pool import MambaRadixReqToTokenPool

        ctx, _ = F.scheduler_context(F.base_argv("--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"))
        with F.in_context(ctx):
            pool = F.build_req_pool()
            self.assertIs(type(pool), HybridReqToTokenPool)
            self.assertNotIsInstance(pool, MambaRadixReqToTokenPool)
            cache, _ = F.build_tree_cache(pool, KV_SIZE)
            self.assertIsInstance(cache, UnifiedRadixCache)


class TestHostTierPools(unittest.TestCase):
    """``--enable-hierarchical-cache``: the host tier's KV pool over SGLang's own
    ``MHATokenToKVPool`` buffers (``plugin/host_tier.py``), its sizes from SGLang's flags, and
    one KV round trip through it (device -> host at eviction, host -> device at a match)."""

    def build(self, *flags):
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        ctx, _ = F.scheduler_context(F.base_argv("--enable-mamba-radix", "--enable-hierarchical-cache",
                                                 "--max-mamba-cache-size", str(MAMBA_SIZE), *flags))
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(F.in_context(ctx))
        self.addCleanup(self._stack.close)
        kv_pool = MHATokenToKVPool(64, page_size=1, dtype=torch.float32, head_num=2, head_dim=4, layer_num=2,
                                   device="cpu", enable_memory_saver=False)
        cache, _ = F.build_tree_cache(F.build_req_pool(), 64, hierarchical=True, kv_pool=kv_pool)
        return cache, kv_pool

    def test_ratio_sizes_the_kv_host_pool_over_sglang_buffers(self):
        cache, kv_pool = self.build("--hicache-ratio", "3")
        host = cache.core.kv_host_pool
        self.assertIs(cache.token_to_kv_pool_host, host)
        self.assertEqual((host.size, host.logical_size, host.available_size()), (192, 192, 192))
        self.assertEqual(len(host.host_buffers), 4)  # K and V of 2 layers
        self.assertEqual(tuple(host.host_buffers[0].shape), (193, 2, 4))
        self.assertIs(host.device_buffers[0], kv_pool.k_buffer[0])
        self.assertIs(host.device_buffers[2], kv_pool.v_buffer[0])

    def test_size_in_gib_is_shared_by_states_and_kv(self):
        cache, _ = self.build("--hicache-size", "1")
        core = cache.core
        kv_bytes = core.kv_host_pool.size * core.kv_host_pool.token_bytes()
        state_bytes = core.mamba_host_pool.size * core.mamba_host_pool.slot_bytes()
        self.assertGreater(core.kv_host_pool.size, 0)
        self.assertGreater(core.mamba_host_pool.size, 0)
        self.assertLessEqual(kv_bytes + state_bytes, (1 << 30))
        self.assertGreater(kv_bytes + state_bytes, (1 << 30) - core.mamba_host_pool.slot_bytes() - core.kv_host_pool.token_bytes())

    def test_kv_round_trip_through_the_host(self):
        from sglang_mamba_ext.mem_cache import CacheReq

        cache, kv_pool = self.build("--hicache-ratio", "2")
        core = cache.core
        kv = core.token_to_kv_pool_allocator
        slots = kv.alloc(8)
        torch.manual_seed(0)
        for b in kv_pool.k_buffer + kv_pool.v_buffer:
            b[slots] = torch.randn(8, 2, 4)
        want = [b[slots].clone() for b in kv_pool.k_buffer + kv_pool.v_buffer]
        core.insert(list(range(10, 18)), slots, mamba_value=core.mamba_pool.alloc_list(1)[0])
        self.assertEqual(core.evict(num_tokens=8).num_tokens_evicted, 8)
        self.assertEqual(core.host_kv_tokens(), 8)
        for b in kv_pool.k_buffer + kv_pool.v_buffer:
            b.zero_()
        req = CacheReq("r", list(range(10, 19)))
        m = core.match_prefix(list(range(10, 18)), cow_mamba=True, req=req)
        self.assertEqual((m.prefix_len, core.host_kv_loaded_total), (8, 8))
        for b, w in zip(kv_pool.k_buffer + kv_pool.v_buffer, want):
            self.assertTrue(torch.equal(b[m.device_indices], w))
        core.mamba_pool.free([req.mamba_pool_idx])
        core.sanity_check()
        self.assertEqual(kv.available_size() + core.total_size(), 64)
        host = core.kv_host_pool
        self.assertEqual((host.available_size(), core.host_kv_tokens()), (host.size, 0))


class TestLifecycle(_ContextTest):
    def setUp(self):
        super().setUp()
        self.pool = F.build_req_pool(max_num_reqs=4)
        self.cache, self.allocator = F.build_tree_cache(self.pool, KV_SIZE)
        self.h = _Harness(self, self.pool, self.cache, self.allocator)

    def test_chunked_prefill_decode_finish_then_hit(self):
        h = self.h
        prompt = list(range(10, 50))  # 40 tokens: chunks of 32 + 8
        a = F.make_req("a", prompt)
        h.admit(a)
        self.assertEqual(a.prefix_len, 0)
        self.assertEqual(len(a.kv.mamba_ping_pong_track_buffer), 2)
        h.prefill(a)
        # The first chunk's checkpoint (at 32) and the prompt's (at 40) are in the tree.
        self.assertEqual(a.kv.cache_protected_len, 40)
        outs = list(range(300, 310))
        h.decode(a, outs)  # committed 40 + 9 = 49: a decode checkpoint at 48
        self.assertEqual(a.kv.mamba_last_track_seqlen, 48)
        h.finish(a)
        self.assertIsNone(a.kv.req_pool_idx)
        self.assertIsNone(a.kv.mamba_pool_idx)
        self.assertGreaterEqual(h.check_tree_states(), 3)
        h.check_idle()

        # Same prompt + more: hits the finished sequence's state (49 tokens) by COW.
        b = F.make_req("b", prompt + outs[:9] + [7, 8, 9])
        h.admit(b)
        self.assertEqual(b.prefix_len, 49)
        src = int(b.kv.mamba_cow_src_index[0])
        self.assertEqual(h.state_of(src), state_value(prompt + outs[:9]))
        h.prefill(b)  # checks the working state == the COW'd prefix state first
        self.assertEqual(h.state_of(src), state_value(prompt + outs[:9]))  # tree slot untouched
        h.decode(b, [1, 2, 3])
        h.finish(b)
        h.check_tree_states()
        h.check_idle()

    def test_sanity_check_is_the_core_check(self):
        """SGLang's idle check (``sanity_check``) runs the core's invariant check: a size
        counter out of step with the tree is reported."""
        h = self.h
        a = F.make_req("a", list(range(10, 50)))
        h.admit(a)
        h.prefill(a)
        h.finish(a)
        self.cache.sanity_check()
        self.cache.core._full_evictable += 1
        with self.assertRaisesRegex(AssertionError, "KV counters"):
            self.cache.sanity_check()
        self.cache.core._full_evictable -= 1
        h.check_idle()

    def test_namespaces_never_share(self):
        h = self.h
        prompt = list(range(60, 100))
        a = F.make_req("a", prompt, cache_salt="tenant-a")
        h.admit(a)
        h.prefill(a)
        h.decode(a, [5, 6])
        h.finish(a)
        b = F.make_req("b", prompt + [5, 9], cache_salt="tenant-b")
        b.init_next_round_input(self.cache)
        self.assertEqual(b.prefix_len, 0)
        d = F.make_req("d", prompt + [5, 9])  # no salt: its own namespace too
        d.init_next_round_input(self.cache)
        self.assertEqual(d.prefix_len, 0)
        c = F.make_req("c", prompt + [5, 9], cache_salt="tenant-a")
        c.init_next_round_input(self.cache)
        self.assertEqual(c.prefix_len, 41)
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(c, self.cache, checkpoint=False)  # matched (COW slot), never admitted
        h.check_idle()

    def test_abort_before_alloc_and_retraction_leave_no_leak(self):
        from sglang.srt.mem_cache.common import release_kv_cache

        h = self.h
        prompt = list(range(100, 140))
        a = F.make_req("a", prompt)
        h.admit(a)
        h.prefill(a)
        h.decode(a, [9, 9])
        h.finish(a)
        # Abort after match_prefix allocated the COW slot, before the pool took it.
        b = F.make_req("b", prompt + [9, 1])
        b.init_next_round_input(self.cache)
        self.assertTrue(b.kv.holds_mamba)
        release_kv_cache(b, self.cache, checkpoint=False)
        self.assertIsNone(b.kv.mamba_pool_idx)
        h.check_idle()
        # Retraction mid-decode (ScheduleBatch.retract_decode -> release_kv_cache).
        c = F.make_req("c", prompt + [9, 1, 2, 3])
        h.admit(c)
        h.prefill(c)
        h.decode(c, [4, 5, 6, 7, 8])
        release_kv_cache(c, self.cache, checkpoint=False)
        c.reset_for_retract()
        h.check_idle()
        h.check_tree_states()

    def test_flush_cache(self):
        """``Scheduler.flush_cache``: ``tree_cache.reset()``, then the pools' ``clear()``."""
        h = self.h
        a = F.make_req("a", list(range(5, 45)))
        h.admit(a)
        h.prefill(a)
        h.decode(a, [1, 2])
        h.finish(a)
        self.assertGreater(self.cache.total_size(), 0)
        self.cache.reset()
        self.pool.clear()
        self.allocator.clear()
        self.assertEqual(self.cache.total_size(), 0)
        self.assertEqual(self.pool.mamba_allocator.available_size(), MAMBA_SIZE)
        h.check_idle()
        b = F.make_req("b", list(range(5, 45)) + [1, 7])
        h.admit(b)
        self.assertEqual(b.prefix_len, 0)
        h.prefill(b)
        h.finish(b)
        h.check_idle()

    def test_eviction_under_pressure(self):
        """More distinct prompts than the pools hold: SSM states and KV are evicted through
        ``ensure_mamba_capacity`` / ``evict_for_alloc``; every request still runs."""
        h = self.h
        for i in range(12):
            prompt = [700 + i] + list(range(i * 50, i * 50 + 59))  # 12 x 62 tokens > 512 KV slots
            r = F.make_req(f"r{i}", prompt)
            h.admit(r)
            h.prefill(r)
            h.decode(r, [1, 2, 3])
            h.finish(r)
            h.check_idle()
        self.assertGreater(self.cache.core.evicted_states_total, 0)
        self.assertGreater(self.cache.core.evicted_tokens_total, 0)
        self.assertGreater(h.check_tree_states(), 0)


class TestPrefixCheckpoints(_ContextTest):
    """Issue 6 in serving: with a backend that writes a state at any token (the pool's
    ``prefix_checkpoint_writer``, set by the tiny model's backend), the pool plans the
    core's prefix checkpoints when a request gets its row — the exact branch point of its
    match and prompt length - 1 — the forward writes them, ``checkpoint`` inserts them, and
    every release path frees the ones not reached."""

    def setUp(self):
        super().setUp()
        self.pool = F.build_req_pool(max_num_reqs=4)
        self.pool.prefix_checkpoint_writer = True
        self.cache, self.allocator = F.build_tree_cache(self.pool, KV_SIZE)
        self.h = _Harness(self, self.pool, self.cache, self.allocator)

    def run_req(self, rid, prompt, outs=(1, 2)):
        r = F.make_req(rid, prompt)
        self.h.admit(r)
        self.h.prefill(r)
        self.h.decode(r, list(outs))
        self.h.finish(r)
        return r

    def test_identical_grid_aligned_prompt_hits_all_but_last_token(self):
        h = self.h
        prompt = list(range(10, 50))  # 40 tokens: on the 8-token grid
        a = F.make_req("a", prompt)
        h.admit(a)
        self.assertEqual(self.pool.prefix_checkpoints[a.kv.req_pool_idx][-1][0], 39)
        h.prefill(a)
        self.assertNotIn(a.kv.req_pool_idx, self.pool.prefix_checkpoints)  # inserted
        h.decode(a, [1, 2])
        h.finish(a)
        h.check_idle()
        b = F.make_req("b", prompt)
        h.admit(b)
        self.assertEqual(b.prefix_len, 39)
        self.assertEqual(h.state_of(int(b.kv.mamba_cow_src_index[0])), state_value(prompt[:39]))
        h.prefill(b)
        h.finish(b)
        self.assertGreaterEqual(h.check_tree_states(), 3)
        h.check_idle()

    def test_exact_branch_point_off_the_grid(self):
        h = self.h
        base = list(range(100, 140))
        self.run_req("a", base)
        first = base[:21] + [901, 902, 903, 904, 905]
        b = F.make_req("b", first)
        h.admit(b)
        self.assertEqual(b.prefix_len, 0)  # KV for 21 tokens, no state inside them yet
        self.assertEqual(b.mamba_branching_seqlen, 21)
        planned = [c for c, _ in self.pool.prefix_checkpoints[b.kv.req_pool_idx]]
        self.assertEqual(planned, [21, 25])
        h.prefill(b)
        h.finish(b)
        c = F.make_req("c", base[:21] + [7, 7, 7])
        h.admit(c)
        self.assertEqual(c.prefix_len, 21)
        self.assertEqual(h.state_of(int(c.kv.mamba_cow_src_index[0])), state_value(base[:21]))
        h.prefill(c)
        h.finish(c)
        h.check_tree_states()
        h.check_idle()

    def test_message_boundaries_from_kv_hints(self):
        """Issue 16: the offsets a request carries in ``kv_hints`` (``plugin/chat_boundaries.py``)
        are planned after prompt length - 1; a reclaim gives the deepest boundary back
        first; the forward writes the others, and the first request sharing the prefix hits
        the boundary exactly."""
        from sglang_mamba_ext.plugin.chat_boundaries import with_offsets

        h = self.h
        base = list(range(100, 141))  # 41 tokens: off the 8-token grid
        a = F.make_req("a", base + [901, 902, 903, 904, 905])
        a.kv_hints = with_offsets(None, [36, 41])
        h.admit(a)
        row = a.kv.req_pool_idx
        self.assertEqual([c for c, _ in self.pool.prefix_checkpoints[row]], [36, 41, 45])
        self.assertEqual(self.pool.reclaim_prefix_checkpoints(1), 1)
        self.assertEqual([c for c, _ in self.pool.prefix_checkpoints[row]], [36, 45])
        h.prefill(a)
        h.decode(a, [1, 2])
        h.finish(a)
        h.check_idle()
        b = F.make_req("b", base + [7, 7, 7])
        h.admit(b)
        # 36: deeper than SGLang's tracked state on the grid (32), the reclaimed 41 is gone
        self.assertEqual(b.prefix_len, 36)
        self.assertEqual(h.state_of(int(b.kv.mamba_cow_src_index[0])), state_value(base[:36]))
        h.prefill(b)
        h.finish(b)
        h.check_tree_states()
        h.check_idle()

    def test_release_paths_free_planned_checkpoints(self):
        from sglang.srt.mem_cache.common import release_kv_cache

        h = self.h
        # Aborted after its first chunk (the prompt-end checkpoint not reached yet).
        b = F.make_req("b", list(range(300, 360)))
        h.admit(b)
        h.forward_extend(b, 32)
        self.assertEqual([c for c, _ in self.pool.prefix_checkpoints[b.kv.req_pool_idx]], [59])
        release_kv_cache(b, self.cache, checkpoint=False)
        self.assertEqual(self.pool.prefix_checkpoints, {})
        h.check_idle()
        # Retracted mid-prefill (ScheduleBatch.retract_decode -> release_kv_cache), then
        # re-admitted and run to the end: planned again, inserted, nothing lost.
        c = F.make_req("c", list(range(600, 650)))
        h.admit(c)
        h.forward_extend(c, 32)
        self.assertTrue(self.pool.prefix_checkpoints)
        release_kv_cache(c, self.cache, checkpoint=False)
        c.reset_for_retract()
        self.assertEqual(self.pool.prefix_checkpoints, {})
        h.check_idle()
        h.admit(c)
        self.assertEqual(c.prefix_len, 32)
        h.prefill(c)
        h.finish(c)
        self.assertEqual(self.pool.prefix_checkpoints, {})
        h.check_tree_states()
        h.check_idle()

    def test_planned_checkpoints_give_way_to_admission(self):
        """A request's own slots never wait for an optional checkpoint: a chunked request
        holding planned checkpoints gives them back when a new request needs the slots."""
        h = self.h
        size = self.pool.mamba_pool.size
        # b's prompt fits one chunk: its working slot only (planned checkpoints replace its
        # ping-pong slots, MambaRadixReqToTokenPool.tracking_replaced)
        per_req = 1 + self.pool.mamba_initial_tracking_slots
        self.assertEqual(per_req, 1)
        a = F.make_req("a", list(range(400, 460)))
        h.admit(a)
        h.forward_extend(a, 32)
        held = len(self.pool.prefix_checkpoints[a.kv.req_pool_idx])
        self.assertEqual(held, 1)
        # Fill the pool up to exactly the slots a new request needs minus one.
        free = self.pool.core_mamba_pool.available_size()
        filler = self.pool.core_mamba_pool.alloc_list(free - per_req + 1)
        self.assertEqual(self.pool.mamba_allocator.available_size(), per_req)  # counts the planned one
        b = F.make_req("b", list(range(500, 520)))
        h.admit(b)  # SGLang's alloc_req_slots: would raise without the reclaim
        self.assertIsNotNone(b.kv.req_pool_idx)
        self.assertNotIn(a.kv.req_pool_idx, self.pool.prefix_checkpoints)
        self.pool.core_mamba_pool.free(filler)
        h.prefill(a)
        h.prefill(b)
        h.finish(a)
        h.finish(b)
        self.assertLessEqual(len(filler), size)
        h.check_tree_states()
        h.check_idle()

    def test_admission_evicts_cold_states_before_planned_checkpoints(self):
        """Issue 11: a new request admitted while another is between prefill chunks (the two
        share the next forward) must take its SSM slots from the tree's cold states, not from
        the other request's planned checkpoints. SGLang's ``ensure_mamba_capacity`` evicts
        only for the shortfall of ``schedulable_available_size()``; counting planned slots as
        free there made it skip the eviction and the pool reclaim the checkpoints, so the
        branch point and prompt length - 1 were lost under SSM pressure."""
        h = self.h
        per_req = self.pool.core.mamba_slots_per_req()
        # Cold states in the tree: two finished requests.
        self.run_req("cold1", list(range(800, 830)))
        self.run_req("cold2", list(range(850, 880)))
        cold_states = self.cache.mamba_evictable_size()
        self.assertGreaterEqual(cold_states, per_req)
        prompt = list(range(400, 460))
        a = F.make_req("a", prompt)
        h.admit(a)
        h.forward_extend(a, 32)
        a_row = a.kv.req_pool_idx
        planned = list(self.pool.prefix_checkpoints[a_row])
        self.assertEqual([c for c, _ in planned], [59])
        # Every other slot taken: the next admission needs per_req slots from the tree.
        filler = self.pool.core_mamba_pool.alloc_list(self.pool.core_mamba_pool.available_size())
        self.assertEqual(self.pool.core_mamba_pool.available_size(), 0)
        b = F.make_req("b", list(range(500, 520)))
        h.admit(b)
        self.assertEqual(self.pool.prefix_checkpoints[a_row], planned)
        # b's own slots and its prompt-end checkpoint (at 19) came from the cold states.
        self.assertEqual([c for c, _ in self.pool.prefix_checkpoints[b.kv.req_pool_idx]], [19])
        # b's prompt fits one chunk: planned checkpoints replace its ping-pong slots
        # (MambaRadixReqToTokenPool.tracking_replaced), so it holds its working slot only
        self.assertEqual(b.kv.mamba_ping_pong_track_buffer.tolist(), [-1, -1])
        self.assertEqual(self.cache.mamba_evictable_size(), cold_states - 1 - 1)
        self.pool.core_mamba_pool.free(filler)
        h.prefill(a)
        h.prefill(b)
        h.finish(a)
        h.finish(b)
        h.check_tree_states()
        h.check_idle()
        again = F.make_req("again", prompt)
        h.admit(again)
        self.assertEqual(again.prefix_len, len(prompt) - 1)
        h.prefill(again)
        h.finish(again)
        h.check_idle()


class TestLifecycleNoBuffer(_ContextTest):
    """``--mamba-radix-cache-strategy no_buffer`` (explicit user choice): no ping-pong
    slots; a chunk checkpoint copies the live state into a fresh slot."""

    ARGV = _ContextTest.ARGV + ("--mamba-radix-cache-strategy", "no_buffer")

    def test_chunked_prefill_finish_hit(self):
        pool = F.build_req_pool(max_num_reqs=4)
        self.assertFalse(pool.enable_mamba_extra_buffer)
        self.assertEqual(pool.mamba_initial_tracking_slots, 0)
        cache, allocator = F.build_tree_cache(pool, KV_SIZE)
        h = _Harness(self, pool, cache, allocator)
        prompt = list(range(10, 50))
        a = F.make_req("a", prompt)
        h.admit(a)
        self.assertIsNone(a.kv.mamba_ping_pong_track_buffer)
        h.prefill(a)
        self.assertEqual(a.kv.cache_protected_len, 40)  # chunk end 32, then the prompt end
        h.decode(a, [1, 2, 3])
        h.finish(a)
        self.assertEqual(h.check_tree_states(), 3)  # states at 32, 40 and 42
        h.check_idle()
        b = F.make_req("b", prompt + [1, 2, 9])
        h.admit(b)
        self.assertEqual(b.prefix_len, 42)
        h.prefill(b)
        h.finish(b)
        h.check_idle()



class TestEmptyPromptGuard(unittest.TestCase):
    """A text prompt that tokenizes to nothing, and input ids outside the vocabulary, are
    refused before scheduling (SGLang refuses only an empty input_ids list; either prompt
    kills its scheduler)."""

    def test_guard(self):
        from types import SimpleNamespace
        from unittest import mock

        from sglang_mamba_ext.plugin import request_validation

        on = {"enable": True}
        with mock.patch("sglang_mamba_ext.plugin.settings.current_settings", return_value=on):
            with self.assertRaises(ValueError) as cm:
                request_validation.validate_one_request_before(None, SimpleNamespace(input_embeds=None), [])
            self.assertIn("empty", str(cm.exception))
            self.assertIsNone(request_validation.validate_one_request_before(None, SimpleNamespace(input_embeds=None), [5]))
            tm = SimpleNamespace(model_config=SimpleNamespace(vocab_size=768))
            self.assertIsNone(request_validation.validate_one_request_before(tm, SimpleNamespace(input_embeds=None), [0, 767]))
            for ids, bad in (([5, 768], "768"), ([-2, 5], "-2")):
                with self.assertRaises(ValueError) as cm:
                    request_validation.validate_one_request_before(tm, SimpleNamespace(input_embeds=None), ids)
                self.assertIn(f"out-of-vocabulary token id {bad}", str(cm.exception))
        with mock.patch("sglang_mamba_ext.plugin.settings.current_settings", return_value={"enable": False}):
            self.assertIsNone(request_validation.validate_one_request_before(None, SimpleNamespace(input_embeds=None), []))


if __name__ == "__main__":
    unittest.main()
