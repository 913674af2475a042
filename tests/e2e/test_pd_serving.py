"""End to end: prefill/decode disaggregation with the plugin on the prefill server (issue 14).

One set for the class, as ``scripts/serve_cpu_pd.sh`` starts it: a prefill server with
``--enable-mamba-radix`` and the ``kda_cache`` warm-up, a decode server (SGLang's own pool;
the decode side with the plugin: ``test_pd_decode_cache.py``), both ``--disaggregation-transfer-backend
mooncake_tcp`` (mooncake's non-CUDA wheel, TCP transport), and ``sglang-router`` in PD mode.
The decode server only ever sees the KV and SSM state the prefill server sends, so greedy
output equal to ``TinyHybridReference.generate_greedy`` token for token, with log-probabilities
within 1e-4, means both arrived intact (a zeroed or mis-sliced SSM state changes them). Hits on
the prefill side are asserted exactly; SGLang's strict idle checks (leaks) run on both servers.
The prefill server runs ``--tp 2`` and the decode server ``--tp 1`` (one set keeps CI short,
and it covers the harder case): each prefill rank holds half of the heads (KV heads, and the
SSM state's heads and conv channels split per q / k / v group, ``models/tiny_shard.py``), the
decode server holds them whole, so the transfer must put each rank's slices at their places
(conv state per group, not as one block: sglang #22060). The equal-TP case (what
``scripts/serve_cpu_pd.sh`` runs by default) is the same transfer with one rank. Skipped when
``sglang_router`` or mooncake is not installed (``scripts/setup_env.sh`` installs both).
"""

import concurrent.futures
import json
import os
import unittest

import pytest
import requests

from isolation import chat_length, check_isolation, check_warm_prompt_not_shared, openai_sender
from pd_util import skip_without_pd, start_pd_pair, start_router
from server_util import CHECKED_ENV, common_prefix, idle_and_checked, tiny_class_setup

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW = 8
CHUNK = 8  # TinyHybridSGLangConfig.mamba_chunk_size: SGLang's prefill tracking grid


def _ids(start, n):
    return [(start + 7 * i) % 700 + 3 for i in range(n)]


WARM = _ids(300, 40)  # the kda_cache warm-up prompt of the prefill server


@skip_without_pd
class TestPrefillDecodeServing(unittest.TestCase):
    """One prefill (``--tp 2``) + decode (``--tp 1``) + router set for the class."""

    PREFILL_FLAGS = ["--tp", "2"]  # for the prefill server only

    @classmethod
    def setUpClass(cls):
        tmp = tiny_class_setup(cls)
        model = cls.model
        warm = os.path.join(tmp, "warm.jsonl")
        with open(warm, "w") as f:
            f.write(json.dumps({"input_ids": WARM}) + "\n")
        bootstrap = start_pd_pair(
            cls, model, tmp,
            ["--max-mamba-cache-size", "32", "--warmups", "kda_cache", "--warmup-prompts-file", warm,
             *cls.PREFILL_FLAGS], [], env=CHECKED_ENV)
        from transformers import AutoTokenizer

        cls.tok = AutoTokenizer.from_pretrained(model)
        # sglang-router (Rust) as serve_cpu_pd.sh starts it, and sglang-router's own Python
        # mini load balancer (--mini-lb, ROUTER=mini there) in front of the same pair: the
        # Rust router re-serializes requests without cache_salt, the mini one forwards them as sent.
        cls.url = start_router(cls, tmp, "router", ["--pd-disaggregation"], bootstrap, "/readiness")
        cls.mini_url = start_router(cls, tmp, "mini-lb", ["--pd-disaggregation", "--mini-lb"], bootstrap,
                                    "/health")

    def post(self, ids, n=NEW, timeout=300, url=None, **extra):
        return requests.post((url or self.url) + "/generate", timeout=timeout, json={
            "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
            **extra})

    def gen(self, ids, n=NEW):
        import torch

        r = self.post(ids, n, return_logprob=True)
        r.raise_for_status()
        out = r.json()
        ref_ids = self.ref.generate_greedy(ids, n)
        self.assertEqual(out["output_ids"], ref_ids, f"prompt of {len(ids)}")
        # the log-probabilities too: a state off by a little would still often pick the
        # same greedy tokens
        logits, _ = self.ref.forward_tokens(ids + ref_ids[:-1])
        ref_lp = torch.log_softmax(logits[len(ids) - 1:], dim=-1)[torch.arange(n), torch.tensor(ref_ids)]
        got = torch.tensor([item[0] for item in out["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, ref_lp, atol=1e-4, rtol=0)
        return out

    def prefill_cache(self) -> dict:
        info = requests.get(self.prefill.base_url + "/server_info", timeout=60).json()
        return info["internal_states"][0]["mamba_radix"]

    def test_1_warmup_cached_on_prefill(self):
        # The warm-up ran on the prefill server (fake bootstrap, SGLang would keep it out of
        # the tree): a prompt extending the warmed one hits all of it (the first pass's finish
        # state sits at len(WARM); the suffix avoids the warm-up's own next token, whose
        # second-pass state lies one token deeper).
        first = self.ref.generate_greedy(WARM, 1)[0]
        suffix = [t for t in (11, 12, 13, 14) if t != first][:3]
        out = self.gen(WARM + suffix)
        self.assertEqual(out["meta_info"]["cached_tokens"], len(WARM))
        # Issue 23: a salted request (through --mini-lb, which keeps cache_salt) does not
        # reuse the unsalted warm-up; checked here, before later tests' states can evict it
        # (32 SSM slots).
        check_warm_prompt_not_shared(self, lambda ids, ns: self.cached(ids, ns, "cache_salt", self.mini_url),
                                     WARM, [t for t in (21, 22, 23) if t != first], len(WARM))

    def test_2_turns_equal_single_server_and_hit_on_prefill(self):
        ids1 = _ids(1, 45)
        out1 = self.gen(ids1)
        # the next turn: the conversation so far plus a new user message
        ids2 = ids1 + out1["output_ids"] + _ids(500, 12)
        out2 = self.gen(ids2)
        # What the prefill server cached of turn 1: it ran the prompt and sampled one token
        # (the decode server produced the rest), so its states on that path are the prompt's
        # len - 1 checkpoint, the end of its prefill when on the 8-token tracking grid, and
        # its finish state at len(prompt) (prompt + first token, minus one).
        path = ids1 + out1["output_ids"][:1]
        shared = common_prefix(ids2, path)
        states = [0, len(ids1) - 1, len(path) - 1] + ([len(ids1)] if len(ids1) % CHUNK == 0 else [])
        want = max(s for s in states if s <= min(shared, len(ids2) - 1))
        self.assertEqual(want, len(ids1))  # the test's own set-up: the finish state is on the path
        self.assertEqual(out2["meta_info"]["cached_tokens"], want)
        # a concurrent batch of different prompts through the same pair: still exact
        prompts = [_ids(40 + 13 * k, 20 + 9 * k) for k in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(self.gen, prompts))

    def cached(self, ids, ns, field, url):
        """``cached_tokens`` (the prefill server's hit) of a 2-token request through ``url``
        with namespace ``ns`` in body field ``field``."""
        r = self.post(ids, 2, url=url, **({field: ns} if ns is not None else {}))
        r.raise_for_status()
        out = r.json()
        self.assertEqual(out["output_ids"], self.ref.generate_greedy(ids, 2))
        return out["meta_info"]["cached_tokens"]

    def test_2a_isolation_through_sglang_router(self):
        """Issue 23: sglang-router (Rust) forwards SGLang's ``extra_key`` on ``/generate``
        and ``cache_salt`` on ``/v1/completions`` (``cache_salt`` on ``/generate`` it drops:
        ``tests/test_router_forwarding.py``), and the prefill server keeps tenants apart exactly."""
        check_isolation(self, lambda ids, ns: self.cached(ids, ns, "extra_key", self.url))

        text = "Completions tenant check: name three lakes and one river. "
        length = len(self.tok.encode(text))
        check_isolation(self, openai_sender(self, self.url, "/v1/completions", length), text, length)

    def test_2b_isolation_through_mini_lb_by_cache_salt(self):
        """Issue 23: through sglang-router's ``--mini-lb`` the body reaches both servers as
        sent, so ``cache_salt`` keeps tenants apart exactly on ``/generate`` and
        ``/v1/chat/completions`` (the warm-up rule: ``test_1``)."""
        check_isolation(self, lambda ids, ns: self.cached(ids, ns, "cache_salt", self.mini_url))

        messages = [{"role": "system", "content": "PD tenant check. Reply briefly."},
                    {"role": "user", "content": "Which river is longest?"}]
        length = chat_length(self.tok, messages)
        check_isolation(self, openai_sender(self, self.mini_url, "/v1/chat/completions", length), messages, length,
                        unsalted=False)

    def test_3_client_aborts_leave_no_leak(self):
        # Clients that give up while their request is being prefilled, transferred or decoded
        # (timeouts from a few ms on: where each one lands is up to the scheduler), then
        # both servers must go idle with every slot back (SGLang's strict idle checks).
        prompts = [_ids(900 + 31 * k, 150 + 30 * k) for k in range(6)]
        timeouts = [0.02, 0.05, 0.1, 0.2, 0.4, 0.8]

        def give_up(args):
            ids, t = args
            try:
                self.post(ids, n=48, timeout=t)
            except requests.RequestException:
                pass

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(give_up, zip(prompts, timeouts)))
        for server in (self.prefill, self.decode):
            idle_and_checked(server)
        # and both still serve, exactly
        self.gen(_ids(77, 30))
        for server in (self.prefill, self.decode):
            idle_and_checked(server, settle_s=1.0)
        cache = self.prefill_cache()
        self.assertEqual(cache["kv_protected_tokens"], 0)
        self.assertEqual(cache["ssm_protected_states"], 0)


if __name__ == "__main__":
    unittest.main()
