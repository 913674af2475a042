"""End to end: the PD decode side with the plugin (issue 42 item 2).

One set for the class: a prefill server (``--enable-mamba-radix``) and a decode server with
``--enable-mamba-radix --disaggregation-decode-enable-radix-cache`` (the plugin's pool and
tree on the decode side, ``plugin/pd_decode.py``) and ``--enable-hierarchical-cache`` (its
host tier; ``test_7``), both over mooncake's TCP transport, and
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

Faults with the decode-side tree (issue 42 item 2, ``test_4`` to ``test_6``; the faults of
``test_pd_faults.py`` with the plugin on the decode side too): a transfer that never comes, a
request aborted (``/abort_request``) and a stream cut while the decode server decodes, and the
prefill server killed while it prefills (then started again on its ports). Each fault lands on
the next turn of a conversation in one tenant, after its decode-side match locked the
previous turn; after it (:meth:`TestPdDecodeCache.after_fault`) the decode server is idle with
every slot back (SGLang's strict idle checks, ``/v1/loads`` ``num_used_tokens`` 0, nothing
locked in its tree), another tenant and a request without a salt hit 0 of that prefix on the
decode side, and the tenant's own resend hits exactly the previous turn, its output and
log-probabilities equal to the reference.
"""

import concurrent.futures
import random
import threading
import time
import unittest

import pytest
import requests

from pd_util import skip_without_pd, start_pd_pair, start_router
from server_util import CHECKED_ENV, idle_and_checked, tiny_class_setup, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW = 8
TIMEOUT_S = 20
#: SGLang's bootstrap / transfer waiting timeouts shortened, as in test_pd_faults.py
#: A decode server holds the KV pages of a transfer the prefill side broke off (e.g. a killed
#: prefill server) until the prefill acknowledges the drain, or this many seconds
#: (``disaggregation/decode.py``, ``_defer_release`` / ``resolve_deferred_releases``; SGLang's
#: default 30 s): remote writes may still be in flight. Shortened here like the timeouts above.
DEFERRED_RELEASE_S = 4
ENV = {**CHECKED_ENV, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(TIMEOUT_S),
       "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(TIMEOUT_S),
       "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(DEFERRED_RELEASE_S)}
DECODE_CACHE = ["--enable-mamba-radix", "--disaggregation-decode-enable-radix-cache"]
#: The class's decode server also runs the plugin's host tier (SGLang's decode-side HiCache
#: switch, ``--hicache-ratio`` 2 by default: 4096 host KV tokens) over 2048 device KV tokens,
#: so every test goes through SGLang's HiCache decode path (``plugin/pd_decode.py``'s restore
#: hook) and ``test_7`` pushes a conversation's prefix out to host memory.
DECODE_KV_TOKENS = 2048
DECODE_FLAGS = [*DECODE_CACHE, "--enable-hierarchical-cache", "--max-total-tokens", str(DECODE_KV_TOKENS)]


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
        # 64-token prefill chunks: a long prompt is prefilled in several batches, so test_6
        # kills the prefill server mid-prompt
        bootstrap = start_pd_pair(cls, cls.model, tmp, ["--max-mamba-cache-size", "32", "--chunked-prefill-size", "64"],
                                  DECODE_FLAGS, env=ENV)
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

    def released(self, server) -> float:
        """Idle with every slot back: SGLang's strict idle checks, ``/v1/loads``
        ``num_used_tokens`` 0 (a decode server may hold a broken-off transfer's pages up to
        :data:`DEFERRED_RELEASE_S` first: waited for) and nothing locked in the server's
        tree. Returns the seconds waited for the held pages."""
        if idle_and_checked(server)["num_used_tokens"]:
            t0 = time.time()
            used = wait_for(lambda: server.loads()["num_used_tokens"] == 0, timeout_s=DEFERRED_RELEASE_S + 30)
            self.assertTrue(used, f"KV tokens still in use: {server.loads()['num_used_tokens']}")
            waited = time.time() - t0
            idle_and_checked(server, settle_s=1.0)
        else:
            waited = 0.0
        cache = self.cache_of(server)
        self.assertEqual(cache["kv_protected_tokens"], 0)
        self.assertEqual(cache["ssm_protected_states"], 0)
        return waited

    def after_fault(self, nxt, salt, want_hit, released=True, unsalted=True):
        """After a fault on the turn ``nxt`` of ``salt``'s conversation: every slot back on
        both servers (``released``: not checked yet), then on the decode side another tenant
        and (``unsalted``) a request without a salt hit 0 of it, and ``salt``'s own resend
        hits ``want_hit`` (the turn before) exactly, output and log-probabilities equal to the
        reference. Returns ``salt``'s output."""
        if released:
            for server in (self.prefill, self.decode):
                self.released(server)
        _, hit, _, _ = self.transfer(nxt, cache_salt=salt + "-other")
        self.assertEqual(hit, 0, "another tenant must not reuse the prefix on the decode side")
        if unsalted:
            _, hit, _, _ = self.transfer(nxt)
            self.assertEqual(hit, 0, "a request without a salt must not reuse the tenant's prefix")
        out, hit, _, _ = self.transfer(nxt, cache_salt=salt)
        self.assertEqual(hit, want_hit, "the tenant's decode-side prefix after the fault")
        for server in (self.prefill, self.decode):
            idle_and_checked(server, settle_s=1.0)
        return out

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
        # The next turn of a tenant's conversation sent to the decode server alone, with the
        # prefill server's bootstrap address and a room the prefill server never gets: the
        # decode side matches and locks its prefix, pre-allocates, and waits for KV that never
        # comes (SGLang's waiting timeout ends it). Then every slot is back on both servers and
        # the same turn through the router still hits the decode side exactly.
        salt = "fault-transfer"
        ids = _ids(420, 33)
        out = self.gen(ids, cache_salt=salt)["output_ids"]
        nxt = ids + out + _ids(640, 6)
        before = self.cache_of(self.decode)
        t0 = time.time()
        r = requests.post(self.decode.base_url + "/generate", timeout=300, json={
            "input_ids": nxt, "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap,
            "bootstrap_room": random.getrandbits(62), "cache_salt": salt})
        took = time.time() - t0
        finish = (r.json().get("meta_info", {}).get("finish_reason") or {}) if r.status_code == 200 else {}
        self.assertTrue(r.status_code != 200 or finish.get("type") == "abort", r.text[:300])
        after = self.cache_of(self.decode)
        # it did reach the decode side's match: its prefix was the turn before
        self.assertEqual(after["pd_decode_prefix_tokens"] - before["pd_decode_prefix_tokens"], turn_end(ids, out))
        print(f"\n  transfer never came: HTTP {r.status_code} after {took:.1f} s")
        self.after_fault(nxt, salt, turn_end(ids, out))

    def test_5_abort_and_stream_cut_while_decoding_after_a_hit(self):
        # Two tenants' next turns hit the decode side, then end while the decode server
        # decodes them: one aborted by its rid (``/abort_request`` on the decode server), one
        # a stream the client closes after its first chunk (SGLang aborts it when the
        # connection goes; or it runs to its end).
        turns = {}
        for k, salt in enumerate(("fault-abort", "fault-cut")):
            ids = _ids(480 + 13 * k, 35 + 4 * k)
            out = self.gen(ids, cache_salt=salt)["output_ids"]
            turns[salt] = (ids + out + _ids(690 - 9 * k, 7), turn_end(ids, out))
        before = self.cache_of(self.decode)
        rid = f"pd-decode-abort-{random.getrandbits(32)}"
        result = {}

        def aborted():
            result["abort"] = self.post(turns["fault-abort"][0], n=400, rid=rid, cache_salt="fault-abort")

        def cut():
            body = {"input_ids": turns["fault-cut"][0], "cache_salt": "fault-cut", "stream": True,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}}
            with requests.post(self.url + "/generate", json=body, stream=True, timeout=300) as r:
                for line in r.iter_lines():
                    if line:
                        result["cut_first"] = line[:80]
                        break  # closes the connection

        t = threading.Thread(target=aborted)
        t.start()
        deadline = time.time() + 120
        while self.decode.loads()["num_running_reqs"] < 1:
            self.assertLess(time.time(), deadline, "the request never reached the decode batch")
            time.sleep(0.05)
        a = requests.post(self.decode.base_url + "/abort_request", json={"rid": rid}, timeout=60)
        self.assertEqual(a.status_code, 200, a.text)
        t.join(300)
        self.assertFalse(t.is_alive())
        cut()
        r = result["abort"]
        finish = (r.json().get("meta_info", {}).get("finish_reason") or {}) if r.status_code == 200 else {}
        self.assertTrue(r.status_code != 200 or finish.get("type") == "abort", r.text[:300])
        after = self.cache_of(self.decode)
        self.assertEqual(after["pd_decode_prefix_tokens"] - before["pd_decode_prefix_tokens"],
                         sum(hit for _, hit in turns.values()), "both turns hit the decode side")
        print(f"\n  aborted while decoding: HTTP {r.status_code} {finish}, "
              f"{len(r.json().get('output_ids') or []) if r.status_code == 200 else 0} tokens; stream cut "
              f"after {result.get('cut_first')!r}")
        for k, (salt, (nxt, hit)) in enumerate(turns.items()):
            self.after_fault(nxt, salt, hit, released=k == 0)

    def test_6_prefill_killed_after_a_decode_side_hit(self):
        # A tenant's next turn (a long one: 64-token prefill chunks) hits the decode side,
        # which locks its prefix and pre-allocates; the prefill server is killed while it
        # prefills. The decode side frees the request (its heartbeat to the prefill server
        # fails), the prefill server starts again on its ports with an empty tree, and the
        # same turn hits the decode side's prefix exactly: the new prefill server sends only
        # the KV past it and the whole state.
        salt = "fault-prefill-killed"
        ids = _ids(530, 41)
        out = self.gen(ids, cache_salt=salt)["output_ids"]
        nxt = ids + out + _ids(17, 320)  # 6 prefill chunks
        before = self.cache_of(self.decode)
        marker = len(self.prefill.log_text())
        result = {}

        def client():
            try:
                result["r"] = self.post(nxt, n=8, cache_salt=salt)
            except requests.RequestException as e:
                result["r"] = e

        t = threading.Thread(target=client)
        t.start()
        deadline = time.time() + 60
        while "Prefill batch" not in self.prefill.log_text()[marker:]:
            self.assertTrue(t.is_alive() and time.time() < deadline, "the request never showed on the prefill server")
            time.sleep(0.01)
        killed_at = time.time()
        port = self.prefill.port
        self.prefill.stop()
        t.join(150)
        self.assertFalse(t.is_alive(), "the client got no answer 150 s after the kill")
        answer = result["r"]
        self.assertTrue(isinstance(answer, Exception) or answer.status_code != 200
                        or (answer.json()["meta_info"].get("finish_reason") or {}).get("type") == "abort",
                        getattr(answer, "text", answer))
        after = self.cache_of(self.decode)
        self.assertEqual(after["pd_decode_prefix_tokens"] - before["pd_decode_prefix_tokens"], turn_end(ids, out))
        # the decode side lets the request go once its heartbeat to the dead prefill fails,
        # and its pages after SGLang's deferred release (no drain ack from a dead prefill)
        answered = time.time() - killed_at
        held = self.released(self.decode)
        print(f"\n  prefill killed: client answer "
              f"{type(answer).__name__ if isinstance(answer, Exception) else answer.status_code} "
              f"{answered:.1f} s after the kill; decode side's pages back {time.time() - killed_at:.1f} s "
              f"after it ({held:.1f} s of deferred release after idle)")
        self.prefill.wait_healthy()
        self.assertEqual(self.prefill.port, port, "restarted on another port: the router would not find it")
        # (a request without a salt: test_4 and test_5)
        self.after_fault(nxt, salt, turn_end(ids, out), unsalted=False)

    def test_7_decode_side_prefix_back_from_the_host_tier(self):
        # On an emptied decode-side tree: a conversation's first turn, then fresh prompts in
        # other tenants, more KV than the decode server's device pool holds, so the eviction
        # moves the oldest leaf (the conversation's prefix, KV and state) to host memory.
        # The next turn's decode-side match loads it back: the exact hit, output and
        # log-probabilities equal to the reference, the KV loaded from the host tier.
        for server in (self.prefill, self.decode):
            idle_and_checked(server, settle_s=1.0)
        r = requests.post(self.decode.base_url + "/flush_cache", timeout=60)
        self.assertEqual(r.status_code, 200, r.text)
        salt = "host-tier"
        ids = _ids(560, 40)
        out = self.gen(ids, cache_salt=salt)["output_ids"]
        pushed = 0
        for k in range(4):
            r = self.post(_ids(100 + 37 * k, 600), n=4, cache_salt=f"host-tier-push-{k}")
            self.assertEqual(r.status_code, 200, r.text[:300])
            pushed += 604
        self.assertGreater(pushed, DECODE_KV_TOKENS)
        before = self.cache_of(self.decode)
        self.assertGreater(before["host_kv_tokens"], 0, "nothing went to the host tier")
        nxt = ids + out + _ids(610, 9)
        got, hit, kv, _ = self.transfer(nxt, cache_salt=salt)
        after = self.cache_of(self.decode)
        self.assertEqual(hit, turn_end(ids, out), "the decode-side prefix, back from the host tier")
        loaded = after["host_kv_loaded"] - before["host_kv_loaded"]
        print(f"\n  decode-side host tier: {before['host_kv_tokens']} host KV tokens and "
              f"{before['host_ssm_states']} host states after the push; next turn hit {hit}, "
              f"{loaded} KV tokens and {after['host_loads'] - before['host_loads']} states loaded from host, "
              f"{kv} KV tokens sent")
        self.assertEqual(loaded, turn_end(ids, out), "the whole prefix came back from the host tier")
        for server in (self.prefill, self.decode):
            self.released(server)


if __name__ == "__main__":
    unittest.main()
