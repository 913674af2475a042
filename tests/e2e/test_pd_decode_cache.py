"""End to end: the PD decode side with the plugin (issue 42 item 2).

One set for the class: a prefill server (``--enable-mamba-radix``) and a decode server with
``--enable-mamba-radix --disaggregation-decode-enable-radix-cache`` (the plugin's pool and
tree on the decode side, ``plugin/pd_decode.py``), both over mooncake's TCP transport, and
sglang-router's ``--mini-lb`` in front (it forwards ``cache_salt`` to both servers as sent).

Per request the decode server's ``/server_info`` counters say what it asked the prefill
server for: ``pd_decode_prefix_tokens`` (SGLang's ``decode_prefix_len``: the prefix its tree
already holds) and ``pd_decode_kv_tokens_received`` (prompt minus that prefix); SGLang's
decode side without a tree asks for the whole prompt (``decode_prefix_len`` 0), which a
prompt in a fresh tenant shows on the same set. Greedy output and log-probabilities are
checked against ``TinyHybridReference`` (the state comes from the prefill server, the prefix
KV from the decode side's tree: both must be right). Strict idle checks run on both servers
after client aborts and after a transfer that never comes (SGLang's waiting timeout,
shortened to 20 s as in ``test_pd_faults.py``).
"""

import concurrent.futures
import random
import time
import unittest

import pytest
import requests

from pd_util import skip_without_pd, start_pd_pair, start_router
from server_util import CHECKED_ENV, idle_and_checked, tiny_class_setup

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW = 8
TIMEOUT_S = 20
#: SGLang's bootstrap / transfer waiting timeouts shortened, as in test_pd_faults.py
ENV = {**CHECKED_ENV, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(TIMEOUT_S),
       "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(TIMEOUT_S)}
DECODE_CACHE = ["--enable-mamba-radix", "--disaggregation-decode-enable-radix-cache"]


def turn_end(ids, out):
    """The decode side's hit on the next turn of a conversation: the whole previous prompt
    and output. The decode server schedules with overlap, so the step that sampled the last
    token is followed by one already launched that writes that token's KV and advances the
    working state past it; the finish donates that state at ``kv_committed_len`` =
    ``len(ids) + len(out)`` (without overlap, one less: ``tests/test_pd_decode.py``)."""
    return len(ids) + len(out)


def _ids(start, n):
    return [(start + 11 * i) % 700 + 3 for i in range(n)]


@skip_without_pd
class TestPdDecodeCache(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        tmp = tiny_class_setup(cls)
        bootstrap = start_pd_pair(cls, cls.model, tmp, ["--max-mamba-cache-size", "32"], DECODE_CACHE, env=ENV)
        cls.bootstrap = bootstrap
        cls.url = start_router(cls, tmp, "mini-lb", ["--pd-disaggregation", "--mini-lb"], bootstrap, "/health")

    def post(self, ids, n=NEW, timeout=300, **extra):
        return requests.post(self.url + "/generate", timeout=timeout, json={
            "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
            **extra})

    def gen(self, ids, n=NEW, **extra):
        import torch

        r = self.post(ids, n, return_logprob=True, **extra)
        r.raise_for_status()
        out = r.json()
        ref_ids = self.ref.generate_greedy(ids, n)
        self.assertEqual(out["output_ids"], ref_ids, f"prompt of {len(ids)}")
        logits, _ = self.ref.forward_tokens(ids + ref_ids[:-1])
        ref_lp = torch.log_softmax(logits[len(ids) - 1:], dim=-1)[torch.arange(n), torch.tensor(ref_ids)]
        got = torch.tensor([item[0] for item in out["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, ref_lp, atol=1e-4, rtol=0)
        return out

    @staticmethod
    def cache_of(server) -> dict:
        info = requests.get(server.base_url + "/server_info", timeout=60).json()
        return info["internal_states"][0]["mamba_radix"]

    def transfer(self, ids, n=NEW, **extra):
        """Run one request; returns ``(output ids, decode-side prefix, KV tokens sent, bytes)``
        from the decode server's counters (one request at a time)."""
        before = self.cache_of(self.decode)
        out = self.gen(ids, n, **extra)
        after = self.cache_of(self.decode)
        d = {k: after[k] - before[k] for k in after if k.startswith("pd_decode_")}
        self.assertEqual(d["pd_decode_transfers"], 1)
        self.assertEqual(d["pd_decode_prefix_tokens"] + d["pd_decode_kv_tokens_received"], len(ids))
        return out["output_ids"], d["pd_decode_prefix_tokens"], d["pd_decode_kv_tokens_received"], \
            d["pd_decode_bytes_received"]

    def test_1_three_turns_transfer_only_what_decode_lacks(self):
        ids = _ids(1, 45)
        rows = []
        want_hit = 0
        for turn in range(3):
            out, hit, kv, nbytes = self.transfer(ids)
            # the decode side's tree holds the previous turn's prompt + output, nothing of a
            # fresh conversation
            self.assertEqual(hit, want_hit, f"turn {turn + 1}")
            rows.append((turn + 1, len(ids), hit, kv, nbytes))
            want_hit = turn_end(ids, out)
            ids = ids + out + _ids(500 + 40 * turn, 12)
        # Without the decode-side tree SGLang asks for the whole prompt: the same last turn in
        # a fresh tenant (no prefix of it on either server) shows that figure on this set.
        last = rows[-1]
        prev_ids = ids[: last[1]]
        _, hit0, kv0, bytes0 = self.transfer(prev_ids, cache_salt="pd-decode-no-prefix")
        self.assertEqual((hit0, kv0), (0, last[1]))
        for turn, n, hit, kv, nbytes in rows[1:]:
            self.assertLess(kv, n, f"turn {turn} sends only what the decode side lacks")
        print("\nPD decode cache, per turn: prompt, decode-side hit, KV tokens sent, bytes received "
              "(KV + one SSM state)")
        for turn, n, hit, kv, nbytes in rows:
            print(f"  turn {turn}: prompt {n}, hit {hit}, KV tokens {kv} (without the decode cache {n}), "
                  f"bytes {nbytes}")
        print(f"  turn 3 without the decode cache: KV tokens {kv0}, bytes {bytes0}")

    def test_2_tenants_apart_on_the_decode_side(self):
        ids1 = _ids(200, 37)
        out1, hit, _, _ = self.transfer(ids1, cache_salt="tenant-a")
        self.assertEqual(hit, 0)
        ids2 = ids1 + out1 + _ids(650, 9)
        out_a, hit, _, _ = self.transfer(ids2, cache_salt="tenant-a")
        self.assertEqual(hit, turn_end(ids1, out1), "tenant a hits its own turn")
        out_b, hit, _, _ = self.transfer(ids2, cache_salt="tenant-b")
        self.assertEqual(hit, 0, "tenant b must not reuse tenant a's decode-side prefix")
        _, hit, _, _ = self.transfer(ids2)
        self.assertEqual(hit, 0, "a request without a salt must not reuse tenant a's prefix")
        ids3 = ids2 + out_b + _ids(660, 5)
        _, hit, _, _ = self.transfer(ids3, cache_salt="tenant-b")
        self.assertEqual(hit, turn_end(ids2, out_b), "tenant b hits its own turn")

    def test_3_aborts_leave_no_leak_on_either_server(self):
        # Conversations whose later turns hit the decode side, and clients that give up while
        # their request is prefilled, transferred or decoded; then both servers idle with
        # every slot back (strict idle checks) and nothing left locked in either tree.
        convs = []
        for k in range(3):
            ids = _ids(900 + 31 * k, 40 + 10 * k)
            out = self.gen(ids)["output_ids"]
            convs.append(ids + out + _ids(300 + k, 20))
        prompts = convs + [_ids(950 + 17 * k, 150 + 30 * k) for k in range(3)]
        timeouts = [0.02, 0.1, 0.4, 0.05, 0.2, 0.8]

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
        for server in (self.prefill, self.decode):
            cache = self.cache_of(server)
            self.assertEqual(cache["kv_protected_tokens"], 0)
            self.assertEqual(cache["ssm_protected_states"], 0)
        # both still serve exactly, a decode-side hit included
        ids = _ids(77, 30)
        out = self.gen(ids)["output_ids"]
        _, hit, _, _ = self.transfer(ids + out + [5, 6, 7])
        self.assertEqual(hit, turn_end(ids, out))
        for server in (self.prefill, self.decode):
            idle_and_checked(server, settle_s=1.0)

    def test_4_transfer_failure_after_a_decode_side_hit(self):
        # The next turn of a conversation sent to the decode server alone, with the prefill
        # server's bootstrap address and a room the prefill server never gets: the decode side
        # matches and locks its prefix, pre-allocates, and waits for KV that never comes
        # (SGLang's waiting timeout ends it). Then every slot is back on both servers and the
        # same turn through the router still hits the decode side exactly.
        ids = _ids(420, 33)
        out = self.gen(ids)["output_ids"]
        nxt = ids + out + _ids(640, 6)
        before = self.cache_of(self.decode)
        t0 = time.time()
        r = requests.post(self.decode.base_url + "/generate", timeout=300, json={
            "input_ids": nxt, "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap,
            "bootstrap_room": random.getrandbits(62)})
        took = time.time() - t0
        finish = (r.json().get("meta_info", {}).get("finish_reason") or {}) if r.status_code == 200 else {}
        self.assertTrue(r.status_code != 200 or finish.get("type") == "abort", r.text[:300])
        after = self.cache_of(self.decode)
        # it did reach the decode side's match: its prefix was the turn before
        self.assertEqual(after["pd_decode_prefix_tokens"] - before["pd_decode_prefix_tokens"], turn_end(ids, out))
        print(f"\n  transfer never came: HTTP {r.status_code} after {took:.1f} s")
        for server in (self.prefill, self.decode):
            idle_and_checked(server)
            cache = self.cache_of(server)
            self.assertEqual(cache["kv_protected_tokens"], 0)
            self.assertEqual(cache["ssm_protected_states"], 0)
        _, hit, _, _ = self.transfer(nxt)
        self.assertEqual(hit, turn_end(ids, out))
        for server in (self.prefill, self.decode):
            idle_and_checked(server, settle_s=1.0)


if __name__ == "__main__":
    unittest.main()
