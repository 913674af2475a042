"""End to end: ``--enable-pd-role-switch`` with the plugin on both sides (issue 42 item 4).

One pair for the class: server A starts as the prefill server, B as the decode server, both
``--enable-mamba-radix --disaggregation-decode-enable-radix-cache --enable-pd-role-switch``
(each runs its own bootstrap server, as SGLang starts one on every role-switch instance),
mooncake's TCP transport. Requests are sent as sglang-router's ``--mini-lb`` sends them (to
both servers at once, with the prefill server's bootstrap address and a random room; no
router process: one would have to be restarted for the swapped roles, about 10 s each). A
request goes through, then both are flipped (``POST /pd_role_switch``: A to decode, B to
prefill; SGLang's ``disaggregation/role_switch.py`` tears the role's queues down, resets the
tree and clears the request and KV pools, then builds the other role's queues on the same
pools), and requests go the other way. After the flip: every request's greedy output and
log-probabilities equal ``TinyHybridReference``'s (the state comes from B's pool now, the
prefix KV from A's decode-side tree); the tree each server held before is gone (B, a decode
server that had cached the first conversation, misses it as a prefill server); a resend
hits ``len - 1`` on the new prefill server and, on the next turn, the new decode side asks
only for what its tree lacks; SGLang's strict idle checks (leaks) run on both servers. Then both flip back, and
the same holds again.
"""

import concurrent.futures
import os
import random
import unittest

import pytest
import requests

from pd_util import PD_FLAGS, skip_without_pd
from server_util import CHECKED_ENV, Server, idle_and_checked, start_together, tiny_class_setup

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW = 6
SWITCH = ["--enable-mamba-radix", "--disaggregation-decode-enable-radix-cache", "--enable-pd-role-switch",
          "--max-mamba-cache-size", "32"]


def _ids(start, n):
    return [(start + 13 * i) % 700 + 3 for i in range(n)]


@skip_without_pd
class TestPdRoleSwitch(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.testing.server import free_port

        tmp = tiny_class_setup(cls)
        cls.tmp = tmp
        cls.bootstrap_a, cls.bootstrap_b = free_port(), free_port()
        cls.a = Server(cls.model, [*PD_FLAGS, *SWITCH, "--disaggregation-mode", "prefill",
                                   "--disaggregation-bootstrap-port", str(cls.bootstrap_a)],
                       os.path.join(tmp, "a.log"), env=CHECKED_ENV)
        # B keeps the plugin's host tier in both roles (a flip empties it with the pools)
        cls.b = Server(cls.model, [*PD_FLAGS, *SWITCH, "--disaggregation-mode", "decode",
                                   "--disaggregation-bootstrap-port", str(cls.bootstrap_b),
                                   "--enable-hierarchical-cache", "--hicache-write-policy", "write_through"],
                       os.path.join(tmp, "b.log"), env=CHECKED_ENV)
        start_together(cls, [cls.a, cls.b])
        cls.pair = (cls.a, cls.bootstrap_a, cls.b)  # (prefill, its bootstrap port, decode)

    def gen(self, ids):
        """Greedy ``NEW`` tokens through the current pair, checked against the reference
        (tokens, and log-probabilities within 1e-4); the decode server's response."""
        import torch

        prefill, bootstrap, decode = self.pair
        body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
                "return_logprob": True, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
                "bootstrap_room": random.randrange(1 << 63)}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            sent = [pool.submit(requests.post, s.base_url + "/generate", json=body, timeout=300)
                    for s in (prefill, decode)]
            for f in sent:
                f.result().raise_for_status()
        out = sent[1].result().json()
        ref_ids = self.ref.generate_greedy(ids, NEW)
        self.assertEqual(out["output_ids"], ref_ids, f"prompt of {len(ids)}")
        logits, _ = self.ref.forward_tokens(ids + ref_ids[:-1])
        ref_lp = torch.log_softmax(logits[len(ids) - 1:], dim=-1)[torch.arange(NEW), torch.tensor(ref_ids)]
        got = torch.tensor([item[0] for item in out["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, ref_lp, atol=1e-4, rtol=0)
        return out

    @staticmethod
    def cache(server) -> dict:
        info = requests.get(server.base_url + "/server_info", timeout=60).json()
        return info["internal_states"][0]["mamba_radix"]

    @staticmethod
    def switch(server, role):
        r = requests.post(server.base_url + "/pd_role_switch", timeout=300,
                          json={"new_role": role, "decode_cuda_graph_memory_gb": 0})
        return r.status_code, r.json()

    def test_1_served_before_the_flip(self):
        first = _ids(1, 40)
        self.gen(first)
        again = self.gen(first)
        self.assertEqual(again["meta_info"]["cached_tokens"], len(first) - 1)  # on A, the prefill server
        self.assertGreater(self.cache(self.b)["pd_decode_transfers"], 0)  # B's decode-side tree took it
        self.assertGreater(self.cache(self.b)["kv_tokens"], 0)
        host = self.cache(self.b)  # write_through: the decode-side tree's states copied to B's host tier
        self.assertGreater(host["host_ssm_states"], 0, host)
        type(self).first = first

    def test_2_flip_both_then_served_and_exact(self):
        for server, role in ((self.a, "decode"), (self.b, "prefill")):
            code, out = self.switch(server, role)
            self.assertEqual((code, out["success"], out["new_role"]), (200, True, role), out)
        self.assertIn("PD role switch succeeded: prefill -> decode", self.a.log_text())
        self.assertIn("PD role switch succeeded: decode -> prefill", self.b.log_text())
        # the flip reset both trees and cleared the pools (SGLang's _release_prefix_cache_for_role_switch)
        for server in (self.a, self.b):
            info = self.cache(server)
            self.assertEqual((info["kv_tokens"], info["ssm_states"]), (0, 0), info)
            self.assertEqual(info["ssm_slots_free"], info["ssm_slots_total"], info)
        host = self.cache(self.b)  # B's host tier: emptied with the pools
        self.assertGreater(host["host_ssm_slots_total"], 0, host)
        self.assertEqual((host["host_ssm_states"], host["host_kv_tokens"]), (0, 0), host)
        self.assertEqual(host["host_ssm_slots_free"], host["host_ssm_slots_total"], host)
        type(self).pair = (self.b, self.bootstrap_b, self.a)
        # B cached the first conversation as the decode side: gone with the flip, a miss now
        out = self.gen(self.first)
        self.assertEqual(out["meta_info"]["cached_tokens"], 0)
        second = _ids(300, 50)
        self.assertEqual(self.gen(second)["meta_info"]["cached_tokens"], 0)
        again = self.gen(second)
        self.assertEqual(again["meta_info"]["cached_tokens"], len(second) - 1)  # B's tree as prefill server
        # A's decode-side tree holds the conversation (prompt and output up to the last KV, its
        # finish state; no overlap scheduling on a role-switch server): its next turn asks
        # only for the rest. (A resend of the same prompt has no decode-side state to stop at:
        # the decode side writes no state inside a prompt; plugin/pd_decode.py.)
        before = self.cache(self.a)
        nxt = second + again["output_ids"] + _ids(400, 7)
        self.gen(nxt)
        after = self.cache(self.a)
        self.assertEqual(after["pd_decode_transfers"] - before["pd_decode_transfers"], 1)
        held = len(second) + len(again["output_ids"]) - 1
        self.assertEqual(after["pd_decode_prefix_tokens"] - before["pd_decode_prefix_tokens"], held)
        self.assertEqual(after["pd_decode_kv_tokens_received"] - before["pd_decode_kv_tokens_received"],
                         len(nxt) - held)
        idle_and_checked(self.a)
        idle_and_checked(self.b)

    def test_3_flip_back(self):
        """A second flip (each server back to its first role) leaves nothing behind either."""
        for server, role in ((self.a, "prefill"), (self.b, "decode")):
            code, out = self.switch(server, role)
            self.assertEqual((code, out["success"]), (200, True), out)
            info = self.cache(server)
            self.assertEqual((info["kv_tokens"], info["ssm_states"], info["ssm_slots_free"]),
                             (0, 0, info["ssm_slots_total"]), info)
            self.assertEqual((info["host_ssm_states"], info["host_kv_tokens"]), (0, 0), info)
        type(self).pair = (self.a, self.bootstrap_a, self.b)
        third = _ids(600, 30)
        self.assertEqual(self.gen(third)["meta_info"]["cached_tokens"], 0)
        self.assertEqual(self.gen(third)["meta_info"]["cached_tokens"], len(third) - 1)
        idle_and_checked(self.a)
        idle_and_checked(self.b)


if __name__ == "__main__":
    unittest.main()
