"""End to end (issue 16, item 2): message-boundary checkpoints, the first sharer hits.

One server (``--enable-mamba-radix --enable-cache-report --page-size 4``, no warm-up). Before
this change, a second chat request sharing a system prompt with the first got 0 cached tokens
(its own prefill planted the branch point) and only the third hit. Now:

- ``/v1/chat/completions``: system + user A, then system + user B. B's
  ``cached_tokens`` equals the end of the system message in B's token ids (the chat template
  applied to the system message alone), floored to the page: A's prefill planted a
  checkpoint there. The system message's token length is chosen off the page grid, and A's
  other states (prompt length - 1, SGLang's chunk-end track state, the finish state) all lie
  past the point where B diverges, so only the boundary checkpoint can give that hit.
- ``/generate`` with the plugin's ``kv_hints`` action (``mamba_radix.checkpoint_offsets``):
  the same with token ids and an offset the client names; bad actions (offset 0, at or past
  the prompt's end, not an int, too many, another version) are HTTP 400 and the server keeps
  serving.

Every output equals the torch reference model's greedy continuation and a cold run of the
same prompt in a fresh ``cache_salt`` (0 cached tokens). The server survives going idle
under SGLang's strict leak and tree checks.
"""

import os
import random
import tempfile
import unittest

import pytest
import requests
from conftest import tiny_model_dir
from server_util import CHECKED_ENV, Server, idle_and_checked

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = 4
NEW_TOKENS = 6
ACTION = "mamba_radix.checkpoint_offsets"
SYSTEM_WORDS = (
    "You are the support assistant of a small bakery. Answer questions about opening hours, "
    "bread, cakes, allergens and orders. Keep every answer short and friendly, never invent "
    "prices, and ask for the order number when a customer asks about an order. The bakery "
    "opens at seven and closes at six, except on Sundays."
)
USER_A = "Do you have rye bread today, and is there any gluten free cake left for the weekend?"
USER_B = "When do you close on Saturday?"


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def hints(offsets, version="1"):
    return {
        "protocol_version": "1",
        "message_id": "test",
        "actions": [{"action_id": "a", "action_type": ACTION, "action_version": version, "payload": {"offsets": offsets}}],
    }


class TestChatBoundaryCheckpoints(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from transformers import AutoTokenizer

        from sglang_mamba_ext.models.tiny_hybrid import TinyHybridReference

        cls.tmp = tempfile.TemporaryDirectory(prefix="chat-boundary-e2e-")
        cls.addClassCleanup(cls.tmp.cleanup)
        model_dir = tiny_model_dir()
        cls.tok = AutoTokenizer.from_pretrained(model_dir)
        cls.ref = TinyHybridReference.from_pretrained(model_dir)
        # A system message whose token length is off the page grid (the floor matters).
        system = SYSTEM_WORDS
        while len(cls.chat_ids([{"role": "system", "content": system}], False)) % PAGE == 0:
            system += " Thanks."
        cls.system = system
        args = ["--device", "cpu", "--enable-mamba-radix", "--enable-cache-report", "--page-size", str(PAGE)]
        cls.server = Server(model_dir, args, os.path.join(cls.tmp.name, "server.log"), env=dict(CHECKED_ENV))
        cls.addClassCleanup(cls.server.stop)
        cls.server.wait_healthy()
        cls.salt = 0

    @classmethod
    def chat_ids(cls, messages, add_generation_prompt=True):
        ids = cls.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
        return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)

    def chat(self, messages, **extra):
        body = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        }
        r = requests.post(self.server.base_url + "/v1/chat/completions", json=body, timeout=300)
        self.assertEqual(r.status_code, 200, r.text)
        out = r.json()
        choice = out["choices"][0]
        return choice["prompt_token_ids"], choice["response_token_ids"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

    def cold_salt(self):
        type(self).salt += 1
        return f"cold-{self.salt}"

    def floor(self, n):
        return n - n % PAGE

    def test_a_chat_second_request_hits_the_system_message(self):
        sys_msg = {"role": "system", "content": self.system}
        msgs_a = [sys_msg, {"role": "user", "content": USER_A}]
        msgs_b = [sys_msg, {"role": "user", "content": USER_B}]
        boundary = len(self.chat_ids([sys_msg], False))
        ids_a, ids_b = self.chat_ids(msgs_a), self.chat_ids(msgs_b)
        self.assertNotEqual(boundary % PAGE, 0)
        self.assertLess(boundary, 256)  # SGLang's track interval: no tracked state inside it
        shared = common_prefix(ids_a, ids_b)
        # B diverges from A past the boundary (the user turn's header is shared), and A's
        # own states (SGLang's chunk-end state on the 8-token grid, len - 1) lie past that.
        self.assertGreater(shared, boundary)
        self.assertGreater(len(ids_a) - len(ids_a) % 8, shared)

        prompt_a, out_a, cached_a = self.chat(msgs_a)
        self.assertEqual(prompt_a, ids_a)
        self.assertEqual(cached_a, 0)
        prompt_b, out_b, cached_b = self.chat(msgs_b)
        self.assertEqual(prompt_b, ids_b)
        self.assertEqual(cached_b, self.floor(boundary))
        for ids, out, msgs in ((ids_a, out_a, msgs_a), (ids_b, out_b, msgs_b)):
            self.assertEqual(out, self.ref.generate_greedy(ids, NEW_TOKENS))
            _, cold, cold_cached = self.chat(msgs, cache_salt=self.cold_salt())
            self.assertEqual(cold_cached, 0)
            self.assertEqual(out, cold)

    def test_b_generate_offsets_in_kv_hints(self):
        rng = random.Random(16)
        offset = 61  # off the page grid
        head = [rng.randrange(3, 300) for _ in range(offset)]
        first = head + [rng.randrange(3, 300) for _ in range(40)]
        second = head + [rng.randrange(300, 600) for _ in range(9)]
        self.assertNotEqual(offset % PAGE, 0)
        self.assertEqual(common_prefix(first, second), offset)
        out1 = self.server.generate(input_ids=first, max_new_tokens=NEW_TOKENS, kv_hints=hints([offset]))
        self.assertEqual(out1["meta_info"]["cached_tokens"], 0)
        out2 = self.server.generate(input_ids=second, max_new_tokens=NEW_TOKENS)
        self.assertEqual(out2["meta_info"]["cached_tokens"], self.floor(offset))
        for ids, out in ((first, out1), (second, out2)):
            self.assertEqual(out["output_ids"], self.ref.generate_greedy(ids, NEW_TOKENS))
            cold = self.server.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, cache_salt=self.cold_salt())
            self.assertEqual(cold["meta_info"]["cached_tokens"], 0)
            self.assertEqual(out["output_ids"], cold["output_ids"])

    def test_c_bad_offsets_are_refused(self):
        ids = self.tok.encode("A short prompt for the refusals.")
        bad = {
            "zero": hints([0]),
            "at the end": hints([len(ids)]),
            "past the end": hints([len(ids) + 5]),
            "not an int": hints(["3"]),
            "too many": hints(list(range(1, 18))),
            "other version": hints([3], version="2"),
        }
        for name, kv in bad.items():
            with self.subTest(name):
                r = requests.post(
                    self.server.base_url + "/generate",
                    json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}, "kv_hints": kv},
                    timeout=60,
                )
                self.assertEqual(r.status_code, 400, r.text)
                self.assertIn(ACTION, r.text)
        out = self.server.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, kv_hints=hints([len(ids) - 1]))
        self.assertEqual(out["output_ids"], self.ref.generate_greedy(ids, NEW_TOKENS))

    def test_z_idle_without_leaks(self):
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_used_tokens"], 0)
