"""The e2e harness's server launcher (``sglang_mamba_ext/testing/server.py``): ports come
from outside the kernel's ephemeral range, SGLang's own range and Mooncake's, and a server whose HTTP
port was taken between the pick and its bind is relaunched on a fresh port (CI once lost a
whole PD class to this: uvicorn logged the bind error and hung in shutdown for minutes).

The "server" here is a stand-in process, not SGLang: its first launch prints uvicorn's bind
error and hangs; later launches answer ``/health``."""

import json
import os
import socket
import sys
import tempfile
import time
import unittest

from sglang_mamba_ext.testing.server import PORT_RANGES, ServerProcess, free_port

FAKE = r'''
import http.server, os, sys, time
port = int(sys.argv[1]); marker = sys.argv[2]; fail_first = sys.argv[3] == "1"
if fail_first and not os.path.exists(marker):
    open(marker, "w").close()
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
          "address already in use", flush=True)
    time.sleep(600)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


class FakeServer(ServerProcess):
    def __init__(self, marker: str, fail_first: bool, log_path: str):
        super().__init__("unused", start_timeout_s=60, log_path=log_path)
        self.marker, self.fail_first = marker, fail_first
        self.launched_ports = []

    def command(self):
        self.launched_ports.append(self.port)
        return [sys.executable, "-c", FAKE, str(self.port), self.marker, "1" if self.fail_first else "0"]


class TestServerLauncher(unittest.TestCase):
    def test_free_port_is_outside_ephemeral_sglang_and_mooncake_ranges(self):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
        for _ in range(20):
            port = free_port()
            self.assertTrue(any(lo <= port <= hi for lo, hi in PORT_RANGES), port)
            self.assertLess(port, min(22000, ephemeral_low))  # SGLang's own pick starts at 22000
            self.assertFalse(15000 <= port <= 17000, port)  # Mooncake's ports
            with socket.socket() as s:  # and it really is free
                s.bind(("127.0.0.1", port))

    def _run(self, fail_first: bool):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        server = FakeServer(os.path.join(tmp.name, "marker"), fail_first, os.path.join(tmp.name, "log"))
        self.addCleanup(server.stop)
        server.start()
        self.assertTrue(server.healthy(timeout=10))
        return server

    def test_taken_port_relaunches_on_a_fresh_port(self):
        server = self._run(fail_first=True)
        self.assertEqual(len(server.launched_ports), 2)
        first, second = server.launched_ports
        self.assertNotEqual(first, second)
        self.assertEqual(server.port, second)
        self.assertEqual(server.base_url, f"http://127.0.0.1:{second}")
        log = server.log_text()
        self.assertIn(f"('127.0.0.1', {first}): address already in use", log)  # the first attempt kept
        self.assertIn(f"relaunching on {second}", log)

    def test_healthy_first_launch_is_not_relaunched(self):
        server = self._run(fail_first=False)
        self.assertEqual(len(server.launched_ports), 1)

    def test_every_launch_taken_raises_with_the_log(self):
        class AlwaysTaken(FakeServer):
            def command(self):
                os.path.exists(self.marker) and os.remove(self.marker)
                return super().command()

        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        server = AlwaysTaken(os.path.join(tmp.name, "marker"), True, os.path.join(tmp.name, "log"))
        self.addCleanup(server.stop)
        with self.assertRaisesRegex(RuntimeError, "could not bind a port in 2 launches"):
            server.start(bind_attempts=2)
        self.assertEqual(len(server.launched_ports), 2)
        self.assertFalse(server.alive())


class TestForkLaunch(unittest.TestCase):
    """``sglang_mamba_ext/testing/fork_launch.py``: SGLang's ``set_start_method("spawn")``
    picks fork, other methods pass through, and the launcher runs the module it is given
    as ``__main__`` with the arguments after it."""

    def test_spawn_becomes_fork_and_others_pass_through(self):
        import subprocess

        code = (
            "import multiprocessing as mp\n"
            "from sglang_mamba_ext.testing.fork_launch import _fork_instead_of_spawn\n"
            "_fork_instead_of_spawn()\n"
            "mp.set_start_method('spawn', force=True); print(mp.get_start_method())\n"
            "mp.set_start_method('forkserver', force=True); print(mp.get_start_method())\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        self.assertEqual(out.split(), ["fork", "forkserver"])

    def test_import_time_env_is_what_the_plugin_would_set(self):
        from unittest import mock

        from sglang_mamba_ext.testing.fork_launch import import_time_env

        base = ["--model-path", "unused-dir", "--device", "cpu", "--enable-mamba-radix"]
        spec = [*base, "--speculative-algorithm", "EAGLE"]
        clean = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TORCHDYNAMO_DISABLE")}
        with mock.patch.dict(os.environ, clean, clear=True):
            self.assertEqual(import_time_env(base), {})
            self.assertEqual(import_time_env(spec), {"TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1"})
            os.environ["SGLANG_MAMBA_EXT_NO_CPU_DEFAULTS"] = "1"
            self.assertEqual(import_time_env(spec), {})
            del os.environ["SGLANG_MAMBA_EXT_NO_CPU_DEFAULTS"]
            os.environ["TRITON_INTERPRET"] = "0"  # set by the caller: left alone
            self.assertEqual(import_time_env(spec), {"TORCHDYNAMO_DISABLE": "1"})


class TestLaunchEnvironment(unittest.TestCase):
    """Servers started together (threads, ``tests/e2e/server_util.py::start_together``) each
    judge their import-time variables in their own environment without touching the test
    process's: a swap of ``os.environ`` once left the repository twice on ``PYTHONPATH`` (every
    later launch then started a new zygote) and made another thread's ``subprocess`` start
    fail with EFAULT."""

    def test_concurrent_judgments_leave_os_environ_alone(self):
        import threading

        from sglang_mamba_ext.testing.server import REPO, ServerProcess

        spec = ["--model-path", "unused-dir", "--device", "cpu", "--enable-mamba-radix",
                "--speculative-algorithm", "EAGLE"]
        before = dict(os.environ)
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        cases = {  # a launch's overrides -> what its CPU defaults would set at import
            "a": ({"TRITON_INTERPRET": None, "TORCHDYNAMO_DISABLE": None},
                  {"TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1"}),
            "b": ({"TRITON_INTERPRET": "0", "TORCHDYNAMO_DISABLE": None}, {"TORCHDYNAMO_DISABLE": "1"}),
            "c": ({"SGLANG_MAMBA_EXT_NO_CPU_DEFAULTS": "1"}, {}),
        }
        got, changed, done = {}, [], threading.Event()

        def watch():  # os.environ must never change meanwhile
            while not done.is_set():
                if dict(os.environ) != before:
                    changed.append(True)

        def launch(who):
            proc = ServerProcess("unused-dir", [], env=cases[who][0], log_path=os.path.join(tmp.name, who))
            got[who] = set()
            for _ in range(10):
                env = proc.launch_env()
                got[who].add(tuple(sorted(proc.import_time_preset(spec, env).items())))
            got[who + "-path"] = env["PYTHONPATH"]

        watcher = threading.Thread(target=watch)
        watcher.start()
        threads = [threading.Thread(target=launch, args=(w,)) for w in cases]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        watcher.join()
        self.assertEqual(changed, [])
        self.assertEqual(dict(os.environ), before)
        for who, (_, preset) in cases.items():
            self.assertEqual(got[who], {tuple(sorted(preset.items()))}, who)
            self.assertEqual(got[who + "-path"], REPO + os.pathsep + before.get("PYTHONPATH", ""))

    def test_zygote_start_reasons(self):
        from unittest import mock

        from sglang_mamba_ext.testing import zygote

        with mock.patch.object(zygote, "_zygotes", {(True, ("A", "1"), ("B", "2")): None}), \
                mock.patch.object(zygote, "_closed_keys", {(True, ("C", "3"))}):
            self.assertEqual(zygote._start_reason((True, ("A", "1"), ("B", "3"), ("D", "4"))),
                             "environment differs in B, D")
            self.assertEqual(zygote._start_reason((False, ("A", "1"))), "the first of its kind")
            self.assertEqual(zygote._start_reason((True, ("C", "3"))), "one closed earlier for MAX_ZYGOTES")


class TestZygote(unittest.TestCase):
    """``sglang_mamba_ext/testing/zygote.py``: launches forked from one process that imported
    SGLang once, each a session leader writing to its own log, with its exit status reported
    as ``subprocess`` does. The launches here end at argument parsing (``--help``, a bad flag),
    so no server starts."""

    @staticmethod
    def env():
        """Both tests' environment: one zygote (one SGLang import) serves the class."""
        return dict(os.environ, PYTHONUNBUFFERED="1", MAMBA_EXT_ZYGOTE_TEST=str(os.getpid()))

    def test_two_launches_from_one_zygote(self):
        from sglang_mamba_ext.testing import zygote

        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        env = self.env()
        logs = [os.path.join(tmp.name, f"{i}.log") for i in range(2)]
        helped = zygote.launch(["--help"], env, logs[0])
        self.assertEqual(helped.wait(timeout=300), 0)
        bad = zygote.launch(["--model-path", "m", "--no-such-flag"], env, logs[1])
        self.assertEqual(bad.wait(timeout=120), 2)  # argparse's exit status
        self.assertNotEqual(helped.pid, bad.pid)
        with open(logs[0]) as f:
            helptext = f.read()
        # SGLang's help, with the plugin's flags (a user's `python -m sglang.launch_server --help`
        # runs the same launcher code after the same imports)
        for flag in ("--enable-mamba-radix", "--warmup-prompts-file PATH", "--mamba-spec-state-update"):
            self.assertIn(flag, helptext)
        for choice in ("recompute", "adaptive"):  # --radix-eviction-policy's added choices
            self.assertIn(choice, helptext)
        with open(logs[1]) as f:
            self.assertIn("unrecognized arguments: --no-such-flag", f.read())
        (z,) = [z for key, z in zygote._zygotes.items() if ("MAMBA_EXT_ZYGOTE_TEST", str(os.getpid())) in key]
        self.assertIsNone(z.proc.poll())  # one zygote served both, still up
        self.assertIn("import_s", z.ready)

    def test_late_variables_set_in_the_child_share_the_zygote(self):
        """Launches that differ only in :data:`zygote.LATE_ENV` variables share one zygote, and
        each child sees its own values (and not another launch's)."""
        from sglang_mamba_ext.testing import zygote

        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        with open(os.path.join(tmp.name, "probe_env.py"), "w") as f:
            f.write("import os, json\nprint(json.dumps({k: os.environ.get(k) for k in "
                    "('SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK', 'SGLANG_MAMBA_EXT_PROBE', 'MAMBA_EXT_ZYGOTE_TEST')}))\n")
        # the other test's environment (its zygote, if it ran first: one SGLang import for both)
        base = {k: v for k, v in self.env().items() if not zygote.is_late(k)}
        first = zygote.run("probe_env", [], dict(base, SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK="1",
                                                SGLANG_MAMBA_EXT_PROBE="a"), timeout=300, cwd=tmp.name, plugins=True)
        second = zygote.run("probe_env", [], dict(base, SGLANG_MAMBA_EXT_PROBE="b"), timeout=120, cwd=tmp.name,
                            plugins=True)
        self.assertEqual(first.returncode, 0, first.stderr[-2000:])
        self.assertEqual(json.loads(first.stdout.strip().splitlines()[-1]), {
            "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1", "SGLANG_MAMBA_EXT_PROBE": "a",
            "MAMBA_EXT_ZYGOTE_TEST": str(os.getpid())})
        self.assertEqual(json.loads(second.stdout.strip().splitlines()[-1]), {
            "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": None, "SGLANG_MAMBA_EXT_PROBE": "b",
            "MAMBA_EXT_ZYGOTE_TEST": str(os.getpid())})
        keys = [key for key in zygote._zygotes if ("MAMBA_EXT_ZYGOTE_TEST", str(os.getpid())) in key]
        self.assertEqual(len(keys), 1, keys)  # one zygote served both
        self.assertFalse(any(zygote.is_late(k) for k, _ in keys[0][1:]))


if __name__ == "__main__":
    unittest.main()


def _shared_worker(root, key, log):
    import conftest

    conftest._SHARED["dir"] = root

    def build(path):
        with open(log, "a") as f:
            f.write("built\n")
        import time as _t

        _t.sleep(0.5)  # the other process asks meanwhile
        with open(os.path.join(path, "payload"), "w") as f:
            f.write("ok")

    path = conftest.shared_build(key, build)
    with open(os.path.join(path, "payload")) as f:
        assert f.read() == "ok"


class TestSharedBuild(unittest.TestCase):
    """``conftest.shared_build``: what the test workers share (the MTP pairs) is built once per
    run, the second asker waiting for the first's build instead of building it again."""

    def test_two_processes_build_once(self):
        import multiprocessing

        with tempfile.TemporaryDirectory() as root:
            log = os.path.join(root, "log")
            ctx = multiprocessing.get_context("fork")
            procs = [ctx.Process(target=_shared_worker, args=(root, "pair", log)) for _ in range(2)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(60)
                self.assertEqual(p.exitcode, 0)
            with open(log) as f:
                self.assertEqual(f.read(), "built\n")
            self.assertEqual(sorted(os.listdir(root)), ["log", "pair", "pair.lock"])
