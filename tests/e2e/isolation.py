"""Tenant isolation (issue 23): one check run the same way at every entry point the project
documents (single server, ``--tp 2``, ``--dp 2``, DP attention, PD, replicas behind
``sglang-router``).

SGLang keys its radix cache by ``RadixKey(token_ids, extra_key, cache_salt)``
(``mem_cache/common.py::_req_radix_key``); a request in one namespace walks only the children
that carry the same namespace, so it never matches tokens another namespace (or the
namespace-less root: warm-up prompts, requests without a salt) put in the cache. The plugin
keeps the same rule (``plugin/req_bridge.py::namespace``). :func:`check_isolation` asserts it
with exact values: the same tenant hits ``len - 1`` (the prompt-end checkpoint), another
tenant and a request without a namespace hit 0.
"""

from __future__ import annotations

import random
import uuid
from typing import Callable, List, Optional

#: The tiny model's vocabulary is 768 ids; the e2e tests' arithmetic prompts use 3..702, so a
#: prompt starting in 703..767 shares no first token with them (no match in any namespace).
FIRST_TOKENS = range(703, 768)


def fresh_prompt(n: int = 48) -> List[int]:
    """``n`` token ids no other test sends: the first from :data:`FIRST_TOKENS`, the rest
    random (seeded by a fresh uuid)."""
    rnd = random.Random(uuid.uuid4().int)
    return [rnd.choice(FIRST_TOKENS)] + [rnd.randrange(3, 768) for _ in range(n - 1)]


def tenants() -> tuple:
    """Two namespace values unique to this call."""
    tag = uuid.uuid4().hex[:8]
    return f"tenant-a-{tag}", f"tenant-b-{tag}"


def check_isolation(case, send: Callable[[List[int], Optional[str]], int], prompt: Optional[List[int]] = None,
                    length: Optional[int] = None, unsalted: bool = True) -> None:
    """Assert exact tenant isolation through ``send(ids, namespace) -> cached_tokens``
    (``namespace`` None: the request carries none).

    Tenant a sends a fresh prompt twice (0, then ``len - 1``); tenant b and a request without
    a namespace then send it (0 each: nothing of a's); b's resend hits its own ``len - 1``.
    ``prompt`` may be anything ``send`` understands (e.g. text), with ``length`` its token
    count; by default a :func:`fresh_prompt`. ``unsalted=False`` skips the request without a
    namespace (a chat prompt shares its template's first tokens with every earlier chat in the
    root namespace, where a branch checkpoint may already sit).
    """
    if prompt is None:
        prompt = fresh_prompt()
        length = len(prompt)
    a, b = tenants()
    case.assertEqual(send(prompt, a), 0, "tenant a, first send")
    case.assertEqual(send(prompt, a), length - 1, "tenant a, resend: its own prompt-end checkpoint")
    case.assertEqual(send(prompt, b), 0, "tenant b must not reuse tenant a's tokens")
    if unsalted:
        case.assertEqual(send(prompt, None), 0, "a request without a namespace must not reuse tenant a's tokens")
    case.assertEqual(send(prompt, b), length - 1, "tenant b, resend: its own prompt-end checkpoint")


def check_warm_prompt_not_shared(case, send: Callable[[List[int], Optional[str]], int], warm: List[int],
                                 suffix: List[int], unsalted_hit: int) -> None:
    """SGLang's rule for the namespace-less warm-up: a request without a namespace hits it
    (``unsalted_hit`` tokens), a salted one does not (0)."""
    a, _ = tenants()
    case.assertEqual(send(warm + suffix, a), 0, "a salted request must not reuse the unsalted warm-up")
    case.assertEqual(send(warm + suffix, None), unsalted_hit, "an unsalted request hits the warm-up")


def openai_sender(case, url: str, path: str, length: int) -> Callable:
    """``send(prompt, salt) -> cached_tokens`` for SGLang's OpenAI endpoints at ``url``:
    ``path`` ``/v1/chat/completions`` (``prompt``: the messages) or ``/v1/completions`` (text),
    2 greedy tokens, ``cache_salt`` when ``salt`` is not None. Asserts HTTP 200 and
    ``length`` prompt tokens; the cached tokens come from ``usage.prompt_tokens_details``
    (the server needs ``--enable-cache-report``)."""
    import requests

    key = "messages" if path.endswith("chat/completions") else "prompt"

    def send(prompt, salt):
        body = {"model": "tiny", key: prompt, "max_tokens": 2, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = requests.post(url + path, json=body, timeout=300)
        case.assertEqual(r.status_code, 200, r.text)
        usage = r.json()["usage"]
        case.assertEqual(usage["prompt_tokens"], length)
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)  # None when 0

    return send


def chat_length(tok, messages) -> int:
    """Prompt tokens of ``messages`` under the tokenizer's chat template (generation prompt on)."""
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)
