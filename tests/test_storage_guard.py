"""The storage tier's guard (``mem_cache/storage_guard.py``): a store that hangs or reports
itself unreachable costs a caller at most the timeout once, then misses and dropped writes
at once, probed off the caller's thread until it answers again. A fake store, no SGLang, no
mooncake (``tests/test_storage_mooncake.py`` kills and restarts a real master)."""

import threading
import time
import os
import unittest

from conftest import SGLANG_INSTALLED

from sglang_mamba_ext.mem_cache.storage_guard import GuardedStore, StoreUnavailable


class FakeStore:
    def __init__(self):
        self.values = {}
        self.mode = "up"  # "up", "hang" (calls block until released), "refuse" (StoreUnavailable)
        self.release = threading.Event()
        self.calls = 0
        self.pings = 0

    def _gate(self):
        self.calls += 1
        if self.mode == "hang":
            self.release.wait(10)
        if self.mode == "refuse":
            raise StoreUnavailable("gone")

    def get(self, key, target):
        self._gate()
        return self.values.get(key)

    def set(self, key, value):
        self._gate()
        self.values[key] = value
        return True

    def exists(self, key):
        self._gate()
        return key in self.values

    def batch_exists(self, keys):
        self._gate()
        n = 0
        for k in keys:
            if k not in self.values:
                break
            n += 1
        return n

    def clear(self):
        self._gate()
        self.values.clear()
        return True

    def ping(self):
        self.pings += 1
        self._gate()
        return True


class TestGuardedStore(unittest.TestCase):
    def make(self, timeout=0.2, retry=0.2):
        inner = FakeStore()
        guard = GuardedStore(inner, timeout, retry)
        self.addCleanup(guard.close)
        self.addCleanup(inner.release.set)
        return inner, guard

    def wait_available(self, guard, limit=5.0):
        deadline = time.monotonic() + limit
        while not guard.available and time.monotonic() < deadline:
            guard.exists("x")
            time.sleep(0.02)
        return guard.available

    def test_passes_calls_through_while_up(self):
        inner, g = self.make()
        self.assertTrue(g.set("a", 1))
        self.assertEqual((g.get("a", None), g.exists("a"), g.exists("b"), g.batch_exists(["a", "b"])), (1, True, False, 1))
        self.assertTrue(g.clear())
        self.assertEqual(g.unavailable_total, 0)
        self.assertTrue(g.available)

    def test_a_hanging_store_costs_one_timeout_then_nothing(self):
        inner, g = self.make(timeout=0.2, retry=0.2)
        g.set("a", 1)
        inner.mode = "hang"
        t = time.monotonic()
        self.assertIsNone(g.get("a", None))  # waits the timeout, then a miss
        self.assertLess(time.monotonic() - t, 0.6)
        self.assertFalse(g.available)
        t = time.monotonic()
        for _ in range(50):  # the hung call keeps the worker: answered at once, nothing reaches the store
            self.assertEqual((g.exists("a"), g.batch_exists(["a"]), g.set("b", 2), g.get("a", None)), (False, 0, False, None))
        self.assertLess(time.monotonic() - t, 0.2)
        self.assertEqual(inner.calls, 2)  # the set above and the hung get
        self.assertEqual((g.outages_total, g.unavailable_total), (1, 201))
        inner.mode = "up"
        inner.release.set()  # the hung call returns; the next call after the retry time probes
        self.assertTrue(self.wait_available(g))
        self.assertEqual((g.recoveries_total, g.get("a", None), g.set("b", 2)), (1, 1, True))

    def test_an_unreachable_store_is_probed_every_retry_interval_off_the_caller(self):
        inner, g = self.make(timeout=1.0, retry=0.3)
        inner.mode = "refuse"
        t = time.monotonic()
        self.assertFalse(g.exists("a"))  # answered "unreachable": tripped without waiting
        self.assertLess(time.monotonic() - t, 0.2)
        t = time.monotonic()
        while time.monotonic() - t < 1.0:
            self.assertEqual(g.batch_exists(["a"]), 0)
            time.sleep(0.01)
        self.assertGreaterEqual(inner.pings, 2)
        self.assertLessEqual(inner.pings, 4)  # about one per 0.3 s, not one per call
        inner.mode = "hang"  # a probe that hangs does not hold the caller either
        time.sleep(0.35)
        t = time.monotonic()
        for _ in range(20):
            self.assertFalse(g.exists("a"))
        self.assertLess(time.monotonic() - t, 0.2)
        inner.mode = "up"
        inner.release.set()
        self.assertTrue(self.wait_available(g))
        self.assertEqual((g.outages_total, g.recoveries_total), (1, 1))

    def test_other_errors_reach_the_tier_and_do_not_trip(self):
        inner, g = self.make()

        def boom(key, target):
            raise RuntimeError("short read")

        inner.get = boom
        with self.assertRaises(RuntimeError):
            g.get("a", None)
        self.assertTrue(g.available)

    def test_settings_must_be_positive(self):
        with self.assertRaises(ValueError):
            GuardedStore(FakeStore(), 0, 1)
        from sglang_mamba_ext.plugin.host_tier import _guard_settings

        with self.assertRaises(ValueError):
            GuardedStore(FakeStore(), float("inf"), 1)  # a thread wait that long overflows
        self.assertEqual(_guard_settings({}), (2.0, 5.0))
        self.assertEqual(_guard_settings({"storage_call_timeout_s": None}), (2.0, 5.0))  # JSON null: the default
        self.assertEqual(_guard_settings({"storage_call_timeout_s": 0.5, "storage_retry_interval_s": 1}), (0.5, 1.0))
        # found by a fresh-user check: 1e10 and Infinity passed and then made every guarded
        # call raise OverflowError (the tier silently off); booleans and strings passed as numbers
        for bad in (-1, 0, 1e10, float("inf"), float("nan"), True, "2", "abc", [1]):
            with self.subTest(bad=bad), self.assertRaisesRegex(ValueError, "storage_call_timeout_s must be a number"):
                _guard_settings({"storage_call_timeout_s": bad})
        with self.assertRaisesRegex(ValueError, "unknown key.*storage_call_timout_s"):
            _guard_settings({"storage_call_timout_s": 1})  # misspelled
        self.assertEqual(_guard_settings({"master_server_address": "h:1", "protocol": "tcp"}), (2.0, 5.0))

    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang (its extra-config parser)")
    def test_launcher_check_reads_the_json_flag(self):
        from sglang_mamba_ext.plugin.host_tier import check_guard_settings

        check_guard_settings(None)
        check_guard_settings('{"storage_call_timeout_s": 3, "protocol": "tcp"}')
        with self.assertRaisesRegex(ValueError, "storage_retry_interval_s must be a number"):
            check_guard_settings('{"storage_retry_interval_s": Infinity}')
        with self.assertRaisesRegex(ValueError, "extra-config"):
            check_guard_settings("{not json")
        # at the launcher's flag step (plugin/args.py): a FlagError, which start-up reports
        # argparse-style (usage, "error: ...", status 2) before any model load
        from types import SimpleNamespace

        from sglang_mamba_ext.plugin.args import _take_storage_backend
        from sglang_mamba_ext.plugin.startup_errors import FlagError

        args = SimpleNamespace(hicache_storage_backend="mooncake", enable_hierarchical_cache=True, tp_size=1, dp_size=1,
                               hicache_host_memory_mode="cache",
                               hicache_storage_backend_extra_config='{"storage_call_timeout_s": 1e10}')
        with self.assertRaisesRegex(FlagError, "storage_call_timeout_s must be a number"):
            _take_storage_backend(args, {}, refuse=None)
        args.hicache_storage_backend_extra_config = '{"storage_call_timeout_s": 4}'
        settings = {}
        _take_storage_backend(args, settings, refuse=None)
        self.assertEqual(settings["storage_backend"], "mooncake")

    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang (its extra-config parser)")
    def test_file_backend_extra_config_checked_at_start_up(self):
        """A fresh-user check found these accepted with ``file`` and the scheduler dying with a
        traceback after the model load: each is now a FlagError at the flag step."""
        import tempfile
        from types import SimpleNamespace

        from sglang_mamba_ext.plugin.args import _take_storage_backend
        from sglang_mamba_ext.plugin.startup_errors import FlagError

        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        args = SimpleNamespace(hicache_storage_backend="file", enable_hierarchical_cache=True, tp_size=1, dp_size=1,
                               hicache_host_memory_mode="cache")
        bad = {
            '{"file_storage_path": /tmp/x': "extra-config: Expecting value",
            "[1,2]": "expected a JSON object",
            "@" + os.path.join(tmp.name, "missing.json"): "No such file",
            '{"file_storage_path": "/proc/nope/hc"}': "file_storage_path '/proc/nope/hc' cannot be made",
            '{"storage_call_timeout_s": 3}': "apply to --hicache-storage-backend mooncake only",
            '{"storage_call_timout_s": 3}': "apply to --hicache-storage-backend mooncake only",
        }
        for extra, message in bad.items():
            with self.subTest(extra=extra):
                args.hicache_storage_backend_extra_config = extra
                args.hicache_storage_backend = "file"
                with self.assertRaisesRegex(FlagError, message):
                    _take_storage_backend(args, {}, refuse=None)
        store = os.path.join(tmp.name, "a", "b")
        args.hicache_storage_backend_extra_config = '{"file_storage_path": "%s"}' % store
        settings = {}
        _take_storage_backend(args, settings, refuse=None)
        self.assertEqual((settings["storage_backend"], os.path.isdir(store)), ("file", True))


class TestModelFingerprint(unittest.TestCase):
    """Storage values carry the model's fingerprint in their digest (``host_tier.storage_layout_tag``):
    a fresh-user check replaced a model's weights in place and the restarted server hit the old
    weights' states from storage (wrong outputs)."""

    def test_changes_with_the_weights_not_otherwise(self):
        import tempfile
        import time

        from sglang_mamba_ext.plugin.host_tier import model_fingerprint

        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        d = tmp.name
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write('{"a": 1}')
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            f.write(b"x" * 64)
        first = model_fingerprint(d)
        self.assertEqual(len(first), 16)
        self.assertEqual(model_fingerprint(d), first)  # stable: a restart on the same files hits
        with open(os.path.join(d, "tokenizer.json"), "w") as f:  # not a weight file
            f.write("{}")
        self.assertEqual(model_fingerprint(d), first)
        time.sleep(0.01)
        with open(os.path.join(d, "model.safetensors"), "wb") as f:  # same size, new bytes
            f.write(b"y" * 64)
        second = model_fingerprint(d)
        self.assertNotEqual(second, first)
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write('{"a": 2}')
        self.assertNotIn(model_fingerprint(d), (first, second))
        self.assertEqual(model_fingerprint("org/hub-model"), "")
        self.assertEqual(model_fingerprint(None), "")


if __name__ == "__main__":
    unittest.main()
