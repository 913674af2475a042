"""A bound on what an unreachable store costs the scheduler (``docs/flags.md``, mooncake;
``docs/design.md``, "Storage tier").

The storage tier calls its store synchronously, inside a match or an eviction. A store whose
server went away can make each call wait: mooncake's client retries its master for about
4.3 s per call when the master is gone (measured, connection refused), so one request that
spills a prefix of a hundred pages stalled the scheduler for minutes. :class:`GuardedStore`
sits between the tier and the store (the tier's interface, unchanged):

- every call runs on one worker thread and is waited for at most ``timeout_s``; a call that
  takes longer, or one the store answers "unreachable" (:class:`StoreUnavailable`), trips
  the guard: that call and every later one is answered at once as a miss (``get`` -> ``None``,
  ``exists`` -> ``False``, ``batch_exists`` -> ``0``) or a dropped write (``set`` -> ``False``);
- while tripped, a probe (the store's ``ping``) runs on the worker, never on the caller,
  every ``retry_s`` seconds once the worker is free; the first probe that succeeds lets calls
  through again;
- a call left running after its timeout keeps the worker (and so the store's staging
  buffer) to itself: no other call starts until it has returned.

Nothing here can make a hit wrong: the guard only turns calls into misses and dropped
writes, which the tier already treats as a shorter match; what comes back from a call that
did finish is checked by the tier as before (length, digest). Depends on nothing but the
standard library.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

#: Defaults: seconds a call may take before the store counts as unreachable, seconds between
#: probes while it is.
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_RETRY_S = 5.0
#: Longest wait a thread's ``result(timeout=)`` takes without overflowing (``threading.TIMEOUT_MAX``).
MAX_WAIT_S = __import__("threading").TIMEOUT_MAX


class StoreUnavailable(Exception):
    """Raised by a store adapter for a call its server could not serve (e.g. mooncake's
    ``RPC_FAIL``: the master is gone)."""


class GuardedStore:
    """The tier's store behind a timeout and a short-circuit (module docstring).

    Args:
        inner: the store (``get``, ``set``, ``exists``, ``batch_exists``; optional
            ``discard``, ``clear``, ``close``, ``ping``).
        timeout_s: the longest a caller waits for one call.
        retry_s: seconds between probes while the store is unreachable.
        what: names the store in log lines.
    """

    def __init__(self, inner, timeout_s: float = DEFAULT_TIMEOUT_S, retry_s: float = DEFAULT_RETRY_S,
                 what: str = "storage"):
        if not 0 < timeout_s < MAX_WAIT_S or not 0 < retry_s < MAX_WAIT_S:
            raise ValueError(f"storage call timeout and retry interval must be > 0 and finite seconds "
                             f"(got {timeout_s}, {retry_s})")
        self.inner = inner
        self.timeout_s = float(timeout_s)
        self.retry_s = float(retry_s)
        self.what = what
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        #: The call or probe still running on the worker (after its caller stopped waiting).
        self._busy: Optional[concurrent.futures.Future] = None
        #: ``time.monotonic()`` when the store became unreachable; ``None`` while it is up.
        self.down_since: Optional[float] = None
        self._retry_at = 0.0
        #: Calls answered as a miss / dropped write because the store was unreachable (the
        #: tripping calls included), times it became unreachable, times it came back.
        self.unavailable_total = 0
        self.outages_total = 0
        self.recoveries_total = 0

    # ---------------------------------------------------------------- the tier's interface
    def get(self, key, target):
        return self._call(self.inner.get, None, key, target)

    def set(self, key, value) -> bool:
        return bool(self._call(self.inner.set, False, key, value))

    def exists(self, key) -> bool:
        return bool(self._call(self.inner.exists, False, key))

    def batch_exists(self, keys) -> int:
        return int(self._call(self.inner.batch_exists, 0, keys))

    def discard(self, key) -> None:
        self._call(self.inner.discard, None, key)

    def clear(self) -> bool:
        return bool(self._call(self.inner.clear, False))

    def __getattr__(self, name):  # the adapter's other attributes (name, client, store, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def available(self) -> bool:
        return self.down_since is None

    def close(self) -> None:
        """Stop the worker; close the store unless a call is still running on it."""
        busy = self._busy is not None and not self._busy.done()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if busy:
            logger.warning("sglang-mamba-ext: %s still busy at close; not closed", self.what)
            return
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    # ---------------------------------------------------------------- the guard
    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="smx-storage")
        return self._pool

    def _call(self, fn: Callable, miss, *args):
        busy = self._busy
        if busy is not None:
            if not busy.done():
                self.unavailable_total += 1
                return miss
            self._busy = None
        if self.down_since is not None:
            if time.monotonic() >= self._retry_at:
                self._start_probe()
            if self.down_since is not None:
                self.unavailable_total += 1
                return miss
        fut = self._worker().submit(fn, *args)
        try:
            return fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self._busy = fut
            self._trip(f"a call took over {self.timeout_s:g} s")
        except StoreUnavailable as e:
            self._trip(str(e))
        self.unavailable_total += 1
        return miss

    def _trip(self, why: str) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.outages_total += 1
            logger.warning(
                "sglang-mamba-ext: %s unreachable (%s): its reads are misses and its writes are "
                "dropped; retried every %g s", self.what, why, self.retry_s)
        self._retry_at = time.monotonic() + self.retry_s

    def _start_probe(self) -> None:
        ping = getattr(self.inner, "ping", None)
        self._retry_at = time.monotonic() + self.retry_s
        if ping is None:  # no probe: let the next call through and see
            self._back()
            return
        self._busy = fut = self._worker().submit(ping)
        fut.add_done_callback(self._probe_done)

    def _probe_done(self, fut: concurrent.futures.Future) -> None:
        if fut.cancelled() or fut.exception() is not None or fut.result() is False:
            self._retry_at = time.monotonic() + self.retry_s  # from its end, not its start
            return
        self._back()

    def _back(self) -> None:
        since = self.down_since
        if since is None:
            return
        self.down_since = None
        self.recoveries_total += 1
        logger.warning("sglang-mamba-ext: %s reachable again after %.1f s", self.what, time.monotonic() - since)
