"""End to end: SGLang's capacity flags with ``--enable-mamba-radix`` on CPU (issue 26).

``TestInt8Checkpoints`` serves the tiny model with ``--enable-int8-mamba-checkpoint
--int8-mamba-ckpt-size 20 --max-mamba-cache-size 8``: the tree's states are kept int8 in
SGLang's checkpoint pool (``docs/design.md``, "int8 checkpoints"), the 8 active slots only
back running requests. Six distinct 200-token prompts leave 18 states (prompt length - 1,
the 200-token ping-pong checkpoint and the finish state each), more than the active pool
could hold; sent a second time, each hits exactly ``len - 1`` tokens from a dequantized
state. Every generated token is the torch reference's greedy token or, at a near-tie, within
the stated log-probability tolerance of it, and the server's log-probabilities agree with
the reference's within that tolerance. ``/server_info`` reports the checkpoint pool;
``/flush_cache`` gives every checkpoint slot back; the server survives going idle under
SGLang's strict idle checks (its two-pool check for int8 checkpoints).

``TestHostTier`` serves it with ``--enable-hierarchical-cache --hicache-ratio 4
--max-mamba-cache-size 8 --max-total-tokens 640``: the same six prompts (18 states, more than
the 8 device slots; 1248 tokens of KV, more than the 640 device KV slots) sent twice; on the
second pass each hits ``len - 1`` tokens from a state the device tier had given up for its
host copy, its KV loaded back from the host where the device had given that up too
(``docs/design.md``, "Host tier"), and the outputs equal the reference's greedy tokens (host
copies are exact). ``/flush_cache`` releases the host
memory; strict idle checks.

``TestSessions`` serves it with ``--enable-streaming-session --enable-session-radix-cache
--max-mamba-cache-size 8``: a streaming session's turns
(named by the session id alone) and a plain session's (``session_params`` with the previous
turn's ``rid``) each hit the previous turn's prompt and output less one token, and generate
what the reference generates for the whole history; closing the sessions leaves the server
idle and checked. A radix session's turn (a top-level ``session_id``) keeps its state
through a flood that evicts every state of an older unpinned prompt.
"""

import os
import random
import tempfile
import unittest

import pytest
import requests
import torch

from conftest import tiny_model_dir
from server_util import CHECKED_ENV, Server, idle_and_checked

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = 6
PROMPT_LEN = 200
NEW_TOKENS = 8
ACTIVE_SLOTS = 8
#: Device KV tokens of the host-tier server (``--max-total-tokens``): three of the six
#: prompts' 208 tokens, so the host tier holds the rest of their KV.
KV_TOKENS = 640
CKPT_SLOTS = 20
#: States a first pass leaves per prompt: its planned prompt - 1 checkpoint and its finish
#: state (planned checkpoints replace the prefill's ping-pong slots, docs/design.md,
#: "Ping-pong checkpoints")
STATES = 2
#: Host slots of ``TestInt8HostTier``: the bytes of 2 x 8 full-precision states filled with
#: int8 ones (measured from the tiny model's pools; see the class).
HOST_INT8_SLOTS = 36
#: Largest next-token log-probability difference accepted between the server (a continuation
#: from an int8 state) and the reference recurrence (tests/test_int8_checkpoints.py states the
#: same tolerance for the core's round trip).
LOGPROB_TOL = 2e-2


class _Prompts(unittest.TestCase):
    ARGS: list = []

    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.models.tiny_hybrid import TinyHybridReference

        cls.tmp = tempfile.TemporaryDirectory(prefix="tiers-e2e-")
        cls.addClassCleanup(cls.tmp.cleanup)
        cls.model_dir = tiny_model_dir()
        cls.ref = TinyHybridReference.from_pretrained(cls.model_dir).eval()
        rng = random.Random(262)
        cls.prompts = [[rng.randrange(5, 500) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
        cls.server = Server(
            cls.model_dir, ["--device", "cpu", "--enable-mamba-radix", *cls.ARGS],
            os.path.join(cls.tmp.name, f"{cls.__name__}.log"), env=dict(CHECKED_ENV),
        )
        cls.addClassCleanup(cls.server.stop)
        cls.server.wait_healthy()

    def post(self, path, body):
        """POST; the JSON answer, or the text of a non-JSON one (``/flush_cache``)."""
        r = requests.post(self.server.base_url + path, json=body, timeout=300)
        self.assertEqual(r.status_code, 200, r.text)
        try:
            return r.json()
        except ValueError:
            return r.text

    def info(self):
        r = requests.get(self.server.base_url + "/server_info", timeout=60)
        r.raise_for_status()
        return r.json()["internal_states"][0]["mamba_radix"]

    def greedy(self, ids, n=NEW_TOKENS):
        with torch.no_grad():
            return self.ref.generate_greedy(ids, n)


class TestInt8Checkpoints(_Prompts):
    ARGS = ["--enable-int8-mamba-checkpoint", "--int8-mamba-ckpt-size", str(CKPT_SLOTS),
            "--max-mamba-cache-size", str(ACTIVE_SLOTS)]

    def generate(self, ids):
        return self.server.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, return_logprob=True)

    def check_against_reference(self, ids, out):
        """Each token the server chose is the reference's argmax or within ``LOGPROB_TOL`` of
        it (a near-tie), and the server's log-probability of it is the reference's within
        ``LOGPROB_TOL`` (the reference follows the server's tokens)."""
        tokens = out["output_ids"]
        served = [lp[0] for lp in out["meta_info"]["output_token_logprobs"]]
        self.assertEqual(len(tokens), NEW_TOKENS)
        with torch.no_grad():
            logits, cache = self.ref.prefill(ids)
            step = logits[-1]
            for t, lp in zip(tokens, served):
                ls = step.log_softmax(-1)
                self.assertLessEqual(float(ls.max() - ls[t]), LOGPROB_TOL, "a token off the reference's greedy choice")
                self.assertLessEqual(abs(float(ls[t]) - lp), LOGPROB_TOL)
                step, cache = self.ref.decode_step(t, cache)

    def flush(self):
        self.post("/flush_cache", {})

    def test_a_second_pass_hits_every_prompt_from_int8_states(self):
        self.flush()  # SGLang's start-up warm-up request left states
        info = self.info()
        self.assertEqual(info["int8_ckpt_slots_total"], CKPT_SLOTS)
        self.assertEqual(info["ssm_slots_total"], ACTIVE_SLOTS)
        first = [self.generate(ids) for ids in self.prompts]
        self.assertEqual([o["meta_info"]["cached_tokens"] for o in first], [0] * PROMPTS)
        info = self.info()
        # two states a prompt, all in the checkpoint pool; the active pool is all free
        self.assertEqual(info["ssm_states"], STATES * PROMPTS)
        self.assertEqual(info["int8_ckpt_slots_free"], CKPT_SLOTS - STATES * PROMPTS)
        self.assertEqual(info["ssm_slots_free"], ACTIVE_SLOTS)
        self.assertGreater(STATES * PROMPTS, ACTIVE_SLOTS)
        second = [self.generate(ids) for ids in self.prompts]
        self.assertEqual([o["meta_info"]["cached_tokens"] for o in second], [PROMPT_LEN - 1] * PROMPTS)
        self.assertEqual(self.info()["cow_copies"], PROMPTS)
        for ids, out in zip(self.prompts, second):
            self.check_against_reference(ids, out)
        idle_and_checked(self.server)

    def test_b_flush_gives_every_checkpoint_slot_back(self):
        self.generate(self.prompts[0])
        self.assertLess(self.info()["int8_ckpt_slots_free"], CKPT_SLOTS)
        self.flush()
        info = self.info()
        self.assertEqual((info["int8_ckpt_slots_free"], info["ssm_states"]), (CKPT_SLOTS, 0))
        self.assertEqual(info["ssm_slots_free"], ACTIVE_SLOTS)
        self.assertEqual(self.generate(self.prompts[0])["meta_info"]["cached_tokens"], 0)
        idle_and_checked(self.server)


class TestHostTier(_Prompts):
    ARGS = ["--enable-hierarchical-cache", "--hicache-ratio", "4", "--max-mamba-cache-size", str(ACTIVE_SLOTS),
            "--max-total-tokens", str(KV_TOKENS)]

    def test_a_second_pass_hits_every_prompt_from_the_host_tier(self):
        self.post("/flush_cache", {})
        info = self.info()
        self.assertEqual(info["host_ssm_slots_total"], 4 * ACTIVE_SLOTS)
        self.assertEqual(info["host_ssm_slots_free"], 4 * ACTIVE_SLOTS)
        self.assertEqual(info["host_kv_tokens_total"], 4 * info["kv_slots_total"])
        first = [self.server.generate(input_ids=ids, max_new_tokens=NEW_TOKENS) for ids in self.prompts]
        self.assertEqual([o["meta_info"]["cached_tokens"] for o in first], [0] * PROMPTS)
        info = self.info()
        # write_through: every state the tree took has a host copy; the device keeps few
        self.assertEqual(info["host_ssm_states"], STATES * PROMPTS)
        self.assertLessEqual(info["ssm_states"], ACTIVE_SLOTS)
        # 6 x 207 tokens of KV (the last generated token has none) against a device pool of
        # KV_TOKENS: the tree keeps all of it, the rest in the host tier
        self.assertGreater(info["host_kv_tokens"], 0)
        self.assertEqual(info["host_kv_tokens"] + info["kv_evictable_tokens"], PROMPTS * (PROMPT_LEN + NEW_TOKENS - 1))
        loads, kv_loads = info["host_loads"], info["host_kv_loaded"]
        second = [self.server.generate(input_ids=ids, max_new_tokens=NEW_TOKENS) for ids in self.prompts]
        self.assertEqual([o["meta_info"]["cached_tokens"] for o in second], [PROMPT_LEN - 1] * PROMPTS)
        # every hit of the second pass came back from the host tier, state and KV: the
        # pass walks the prompts in order, so each finds its KV given up to the host (the
        # device KV holds three prompts, the least recently used go first)
        info = self.info()
        self.assertEqual(info["host_loads"] - loads, PROMPTS)
        self.assertEqual(info["host_kv_loaded"] - kv_loads, PROMPTS * (PROMPT_LEN - 1))
        for ids, out in zip(self.prompts, second):
            self.assertEqual(out["output_ids"], self.greedy(ids))
        idle_and_checked(self.server)

    def test_b_flush_releases_host_memory(self):
        self.server.generate(input_ids=self.prompts[0], max_new_tokens=NEW_TOKENS)
        self.assertGreater(self.info()["host_ssm_states"], 0)
        self.post("/flush_cache", {})
        info = self.info()
        self.assertEqual((info["host_ssm_states"], info["host_ssm_slots_free"]), (0, info["host_ssm_slots_total"]))
        self.assertEqual(info["host_kv_tokens"], 0)
        self.assertEqual(info["ssm_slots_free"], ACTIVE_SLOTS)
        idle_and_checked(self.server)


class TestInt8HostTier(TestInt8Checkpoints):
    """Issue 42: ``--enable-int8-mamba-checkpoint --enable-hierarchical-cache`` together. The
    host tier copies the int8 checkpoint slots as they are; at ``--hicache-ratio 2`` its bytes
    are those of 2 full-precision states per device slot, which hold ``HOST_INT8_SLOTS`` int8
    states (2.28 times as many). The 12 states of the six prompts overflow the 6 checkpoint
    slots into the host; the second pass hits ``len - 1`` of every prompt, from a host copy
    where the device gave its state up, within the int8 tolerance of the reference."""

    ARGS = ["--enable-int8-mamba-checkpoint", "--int8-mamba-ckpt-size", "6", "--max-mamba-cache-size",
            str(ACTIVE_SLOTS), "--enable-hierarchical-cache", "--hicache-ratio", "2"]

    def test_a_second_pass_hits_every_prompt_from_int8_states(self):
        self.flush()
        info = self.info()
        self.assertEqual((info["int8_ckpt_slots_total"], info["host_ssm_slots_total"]), (6, HOST_INT8_SLOTS))
        first = [self.generate(ids) for ids in self.prompts]
        self.assertEqual([o["meta_info"]["cached_tokens"] for o in first], [0] * PROMPTS)
        info = self.info()
        # write_through: every state has its int8 host copy; the checkpoint pool keeps 6
        self.assertEqual((info["host_ssm_states"], info["ssm_states"]), (STATES * PROMPTS, 6))
        loads = info["host_loads"]
        second = [self.generate(ids) for ids in self.prompts]
        self.assertEqual([o["meta_info"]["cached_tokens"] for o in second], [PROMPT_LEN - 1] * PROMPTS)
        # two of the hits come from the host, the others from the states the default
        # adaptive policy kept in the 6 checkpoint slots (its choice among the 12; four from
        # the host when the prefill's ping-pong checkpoint made it 18)
        self.assertEqual(self.info()["host_loads"] - loads, 2)
        for ids, out in zip(self.prompts, second):
            self.check_against_reference(ids, out)
        idle_and_checked(self.server)

    def test_b_flush_gives_every_checkpoint_slot_back(self):
        self.generate(self.prompts[0])
        self.flush()
        info = self.info()
        self.assertEqual((info["int8_ckpt_slots_free"], info["host_ssm_slots_free"]), (6, HOST_INT8_SLOTS))
        self.assertEqual(info["ssm_slots_free"], ACTIVE_SLOTS)
        idle_and_checked(self.server)


class TestSessions(_Prompts):
    ARGS = ["--enable-streaming-session", "--enable-session-radix-cache", "--max-mamba-cache-size", str(ACTIVE_SLOTS)]

    def turns(self, prompts, session_params):
        """Three turns of one session (60 tokens of each of ``prompts``, new to the cache);
        returns ``(cached_tokens, expected, outputs equal)``: the cached tokens of every turn
        and what they must be (0 for the first, the previous turn's prompt and output less
        one token for the others), and whether each output is the reference's for the whole
        history."""
        history, got, want, same = [], [], [], []
        prev = None
        for i, ids in enumerate(prompts):
            sp = session_params(prev)
            rid = f"{sp['id']}-{i}"
            out = self.server.generate(input_ids=ids[:60], max_new_tokens=NEW_TOKENS, rid=rid, session_params=sp)
            full = history + ids[:60]
            same.append(out["output_ids"] == self.greedy(full))
            got.append(out["meta_info"]["cached_tokens"])
            want.append(max(len(history) - 1, 0))
            history = full + out["output_ids"]
            prev = rid
        return got, want, same

    def test_streaming_session_turns_resume_from_the_last_turn(self):
        sid = self.post("/open_session", {"capacity_of_str_len": 8192, "streaming": True})
        got, want, same = self.turns(self.prompts[3:6], lambda prev: {"id": sid})
        self.assertEqual(got, want)
        self.assertEqual(same, [True] * 3)
        self.post("/close_session", {"session_id": sid})
        idle_and_checked(self.server)

    def test_plain_session_turns_resume_from_the_last_turn(self):
        sid = self.post("/open_session", {"capacity_of_str_len": 8192})
        got, want, same = self.turns(self.prompts[:3], lambda prev: {"id": sid} if prev is None else {"id": sid, "rid": prev})
        self.assertEqual(got, want)
        self.assertEqual(same, [True] * 3)
        self.post("/close_session", {"session_id": sid})
        idle_and_checked(self.server)

    def test_radix_session_state_is_evicted_last(self):
        """``--enable-session-radix-cache``: a turn of an open radix session (a top-level
        ``session_id``) pins its finish state. Four more prompts then leave 12 new states
        against 8 slots: an unpinned prompt sent before the session's turn loses every state
        (its resend hits 0), the session's next turn still hits its whole history less one
        token. Closing the session drops the pin."""
        rng = random.Random(2626)
        fresh = [[rng.randrange(5, 500) for _ in range(PROMPT_LEN)] for _ in range(6)]
        control, turn, flood = fresh[0], fresh[1], fresh[2:]
        sid = "radix-session"
        self.post("/open_session", {"capacity_of_str_len": 8192, "session_id": sid})
        self.server.generate(input_ids=control, max_new_tokens=NEW_TOKENS)
        out = self.server.generate(input_ids=turn, max_new_tokens=NEW_TOKENS, session_id=sid)
        self.assertEqual(self.info()["session_pins"], 1)
        for ids in flood:
            self.server.generate(input_ids=ids, max_new_tokens=NEW_TOKENS)
        again = self.server.generate(input_ids=control + [7], max_new_tokens=NEW_TOKENS)
        self.assertEqual(again["meta_info"]["cached_tokens"], 0)
        history = turn + out["output_ids"]
        nxt = self.server.generate(input_ids=history + [11, 12, 13], max_new_tokens=NEW_TOKENS, session_id=sid)
        self.assertEqual(nxt["meta_info"]["cached_tokens"], len(history) - 1)
        self.assertEqual(nxt["output_ids"], self.greedy(history + [11, 12, 13]))
        self.post("/close_session", {"session_id": sid})
        self.assertEqual(self.info()["session_pins"], 0)
        idle_and_checked(self.server)


if __name__ == "__main__":
    unittest.main()
