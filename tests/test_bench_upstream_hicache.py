"""Tests of the hit-rate benchmark's host-tier rows of SGLang's own cache
(``sglang_mamba_ext.benchmarks.upstream_hicache``: ``upstream-xbuf-host`` and
``upstream-nobuf-ckpt-host``, SGLang's HiCache over its ``UnifiedRadixCache``).

CPU only. The transfer-op tests need only torch; the driver tests import SGLang and
replay the first 80 requests of the chat workload (no trace file needed):

* device pools so large that nothing is evicted: each host row hits, request by
  request, exactly what the same strategy hits without a host tier, and loads nothing;
* 6 device SSM slots: each host row hits strictly more tokens than without the host
  tier, some requests' hits come from load-backs, the leak check (device and host pools,
  SGLang's tree invariants) passes, and the KV of every reported prefix -- device
  resident or loaded back -- holds what was written for those positions.
"""

from __future__ import annotations

import unittest

import torch
from conftest import requires_sglang

from sglang_mamba_ext.benchmarks import upstream_hicache as uh

KV_SIZE = 200_000
#: (host row, the same strategy without a host tier)
PAIRS = (
    ("upstream-xbuf-host", "upstream-xbuf"),
    ("upstream-nobuf-ckpt-host", "upstream-nobuf-ckpt"),
)


class DirectOpsTest(unittest.TestCase):
    """The torch stand-ins for sgl_kernel's "direct" transfer ops."""

    def test_copy(self):
        src = [torch.arange(12.0).view(6, 2), -torch.arange(12.0).view(6, 2)]
        dst = [torch.zeros(4, 2), torch.zeros(4, 2)]
        uh._direct_copy(src, dst, torch.tensor([5, 1]), torch.tensor([0, 3]), page_size=1)
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(d[0], s[5]) and torch.equal(d[3], s[1]))
            self.assertTrue(torch.equal(d[1:3], torch.zeros(2, 2)))

    def test_page_first_roundtrip(self):
        # Two destinations (K and V) of 3 layers each, page size 2, 4 host pages.
        layers, page, slots = 3, 2, 7
        dev = [torch.randn(slots, 1, 4) for _ in range(2 * layers)]
        host = [torch.zeros(4, layers, page, 1, 4) for _ in range(2)]
        src_idx, host_idx = torch.tensor([6, 0, 3]), torch.tensor([1, 4, 7])
        uh._direct_layer_first_to_page_first(dev, host, src_idx, host_idx, page)
        for j in range(2):
            for layer in range(layers):
                for s, h in zip(src_idx.tolist(), host_idx.tolist()):
                    self.assertTrue(torch.equal(host[j][h // page, layer, h % page], dev[j * layers + layer][s]))
        # Back, one layer at a time, into fresh device rows.
        back = [torch.zeros(slots, 1, 4) for _ in range(2 * layers)]
        dst_idx = torch.tensor([2, 4, 5])
        for layer in range(layers):
            uh._direct_page_first_to_layer_first(
                host, [back[layer], back[layers + layer]], host_idx, dst_idx, layer, page
            )
        for k in range(2 * layers):
            self.assertTrue(torch.equal(back[k][dst_idx], dev[k][src_idx]))


def _run(name: str, mamba_size: int, records, check_kv: bool = False):
    """``(result, driver)`` of one hit-rate variant over ``records``; with ``check_kv``
    every KV slot the driver allocates gets a value of its (token, position), and once the
    request is admitted (its batch's loads started) every reported prefix is checked against those values (``driver.kv_checked``: requests
    checked, ``driver.kv_checked_loaded``: of them, with a load-back)."""
    from sglang_mamba_ext.benchmarks import hit_rate as bench_hit_rate

    driver = bench_hit_rate.VARIANTS[name].factory(KV_SIZE, mamba_size)
    if check_kv:
        _instrument_kv(driver)
    return bench_hit_rate.run_hit_trace(driver, records), driver


def _marker(seq, start: int, stop: int) -> torch.Tensor:
    """The value written at positions ``start..stop-1`` of ``seq`` (exact in bf16)."""
    pos = torch.arange(start, stop)
    tok = torch.tensor(seq[start:stop], dtype=torch.int64)
    return ((tok * 31 + pos) % 251 + 1).to(torch.float32)


def _instrument_kv(driver) -> None:
    kv = driver.allocator.get_kvcache().full_kv_pool
    buffers = list(kv.k_buffer) + list(kv.v_buffer)
    rows = driver.req_to_token_pool.req_to_token
    driver.kv_checked = driver.kv_checked_loaded = 0
    seqs, loaded = {}, {}
    alloc_kv, match, lock = driver.alloc_kv, driver.match, driver.lock

    def alloc_kv_marked(h, num_tokens):
        alloc_kv(h, num_tokens)
        if num_tokens > 0:
            seq = seqs[h.req.rid]
            start, stop = h.seq_len - num_tokens, h.seq_len
            slots = rows[h.req.kv.req_pool_idx, start:stop].to(torch.int64)
            value = _marker(seq, start, stop)
            for buf in buffers:
                buf[slots] = value.view(-1, *([1] * (buf.dim() - 1))).to(buf.dtype)

    def match_recorded(h):
        seqs[h.req.rid] = tuple(h.req.origin_input_ids) + tuple(h.output)
        loads = driver.load_backs
        p = match(h)
        loaded[h.req.rid] = driver.load_backs > loads
        return p

    def lock_checked(h):
        # The H2D loads of a batch start when it is built (lock): check after that.
        lock(h)
        p = h.req.prefix_len
        if p > 0:
            slots = driver.cache.prefix_device_indices(h.req).to(torch.int64)
            want = _marker(seqs[h.req.rid], 0, p)
            for buf in buffers:
                got = buf[slots].reshape(p, -1).to(torch.float32)
                if not torch.equal(got, want.view(-1, 1).expand_as(got)):
                    bad = int((got[:, 0] != want).nonzero()[0])
                    raise AssertionError(
                        f"rid {h.req.rid}: KV at prefix position {bad} of {p} holds "
                        f"{got[bad, 0].item()}, written {want[bad].item()} "
                        f"(load-back: {loaded[h.req.rid]})"
                    )
            driver.kv_checked += 1
            driver.kv_checked_loaded += loaded[h.req.rid]

    driver.alloc_kv, driver.match, driver.lock = alloc_kv_marked, match_recorded, lock_checked


class _ChatCase(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.benchmarks.chat_workload import chat_workload

        torch.set_num_threads(1)
        cls.records = chat_workload(0)[:80]


@requires_sglang
class NoEvictionTest(_ChatCase):
    """400 SSM slots, 200,000 KV tokens: nothing leaves the device, so the host tier
    changes no hit."""

    MAMBA = 400

    def test_host_rows_hit_what_the_device_rows_hit(self):
        for host_name, base_name in PAIRS:
            with self.subTest(host_name):
                host, d = _run(host_name, self.MAMBA, self.records)
                base, _ = _run(base_name, self.MAMBA, self.records)
                self.assertTrue(host.leak_ok, host.leak_details)
                self.assertTrue(base.leak_ok, base.leak_details)
                self.assertGreater(base.matched_tokens, 0)
                self.assertEqual(host.prefix_lens, base.prefix_lens)
                self.assertEqual(host.kv_prefix_lens, base.kv_prefix_lens)
                self.assertEqual(d.load_backs, 0)
                # Write-through backed every cached node up: the host holds what the device does.
                kv_host = {n: held for n, _, held, _ in d.host_accounting()}["kv"]
                self.assertEqual(kv_host, d.cache.full_evictable_size())


@requires_sglang
class SmallSsmPoolTest(_ChatCase):
    """6 SSM slots: states evicted from the device survive on the host (13 host slots),
    and later requests resume from them."""

    MAMBA = 6

    def test_host_tier_adds_hits(self):
        for host_name, base_name in PAIRS:
            with self.subTest(host_name):
                host, d = _run(host_name, self.MAMBA, self.records, check_kv=True)
                base, _ = _run(base_name, self.MAMBA, self.records)
                self.assertTrue(host.leak_ok, host.leak_details)
                self.assertIn("host mamba", host.leak_details)
                self.assertGreater(host.matched_tokens, base.matched_tokens)
                self.assertGreater(d.load_backs, 0)
                self.assertGreater(d.host_loaded_tokens, 0)
                # Every reported prefix's KV was checked, the loaded ones included.
                self.assertEqual(d.kv_checked, sum(p > 0 for p in host.prefix_lens))
                self.assertEqual(d.kv_checked_loaded, d.load_backs)
                for p, kv in zip(host.prefix_lens, host.kv_prefix_lens):
                    self.assertLessEqual(p, kv)


if __name__ == "__main__":
    unittest.main()
