"""End to end: the tiny hybrid model served by stock SGLang 0.5.23 on CPU with
``--enable-mamba-radix`` (issue 4, item 5).

``TestProductLaunch`` starts the server with the product flags only (``--model-path --device
cpu --enable-mamba-radix --warmups kda_cache --warmup-prompts-file F --host --port``; the
CPU defaults come from the plugin) and checks: warmed prompts (a chat system prompt and a
text prompt) are hit by the first real request that shares them, for exactly the tokens the
warm-up cached; a resent prompt hits exactly ``len - 1`` tokens and a request diverging
inside a cached prompt exactly the branch point (page size 1; expected values computed from
the token ids); ``/v1/chat/completions`` works with the tiny tokenizer's chat template; a
client that disconnects mid-generation and an ``/abort_request`` leave the server serving,
and it survives going idle under SGLang's own idle checks (``Scheduler.on_idle``: the strict
pool leak check and, with ``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK=1``, the cache's
``sanity_check``; either stops the server on a leak) with no KV held
(``/v1/loads`` ``num_used_tokens == 0``).

``TestRadixWorkload``, ``TestRecomputeEvictionWorkload`` and ``TestNoCacheWorkload`` (one
server each) run one workload (a shared system prefix, long chunked prompts,
repeats and multi-turn extensions, 3-4 requests at a time) against ``--enable-mamba-radix``
and against ``--disable-radix-cache`` with small pools (``--max-total-tokens 640
--max-mamba-cache-size 12``, which forces KV and SSM eviction), ``--chunked-prefill-size 32``
and ``--mamba-track-interval 16`` (smaller than the prompts), and requires each server's
greedy outputs to equal the torch reference model's (so the three agree token for token);
the radix server must have hit its
cache, and after the workload a sequential probe shows evictions as resends that no longer
hit: a prompt that hit ``len - 1`` hits 0 after more than 12 newer SSM states (LRU) and
again after more than 640 newer KV tokens. Both radix servers survive going idle under
SGLang's idle checks. That server donates decode checkpoints at finish
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

import pytest
from conftest import tiny_model_dir
from isolation import check_isolation, check_warm_prompt_not_shared, fresh_prompt
from server_util import CHECKED_ENV, Server, idle_and_checked, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW_TOKENS = 16
SYSTEM = "You are a terse assistant. Answer in one line."
POLICY = "Policy: be kind, be brief, cite nothing."
SERVER_ENV = dict(CHECKED_ENV)


def _ids(x):
    return list(x["input_ids"]) if hasattr(x, "keys") else list(x)




def warm_hit(ids, warm, first_token) -> int:
    """What a request ``ids`` hits after the ``kda_cache`` warm-up of ``warm``
    (``plugin/warmup.py``): pass 1 caches ``warm`` with its final state (at ``len(warm)``),
    pass 2 resends it extended by the token pass 1 generated (``first_token``) and caches
    the state after that token too. So: ``len(warm) + 1`` if ``ids`` continues with that
    token, else ``len(warm)``; a match never covers the last token."""
    n = len(warm)
    assert list(ids[:n]) == list(warm), "the request does not start with the warmed prompt"
    hit = n + 1 if list(ids[: n + 1]) == list(warm) + [first_token] else n
    return min(hit, len(ids) - 1)


class _Base(unittest.TestCase):
    @classmethod
    def _setup_model(cls):
        from transformers import AutoTokenizer

        from sglang_mamba_ext.models.tiny_hybrid import TinyHybridReference

        cls.tmp = tempfile.TemporaryDirectory(prefix="mamba-radix-e2e-")
        cls.addClassCleanup(cls.tmp.cleanup)
        cls.model_dir = tiny_model_dir()
        cls.tok = AutoTokenizer.from_pretrained(cls.model_dir)
        cls.ref = TinyHybridReference.from_pretrained(cls.model_dir)

    @classmethod
    def _start(cls, name, args, env=None, spawn=False):
        server = Server(cls.model_dir, args, os.path.join(cls.tmp.name, f"{name}.log"), env=env, spawn=spawn)
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
            spawn=True,  # README's launch, as a user runs it
        )

    def test_a_warm_chat_system_prompt_hit_by_first_request(self):
        warm = self.chat_ids([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
        ids = self.chat_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fox."}])
        self.assertEqual(ids[: len(warm)], warm)
        out = self.server.generate(input_ids=ids, max_new_tokens=NEW_TOKENS)
        expected = warm_hit(ids, warm, self.ref.generate_greedy(warm, 1)[0])
        self.assertEqual(out["meta_info"]["cached_tokens"], expected)
        self.assertEqual(out["output_ids"], self.ref.generate_greedy(ids, NEW_TOKENS))
        log = self.server.log_text()
        self.assertIn("kda_cache warmup: 2 prompts", log)

    def test_a_warm_text_prompt_hit_by_first_request(self):
        warm = self.tok.encode(POLICY)
        text = POLICY + " What is two plus two?"
        self.assertEqual(self.tok.encode(text)[: len(warm)], warm)
        out = self.server.generate(text=text, max_new_tokens=NEW_TOKENS)
        expected = warm_hit(self.tok.encode(text), warm, self.ref.generate_greedy(warm, 1)[0])
        self.assertEqual(out["meta_info"]["cached_tokens"], expected)
        self.assertEqual(out["output_ids"], self.ref.generate_greedy(self.tok.encode(text), NEW_TOKENS))

    def test_b_repeated_prefixes_hit_exactly(self):
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
        # The first request's prompt-end checkpoint (at len - 1) serves its resend.
        self.assertEqual(again["meta_info"]["cached_tokens"], len(long) - 1)
        self.assertEqual(again["output_ids"], first["output_ids"])

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
        # No state inside the prompt yet: the cached path holds states only from
        # len(warm) - 1 on (prompt-end checkpoint, warm-up passes; the default
        # --mamba-track-interval, 256, tracks none inside a prompt this short).
        self.assertLess(len(warm), 256)
        out1 = self.server.generate(input_ids=first, max_new_tokens=NEW_TOKENS)
        self.assertEqual(out1["meta_info"]["cached_tokens"], 0)
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

    def test_d_tenant_isolation(self):
        """Issue 23: ``cache_salt`` and SGLang's ``extra_key`` each keep tenants apart
        exactly; the namespace-less warm-up serves only requests without a namespace."""
        for field in ("cache_salt", "extra_key"):
            def send(ids, ns, field=field):
                extra = {field: ns} if ns is not None else {}
                out = self.server.generate(input_ids=ids, max_new_tokens=2, **extra)
                return out["meta_info"]["cached_tokens"]

            with self.subTest(field=field):
                check_isolation(self, send)
        warm = self.tok.encode(POLICY)
        suffix = fresh_prompt(6)
        check_warm_prompt_not_shared(self, send, warm, suffix,
                                     warm_hit(warm + suffix, warm, self.ref.generate_greedy(warm, 1)[0]))

    def test_e_soak_with_random_endings(self):
        """Issue 23, item 4: concurrent clients with random endings (served, disconnected,
        stream cut, aborted) for ``SOAK_SECONDS``; then every slot back (SGLang's strict idle
        checks), nothing held, and resident memory flat (within 10 % + 64 MB of its level
        after the first tenth of the run)."""
        from conftest import progress
        from soak import soak, soak_seconds

        figures = soak(self.server.base_url, [self.server.proc.pid], soak_seconds(),
                       abort_url=self.server.base_url)
        progress(f"  soak, single server: {figures}")
        self.assertEqual(figures["errors"], 0, figures)
        for ending in ("served", "disconnected", "stream_cut", "aborted"):
            self.assertGreater(figures[ending], 0, figures)
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_used_tokens"], 0)
        self.assertLessEqual(figures["rss_end_mb"], figures["rss_start_mb"] * 1.1 + 64, figures)

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
        ids = self.tok.encode("After the storm")
        out = self.server.generate(input_ids=ids, max_new_tokens=NEW_TOKENS)
        self.assertEqual(out["output_ids"], self.ref.generate_greedy(ids, NEW_TOKENS))
        # 5. SGLang's idle checks ran with this cache after all of it (strict pool check:
        # KV and SSM free + evictable + locked == size, request slots free; the cache's
        # sanity_check) and the server survived them; no KV is held at idle (no lock left
        # by the disconnect, the abort or the refusals).
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_used_tokens"], 0, load)


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
    """Returns (inputs, outputs, cached_tokens) by request name."""
    inputs = {}
    outs = {}
    cached = {}
    waves = _workload(tok)
    # Multi-turn: a fourth wave continues conversations of the first two.
    for wave in waves + [None]:
        if wave is None:
            more = tok.encode(" Thanks. And next?", add_special_tokens=False)
            wave = [
                ("turn2_sys1", waves[0][1][1] + outs["sys1"] + more, 24),
                ("turn2_long0", waves[0][3][1] + outs["long0"] + more, 24),
                ("turn2_sys4", waves[1][1][1] + outs["sys4"] + more, 16),
            ]
        with ThreadPoolExecutor(len(wave)) as ex:
            results = list(ex.map(lambda w: server.generate(input_ids=w[1], max_new_tokens=w[2]), wave))
        for (name, ids, n), r in zip(wave, results):
            inputs[name] = (ids, n)
            outs[name] = r["output_ids"]
            cached[name] = r["meta_info"]["cached_tokens"]
    return inputs, outs, cached


PROBE_NEW_TOKENS = 4


def _eviction_probe(server, tok, ssm_flood: bool) -> dict:
    """Sequential requests after the workload (pools: 640 KV tokens, 12 SSM slots, page
    size 1) whose hits are exact. ``probe`` (first token unlike any other prompt's, so it
    shares no prefix) is sent, then resent: it hits ``len - 1`` (its prompt-end checkpoint).
    With ``ssm_flood``, 14 short prompts (each its own branch, each leaving at least one
    state) follow: more than the 12 slots, all newer than the probe's states, so LRU SSM
    eviction takes the probe's states first and its resend hits 0; it is resent once more
    (hits ``len - 1`` again). Then prompts holding more than 640 KV tokens in all: under LRU
    the probe's KV (older than all of them) is evicted and its resend hits 0. Under any
    policy the probe and those prompts do not fit together, so once they are all sent at
    least one of them is missing and its resend (``resends``: (hit, length) each, the probe
    last) hits less than ``len - 1``: resends only re-insert themselves.

    Returns the hits by step name and the probe's length."""
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    probe = enc("Zebra probe: alpha beta gamma delta epsilon zeta eta theta iota kappa.")
    short = [enc(f"{w} {i} and {i + 1}.") for i, w in enumerate(
        ["Apple", "Bear", "Cat", "Dog", "Eel", "Fox", "Gnu", "Hen", "Ibis", "Jay", "Kite", "Lynx", "Mole", "Newt"])]
    filler = enc(" lorem ipsum dolor sit amet, consectetur adipiscing elit" * 12)
    big = [enc(w)[:1] + filler[:150] for w in ("Pear", "Quail", "Rook", "Vole", "Wren")]
    firsts = [p[0] for p in [probe, *short, *big]]
    assert len(set(firsts)) == len(firsts), "probe prompts must not share a first token"
    assert sum(len(p) + PROBE_NEW_TOKENS for p in big) > 640 and all(len(p) < 300 for p in big)

    def hit(ids):
        return server.generate(input_ids=ids, max_new_tokens=PROBE_NEW_TOKENS)["meta_info"]["cached_tokens"]

    hits = {"len": len(probe), "first": hit(probe), "resend": hit(probe)}
    if ssm_flood:
        for ids in short:
            hit(ids)
        hits["after_ssm_flood"] = hit(probe)
        hits["resend_again"] = hit(probe)
    for ids in big:
        hit(ids)
    if ssm_flood:
        hits["after_kv_flood"] = hit(probe)
    else:
        hits["resends"] = [(hit(ids), len(ids)) for ids in [*big, probe]]
    return hits


class _Workload(_Base):
    """One server per class, under the same small pools, running :func:`_workload`;
    outputs must equal the torch reference model's (so the servers agree token for token
    with each other: the cache changes nothing)."""

    __test__ = False  # a base: the subclasses run
    POOLS = ["--max-total-tokens", "640", "--max-mamba-cache-size", "12", "--chunked-prefill-size", "32"]
    FLAGS: list = []
    ENV: dict = {}
    PROBE = None  # None: no eviction probe; else whether it floods the SSM pool too

    @classmethod
    def setUpClass(cls):
        cls._setup_model()
        server = cls._start(cls.__name__, [*cls.FLAGS, *cls.POOLS], env=cls.ENV)
        cls.inputs, cls.outs, cls.cached = _run_workload(server, cls.tok)
        cls.idle_load = idle_and_checked(server) if cls.PROBE is not None else None
        cls.probe = _eviction_probe(server, cls.tok, cls.PROBE) if cls.PROBE is not None else None
        cls.probe_idle_load = idle_and_checked(server) if cls.PROBE is not None else None
        cls.log = server.log_text()
        server.stop()

    def test_outputs_match_reference_model(self):
        for name, (ids, n) in sorted(self.inputs.items()):
            self.assertEqual(self.outs[name], self.ref.generate_greedy(ids, n), name)

    def check_radix_server(self):
        """Hits, exact probe hits, and idle checks passed with no KV held."""
        hits = [name for name, n in self.cached.items() if n > 0]
        self.assertGreaterEqual(len(hits), 3, self.cached)
        self.assertEqual(self.idle_load["num_used_tokens"], 0, self.idle_load)
        self.assertEqual(self.probe_idle_load["num_used_tokens"], 0, self.probe_idle_load)
        p = self.probe
        self.assertEqual(p["first"], 0, p)
        self.assertEqual(p["resend"], p["len"] - 1, p)
        if self.PROBE:
            self.assertEqual(p["after_ssm_flood"], 0, p)  # its states were evicted
            self.assertEqual(p["resend_again"], p["len"] - 1, p)
            self.assertEqual(p["after_kv_flood"], 0, p)  # its KV was evicted
        else:  # something was evicted: not every prompt still hits all but its last token
            self.assertTrue(any(h < n - 1 for h, n in p["resends"]), p)
        self.assertIn("sglang-mamba-ext: mamba_radix_ext tree cache", self.log)


class TestRadixWorkload(_Workload):
    """``--enable-mamba-radix`` with ``--mamba-track-interval 16`` (ping-pong checkpoints
    inside 32-token chunks); finished requests donate their newest decode checkpoint (the
    overlap-safe path GPU servers use) rather than the live state, so decode checkpoints
    get reused."""

    __test__ = True

    FLAGS = ["--device", "cpu", "--enable-mamba-radix", "--mamba-track-interval", "16", "--radix-eviction-policy", "lru"]
    ENV = {**SERVER_ENV, "SGLANG_MAMBA_EXT_FINISH_STATE": "checkpoint"}
    PROBE = True  # the probe's order is LRU's: named, since the default policy is adaptive

    def test_hit_evicted_and_idle_checked(self):
        self.check_radix_server()
        self.assertIn("ping-pong tracking on", self.log)
        self.assertIn("finish_state=checkpoint", self.log)


class TestRecomputeEvictionWorkload(_Workload):
    """The recompute-aware SSM eviction (issue 6, ``--radix-eviction-policy recompute``),
    with the live-state donation of non-overlap serving, under the same pressure. The probe
    floods KV only, and checks only that something was evicted: what this policy evicts
    first depends on recompute saved per byte, not recency (the probe itself survived
    the flood in one run)."""

    __test__ = True

    FLAGS = [
        "--device", "cpu", "--enable-mamba-radix", "--mamba-track-interval", "16",
        "--radix-eviction-policy", "recompute",
    ]
    ENV = SERVER_ENV
    PROBE = False

    def test_hit_evicted_and_idle_checked(self):
        self.check_radix_server()
        self.assertIn("eviction recompute", self.log)


class TestNoCacheWorkload(_Workload):
    """``--disable-radix-cache``: the baseline the radix servers must agree with."""

    __test__ = True

    FLAGS = ["--device", "cpu", "--disable-radix-cache", "--disable-overlap-schedule"]

    def test_caches_nothing(self):
        self.assertEqual(sum(self.cached.values()), 0, self.cached)


if __name__ == "__main__":
    unittest.main()
