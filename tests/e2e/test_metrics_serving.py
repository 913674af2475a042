"""End to end: the hybrid cache's Prometheus series and ``/server_info`` entry (issue 11,
item 6; ``docs/design.md``, "Metrics").

One server: the tiny hybrid model on CPU with ``--enable-mamba-radix --enable-metrics`` and
the ``kda_cache`` warm-up of two prompts, under SGLang's idle leak checks. ``/metrics`` is
scraped before and after each request, and the ``sglang:mamba_radix_*`` series must move by
exactly what the request did (expected values computed from the token ids):

- the warm-up counters equal the warm-up's prompts and tokens;
- a fresh prompt (no token shared with anything cached) matches nothing and leaves its
  prompt-end checkpoint (at ``len - 1``) and its finish state; the same prompt resent matches ``len - 1``
  tokens as KV, all usable, ends on the prompt-end state, takes one copy-on-write copy, and
  its ``cached_tokens`` says the same;
- a request diverging inside that prompt at a point with no state matches KV only (no
  usable token) and plants a branch checkpoint; the next one diverging there hits it;
- ``/server_info``'s ``internal_states[0]["mamba_radix"]`` reports the cache's settings and
  the same counters, and the gauges agree with it at idle;
- with ``--enable-cache-report`` a resent chat reports its hit in the OpenAI ``usage``
  (``prompt_tokens_details.cached_tokens``), the same tokens the counters moved by.
"""

import json
import os
import tempfile
import unittest
import uuid

import pytest
from conftest import tiny_model_dir
from server_util import CHECKED_ENV, Server, idle_and_checked, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW_TOKENS = 8
GRID = 8  # the tiny model's checkpoint grid (mamba_chunk_size)
SYSTEM = "You are a terse assistant. Answer in one line."
POLICY = "Policy: be kind, be brief, cite nothing."
PREFIX = "sglang:mamba_radix_"


def scrape(server) -> dict:
    """The ``sglang:mamba_radix_*`` samples of ``/metrics``: ``name`` or
    ``name{kind|policy}`` -> value (one scheduler, so one series per name and label)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.base_url + "/metrics", timeout=60).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(PREFIX) or s.name.endswith("_created"):
                continue
            extra = s.labels.get("kind") or s.labels.get("policy")
            out[s.name[len(PREFIX):] + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def settle(server) -> None:
    """Wait until the scheduler holds no request (``/v1/loads``). Not ``/health``: SGLang's
    health check generates a 1-token request, which the counters would count."""
    ok = wait_for(lambda: not any(server.loads()[k] for k in ("num_running_reqs", "num_waiting_reqs")), 120, 0.2)
    assert ok, "server not idle"


def moved(before: dict, after: dict) -> dict:
    """Counters and gauges that changed, by how much (ints)."""
    return {k: int(after[k] - before.get(k, 0)) for k in after if after[k] != before.get(k, 0)}


class TestMetricsServing(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from transformers import AutoTokenizer

        cls.tmp = tempfile.TemporaryDirectory(prefix="mamba-radix-metrics-")
        cls.addClassCleanup(cls.tmp.cleanup)
        cls.model_dir = tiny_model_dir()
        cls.tok = AutoTokenizer.from_pretrained(cls.model_dir)
        prompts = os.path.join(cls.tmp.name, "prompts.jsonl")
        with open(prompts, "w") as f:
            f.write(json.dumps({"messages": [{"role": "system", "content": SYSTEM}]}) + "\n")
            f.write(json.dumps({"text": POLICY}) + "\n")
        cls.server = Server(
            cls.model_dir,
            [
                "--device", "cpu", "--enable-mamba-radix", "--enable-metrics", "--enable-cache-report",
                "--warmups", "kda_cache", "--warmup-prompts-file", prompts,
            ],
            os.path.join(cls.tmp.name, "server.log"),
            env=dict(CHECKED_ENV),
        )
        cls.addClassCleanup(cls.server.stop)
        cls.server.wait_healthy()

    def fresh_prompt(self, text):
        """Token ids of ``text`` without special tokens, checked to share no first token
        with anything the server has cached (its own warm-up request and ours start with
        other tokens), so the first send matches nothing."""
        ids = self.tok.encode(text, add_special_tokens=False)
        for other in (
            self.tok.apply_chat_template([{"role": "system", "content": SYSTEM}], tokenize=True),
            self.tok.encode(POLICY),
            self.tok.encode("The capital city of France is"),
        ):
            other = list(other["input_ids"]) if hasattr(other, "keys") else list(other)
            self.assertNotEqual(ids[0], other[0])
        return ids

    def test_a_warmup_counters(self):
        chat = self.tok.apply_chat_template([{"role": "system", "content": SYSTEM}], tokenize=True)
        chat = list(chat["input_ids"]) if hasattr(chat, "keys") else list(chat)
        tokens = len(chat) + len(self.tok.encode(POLICY))
        m = scrape(self.server)
        self.assertEqual(m["warmup_prompts_total"], 2)
        self.assertEqual(m["warmup_tokens_total"], tokens)
        # The second pass resends each prompt plus its first output token: it hits the whole
        # prompt (the first pass's finish state).
        self.assertEqual(m["warmup_hit_tokens_total"], tokens)
        self.assertIn(f"the second pass hit {tokens} cached tokens", self.server.log_text())

    def generate_measured(self, ids, label):
        """Greedy ``/generate`` of ``ids``; returns the response and how the cache's series
        moved over it (after the server settled)."""
        before = scrape(self.server)
        out = self.server.generate(input_ids=ids, max_new_tokens=NEW_TOKENS)
        settle(self.server)
        d = moved(before, scrape(self.server))
        print(label + ":", json.dumps(d, sort_keys=True))
        return out, d

    def test_b_fresh_prompt_then_resend(self):
        ids = self.fresh_prompt("Zebras graze quietly near the river while seven herons watch. " * 2)
        n = len(ids)
        self.assertNotEqual(n % GRID, 0)  # off the grid: only the prompt-end state serves a resend
        self.assertNotEqual((n - 1) % GRID, 0)
        first, d = self.generate_measured(ids, f"fresh prompt of {n} tokens")
        self.assertEqual(first["meta_info"]["cached_tokens"], 0)
        self.assertEqual(d.get("matches_total"), 1)
        self.assertEqual(d.get("prompt_tokens_total"), n)
        self.assertNotIn("kv_match_tokens_total", d)
        self.assertNotIn("prefix_tokens_total", d)
        self.assertNotIn("cow_copies_total", d)
        # States the tree took: the prompt-end checkpoint (n - 1) and the finish state
        # (n + NEW_TOKENS - 1: the last output token is never fed); a one-chunk prefill
        # shorter than --mamba-track-interval (256) inserts no ping-pong checkpoint.
        self.assertEqual(d.get("checkpoints_total{prompt_end}"), 1)
        self.assertEqual(d.get("checkpoints_total{finish}"), 1)
        self.assertNotIn("checkpoints_total{ping_pong}", d)
        self.assertEqual(d.get("ssm_states"), 2)
        self.assertEqual(d.get("kv_tokens"), n + NEW_TOKENS - 1)

        again, d = self.generate_measured(ids, "resent")
        self.assertEqual(again["meta_info"]["cached_tokens"], n - 1)
        self.assertEqual(again["output_ids"], first["output_ids"])
        self.assertEqual(d.get("matches_total"), 1)
        self.assertEqual(d.get("prompt_tokens_total"), n)
        self.assertEqual(d.get("kv_match_tokens_total"), n - 1)
        self.assertEqual(d.get("prefix_tokens_total"), n - 1)
        self.assertEqual(d.get("checkpoint_hits_total{prompt_end}"), 1)
        self.assertEqual(sum(v for k, v in d.items() if k.startswith("checkpoint_hits_total")), 1)
        self.assertEqual(d.get("cow_copies_total"), 1)
        self.__class__.resend_ids = ids

    def test_c_kv_only_match_then_branch_hit(self):
        base = getattr(self.__class__, "resend_ids", None)
        if base is None:
            self.skipTest("needs test_b's prompt in the cache")
        k = 13  # inside the cached prompt, below its first grid checkpoint: no state there
        self.assertLess(k, len(base) // GRID * GRID)
        one = base[:k] + self.tok.encode("Lions roar.", add_special_tokens=False)
        two = base[:k] + self.tok.encode("Owls hoot at night.", add_special_tokens=False)
        self.assertNotEqual(one[k], base[k])
        self.assertNotEqual(two[k], base[k])
        self.assertNotEqual(one[k], two[k])
        out, d = self.generate_measured(one, "diverging inside it")
        self.assertEqual(out["meta_info"]["cached_tokens"], 0)
        self.assertEqual(d.get("kv_match_tokens_total"), k)  # KV present ...
        self.assertNotIn("prefix_tokens_total", d)  # ... but no state at k: not a hit
        self.assertEqual(d.get("checkpoints_total{branch}"), 1)
        out, d = self.generate_measured(two, "second diverging")
        self.assertEqual(out["meta_info"]["cached_tokens"], k)
        self.assertEqual((d.get("kv_match_tokens_total"), d.get("prefix_tokens_total")), (k, k))
        self.assertEqual(d.get("checkpoint_hits_total{branch}"), 1)

    def test_d_server_info_agrees_with_metrics(self):
        import requests

        settle(self.server)
        info = requests.get(self.server.base_url + "/server_info", timeout=60).json()
        entry = info["internal_states"][0]["mamba_radix"]
        self.assertEqual(entry["backend"], "mamba_radix_ext")
        self.assertEqual(entry["eviction_policy"], "adaptive")  # --enable-mamba-radix's default
        self.assertEqual(entry["mamba_track_interval"], 256)
        self.assertTrue(entry["ping_pong_tracking"])
        self.assertTrue(entry["exact_prefix_checkpoints"])
        self.assertEqual(entry["ssm_slots_total"], 128)
        m = scrape(self.server)
        for key in ("matches", "kv_match_tokens", "prefix_tokens", "cow_copies"):
            self.assertEqual(entry[key], m[key + "_total"], key)
        for key in ("kv_tokens", "ssm_states", "tombstones"):
            self.assertEqual(entry[key], m[key], key)
        # At idle nothing is locked: every SSM slot is free or in the tree.
        self.assertEqual(entry["ssm_slots_free"] + entry["ssm_states"], entry["ssm_slots_total"])
        self.assertEqual(entry["kv_protected_tokens"], 0)

    def test_e_cache_report_in_chat_usage(self):
        import requests

        body = {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": "Quokkas only. Reply in five words."},
                {"role": "user", "content": "Which animal smiles most?"},
            ],
            "max_tokens": 4,
            "temperature": 0,
        }
        url = self.server.base_url + "/v1/chat/completions"
        first = requests.post(url, json=body, timeout=300).json()["usage"]
        settle(self.server)
        m0 = scrape(self.server)
        second = requests.post(url, json=body, timeout=300).json()["usage"]
        settle(self.server)
        d = moved(m0, scrape(self.server))
        self.assertEqual(second["prompt_tokens"], first["prompt_tokens"])
        cached = second["prompt_tokens_details"]["cached_tokens"]
        self.assertEqual(cached, second["prompt_tokens"] - 1)  # the prompt-end checkpoint
        self.assertEqual(d.get("prefix_tokens_total"), cached)
        self.assertEqual(d.get("prompt_tokens_total"), second["prompt_tokens"])

    def test_e_tenant_isolation_in_chat(self):
        """Issue 23: ``cache_salt`` in a ``/v1/chat/completions`` body keeps tenants apart
        exactly (``usage.prompt_tokens_details.cached_tokens``)."""
        from isolation import chat_length, check_isolation, openai_sender

        messages = [{"role": "system", "content": f"Tenant check {uuid.uuid4().hex}. Reply briefly."},
                    {"role": "user", "content": "Which bird sings at dawn?"}]
        length = chat_length(self.tok, messages)
        send = openai_sender(self, self.server.base_url, "/v1/chat/completions", length)
        check_isolation(self, send, messages, length, unsalted=False)

    def test_f_survives_sglangs_idle_checks(self):
        idle_and_checked(self.server)


if __name__ == "__main__":
    unittest.main()
