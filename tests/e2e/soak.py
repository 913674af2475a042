"""A bounded soak (issue 23, item 4): concurrent clients sending requests with random
endings (served to the end, client read timeouts that disconnect mid-request, streams cut
after their first chunk, ``/abort_request`` by rid) for a fixed time, while the resident
memory of the server processes is sampled. The caller then runs SGLang's strict idle checks.

``SOAK_SECONDS`` (environment) sets the duration; the default keeps CI short, the figures in
``docs/serving.md`` come from longer runs.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from typing import Dict, List, Optional

import requests

#: Seconds of traffic per soak (``SOAK_SECONDS`` overrides).
DEFAULT_SECONDS = 20


def soak_seconds() -> float:
    return float(os.environ.get("SOAK_SECONDS", DEFAULT_SECONDS))


def process_tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (psutil; SGLang depends on it)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _prompt(rnd: random.Random, prefixes: List[List[int]]) -> List[int]:
    """A shared prefix (so requests hit and branch) plus a random tail."""
    head = rnd.choice(prefixes)[: rnd.randrange(8, 64)]
    return head + [rnd.randrange(3, 703) for _ in range(rnd.randrange(1, 48))]


def soak(url: str, pids: List[int], seconds: float, clients: int = 4, seed: int = 0,
         abort_url: Optional[str] = None) -> Dict[str, float]:
    """Drive ``url`` (``/generate``) with ``clients`` threads for ``seconds``; sample the RSS of
    the process trees ``pids`` every second. ``abort_url``: a server to send
    ``/abort_request`` to (none through a router).

    Returns counts per ending (``served``, ``disconnected``, ``stream_cut``, ``aborted``,
    ``errors``: a non-2xx answer, a stream that closed without a chunk, or a request error
    other than the client's own read timeout) and
    ``rss_start_mb`` (after the first tenth of the run), ``rss_end_mb``, ``rss_max_mb``.
    """
    rnd0 = random.Random(seed)
    prefixes = [[rnd0.randrange(3, 703) for _ in range(64)] for _ in range(6)]
    counts = {"served": 0, "disconnected": 0, "stream_cut": 0, "aborted": 0, "errors": 0}
    lock = threading.Lock()
    deadline = time.time() + seconds

    def count(key):
        with lock:
            counts[key] += 1

    def client(k):
        rnd = random.Random(seed * 1000 + k)
        while time.time() < deadline:
            ids = _prompt(rnd, prefixes)
            body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": rnd.randrange(1, 33),
                                                          "ignore_eos": True}}
            kind = rnd.random()
            try:
                if kind < 0.55:
                    r = requests.post(url + "/generate", json=body, timeout=300)
                    count("served" if r.ok else "errors")
                elif kind < 0.75:
                    try:
                        r = requests.post(url + "/generate", json=body, timeout=rnd.uniform(0.05, 1.5))
                        count("served" if r.ok else "errors")
                    except requests.Timeout:
                        count("disconnected")
                elif kind < 0.9 or abort_url is None:
                    with requests.post(url + "/generate", json={**body, "stream": True}, stream=True,
                                       timeout=300) as r:
                        first = next(r.iter_lines(), None)  # the first chunk, then the connection closes
                        count("stream_cut" if r.ok and first else "errors")
                else:
                    rid = uuid.uuid4().hex
                    t = threading.Thread(target=lambda: requests.post(
                        url + "/generate", json={**body, "rid": rid}, timeout=300))
                    t.start()
                    time.sleep(rnd.uniform(0.0, 0.5))
                    requests.post(abort_url + "/abort_request", json={"rid": rid}, timeout=60)
                    t.join(300)
                    count("aborted")
            except requests.RequestException:
                count("errors")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    samples = []
    t0 = time.time()
    while any(t.is_alive() for t in threads):
        samples.append((time.time() - t0, sum(process_tree_rss(p) for p in pids)))
        time.sleep(1)
    for t in threads:
        t.join()
    settled = [rss for at, rss in samples if at >= seconds / 10] or [samples[-1][1]]
    mb = 1 << 20
    return {**counts, "rss_start_mb": settled[0] / mb, "rss_end_mb": settled[-1] / mb,
            "rss_max_mb": max(rss for _, rss in samples) / mb}
