"""KV events of the plugin's cache (``sglang_mamba_ext/plugin/kv_events.py``;
``docs/design.md``, "KV events"), in process on CPU, against SGLang 0.5.23's own types.

The adapter is built through SGLang's ``registry.create_tree_cache`` over the plugin's pool
with ``CacheInitParams(enable_kv_cache_events=True)``, as a scheduler builds it under
``--kv-events-config``. Every check decodes what the scheduler would publish: the events
``take_events`` returns, packed into SGLang's ``KVEventBatch`` with the msgpack encoder its
``ZmqEventPublisher`` uses and decoded as its subscribers decode them
(``msgspec.msgpack.Decoder(type=KVEventBatch)``).

Expected values are never written out: they come from SGLang's own ``RadixCache``
(``create_simulated`` with events on) fed the same sequences — for insertions the two
caches must publish identical events (block hashes, parent links, token lists, pages,
``medium``, ``cache_salt`` / LoRA namespaces, the ``dynamo`` format) — and, for the
hybrid rule, the block hashes of the affected pages taken from that reference.

Hybrid rule checks: dropping a state whose KV a deeper state still covers publishes
nothing; removing a leaf (KV or SSM eviction) withdraws exactly its pages and those of
ancestors that left the tree with it; a stateless leaf kept by a lock (a request locked a
node whose state was evicted before its lock) is withdrawn when it loses its last child,
republished when a state is stored on it again, and not reported twice when its unlock
removes it; ``reset`` publishes ``AllBlocksCleared``; with events off nothing is recorded
and the core has no sink.
"""

from __future__ import annotations

import contextlib
import unittest
from array import array

import torch

import sglang_glue_fixtures as F

KV_SIZE = 512
MAMBA_SIZE = 16


def build_cache(pool, page_size: int = 1, **event_params):
    """``(adapter, kv_allocator)`` through SGLang's ``create_tree_cache`` with the event
    fields of ``CacheInitParams`` (``enable_kv_cache_events`` ...) set as given."""
    return F.build_tree_cache(pool, KV_SIZE, page_size, **event_params)


def decoded(events):
    """``events`` as a subscriber of SGLang's ZMQ publisher receives them."""
    import msgspec

    from sglang.srt.disaggregation.kv_events import KVEventBatch

    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=list(events)))
    return msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload).events


def published(cache):
    """What the scheduler would publish now (``take_events``), decoded."""
    return decoded(cache.take_events())


def sglang_key(tokens, extra_key=None, cache_salt=None):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)


class Reference:
    """SGLang's own ``RadixCache`` with KV events (``create_simulated``), the oracle."""

    def __init__(self, page_size: int = 1, **event_params):
        from sglang.srt.mem_cache.radix_cache import RadixCache

        self.page_size = page_size
        self.event_params = event_params
        self.cache = RadixCache.create_simulated(page_size=page_size, enable_kv_cache_events=True, **event_params)

    def insert(self, tokens, extra_key=None, cache_salt=None):
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        self.cache.insert(InsertParams(key=sglang_key(tokens, extra_key, cache_salt)))

    def published(self):
        return decoded(self.cache.take_events())

    def block_hashes(self, tokens, extra_key=None, cache_salt=None):
        """The published hash of each whole page of the path ``tokens`` (a fresh
        reference cache storing that path alone)."""
        from sglang.srt.disaggregation.kv_events import BlockStored

        fresh = Reference(self.page_size, **self.event_params)
        fresh.insert(tokens, extra_key, cache_salt)
        return [h for e in fresh.published() if isinstance(e, BlockStored) for h in e.block_hashes]


class _EventsCase(unittest.TestCase):
    """One scheduler context with ``--enable-mamba-radix --kv-events-config`` (null
    publisher: the test drains the queue itself)."""

    PAGE_SIZE = 1
    EVENT_PARAMS = {"enable_kv_cache_events": True}

    @classmethod
    def setUpClass(cls):
        cls.ctx, _ = F.scheduler_context(
            F.base_argv(
                "--enable-mamba-radix", "--page-size", str(cls.PAGE_SIZE), "--max-mamba-cache-size", str(MAMBA_SIZE),
                "--kv-events-config", '{"publisher": "null"}',
                "--radix-eviction-policy", "lru",  # the eviction orders below are LRU's
            )
        )

    def setUp(self):
        stack = contextlib.ExitStack()
        stack.enter_context(F.in_context(self.ctx))
        self.addCleanup(stack.close)
        self.pool = F.build_req_pool(max_num_reqs=4)
        self.cache, self.allocator = build_cache(self.pool, self.PAGE_SIZE, **self.EVENT_PARAMS)
        self.core = self.cache.core

    # -- driving the tree ------------------------------------------------------------------
    def insert(self, tokens, extra_key=None, cache_salt=None):
        """Store ``tokens`` with their KV and the state after them: the core insert every
        ``checkpoint`` of the adapter ends in (``prefix_checkpoints._adopt_prefix``)."""
        from sglang_mamba_ext.mem_cache import RadixKey as CoreRadixKey
        from sglang_mamba_ext.plugin.req_bridge import namespace

        kv = self.allocator.alloc(len(tokens))
        slot = int(self.pool.mamba_allocator.alloc(1)[0])
        res = self.core.insert(CoreRadixKey(list(tokens), namespace(extra_key, cache_salt)), kv, slot)
        if res.mamba_exist:
            self.pool.mamba_allocator.free(torch.tensor([slot]))
        return res.last_node

    def match(self, tokens):
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.cache.match_prefix(MatchPrefixParams(key=sglang_key(tokens)))

    def evict(self, num_tokens=0, mamba_num=0):
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return self.cache.evict(EvictParams(num_tokens=num_tokens, mamba_num=mamba_num))

    def node_at(self, tokens):
        """The tree node ending exactly after ``tokens``."""
        node, pos = self.core.root_node, 0
        while pos < len(tokens):
            node = next(c for c in node.children.values() if c.key == list(tokens[pos : pos + len(c.key)]))
            pos += len(node.key)
        self.assertEqual(pos, len(tokens))
        return node

    def removed(self, hashes):
        from sglang.srt.disaggregation.kv_events import BlockRemoved, StorageMedium

        return decoded([BlockRemoved(block_hashes=list(hashes), medium=StorageMedium.GPU)])

    def stored(self, tokens, start, parent_hash):
        """The ``BlockStored`` of pages ``[start, len(tokens))`` of the path ``tokens``."""
        from sglang.srt.disaggregation.kv_events import BlockStored, StorageMedium

        hashes = Reference(self.PAGE_SIZE).block_hashes(tokens)
        ps = self.PAGE_SIZE
        return decoded(
            [
                BlockStored(
                    block_hashes=hashes[start // ps :],
                    parent_block_hash=parent_hash,
                    token_ids=list(tokens[start:]),
                    block_size=ps,
                    lora_id=None,
                    medium=StorageMedium.GPU,
                )
            ]
        )


class TestEventsOff(_EventsCase):
    EVENT_PARAMS = {}

    def test_nothing_recorded_and_no_sink(self):
        self.assertIsNone(self.cache.kv_events)
        self.assertIsNone(self.core.event_sink)
        self.insert(list(range(1, 21)))
        self.evict(num_tokens=KV_SIZE)
        self.cache.reset()
        self.assertEqual(self.cache.take_events(), [])


class TestInsertsAsSGLang(_EventsCase):
    """Insertions publish exactly what SGLang's own ``RadixCache`` publishes for the same
    sequences (every stored path ends at a state, so the hybrid rule publishes all of it)."""

    #: Paths: a prompt, one diverging inside it (a split), one extending it, a prefix of it
    #: (state stored on an existing split point: no new KV), a disjoint one.
    def paths(self):
        a = list(range(100, 124))
        return [a, a[:9] + [7, 7, 7, 7, 7, 7, 7], a + [5, 6, 7, 8], a[:12], list(range(200, 212))]

    def check_against_reference(self, extra_key=None, cache_salt=None, **event_params):
        ref = Reference(self.PAGE_SIZE, **event_params)
        for tokens in self.paths():
            n = len(tokens) - len(tokens) % self.PAGE_SIZE
            tokens = tokens[:n]
            self.insert(tokens, extra_key, cache_salt)
            ref.insert(tokens, extra_key, cache_salt)
            with self.subTest(tokens=tokens):
                self.assertEqual(published(self.cache), ref.published())
        self.core.sanity_check()

    def test_plain(self):
        self.check_against_reference()

    def test_cache_salt(self):
        self.check_against_reference(cache_salt="tenant-a")

    def test_lora_extra_key_with_a_registered_name(self):
        """A LoRA request's namespace (``extra_key`` ends with the adapter id) named in the
        scheduler's table (``CacheInitParams.kv_event_lora_names``, filled at admission)."""
        from types import SimpleNamespace

        from sglang.srt.mem_cache.events import KvEventLoraNames

        lora_id = "0123456789abcdef" * 2
        extra_key = "sys-" + lora_id
        names = KvEventLoraNames()
        names.register(lora_id=lora_id, lora_name="adapter-x")
        names.register(SimpleNamespace(extra_key=extra_key, lora_id=lora_id), "adapter-x")
        self.cache, self.allocator = build_cache(
            self.pool, self.PAGE_SIZE, kv_event_lora_names=names, **self.EVENT_PARAMS
        )
        self.core = self.cache.core
        self.check_against_reference(extra_key=extra_key, kv_event_lora_names=names)

    def test_first_event_is_all_blocks_cleared(self):
        from sglang.srt.disaggregation.kv_events import AllBlocksCleared

        self.assertEqual(published(self.cache), decoded([AllBlocksCleared()]))
        self.assertEqual(published(self.cache), [])


class TestInsertsAsSGLangPages(TestInsertsAsSGLang):
    PAGE_SIZE = 4

    def test_match_split_on_a_page(self):
        """A match diverging inside a page splits at the page before: no event; the next
        path stored below it links to that page's hash."""
        a = list(range(100, 124))
        self.insert(a)
        published(self.cache)
        b = a[:10] + [1, 2, 3, 4, 5, 6]
        self.assertEqual(self.match(b).full_kv_hit_length, 8)
        self.assertEqual(published(self.cache), [])
        self.insert(b)
        self.assertEqual(published(self.cache), self.stored(b, 8, Reference(4).block_hashes(a)[1]))


class TestDynamoFormat(TestInsertsAsSGLang):
    EVENT_PARAMS = {"enable_kv_cache_events": True, "dynamo_kv_event_format": True}

    def check_against_reference(self, extra_key=None, cache_salt=None, **event_params):
        event_params.setdefault("dynamo_kv_event_format", True)
        super().check_against_reference(extra_key, cache_salt, **event_params)


class TestHybridRule(_EventsCase):
    """Which blocks stay published as SSM states come and go (``docs/design.md``, "KV
    events")."""

    A = list(range(100, 124))
    B = A[:9] + [7, 7, 7, 7, 7, 7, 7]

    def setUp(self):
        super().setUp()
        self.insert(self.A)
        self.insert(self.B)  # splits A after 9 tokens: a stateless node [0, 9)
        self.upper = self.node_at(self.A[:9])
        self.assertIsNone(self.upper.mamba_value)
        self.hashes = Reference().block_hashes(self.A)
        self.b_hashes = Reference().block_hashes(self.B)
        published(self.cache)

    def test_dropping_a_covered_state_publishes_nothing(self):
        node = self.insert(self.A[:9])  # a state on the split point
        self.assertIs(node, self.upper)
        self.assertEqual(published(self.cache), [])
        self.match(self.A)
        self.match(self.B)  # both leaves more recent than the state at 9
        self.assertEqual(self.evict(mamba_num=1).mamba_num_evicted, 1)
        self.assertIsNone(self.upper.mamba_value)
        self.assertEqual(len(self.upper.children), 2)
        # The KV of [0, 9) is still covered by the states at the ends of A and B.
        self.assertEqual(published(self.cache), [])
        self.core.sanity_check()
        self.match(self.B)  # A's leaf is the least recent
        self.evict(num_tokens=KV_SIZE)
        self.assertEqual(
            published(self.cache), self.removed(self.hashes[9:] + self.b_hashes[9:] + self.hashes[:9])
        )

    def test_ssm_eviction_of_a_leaf_withdraws_its_pages(self):
        self.match(self.A)  # B's leaf is the least recent state
        self.assertEqual(self.evict(mamba_num=1).mamba_num_evicted, 1)
        self.assertEqual(published(self.cache), self.removed(self.b_hashes[9:]))
        # [0, 9) lost a child but keeps A's: a one-child stateless node, still published.
        self.assertIsNone(self.node_at(self.A[:9]).mamba_value)
        self.assertEqual(published(self.cache), [])

    def test_kv_eviction_withdraws_every_page_once(self):
        self.match(self.B)  # A's leaf is the least recent
        res = self.evict(num_tokens=KV_SIZE)
        self.assertEqual(res.num_tokens_evicted, len(self.A) + len(self.B) - 9)
        # A's tail, then B's tail, then the stateless node they left bare, which goes too.
        self.assertEqual(
            published(self.cache), self.removed(self.hashes[9:] + self.b_hashes[9:] + self.hashes[:9])
        )
        self.assertEqual(self.core.root_node.children, {})

    def test_locked_stateless_leaf_is_withdrawn_then_republished(self):
        """A request locks [0, 9) (SGLang locks the node its match returned; the state it
        held may have been evicted since, here it never had one). Both leaves below are
        evicted: [0, 9) stays in the tree, locked, but no state at or below it can resume
        a request there, so its pages are withdrawn. A state stored there publishes them
        again (no parent: they start at the root)."""
        self.cache.inc_lock_ref(self.upper)
        self.evict(num_tokens=KV_SIZE)
        self.assertIs(self.node_at(self.A[:9]), self.upper)
        self.assertEqual(self.upper.children, {})
        self.assertEqual(
            published(self.cache), self.removed(self.hashes[9:] + self.b_hashes[9:] + self.hashes[:9])
        )
        self.insert(self.A[:9])
        self.assertIsNotNone(self.upper.mamba_value)
        self.assertEqual(published(self.cache), self.stored(self.A[:9], 0, None))
        self.cache.dec_lock_ref(self.upper)
        self.assertEqual(published(self.cache), [])
        self.core.sanity_check()

    def test_locked_stateless_leaf_removed_at_unlock_reports_nothing_more(self):
        self.cache.inc_lock_ref(self.upper)
        self.evict(num_tokens=KV_SIZE)
        self.assertEqual(
            published(self.cache), self.removed(self.hashes[9:] + self.b_hashes[9:] + self.hashes[:9])
        )
        self.cache.dec_lock_ref(self.upper)  # the bare node leaves the tree
        self.assertEqual(self.core.root_node.children, {})
        self.assertEqual(published(self.cache), [])

    def test_state_dropped_above_a_withdrawn_leaf_withdraws_its_node(self):
        """[0, 4) holds a state, [4, 9) is the locked stateless leaf (withdrawn). Evicting
        the state at 4 leaves [0, 4) with neither a state nor a published child: withdrawn
        as well. The unlock then removes both nodes without further events."""
        n4 = self.insert(self.A[:4])  # splits [0, 9) at 4; the state sits at 4
        self.assertIs(self.upper.parent, n4)
        self.cache.inc_lock_ref(self.upper)
        self.evict(num_tokens=KV_SIZE)
        self.assertEqual(
            published(self.cache), self.removed(self.hashes[9:] + self.b_hashes[9:] + self.hashes[4:9])
        )
        self.assertEqual(self.evict(mamba_num=1).mamba_num_evicted, 1)
        self.assertIsNone(n4.mamba_value)
        self.assertEqual(published(self.cache), self.removed(self.hashes[:4]))
        self.cache.dec_lock_ref(self.upper)
        self.assertEqual(self.core.root_node.children, {})
        self.assertEqual(published(self.cache), [])

    def test_new_path_below_a_withdrawn_node_republishes_it_first(self):
        """A path stored below the withdrawn locked node announces the node's pages, then
        its own, as one parent-linked chain."""
        self.cache.inc_lock_ref(self.upper)
        self.evict(num_tokens=KV_SIZE)
        published(self.cache)
        c = self.A[:9] + [9, 9, 9]
        self.insert(c)
        self.assertEqual(published(self.cache), self.stored(c, 0, None))
        self.cache.dec_lock_ref(self.upper)
        self.core.sanity_check()

    def test_reset_clears_all_and_starts_over(self):
        from sglang.srt.disaggregation.kv_events import AllBlocksCleared

        self.cache.reset()
        self.assertEqual(published(self.cache), decoded([AllBlocksCleared()]))
        self.insert(self.B)
        self.assertEqual(published(self.cache), self.stored(self.B, 0, None))


class TestRandomizedAgainstTheRule(_EventsCase):
    """Seeded random inserts, matches (splits), SSM and KV evictions, locks and unlocks
    (including locks on stateless nodes) and resets. A router's view is rebuilt from the
    published events alone (each ``BlockStored`` must link to an announced block, store no
    announced block again, each ``BlockRemoved`` remove announced blocks only); after every
    step it must equal the hybrid rule applied to the tree: the pages of every node that
    holds a state or has one below it, with the hashes SGLang's ``RadixCache`` gives those
    pages."""

    SEED = 11
    STEPS = 400
    PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [6] * 12, [])

    def test_router_view_follows_the_rule(self):
        import random

        from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        rng = random.Random(self.SEED + self.PAGE_SIZE)
        ps = self.PAGE_SIZE
        ref = Reference(ps)
        hashes_of = {}
        announced = set()
        locked = []

        def path_hashes(tokens):
            key = tuple(tokens)
            if key not in hashes_of:
                hashes_of[key] = ref.block_hashes(list(tokens))
            return hashes_of[key]

        def apply_events():
            for ev in published(self.cache):
                if isinstance(ev, AllBlocksCleared):
                    announced.clear()
                elif isinstance(ev, BlockStored):
                    self.assertTrue(ev.parent_block_hash is None or ev.parent_block_hash in announced)
                    self.assertFalse(announced & set(ev.block_hashes), "a block stored twice")
                    self.assertEqual(len(ev.token_ids), len(ev.block_hashes) * ps)
                    announced.update(ev.block_hashes)
                else:
                    self.assertIsInstance(ev, BlockRemoved)
                    self.assertTrue(set(ev.block_hashes) <= announced, "an unannounced block removed")
                    announced.difference_update(ev.block_hashes)

        def rule():
            want = set()

            def visit(node, path):
                covered = node.mamba_value is not None
                for child in node.children.values():
                    covered |= visit(child, path + child.key)
                if covered and node.parent is not None:
                    want.update(path_hashes(path)[(len(path) - len(node.key)) // ps :])
                return covered

            visit(self.core.root_node, [])
            return want

        for step in range(self.STEPS):
            op = rng.random()
            if op < 0.4:
                tokens = rng.choice(self.PREFIXES) + [rng.randrange(20, 24) for _ in range(rng.randrange(0, 3) * ps + ps)]
                tokens = tokens[: len(tokens) - len(tokens) % ps]
                if self.allocator.available_size() < len(tokens):
                    self.evict(num_tokens=len(tokens))
                if self.pool.mamba_allocator.available_size() == 0:
                    self.evict(mamba_num=1)
                if self.allocator.available_size() >= len(tokens) and self.pool.mamba_allocator.available_size():
                    self.insert(tokens)
            elif op < 0.55:
                self.match(rng.choice(self.PREFIXES)[: rng.randrange(1, 13)] + [rng.randrange(20, 24)])
            elif op < 0.7:
                self.evict(mamba_num=rng.randrange(1, 3))
            elif op < 0.78:
                self.evict(num_tokens=rng.randrange(1, 20))
            elif op < 0.9:
                nodes = self.core.nodes()
                if nodes:
                    node = rng.choice(nodes)
                    self.cache.inc_lock_ref(node)
                    locked.append(node)
            elif op < 0.995:
                if locked:
                    self.cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
            elif not locked:
                self.cache.reset()
            apply_events()
            self.core.sanity_check()
            self.assertEqual(announced, rule(), f"step {step}")
        while locked:
            self.cache.dec_lock_ref(locked.pop())
        apply_events()
        self.assertEqual(announced, rule())


class TestRandomizedAgainstTheRulePages(TestRandomizedAgainstTheRule):
    PAGE_SIZE = 4


class TestLifecycleThroughSGLang(_EventsCase):
    """Two prompts sharing a prefix, each admitted, prefilled and finished through SGLang's
    scheduler functions (``match_kv_cache``, ``alloc_req_slots``, ``checkpoint_kv_cache``,
    ``release_kv_cache``; the glue tests' harness) with prefix checkpoints: the finished
    prompts are published exactly as SGLang's ``RadixCache`` publishes the same two
    sequences, although the plugin's tree holds them as several nodes (the prompt-end and
    branch-point checkpoints)."""

    def test_two_prompts_sharing_a_prefix(self):
        from test_sglang_glue import _Harness

        self.pool.prefix_checkpoint_writer = True
        h = _Harness(self, self.pool, self.cache, self.allocator)
        ref = Reference()
        a = list(range(10, 50))
        b = a[:24] + list(range(300, 316))
        published(self.cache)
        ref.published()
        for rid, prompt in (("a", a), ("b", b)):
            req = F.make_req(rid, prompt, max_new_tokens=1)
            h.admit(req)
            h.prefill(req)
            h.decode(req, [5])
            h.finish(req)
            h.check_idle()
            ref.insert(prompt)
            with self.subTest(rid=rid):
                self.assertEqual(published(self.cache), ref.published())
        # The tree holds states at 24 (branch point), 39 (prompt end) and 40 on each path.
        self.assertIsNotNone(self.node_at(a[:24]).mamba_value)
        self.assertIsNotNone(self.node_at(b[:39]).mamba_value)


if __name__ == "__main__":
    unittest.main()
