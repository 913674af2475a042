"""End to end: KV events of the plugin's cache from a stock SGLang 0.5.23 server on CPU
(``--enable-mamba-radix --kv-events-config '{"publisher": "zmq", ...}'``; ``docs/design.md``,
"KV events").

A ZMQ SUB socket subscribes before the server starts, the way SGLang's own subscribers
read its ``ZmqEventPublisher`` (frames ``[topic, seq, payload]``, the payload decoded with
``msgspec.msgpack.Decoder(type=KVEventBatch)``). The server runs without SGLang's start-up
warm-up request (``--skip-server-warmup``) and with a ``/health`` that generates nothing
(``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0``), so the test's requests are the only ones
that touch the cache. The scheduler publishes after each prefill batch and when it goes
idle; its first idle pass, during start-up, publishes batch 0 before any subscriber can
have joined, so the test reads that batch back through the publisher's replay socket
(``replay_endpoint``, a ZMQ DEALER asking from sequence number 0): ``AllBlocksCleared``,
recorded when the cache was built. Then, with ``max_new_tokens=1`` (each request finishes
in its prefill batch):

1. prompt ``A`` (40 tokens): one ``BlockStored`` of A's 40 blocks;
2. ``B`` = the first 24 tokens of A + 16 others: ``cached_tokens`` 0 (no state inside A
   yet) and one ``BlockStored`` of B's 16 new blocks linked to A's 24th block;
3. ``C`` = the same 24 tokens + 16 others: ``cached_tokens`` 24 (B's prefill saved a state
   at the branch point) and the ``BlockStored`` of its 16 new blocks;
4. ``/flush_cache``, then ``A`` again: ``AllBlocksCleared``, then A's blocks as in 1.

Every expected event comes from SGLang's own ``RadixCache`` (``create_simulated`` with
events on) storing the same prompts; the events received must equal them exactly, batch
sequence numbers must be consecutive from 0, nothing else may arrive, and the server must
pass SGLang's idle leak checks afterwards.
"""

import json
import os
import tempfile
import time
import unittest
from array import array

import pytest
from conftest import tiny_model_dir
from server_util import CHECKED_ENV, Server, idle_and_checked

from sglang_mamba_ext.testing.server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOPIC = "kv-events"
A = list(range(300, 340))
B = A[:24] + list(range(500, 516))
C = A[:24] + list(range(600, 616))


def decode_events(payload: bytes):
    import msgspec

    from sglang.srt.disaggregation.kv_events import KVEventBatch

    return msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)


class Reference:
    """SGLang's own ``RadixCache`` with KV events: what its caches publish for the same
    prompts (each stored whole, as a finished ``max_new_tokens=1`` request is)."""

    def __init__(self):
        from sglang.srt.mem_cache.radix_cache import RadixCache

        self.cache = RadixCache.create_simulated(page_size=1, enable_kv_cache_events=True)

    def store(self, tokens):
        import msgspec

        from sglang.srt.disaggregation.kv_events import KVEventBatch
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.cache.insert(InsertParams(key=RadixKey(array("q", tokens))))
        batch = KVEventBatch(ts=0.0, events=self.cache.take_events())
        return decode_events(msgspec.msgpack.Encoder().encode(batch)).events

    def flush(self):
        self.cache.reset()


class TestKVEventsServing(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import zmq

        cls.tmp = tempfile.TemporaryDirectory(prefix="kv-events-e2e-")
        cls.addClassCleanup(cls.tmp.cleanup)
        port, replay_port = free_port(), free_port()
        cls.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        cls.sub = zmq.Context.instance().socket(zmq.SUB)
        cls.addClassCleanup(cls.sub.close, 0)
        cls.sub.connect(f"tcp://127.0.0.1:{port}")
        cls.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        config = {
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{port}",
            "bind": True,
            "replay_endpoint": cls.replay_endpoint,
            "topic": TOPIC,
        }
        env = dict(CHECKED_ENV, SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION="0")
        cls.server = Server(
            tiny_model_dir(),
            ["--device", "cpu", "--enable-mamba-radix", "--skip-server-warmup", "--kv-events-config", json.dumps(config)],
            os.path.join(cls.tmp.name, "server.log"),
            env=env,
        )
        cls.addClassCleanup(cls.server.stop)
        cls.server.wait_healthy()
        cls.next_seq = 0

    def replay(self, start: int = 0, timeout_s: float = 30.0):
        """``[(seq, events)]`` of every batch from ``start`` on, asked from the publisher's
        replay socket (the request is the 8-byte big-endian start; the answer one message
        per batch, then sequence number -1)."""
        import zmq

        dealer = zmq.Context.instance().socket(zmq.DEALER)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            batches = []
            while True:
                self.assertTrue(dealer.poll(int(timeout_s * 1000)), "no answer from the replay socket")
                _, topic, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    return batches
                self.assertEqual(topic.decode(), TOPIC)
                batches.append((int.from_bytes(seq, "big"), decode_events(payload).events))
        finally:
            dealer.close(0)

    def receive(self, want: int, timeout_s: float = 60.0, quiet_s: float = 2.0):
        """Events of the batches published from now on: until ``want`` events have come,
        then for ``quiet_s`` more seconds (anything extra would show). Checks that batch
        sequence numbers continue without a gap; a batch already read back through the
        replay socket (the SUB socket may or may not have caught it) is skipped."""
        events = []
        deadline = time.time() + timeout_s
        quiet_until = None
        while True:
            now = time.time()
            if len(events) >= want and quiet_until is None:
                quiet_until = now + quiet_s
            end = quiet_until if quiet_until is not None else deadline
            if now >= end:
                return events
            if not self.sub.poll(int((end - now) * 1000) + 1):
                continue
            topic, seq, payload = self.sub.recv_multipart()
            self.assertEqual(topic.decode(), TOPIC)
            if int.from_bytes(seq, "big") < type(self).next_seq:
                continue
            self.assertEqual(int.from_bytes(seq, "big"), type(self).next_seq, "a batch was missed")
            type(self).next_seq += 1
            events.extend(decode_events(payload).events)

    def test_events_of_a_prefix_branch_and_flush(self):
        import requests

        ref = Reference()
        expected_a = ref.store(A)
        self.assertEqual(len(expected_a), 2)  # AllBlocksCleared, BlockStored of 40 blocks
        startup = []
        for _ in range(60):  # the first idle pass publishes shortly after start-up
            startup = self.replay(0)
            if startup:
                break
            time.sleep(0.5)
        self.assertEqual(startup, [(0, expected_a[:1])])
        type(self).next_seq = 1
        out = self.server.generate(input_ids=A, max_new_tokens=1)
        self.assertEqual(out["meta_info"]["cached_tokens"], 0)
        # The first event hashes run SGLang's native hash extension, built on first use.
        self.assertEqual(self.receive(1, timeout_s=300), expected_a[1:])

        expected_b = ref.store(B)
        self.assertEqual(expected_b[0].parent_block_hash, expected_a[1].block_hashes[23])
        out = self.server.generate(input_ids=B, max_new_tokens=1)
        self.assertEqual(out["meta_info"]["cached_tokens"], 0)
        self.assertEqual(self.receive(len(expected_b)), expected_b)

        expected_c = ref.store(C)
        out = self.server.generate(input_ids=C, max_new_tokens=1)
        self.assertEqual(out["meta_info"]["cached_tokens"], 24)
        self.assertEqual(self.receive(len(expected_c)), expected_c)

        idle_and_checked(self.server)
        r = requests.post(self.server.base_url + "/flush_cache", timeout=60)
        self.assertEqual(r.status_code, 200, r.text)
        ref.flush()
        expected_again = ref.store(A)
        out = self.server.generate(input_ids=A, max_new_tokens=1)
        self.assertEqual(out["meta_info"]["cached_tokens"], 0)
        self.assertEqual(self.receive(len(expected_again)), expected_again)
        idle_and_checked(self.server)


if __name__ == "__main__":
    unittest.main()
