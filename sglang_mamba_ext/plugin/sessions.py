"""SGLang's sessions with ``--enable-mamba-radix`` (``docs/design.md``, "Sessions").

The session API (``/open_session``, requests with ``session_params``) builds each turn from
the previous turn's input and output (``session/session_controller.py``): a turn is an
ordinary request, so the tree serves it like any other — the previous turn's finish state,
saved at its end, is hit exactly (``len - 1`` of that turn's tokens).

``--enable-streaming-session`` (turns named by the session id alone): SGLang's registry
accepts it only for its own ``UnifiedRadixCache``, whose ``StreamingSession`` keeps a
turn's request row alive between turns. The plugin serves streaming sessions through the
tree instead — each turn donates its state at finish and the next turn resumes from it by
copy-on-write, exactly as a non-streaming turn — so it only needs (1) the registry's check
to let its backend through (:func:`create_tree_cache_around`) and (2) the session told that
its turn ended (:func:`end_streaming_turn`, from the adapter's ``on_release``), which
``UnifiedRadixCache`` does in ``StreamingSession.try_cache_finished_req``.

``--enable-session-radix-cache`` (radix-native sessions: requests name a top-level
``session_id``; ``/open_session`` and ``/close_session`` bracket them): each finished turn
pins the state it ended on in the core (``mem_cache/session_pins.py``), so eviction takes an
open session's state and its path's KV only after everything else; closing the session
drops its pins (:class:`RadixSessions`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Optional

#: SGLang's tree-cache factory, wrapped by :func:`create_tree_cache_around`.
CREATE_TREE_CACHE = "sglang.srt.mem_cache.registry.create_tree_cache"


def create_tree_cache_around(original, ctx, *args, **kwargs):
    """AROUND hook on ``mem_cache.registry.create_tree_cache``: under ``--enable-mamba-radix``
    with ``--enable-streaming-session``, build the tree with the streaming flag hidden from
    the registry's check (it refuses every cache but ``UnifiedRadixCache``); otherwise the
    call runs unchanged."""
    from sglang.srt.runtime_context import get_memory, get_serving

    from sglang_mamba_ext.plugin.settings import BACKEND_NAME

    serving = get_serving()
    if get_memory().radix_cache_backend != BACKEND_NAME or not serving.enable_streaming_session:
        return original(ctx, *args, **kwargs)
    with serving.override(enable_streaming_session=False):
        return original(ctx, *args, **kwargs)


def end_streaming_turn(req) -> None:
    """Tell a streaming session that its turn ``req`` ended (SGLang's ``Session.finish_req``
    with the output cut at ``finished_len``, or ``abort_req`` for an aborted turn), so that
    the session takes its next turn. No-op for any other request, or a turn not finished
    (retracted: it runs again)."""
    session = getattr(req, "session", None)
    if session is None or not getattr(session, "streaming", False) or not req.finished():
        return
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if isinstance(req.finished_reason, FINISH_ABORT):
        session.abort_req()
        return
    done = req.finished_len if req.finished_len is not None else len(req.output_ids)
    req.output_ids = req.output_ids[:done]
    session.finish_req(req)


#: Closed session ids remembered, so that a turn finishing after its session closed pins
#: nothing (SGLang keeps a bounded record too).
CLOSED_SESSIONS_KEPT = 8192


class RadixSessions:
    """SGLang's radix-session protocol on the adapter (``--enable-session-radix-cache``;
    SGLang's ``unified_cache/session_ref_tracker.py`` defines it): ``open`` /
    ``generation`` / ``close`` give each session incarnation a number that its requests
    carry (``req.session_generation``), and :meth:`pin_finished` pins a finished turn's state
    in the core only while that incarnation is open."""

    def __init__(self, core):
        self.core = core
        self._counter = 0
        self._generations: Dict[str, int] = {}
        self._closed: "OrderedDict[str, None]" = OrderedDict()

    def open(self, session_id: str) -> int:
        self._closed.pop(session_id, None)
        self._counter += 1
        self._generations[session_id] = self._counter
        return self._counter

    def generation(self, session_id: str) -> int:
        gen = self._generations.get(session_id)
        return self.open(session_id) if gen is None else gen

    def close(self, session_id: Optional[str]) -> int:
        """Drop the session's pins; returns how many it held."""
        if session_id is None or session_id in self._closed:
            return 0
        self._closed[session_id] = None
        while len(self._closed) > CLOSED_SESSIONS_KEPT:
            self._closed.popitem(last=False)
        self._generations.pop(session_id, None)
        return self.core.release_session(session_id)

    def pin_finished(self, req, node) -> None:
        """After a finished turn's insert (``node``: the core node its lock moved to): pin
        it for the request's radix session, unless the turn was aborted, belongs to a
        streaming or closed session, or to an earlier incarnation of its session."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        session = getattr(req, "session", None)
        if session is not None and getattr(session, "streaming", False):
            return
        sid = getattr(req, "session_id", None)
        if sid is None and session is not None:
            sid = getattr(session, "session_id", None)
        if sid is None or node is None or isinstance(req.finished_reason, FINISH_ABORT):
            return
        if self._generations.get(sid) is None or getattr(req, "session_generation", None) != self._generations[sid]:
            return
        self.core.pin_session(sid, node)
