"""Message-boundary checkpoints under ``--enable-mamba-radix`` (``docs/design.md``, "Prefix
checkpoints", message boundaries).

A later request that shares a system prompt (or the first turns of a conversation) with an
earlier one branches where a message ends. The branch-point checkpoint alone is planted only
by the *second* request that passes such a point, so the first sharer misses. The request
therefore carries the token offsets where its messages end, and the cache plants checkpoints
there in the first request that passes them (``MambaRadixCache.plan_prefix_checkpoints``,
``boundaries``).

Carrier: SGLang's versioned KV-hint envelope (``GenerateReqInput.kv_hints``,
``managers/kv_hints.py::KvHintsEnvelope``), which SGLang forwards unchanged from the HTTP
body to the scheduler's ``Req.kv_hints`` and whose consumers read only the action types they
implement. This plugin implements one action:

    {"action_id": "<any>", "action_type": "mamba_radix.checkpoint_offsets",
     "action_version": "1", "payload": {"offsets": [<int>, ...]}}

``offsets`` are token counts from the start of the prompt (a checkpoint at ``o`` is the state
after the first ``o`` tokens), at most :data:`MAX_OFFSETS`, each in ``[1, prompt_len)``,
in priority order (the cache plants the first ones when the per-path cap leaves room for
fewer). A bad action is refused with HTTP 400 (:func:`validate_request_hints`).

- ``/v1/chat/completions``: :func:`convert_to_internal_request_around` and
  :func:`render_and_encode_around` compute the offsets with SGLang's own template
  application (``OpenAIServingChat._render_and_encode_chat_template``, called again with the
  same arguments on ``messages[:k]`` without the generation prompt; an offset is kept only
  when those ids are a prefix of the full prompt's) and attach the action.
- ``/generate``: the client sends the envelope itself in ``kv_hints``.
- scheduler: :func:`request_offsets` reads them from ``Req.kv_hints`` when the request pool
  plans its checkpoints (``plugin/pool.py``).

Everything is inert without ``--enable-mamba-radix``.
"""

from __future__ import annotations

import contextvars
import logging
import uuid
from typing import Any, Callable, List, Optional, Sequence

logger = logging.getLogger(__name__)

#: ``KvHintAction.action_type`` / ``action_version`` this plugin implements.
ACTION_TYPE = "mamba_radix.checkpoint_offsets"
ACTION_VERSION = "1"
#: At most this many offsets per request (each may take an SSM slot during the prefill).
MAX_OFFSETS = 16
#: A chat request names the end of its leading system message(s) and the ends of at most
#: this many of its latest earlier turns (each offset costs one template application).
CHAT_TURN_BOUNDARIES = 4

#: Set while ``_convert_to_internal_request`` runs: the boundary lists computed by
#: :func:`render_and_encode_around` (the last successful template application wins).
_capture: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("mamba_radix_chat_capture", default=None)


def _enabled() -> bool:
    from sglang_mamba_ext.plugin.settings import current_settings

    return bool(current_settings().get("enable"))


# -- envelope ------------------------------------------------------------------------------
def _our_actions(envelope) -> list:
    if envelope is None:
        return []
    return [a for a in getattr(envelope, "actions", None) or () if getattr(a, "action_type", None) == ACTION_TYPE]


def parse_offsets(envelope, prompt_len: Optional[int] = None) -> List[int]:
    """The offsets of this plugin's action in a ``KvHintsEnvelope`` (``[]`` when it has
    none), checked.

    Raises:
        ValueError: more than one such action, another ``action_version``, a payload that
            is not ``{"offsets": [int, ...]}``, more than :data:`MAX_OFFSETS` offsets, or
            an offset outside ``[1, prompt_len)`` (when ``prompt_len`` is given).
    """
    actions = _our_actions(envelope)
    if not actions:
        return []
    where = f"kv_hints action {ACTION_TYPE!r}"
    if len(actions) > 1:
        raise ValueError(f"{where}: given {len(actions)} times; send one action with all offsets")
    action = actions[0]
    if action.action_version != ACTION_VERSION:
        raise ValueError(f"{where}: action_version {action.action_version!r} is not supported; use {ACTION_VERSION!r}")
    payload = action.payload
    offsets = payload.get("offsets") if isinstance(payload, dict) else None
    if not isinstance(offsets, list) or not all(type(o) is int for o in offsets):
        raise ValueError(f'{where}: payload must be {{"offsets": [<int>, ...]}} (token offsets), got {payload!r}')
    if len(offsets) > MAX_OFFSETS:
        raise ValueError(f"{where}: {len(offsets)} offsets, at most {MAX_OFFSETS} are accepted")
    if prompt_len is not None:
        for o in offsets:
            if not 1 <= o < prompt_len:
                raise ValueError(
                    f"{where}: offset {o} is outside the prompt; each offset must be a token count "
                    f"in [1, {prompt_len}) for this {prompt_len}-token prompt"
                )
    return list(offsets)


def with_offsets(envelope, offsets: Sequence[int]):
    """``envelope`` (a ``KvHintsEnvelope`` or ``None``) plus this plugin's action carrying
    ``offsets``; an envelope that already carries the action is returned unchanged (the
    caller's offsets win)."""
    from sglang.srt.managers.kv_hints import KvHintAction, KvHintsEnvelope

    if _our_actions(envelope):
        return envelope
    action = KvHintAction(
        action_id=f"mamba-radix-{uuid.uuid4().hex[:8]}",
        action_type=ACTION_TYPE,
        action_version=ACTION_VERSION,
        payload={"offsets": [int(o) for o in offsets]},
    )
    if envelope is None:
        return KvHintsEnvelope(protocol_version="1", message_id=uuid.uuid4().hex, actions=[action])
    return KvHintsEnvelope(
        protocol_version=envelope.protocol_version,
        message_id=envelope.message_id,
        actions=list(envelope.actions) + [action],
    )


def request_offsets(req) -> List[int]:
    """Scheduler side: the offsets an SGLang ``Req`` carries in ``kv_hints`` (checked by the
    tokenizer manager already; anything malformed reads as none)."""
    try:
        return parse_offsets(getattr(req, "kv_hints", None))
    except ValueError:
        return []


def validate_request_hints(obj, input_ids) -> None:
    """Part of the ``TokenizerManager._validate_one_request`` BEFORE hook
    (``plugin/request_validation.py``): refuse a bad action of this plugin (HTTP 400).

    Raises:
        ValueError: see :func:`parse_offsets`.
    """
    envelope = getattr(obj, "kv_hints", None)
    if envelope is None or isinstance(envelope, list):
        return
    parse_offsets(envelope, len(input_ids) if input_ids is not None else None)


# -- chat ------------------------------------------------------------------------------------
def boundary_messages(messages: Sequence[dict]) -> List[int]:
    """Message counts ``k`` whose prefix ``messages[:k]`` ends at a boundary worth a
    checkpoint, in priority order: the end of the leading system message(s), then the ends
    of the latest :data:`CHAT_TURN_BOUNDARIES` earlier turns (a turn ends where the next
    user message starts), deepest first. The last message never ends a boundary (the
    prompt's own end is the prompt length - 1 checkpoint)."""
    n = len(messages)
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    out: List[int] = []
    k = 0
    while k < n and roles[k] in ("system", "developer"):
        k += 1
    if 0 < k < n:
        out.append(k)
    turns = [j for j in range(k + 1, n) if roles[j] == "user" and j not in out]
    out.extend(reversed(turns[-CHAT_TURN_BOUNDARIES:]))
    return out


def message_boundaries(render: Callable[[list], List[int]], messages: Sequence[dict], full_ids: Sequence[int]) -> List[int]:
    """Token offsets where messages end, in :func:`boundary_messages`' order: ``render``
    applied to ``messages[:k]`` (without the generation prompt) gives ids that must be a
    proper prefix of ``full_ids``; other ``k`` give nothing."""
    full = list(full_ids)
    out: List[int] = []
    for k in boundary_messages(messages):
        ids = list(render(list(messages[:k])))
        if 0 < len(ids) < len(full) and full[: len(ids)] == ids and len(ids) not in out:
            out.append(len(ids))
    return out


def render_and_encode_around(original, serving, messages, *args, **kwargs):
    """AROUND hook on ``OpenAIServingChat._render_and_encode_chat_template`` (SGLang's jinja
    chat-template application): while :func:`convert_to_internal_request_around` listens,
    also computes the message boundaries with the same arguments."""
    result = original(serving, messages, *args, **kwargs)
    found = _capture.get()
    if found is None:
        return result
    token = _capture.set(None)  # the renders below are not captured
    try:
        opts = dict(kwargs, add_generation_prompt=False, use_cache=False)
        found.append(message_boundaries(lambda msgs: original(serving, msgs, *args, **opts)[0], messages, result[0]))
    except Exception as e:  # a template that cannot render a prefix: no boundaries
        logger.debug("sglang-mamba-ext: no message boundaries (%s)", e)
    finally:
        _capture.reset(token)
    return result


def convert_to_internal_request_around(original, serving, *args, **kwargs):
    """AROUND hook on ``OpenAIServingChat._convert_to_internal_request``: under
    ``--enable-mamba-radix``, attaches the message boundaries of the chat request
    (:func:`render_and_encode_around`) to the ``GenerateReqInput`` it builds, as this
    plugin's ``kv_hints`` action, when the prompt goes on as token ids that start with
    them."""
    if not _enabled():
        return original(serving, *args, **kwargs)
    found: list = []
    token = _capture.set(found)
    try:
        result = original(serving, *args, **kwargs)
    finally:
        _capture.reset(token)
    try:
        _attach(result, found)
    except Exception as e:  # never fail a chat request over an optional checkpoint
        logger.debug("sglang-mamba-ext: message boundaries not attached (%s)", e)
    return result


def _attach(result: Any, found: list) -> None:
    if not found or not found[-1] or not isinstance(result, tuple) or not result:
        return
    adapted = result[0]
    ids = getattr(adapted, "input_ids", None)
    if not isinstance(ids, list) or not ids or not isinstance(ids[0], int):
        return
    offsets = [o for o in found[-1] if o < len(ids)][:MAX_OFFSETS]
    hints = getattr(adapted, "kv_hints", None)
    if offsets and not isinstance(hints, list):
        from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

        envelope = decode_kv_hints_envelope(hints) if hints else None
        adapted.kv_hints = with_offsets(envelope, offsets)
