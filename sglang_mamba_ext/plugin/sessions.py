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
"""

from __future__ import annotations

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
