"""The TP consistency check (``plugin/tp_digest.py``): two real gloo ranks (processes) run the
same cache operations; the digests agree, and a planted divergence (one rank evicts a state
the other keeps) stops both ranks with :class:`TPCacheDivergence` naming the part."""

import os
import unittest

import torch.multiprocessing as mp

from conftest import requires_sglang


def _rank(rank: int, port: int, plant: bool, results) -> None:
    import torch.distributed as dist

    from cache_sim import SimModel, make_cache
    from sglang_mamba_ext.plugin.tp_digest import TPCacheDivergence, TPDigestCheck, cache_digest

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        cache = make_cache(kv_size=256, mamba_size=16)
        sim = SimModel(cache)
        for i, (p, out) in enumerate([(list(range(10, 30)), [1, 2, 3]), (list(range(10, 22)) + [5, 6], [4]),
                                      (list(range(40, 52)), [7, 8])]):
            sim.run(p, out, rid=f"r{i}")
        check = TPDigestCheck(cache, None, every=2)
        check.step()  # batch 1: no check yet
        if plant and rank == 1:
            cache.evict(mamba_num=1)  # a decision rank 0 does not make
        try:
            check.step()  # batch 2: all-reduce
            results[rank] = ("ok", cache_digest(cache), check.checks)
        except TPCacheDivergence as e:
            results[rank] = ("diverged", str(e), check.checks)
    finally:
        dist.destroy_process_group()


def _run(plant: bool):
    from sglang_mamba_ext.testing.server import free_port

    port = free_port()
    with mp.Manager() as m:
        results = m.dict()
        mp.spawn(_rank, args=(port, plant, results), nprocs=2, join=True)
        return dict(results)


@requires_sglang
class TestTPDigest(unittest.TestCase):
    def test_same_decisions_agree(self):
        r = _run(plant=False)
        self.assertEqual((r[0][0], r[1][0]), ("ok", "ok"), r)
        self.assertEqual(r[0][1], r[1][1])
        self.assertEqual(r[0][2], 1)

    def test_planted_divergence_stops_both_ranks(self):
        r = _run(plant=True)
        for rank in (0, 1):
            kind, msg, _ = r[rank]
            self.assertEqual(kind, "diverged", r)
            self.assertIn("prefix caches diverged (tree, slots, counters) by batch 2", msg)
            self.assertIn(f"rank {rank}", msg)

    def test_env_validation(self):
        from sglang_mamba_ext.plugin import tp_digest

        os.environ[tp_digest.ENV] = "often"
        try:
            with self.assertRaisesRegex(ValueError, "expected a positive integer"):
                tp_digest.maybe_digest_check(None, object())
        finally:
            del os.environ[tp_digest.ENV]
        self.assertIsNone(tp_digest.maybe_digest_check(None, object()))  # off by default


if __name__ == "__main__":
    unittest.main()
