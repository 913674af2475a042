"""The ``kda_cache`` warmup: cache system prompts before real traffic.

``--warmups kda_cache --warmup-prompts-file F`` makes SGLang's HTTP server run
:func:`kda_cache_warmup` in its start-up (``entrypoints/http_server.py`` lifespan →
``entrypoints/warmup.py::execute_warmups``; ``docs/design.md``, "SGLang wiring"), before it
reports ready; without ``--warmups kda_cache`` it never runs. For each prompt of ``F``:

(With ``--dp N`` or DP attention, to every data-parallel rank: each has its own cache.)

1. send it with ``max_new_tokens=1`` (greedy): the prefill runs, the request finishes, and
   its KV and final SSM state are inserted into the radix tree;
2. then send it again extended by the token that pass generated, so the second prefill
   starts from the cached state (the prefix-hit / initial-state kernels run once before real
   traffic; a request identical to a cached one cannot hit, SGLang caps a match at
   ``len - 1`` tokens).

It logs how many prompts and tokens were prefilled and how many tokens the second pass hit
On a prefill server (``--disaggregation-mode prefill``) the requests go to SGLang's fake
bootstrap host (no decode peer; SGLang's own warm-up does the same), which SGLang keeps out of
the tree; the warm-up's requests (``rid`` prefix ``settings.WARMUP_RID_PREFIX``) are let in by
the adapter, so the prompts are cached there too.

(with a warning when that is less than the prompts: the pools are too small to keep them);
with ``--enable-metrics`` the same numbers go to the ``sglang:mamba_radix_warmup_*`` counters
(:func:`sglang_mamba_ext.plugin.metrics.record_warmup`).

File formats (:func:`load_prompts`): a JSON list of strings, or JSON lines each one object
with exactly one of ``"text"`` (a string), ``"input_ids"`` (a list of token ids) or
``"messages"`` (a chat: a list of ``{"role", "content"}``; the tokenizer's chat template is
applied without a generation prompt, so the cached tokens are a prefix of any longer chat
that starts with them). Text is tokenized like a ``/generate`` text prompt
(``tokenizer.encode``, special tokens added).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from typing import Any, List, Optional, Sequence

from sglang_mamba_ext.plugin import settings as S
from sglang_mamba_ext.plugin.startup_errors import FlagError

logger = logging.getLogger(__name__)

FLAG = "--warmup-prompts-file"


@dataclasses.dataclass
class WarmPrompt:
    """One prompt of the file: ``kind`` is ``"text"``, ``"input_ids"`` or ``"messages"``;
    ``line`` is its 1-based line in the file."""

    kind: str
    value: Any
    line: int


class PromptsFileError(FlagError):
    """A prompts file that cannot be used; the message names the file (and line). A
    ``ValueError``; at start-up the launcher reports it like an argparse error
    (:mod:`sglang_mamba_ext.plugin.startup_errors`)."""


def _fail(path: str, line: Optional[int], what: str) -> PromptsFileError:
    where = f"{path}:{line}" if line is not None else path
    return PromptsFileError(f"{FLAG} {where}: {what}")


def _check_messages(path: str, line: int, messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _fail(path, line, '"messages" must be a non-empty list of {"role": ..., "content": ...}')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise _fail(path, line, f'"messages"[{i}] must be an object with a string "role" and a "content"')
        if not isinstance(m["content"], (str, list)):
            raise _fail(path, line, f'"messages"[{i}]["content"] must be a string or a list of parts')


def _parse_object(path: str, line: int, obj: Any) -> WarmPrompt:
    if not isinstance(obj, dict):
        raise _fail(path, line, f'expected an object with "text", "input_ids" or "messages", got {type(obj).__name__}')
    keys = [k for k in ("text", "input_ids", "messages") if k in obj]
    if len(keys) != 1:
        raise _fail(path, line, 'each line needs exactly one of "text", "input_ids", "messages"')
    kind = keys[0]
    value = obj[kind]
    if kind == "text":
        if not isinstance(value, str) or not value:
            raise _fail(path, line, '"text" must be a non-empty string')
    elif kind == "input_ids":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
        ):
            raise _fail(path, line, '"input_ids" must be a non-empty list of non-negative integers')
    else:
        _check_messages(path, line, value)
    return WarmPrompt(kind, value, line)


def _parse_json_list(path: str, text: str) -> List[WarmPrompt]:
    decoder = json.JSONDecoder()
    start = text.index("[")
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(path, exc.lineno, f"not valid JSON ({exc.msg})") from exc
    if not isinstance(items, list):
        raise _fail(path, 1, "expected a JSON list of strings")
    # Walk the list again with raw_decode to know each item's line.
    out: List[WarmPrompt] = []
    pos = start + 1
    for i, item in enumerate(items):
        while text[pos] in " \t\r\n,":
            pos += 1
        line = text.count("\n", 0, pos) + 1
        _, pos = decoder.raw_decode(text, pos)
        if not isinstance(item, str) or not item:
            raise _fail(path, line, f"item {i} must be a non-empty string, got {type(item).__name__}")
        out.append(WarmPrompt("text", item, line))
    return out


def _parse_jsonl(path: str, text: str) -> List[WarmPrompt]:
    out: List[WarmPrompt] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            hint = ""
            try:
                json.loads(text)
                hint = (
                    "; the whole file is one JSON value spread over several lines: write one "
                    "JSON object per line (JSON lines), or a JSON list of strings"
                )
            except json.JSONDecodeError:
                pass
            raise _fail(path, lineno, f"not valid JSON ({exc.msg}){hint}") from exc
        out.append(_parse_object(path, lineno, obj))
    return out


def load_prompts(path: str) -> List[WarmPrompt]:
    """Read and check a prompts file (formats in the module docstring).

    Raises:
        PromptsFileError: (a ``ValueError``) naming the file and, where one is at fault,
            the line: missing or unreadable file, not JSON, no prompts, a wrongly typed
            entry.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise _fail(path, None, f"cannot read the file ({exc.strerror or exc})") from exc
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise _fail(path, line, "not UTF-8 text") from exc
    stripped = text.lstrip()
    if not stripped:
        raise _fail(path, None, "the file is empty (expected prompts)")
    prompts = _parse_json_list(path, text) if stripped[0] == "[" else _parse_jsonl(path, text)
    if not prompts:
        raise _fail(path, None, "contains no prompts")
    return prompts


def prompt_token_ids(prompt: WarmPrompt, tokenizer, path: str = "") -> List[int]:
    """Token ids of a prompt as the server would build them."""
    if prompt.kind == "input_ids":
        return list(prompt.value)
    if tokenizer is None:
        raise _fail(path, prompt.line, f'"{prompt.kind}" prompts need a tokenizer (the server skips tokenizer init)')
    if prompt.kind == "text":
        return list(tokenizer.encode(prompt.value))
    ids = tokenizer.apply_chat_template(prompt.value, tokenize=True, add_generation_prompt=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


async def _send(tokenizer_manager, input_ids: Sequence[int], disaggregation_mode: str,
                dp_rank: Optional[int] = None) -> dict:
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
    from sglang.srt.managers.io_struct import GenerateReqInput

    req = GenerateReqInput(
        input_ids=list(input_ids),
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        rid=S.WARMUP_RID_PREFIX + uuid.uuid4().hex,
    )
    if dp_rank is not None:  # every data-parallel rank has its own cache: warm each
        req.routed_dp_rank = dp_rank
    if disaggregation_mode != "null":
        req.bootstrap_room = 0
        req.bootstrap_host = FAKE_BOOTSTRAP_HOST
    last: dict = {}
    async for out in tokenizer_manager.generate_request(req, None):
        last = out
    return last


async def kda_cache_warmup(disaggregation_mode: str, tokenizer_manager) -> dict:
    """Registered as SGLang warmup ``kda_cache`` (module docstring).

    Returns:
        ``{"prompts", "tokens", "skipped", "second_pass_cached_tokens"}`` (also logged).

    Raises:
        PromptsFileError: no ``--warmup-prompts-file`` or a bad file (normally caught at
            argument parsing already).
    """
    path = S.current_settings().get("warmup_prompts_file")
    if not path:
        raise PromptsFileError(f"--warmups {S.WARMUP_NAME} needs {FLAG} PATH")
    prompts = load_prompts(path)
    tokenizer = getattr(tokenizer_manager, "tokenizer", None)
    context_len = getattr(tokenizer_manager, "context_len", None)
    # SGLang refuses an input of max_req_input_len tokens or more (managers/utils.py
    # validate_input_length); both passes must pass: the second sends one token more.
    max_input = getattr(tokenizer_manager, "max_req_input_len", None)
    vocab = getattr(getattr(tokenizer_manager, "model_config", None), "vocab_size", None)
    todo = []
    skipped = 0
    for p in prompts:
        ids = prompt_token_ids(p, tokenizer, path)
        if vocab is not None and ids and max(ids) >= vocab:
            raise _fail(path, p.line, f'token id {max(ids)} is outside the vocabulary (size {vocab})')
        too_long = (context_len is not None and len(ids) + 2 > context_len) or (
            max_input is not None and len(ids) + 1 >= max_input
        )
        if too_long:
            logger.warning(
                "%s %s:%d: prompt of %d tokens skipped (context length %s, longest input %s)",
                FLAG, path, p.line, len(ids), context_len, max_input,
            )
            skipped += 1
            continue
        todo.append(ids)
    # With --dp N (or DP attention) each data-parallel rank has its own scheduler and cache;
    # a request names its rank (routed_dp_rank), so every rank gets every prompt.
    dp = int(getattr(getattr(tokenizer_manager, "server_args", None), "dp_size", 1) or 1)
    ranks: List[Optional[int]] = list(range(dp)) if dp > 1 else [None]
    hit = 0
    for rank in ranks:
        firsts = []
        for ids in todo:
            out = await _send(tokenizer_manager, ids, disaggregation_mode, rank)
            firsts.append((out.get("output_ids") or [0])[:1])
        for ids, first in zip(todo, firsts):
            out = await _send(tokenizer_manager, list(ids) + list(first), disaggregation_mode, rank)
            hit += int((out.get("meta_info") or {}).get("cached_tokens", 0) or 0)
    tokens = sum(len(ids) for ids in todo)
    logger.info(
        "%s warmup: %d prompts (%d tokens) prefilled into the cache from %s on %d data-parallel "
        "rank(s), %d skipped; the second pass hit %d cached tokens",
        S.WARMUP_NAME, len(todo), tokens, path, len(ranks), skipped, hit,
    )
    page = int(getattr(getattr(tokenizer_manager, "server_args", None), "page_size", 1) or 1)
    expected = len(ranks) * sum(len(ids) // page * page for ids in todo)  # matches stop at whole pages
    # Warn on a large shortfall only: a checkpoint grid coarser than a page (64 tokens on
    # GPU kernels) and overlap scheduling's checkpoint donation cost a few tokens per prompt.
    if hit * 2 < expected:
        logger.warning(
            "%s warmup: the second pass hit %d of %d prompt tokens: the pools hold less than the "
            "prompts (raise --max-total-tokens / --max-mamba-cache-size, or warm fewer prompts)",
            S.WARMUP_NAME, hit, expected,
        )
    result = {"prompts": len(todo), "tokens": tokens, "skipped": skipped, "second_pass_cached_tokens": hit}
    server_args = getattr(tokenizer_manager, "server_args", None)
    if getattr(server_args, "enable_metrics", False):
        # This runs in the HTTP server's process; SGLang's multiprocess registry collects it.
        from sglang_mamba_ext.plugin.metrics import record_warmup

        record_warmup(
            result,
            getattr(tokenizer_manager, "served_model_name", None) or getattr(server_args, "served_model_name", ""),
            getattr(server_args, "extra_metric_labels", None),
        )
    return result


def register_warmup() -> None:
    """Register :func:`kda_cache_warmup` under ``kda_cache`` in SGLang's warmup registry
    (``sglang.srt.entrypoints.warmup.warmup``); idempotent."""
    from sglang.srt.entrypoints.warmup import _warmup_registry, warmup

    if _warmup_registry.get(S.WARMUP_NAME) is not kda_cache_warmup:
        warmup(S.WARMUP_NAME)(kda_cache_warmup)
