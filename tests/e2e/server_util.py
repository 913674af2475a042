"""Helpers of the e2e tests: the server subprocess (the package's
``sglang_mamba_ext.testing.server``, always killed as a process group when the test class
ends, also when start-up fails), the environment that makes SGLang's own idle checks stop
the server on a leak, and the check that a server went idle and survived them.
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

from sglang_mamba_ext.testing.server import ServerProcess

START_TIMEOUT_S = 420

#: SGLang's idle checks (``Scheduler.on_idle`` → ``scheduler_components/invariant_checker.py``),
#: run each time the scheduler finds nothing to do: the pool check (KV and SSM
#: ``free + evictable + protected == size``, request slots all free) raises in the scheduler
#: when strict (SGLang's default, set here explicitly), and the tree sanity check calls the
#: cache's ``sanity_check()`` (assertions). Either kills the scheduler and so the server.
CHECKED_ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1",
}


#: Added to every test server: an idle SGLang scheduler otherwise polls its sockets without
#: sleeping and takes a whole core, which the other test worker (``-n 2``) and the test's
#: own reference computations need. With it the idle scheduler still runs its idle checks
#: (``CHECKED_ENV``), then waits up to 1 s for the next request (SGLang's ``IdleSleeper``).
TEST_SERVER_FLAGS = ["--sleep-on-idle"]
#: Added to every forked test server (not to the ``spawn`` ones, launched as a user does):
#: SGLang's start-up warm-up request (``http_server.py::_wait_and_warmup``) costs every one of
#: the suite's ~75 start-ups 3-6 s (more on a speculative server, whose verify runs
#: interpreted), and no test relies on it; the classes' own first requests warm up instead.
FORKED_SERVER_FLAGS = ["--skip-server-warmup"]
#: With ``--skip-server-warmup`` SGLang posts ``/freeze_gc`` to its own HTTP server at once
#: (``http_server.py::_freeze_gc_after_server_warmup``), which can be before uvicorn listens:
#: it then logs this warning with the connection error's traceback and serves on (the GC is
#: simply not frozen). :func:`unexpected_tracebacks` leaves that one out.
FREEZE_GC_WARNING = "post-warmup freeze_gc failed"


def unexpected_tracebacks(log: str) -> List[str]:
    """The tracebacks in a server ``log`` other than the one of :data:`FREEZE_GC_WARNING`
    (each returned as the log line that starts it and the 20 lines after)."""
    lines = log.splitlines()
    found, skipping = [], False
    for i, line in enumerate(lines):
        if FREEZE_GC_WARNING in line:
            skipping = True
        elif line.startswith("[20"):  # the next timestamped log line ends that warning
            skipping = False
        if "Traceback (most recent call last)" in line and not skipping:
            found.append("\n".join(lines[i:i + 21]))
    return found


#: Test servers are forked from a process that has imported SGLang already
#: (``sglang_mamba_ext/testing/zygote.py``): a start-up is mostly Python imports, so it takes
#: a few seconds instead of 30-60 (docs/testing.md, "Forked servers"). Set to 0 to launch
#: every server as a user does; the classes that test the launch itself pass ``spawn=True``
#: and are always launched that way.
FORK_ENV = "SGLANG_MAMBA_EXT_TEST_FORK"


class Server(ServerProcess):
    """The package's :class:`~sglang_mamba_ext.testing.server.ServerProcess` with a fixed
    log file and :data:`TEST_SERVER_FLAGS`; :meth:`wait_healthy` starts it and waits for
    ``/health``. ``spawn``: launch as a user does (``python -m sglang.launch_server``), not
    forked (:data:`FORK_ENV`)."""

    def __init__(self, model_dir: str, args: List[str], log_path: str, env: Optional[Dict[str, str]] = None,
                 spawn: bool = False):
        fork = not spawn and os.environ.get(FORK_ENV, "1") != "0"
        extra = TEST_SERVER_FLAGS + (FORKED_SERVER_FLAGS if fork else [])
        args = [*args, *(f for f in extra if f not in args)]
        super().__init__(model_dir, args, env=env, start_timeout_s=START_TIMEOUT_S, log_path=log_path, fork=fork)

    def wait_healthy(self) -> None:
        from conftest import progress

        name = os.path.splitext(os.path.basename(self.log_path))[0]
        flags = " ".join(self.flags)
        how = "forked" if self.fork else "spawned"
        progress(f"  server {name}: starting, {how} ({flags if len(flags) <= 110 else '...' + flags[-107:]})")
        t0 = time.time()
        self.start()
        reason = getattr(self.proc, "zygote_started", None)
        new = f" (a new zygote, one SGLang import: {reason})" if reason else ""
        progress(f"  server {name}: ready in {time.time() - t0:.0f} s{new}")


def start_together(cls, servers: List[Server]) -> None:
    """Start ``servers`` at once (each in a thread; start-up is mostly one process's imports
    and compiles, so two overlap on 2 cores) and register each one's stop as a class cleanup.
    Raises what the first failing start-up raised."""
    import concurrent.futures

    for s in servers:
        cls.addClassCleanup(s.stop)
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        for started in [pool.submit(s.wait_healthy) for s in servers]:
            started.result()


def idle_and_checked(server: ServerProcess, settle_s: float = 2.0, timeout_s: float = 120) -> dict:
    """Wait until the scheduler has no running or waiting request, let it idle ``settle_s``
    seconds (its idle checks run on every fully idle pass, ``Scheduler.on_idle``, and an idle
    test server sleeps at most 1 s between passes: at least one pass), then require the server still
    healthy and no leak report in its log. Returns ``/v1/loads`` taken while idle.

    Raises:
        AssertionError: the server died, is not healthy, or logged a leak or a scheduler
            exception (the message carries the end of its log).
    """
    deadline = time.time() + timeout_s
    load = server.loads()
    while load["num_running_reqs"] or load["num_waiting_reqs"]:
        if time.time() > deadline:
            raise AssertionError(f"server not idle after {timeout_s:.0f} s: {load}")
        time.sleep(0.5)
        load = server.loads()
    time.sleep(settle_s)
    log = server.log_text()
    for bad in ("memory leak detected", "Scheduler hit an exception", "double free", "use-after-free"):
        if bad in log:
            raise AssertionError(f"server log reports {bad!r}:\n{server.log_tail()}")
    if not server.healthy():
        raise AssertionError(f"server did not survive going idle:\n{server.log_tail()}")
    return server.loads()


def abort_mid_generation(server: ServerProcess, input_ids: List[int], rid: str, max_new_tokens: int = 3000,
                         after_s: float = 2.0) -> dict:
    """Start a greedy generation of ``max_new_tokens`` with request id ``rid``, abort it
    through ``/abort_request`` after ``after_s`` seconds, and return its response (finish
    reason ``abort`` asserted).

    Raises:
        AssertionError: the abort was refused, the request did not end, or it ended
            otherwise than aborted."""
    import threading

    import requests

    result = {}

    def run():
        result["out"] = server.generate(input_ids=input_ids, max_new_tokens=max_new_tokens, rid=rid)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(after_s)
    r = requests.post(server.base_url + "/abort_request", json={"rid": rid}, timeout=60)
    assert r.status_code == 200, r.text
    t.join(timeout=300)
    assert not t.is_alive(), f"request {rid} still running 300 s after its abort"
    reason = result["out"]["meta_info"]["finish_reason"]["type"]
    assert reason == "abort", f"request {rid} ended with {reason!r}, not abort"
    return result["out"]


def wait_for(predicate, timeout_s: float = 120, poll_s: float = 0.5):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    return predicate()


def common_prefix(a, b) -> int:
    """Tokens two id lists share from the start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tiny_class_setup(cls) -> str:
    """For a test class: a temporary directory removed with the class (``cls.tmp_dir``), the
    tiny model (seed 0, ``cls.model``) and its reference (``cls.ref``); returns the directory."""
    import tempfile

    from sglang_mamba_ext.models.tiny_hybrid import TinyHybridReference
    from sglang_mamba_ext.testing import tiny_model_dir

    tmp = tempfile.TemporaryDirectory()
    cls.addClassCleanup(tmp.cleanup)
    cls.tmp_dir = tmp.name
    cls.model = tiny_model_dir()
    cls.ref = TinyHybridReference.from_pretrained(cls.model)
    return cls.tmp_dir


def start_tiny_server(cls, flags: List[str], env: Optional[Dict[str, str]] = None, spawn: bool = False) -> None:
    """For a test class: :func:`tiny_class_setup` and one server with ``flags``
    (``cls.server``; ``spawn``: see :class:`Server`), stopped with the class."""
    tiny_class_setup(cls)
    cls.server = Server(cls.model, flags, os.path.join(cls.tmp_dir, "server.log"), env=env, spawn=spawn)
    cls.addClassCleanup(cls.server.stop)
    cls.server.wait_healthy()


class GreedyHits:
    """Mixin for an e2e test class with ``cls.server``, ``cls.rng`` (``random.Random``) and
    ``cls.salt`` (int): greedy requests with their cache hits and log-probabilities, and the
    check that a hit served what a cold run serves. Class attributes: ``NEW`` (output tokens),
    ``HIT_ATOL`` (nats; float16 hit vs cold), ``VOCAB`` (token id range of random prompts)."""

    NEW = 5
    HIT_ATOL = 2e-2
    VOCAB = (3, 200)

    def tokens(self, n):
        return [self.rng.randrange(*self.VOCAB) for _ in range(n)]

    def gen(self, ids, cold=False, server=None):
        """Greedy ``NEW`` tokens from ``server`` (default ``cls.server``); ``cold``: in a fresh
        ``cache_salt`` (nothing to hit; asserted). Returns ``(output_ids, cached_tokens,
        logprobs)``."""
        extra = {"return_logprob": True}
        if cold:
            type(self).salt += 1
            extra["cache_salt"] = f"cold-{self.salt}"
        r = (server or self.server).generate(input_ids=ids, max_new_tokens=self.NEW, **extra)
        meta = r["meta_info"]
        if cold:
            self.assertEqual(meta["cached_tokens"], 0)
        return r["output_ids"], meta["cached_tokens"], [lp[0] for lp in meta["output_token_logprobs"]]

    def assert_same(self, got, cold):
        """Same tokens, and log-probabilities within ``HIT_ATOL``."""
        import torch

        self.assertEqual(got[0], cold[0])
        torch.testing.assert_close(torch.tensor(got[2]), torch.tensor(cold[2]), rtol=0, atol=self.HIT_ATOL)
