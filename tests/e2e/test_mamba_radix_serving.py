"""End to end: the tiny hybrid model served by stock SGLang 0.5.23 on CPU with
``--enable-mamba-radix`` (issue 4, item 5).

``TestProductLaunch`` starts the server with the product flags only (``--model-path --device
cpu --enable-mamba-radix --warmups kda_cache --warmup-prompts-file F --host --port``; the
CPU defaults come from the plugin) and checks: warmed prompts (a chat system prompt and a
text prompt) are hit by the first real request that shares them; repeated prefixes report
``cached_tokens > 0``; ``/v1/chat/completions`` works with the tiny tokenizer's chat template;
a client that disconnects mid-generation and an ``/abort_request`` leave the server serving,
and SGLang's own idle memory check (``Scheduler.on_idle`` → ``invariant_checker``, strict by
default: a leak raises in the scheduler) passes with this cache — the test reads the cache's
idle-check log line (``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK=1``) and re-checks
``free + evictable == size`` for KV and SSM from the server's own numbers.

``TestGreedyEquivalence`` runs one workload (a shared system prefix, long chunked prompts,
repeats and multi-turn extensions, 3-4 requests at a time) against ``--enable-mamba-radix``
and against ``--disable-radix-cache`` with small pools (``--max-total-tokens 640
--max-mamba-cache-size 12``, which forces KV and SSM eviction), ``--chunked-prefill-size 32``
and ``--mamba-track-interval 16`` (smaller than the prompts), and requires token-identical
greedy outputs (also equal to the torch reference model); the radix server must have hit its
cache and evicted both KV and states. That server donates decode checkpoints at finish
(``SGLANG_MAMBA_EXT_FINISH_STATE=checkpoint``, the overlap-safe path), so later turns start
from ping-pong checkpoints written by the backend.

Every server is a subprocess on a free port, killed at the end of its class.
"""

import json
import os
import tempfile
import threading
import time
import unittest
from concurrent.futures import ThreadPoolExecutor

from server_util import Server, idle_checks, pool_sizes, wait_for

NEW_TOKENS = 16
SYSTEM = "You are a terse assistant. Answer in one line."
POLICY = "Policy: be kind, be brief, cite nothing."
SERVER_ENV = {"SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1"}


def _ids(x):
    return list(x["input_ids"]) if hasattr(x, "keys") else list(x)


class _Base(unittest.TestCase):
    @classmethod
    def _setup_model(cls):
        from transformers import AutoTokenizer

        from sglang_mamba_ext.models.tiny_builder import build_tiny_model
        from sglang_mamba_ext.models.tiny_hybrid import TinyHybridReference

        cls.tmp = tempfile.TemporaryDirectory(prefix="mamba-radix-e2e-")
        cls.addClassCleanup(cls.tmp.cleanup)
        cls.model_dir = build_tiny_model(os.path.join(cls.tmp.name, "tiny"), seed=0)
        cls.tok = AutoTokenizer.from_pretrained(cls.model_dir)
        cls.ref = TinyHybridReference.from_pretrained(cls.model_dir)

    @classmethod
    def _start(cls, name, args, env=None):
        server = Server(cls.model_dir, args, os.path.join(cls.tmp.name, f"{name}.log"), env=env)
        cls.addClassCleanup(server.stop)
        server.wait_healthy()
        return server

    def chat_ids(self, messages, add_generation_prompt=True):
        return _ids(self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt))


class TestProductLaunch(_Base):
    @classmethod
    def setUpClass(cls):
        cls._setup_model()
        prompts = os.path.join(cls.tmp.name, "prompts.jsonl")
        with open(prompts, "w") as f:
            f.write(json.dumps({"messages": [{"role": "system", "content": SYSTEM}]}) + "\n")
            f.write(json.dumps({"text": POLICY}) + "\n")
        cls.server = cls._start(
            "product",
            ["--device", "cpu", "--enable-mamba-radix", "--warmups", "kda_cache", "--warmup-prompts-file", prompts],
            env=SERVER_ENV,
        )

    def test_a_warm_chat_system_prompt_hit_by_first_request(self):
        warm = self.chat_ids([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
        ids = self.chat_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fox."}])
        self.assertEqual(ids[: len(warm)], warm)
        out = self.server.generate(input_ids=ids, max_new_tokens=NEW_TOKENS)
        self.assertGreaterEqual(out["meta_info"]["cached_tokens"], len(warm))
        self.assertEqual(out["output_ids"], self.ref.generate_greedy(ids, NEW_TOKENS))
        log = self.server.log_text()
        self.assertIn("kda_cache warmup: 2 prompts", log)

    def test_a_warm_text_prompt_hit_by_first_request(self):
        warm = self.tok.encode(POLICY)
        text = POLICY + " What is two plus two?"
        self.assertEqual(self.tok.encode(text)[: len(warm)], warm)
        out = self.server.generate(text=text, max_new_tokens=NEW_TOKENS)
        self.assertGreaterEqual(out["meta_info"]["cached_tokens"], len(warm))
        self.assertEqual(out["output_ids"], self.ref.generate_greedy(self.tok.encode(text), NEW_TOKENS))

    def test_b_repeated_prefixes_report_cached_tokens(self):
        long = self.tok.encode("A quick brown fox jumps over the lazy dog, again and again. " * 4)
        # Long enough for several prefill checkpoints; not on the 8-token checkpoint grid,
        # so an identical prompt (matched up to len - 1) finds the prompt's checkpoint.
        self.assertGreater(len(long), 64)
        self.assertNotEqual(len(long) % 8, 0)
        first = self.server.generate(input_ids=long, max_new_tokens=NEW_TOKENS)
        self.assertEqual(first["output_ids"], self.ref.generate_greedy(long, NEW_TOKENS))
        longer = long + first["output_ids"] + self.tok.encode(" And then?", add_special_tokens=False)
        second = self.server.generate(input_ids=longer, max_new_tokens=NEW_TOKENS)
        # The first request's whole sequence (prompt + outputs but the last) is cached.
        self.assertEqual(second["meta_info"]["cached_tokens"], len(long) + NEW_TOKENS - 1)
        self.assertEqual(second["output_ids"], self.ref.generate_greedy(longer, NEW_TOKENS))
        again = self.server.generate(input_ids=long, max_new_tokens=NEW_TOKENS)
        self.assertGreater(again["meta_info"]["cached_tokens"], 0)  # a prefill checkpoint
        self.assertEqual(again["output_ids"], first["output_ids"])

    def test_b_warm_prompt_hit_by_requests_diverging_inside_it(self):
        """Issue 6: requests that share only the first part of the warmed text prompt. The
        tree has KV for all of it but states only at its end, so the first diverging request
        cannot use it; its match reports the branch point, its prefill saves the state there
        (exactly: the tiny model's backend writes a state at any token, so the point is not
        rounded to SGLang's 8-token checkpoint grid), and the next request diverging at the
        same place hits it."""
        warm = self.tok.encode(POLICY)
        k = 2 * len(warm) // 3
        if k % 8 == 0:
            k -= 1  # off the grid: only an exact checkpoint can serve it
        branch = k
        self.assertGreater(branch, 8)
        first = warm[:k] + self.tok.encode(" Unrelated question one?", add_special_tokens=False)
        second = warm[:k] + self.tok.encode(" A different question two?", add_special_tokens=False)
        self.assertNotEqual(first[k], second[k])
        out1 = self.server.generate(input_ids=first, max_new_tokens=NEW_TOKENS)
        self.assertLess(out1["meta_info"]["cached_tokens"], branch)  # no state inside the prompt yet
        out2 = self.server.generate(input_ids=second, max_new_tokens=NEW_TOKENS)
        self.assertEqual(out2["meta_info"]["cached_tokens"], branch)
        self.assertEqual(out2["output_ids"], self.ref.generate_greedy(second, NEW_TOKENS))

    def test_c_chat_completions(self):
        import requests

        messages = [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": "Hi there"}]
        r = requests.post(
            self.server.base_url + "/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            timeout=300,
        )
        self.assertEqual(r.status_code, 200, r.text)
        body = r.json()
        self.assertIsInstance(body["choices"][0]["message"]["content"], str)
        self.assertEqual(body["usage"]["completion_tokens"], 8)
        self.assertEqual(body["usage"]["prompt_tokens"], len(self.chat_ids(messages)))

    def test_z_disconnect_and_abort_then_idle_leak_check(self):
        import requests

        prompt = self.tok.encode("Count slowly from one to a thousand: one, two, three,")
        marker = len(self.server.log_text())
        # 1. A client that disconnects mid-generation (its read times out and it closes).
        with self.assertRaises(requests.exceptions.ReadTimeout):
            requests.post(
                self.server.base_url + "/generate",
                json={"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 3000, "ignore_eos": True}},
                timeout=(5, 1.5),
            )
        self.assertTrue(
            wait_for(lambda: "disconnected from the client side" in self.server.log_text()[marker:], 120),
            self.server.log_tail(),
        )
        # 2. An explicit abort of a running request.
        result = {}

        def run():
            result["out"] = self.server.generate(input_ids=prompt + [7], max_new_tokens=3000, rid="glue-abort")

        t = threading.Thread(target=run)
        t.start()
        time.sleep(1.5)
        r = requests.post(self.server.base_url + "/abort_request", json={"rid": "glue-abort"}, timeout=60)
        self.assertEqual(r.status_code, 200, r.text)
        t.join(timeout=300)
        self.assertFalse(t.is_alive())
        self.assertEqual(result["out"]["meta_info"]["finish_reason"]["type"], "abort")
        self.assertLess(result["out"]["meta_info"]["completion_tokens"], 3000)
        # 3. Prompts that would kill SGLang's scheduler are refused with HTTP 400: a text
        # with no token, token ids outside the vocabulary.
        for body in ({"text": ""}, {"input_ids": [5, 10**6]}, {"input_ids": [-1, 5]}):
            r = requests.post(
                self.server.base_url + "/generate",
                json={**body, "sampling_params": {"max_new_tokens": 2}},
                timeout=60,
            )
            self.assertEqual(r.status_code, 400, (body, r.text))
        # 4. Still serving, correctly.
        self.assertTrue(self.server.alive())
        marker2 = len(self.server.log_text())
        ids = self.tok.encode("After the storm")
        out = self.server.generate(input_ids=ids, max_new_tokens=NEW_TOKENS)
        self.assertEqual(out["output_ids"], self.ref.generate_greedy(ids, NEW_TOKENS))
        # 5. SGLang's idle check ran with this cache after all of it (the cache logs one
        # line per idle check after a change; none can appear while a request runs), and
        # the pools balance.
        checks = wait_for(lambda: idle_checks(self.server.log_text()[marker2:]), 120)
        self.assertTrue(checks, self.server.log_tail())
        last = checks[-1]
        sizes = pool_sizes(self.server.log_text())
        self.assertEqual((last["kv_protected"], last["ssm_protected"]), (0, 0))
        self.assertEqual(last["kv_free"] + last["kv_evictable"], sizes["kv"])
        self.assertEqual(last["ssm_free"] + last["ssm_evictable"], sizes["ssm"])
        log = self.server.log_text()
        self.assertNotIn("memory leak detected", log)
        self.assertNotIn("Scheduler hit an exception", log)
        self.assertTrue(self.server.alive())


def _workload(tok):
    """(name, input_ids, max_new_tokens) waves: each wave runs concurrently; later waves
    extend earlier outputs (filled in by :func:`_run_workload`)."""
    system = tok.encode("System: you are a careful assistant. Think, then answer briefly. ")
    users = [
        "What is a fox?", "Tell me about dogs and their friends in the park.", "1 2 3 4 5 6 7 8 9 10",
        "Describe a river.", "Why is the sky blue during the day but dark at night?", "List three fruits.",
    ]
    long_text = [
        "Once upon a time there was a small model that lived on a CPU and dreamed of GPUs. " * 2,
        "The rain in Spain stays mainly in the plain, said the professor, again and again. " * 2,
    ]
    wave1 = [(f"sys{i}", system + tok.encode(u, add_special_tokens=False), 24) for i, u in enumerate(users[:3])]
    wave1.append(("long0", tok.encode(long_text[0]), 24))
    wave2 = [(f"sys{i}", system + tok.encode(u, add_special_tokens=False), 24) for i, u in enumerate(users[3:], 3)]
    wave2.append(("long1", tok.encode(long_text[1]), 24))
    wave3 = [("repeat_sys0", wave1[0][1], 24), ("repeat_long0", wave1[3][1], 20), ("prefix_long1", wave2[3][1][:70], 20)]
    return [wave1, wave2, wave3]


def _run_workload(server, tok):
    """Returns (outputs, cached_tokens, log offset before the last wave was sent)."""
    outs = {}
    cached = {}
    waves = _workload(tok)
    marker = 0
    # Multi-turn: a fourth wave continues conversations of the first two.
    for wave in waves + [None]:
        if wave is None:
            marker = len(server.log_text())
            more = tok.encode(" Thanks. And next?", add_special_tokens=False)
            wave = [
                ("turn2_sys1", waves[0][1][1] + outs["sys1"] + more, 24),
                ("turn2_long0", waves[0][3][1] + outs["long0"] + more, 24),
                ("turn2_sys4", waves[1][1][1] + outs["sys4"] + more, 16),
            ]
        with ThreadPoolExecutor(len(wave)) as ex:
            results = list(ex.map(lambda w: server.generate(input_ids=w[1], max_new_tokens=w[2]), wave))
        for (name, _, _), r in zip(wave, results):
            outs[name] = r["output_ids"]
            cached[name] = r["meta_info"]["cached_tokens"]
    return outs, cached, marker


    def test_b_identical_prompt_on_the_grid_hits_all_but_its_last_token(self):
        """Issue 6: a resent identical prompt must recompute its last token (for logits), so
        only a state at prompt length - 1 serves it. With a grid-aligned length, SGLang's own
        checkpoints sit at the prompt's end and 8 tokens before; the prompt-end checkpoint
        makes the first repeat hit ``len - 1`` tokens."""
        ids = self.tok.encode("Count the stars, then the sheep, then the stars again: " * 3)
        ids = ids[: len(ids) - len(ids) % 8]
        self.assertGreater(len(ids), 32)
        first = self.server.generate(input_ids=ids, max_new_tokens=NEW_TOKENS)
        self.assertEqual(first["output_ids"], self.ref.generate_greedy(ids, NEW_TOKENS))
        again = self.server.generate(input_ids=ids, max_new_tokens=NEW_TOKENS)
        self.assertEqual(again["meta_info"]["cached_tokens"], len(ids) - 1)
        self.assertEqual(again["output_ids"], first["output_ids"])


class TestGreedyEquivalence(_Base):
    POOLS = ["--max-total-tokens", "640", "--max-mamba-cache-size", "12", "--chunked-prefill-size", "32"]

    @classmethod
    def setUpClass(cls):
        cls._setup_model()
        t0 = time.time()
        radix = cls._start(
            "radix",
            ["--device", "cpu", "--enable-mamba-radix", "--mamba-track-interval", "16", *cls.POOLS],
            # Finished requests donate their newest decode checkpoint (the overlap-safe path
            # GPU servers use) rather than the live state: decode checkpoints get reused.
            env={**SERVER_ENV, "SGLANG_MAMBA_EXT_FINISH_STATE": "checkpoint"},
        )
        cls.radix_outs, cls.radix_cached, marker = _run_workload(radix, cls.tok)
        cls.radix_idle = wait_for(lambda: idle_checks(radix.log_text()[marker:]), 120)
        cls.radix_log = radix.log_text()
        cls.radix_alive = radix.alive()
        radix.stop()
        # The recompute-aware SSM eviction (issue 6, --radix-eviction-policy recompute),
        # with the live-state donation of non-overlap serving, under the same pressure.
        recompute = cls._start(
            "recompute",
            [
                "--device", "cpu", "--enable-mamba-radix", "--mamba-track-interval", "16",
                "--radix-eviction-policy", "recompute", *cls.POOLS,
            ],
            env=SERVER_ENV,
        )
        cls.recompute_outs, cls.recompute_cached, marker = _run_workload(recompute, cls.tok)
        cls.recompute_idle = wait_for(lambda: idle_checks(recompute.log_text()[marker:]), 120)
        cls.recompute_log = recompute.log_text()
        recompute.stop()
        plain = cls._start(
            "plain",
            ["--device", "cpu", "--disable-radix-cache", "--disable-overlap-schedule", *cls.POOLS],
        )
        cls.plain_outs, cls.plain_cached, _ = _run_workload(plain, cls.tok)
        cls.plain_log = plain.log_text()
        plain.stop()
        cls.elapsed_s = time.time() - t0

    def test_greedy_outputs_identical(self):
        self.assertEqual(set(self.radix_outs), set(self.plain_outs))
        for name in sorted(self.radix_outs):
            self.assertEqual(self.radix_outs[name], self.plain_outs[name], name)
        self.assertEqual(sum(self.plain_cached.values()), 0)  # the baseline caches nothing

    def test_recompute_policy_identical_and_evicting(self):
        for name in sorted(self.plain_outs):
            self.assertEqual(self.recompute_outs[name], self.plain_outs[name], name)
        self.assertIn("eviction recompute", self.recompute_log)
        self.assertTrue(self.recompute_idle, self.recompute_log[-4000:])
        last = self.recompute_idle[-1]
        self.assertGreater(last["evicted_ssm"], 0)
        self.assertEqual((last["kv_protected"], last["ssm_protected"]), (0, 0))
        self.assertGreaterEqual(sum(1 for n in self.recompute_cached.values() if n > 0), 3, self.recompute_cached)
        self.assertNotIn("memory leak detected", self.recompute_log)

    def test_outputs_match_reference_model(self):
        inputs = {}
        waves = _workload(self.tok)
        for wave in waves:
            for name, ids, n in wave:
                inputs[name] = (ids, n)
        for name, (ids, n) in sorted(inputs.items()):
            self.assertEqual(self.radix_outs[name], self.ref.generate_greedy(ids, n), name)

    def test_radix_server_hit_and_evicted(self):
        self.assertTrue(self.radix_alive)
        hits = [name for name, n in self.radix_cached.items() if n > 0]
        self.assertGreaterEqual(len(hits), 3, self.radix_cached)
        self.assertTrue(self.radix_idle, self.radix_log[-4000:])
        last = self.radix_idle[-1]
        self.assertGreater(last["evicted_kv"], 0)
        self.assertGreater(last["evicted_ssm"], 0)
        sizes = pool_sizes(self.radix_log)
        self.assertEqual((last["kv_protected"], last["ssm_protected"]), (0, 0))
        self.assertEqual(last["kv_free"] + last["kv_evictable"], sizes["kv"])
        self.assertEqual(last["ssm_free"] + last["ssm_evictable"], sizes["ssm"])
        self.assertNotIn("memory leak detected", self.radix_log)
        # Chunked prefill with ping-pong checkpoints: 32-token chunks were inserted.
        self.assertIn("sglang-mamba-ext: mamba_radix_ext tree cache", self.radix_log)
        self.assertIn("ping-pong tracking on", self.radix_log)
        self.assertIn("finish_state=checkpoint", self.radix_log)


if __name__ == "__main__":
    unittest.main()
