"""A chat-shaped synthetic workload for the hit-rate benchmark (:mod:`.hit_rate`),
generated in code from a seed (no file): a few system prompts, each reused by many
conversations, whose multi-turn requests arrive interleaved.

Token layout (a ChatML-like template; ids 1-6 are the template's special tokens, content
ids are drawn from ``[10, 32000)``)::

    system message   <|im_start|> system \\n  <system content>  <|im_end|> \\n
    user turn        <|im_start|> user \\n    <user content>    <|im_end|> \\n
                     <|im_start|> assistant \\n                (generation prompt)
    output           <assistant content> <|im_end|>

Turn ``k + 1``'s prompt is turn ``k``'s prompt + its output + ``\\n`` + the next user turn,
so ``parent`` is the previous turn's rid. Two conversations that share a system prompt
share ``len(system message) + 3`` tokens (up to the user's content): the branch point.

It shows the *first-sharer effect*: the first turn of the second conversation on a system
prompt finds those tokens as KV but no SSM state at their end (the first conversation left
states only at its own prompt and sequence ends), so it hits nothing; its prefill plants the
branch-point checkpoint that the third conversation then hits (README, "How it works";
issue 16). :func:`sharer_hits` measures it.
"""

from __future__ import annotations

import random
from typing import Dict, List, Sequence, Tuple

from sglang_mamba_ext.benchmarks.common import TraceRecord

IM_START, IM_END, ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, NEWLINE = 1, 2, 3, 4, 5, 6
#: First id of content tokens (ids below are the template's).
CONTENT_MIN = 10
VOCAB = 32000

#: Defaults of :func:`chat_workload` (what the benchmark prints).
DEFAULTS = dict(
    seed=0,
    num_system=6,
    num_conversations=120,
    turns=(2, 6),
    system_len=(300, 700),
    user_len=(20, 160),
    output_len=(30, 240),
    mean_gap=6.0,
    start_span=300.0,
)


def _content(rng: random.Random, lo_hi: Tuple[int, int]) -> List[int]:
    return [rng.randrange(CONTENT_MIN, VOCAB) for _ in range(rng.randint(*lo_hi))]


def chat_workload(
    seed: int = DEFAULTS["seed"],
    *,
    num_system: int = DEFAULTS["num_system"],
    num_conversations: int = DEFAULTS["num_conversations"],
    turns: Tuple[int, int] = DEFAULTS["turns"],
    system_len: Tuple[int, int] = DEFAULTS["system_len"],
    user_len: Tuple[int, int] = DEFAULTS["user_len"],
    output_len: Tuple[int, int] = DEFAULTS["output_len"],
    mean_gap: float = DEFAULTS["mean_gap"],
    start_span: float = DEFAULTS["start_span"],
) -> List[TraceRecord]:
    """The workload's requests in arrival order (``rid`` 0..N-1), the same for the same
    arguments.

    Conversation ``c`` uses system prompt ``sys`` (each prompt gets
    ``num_conversations // num_system`` or one more conversations, in shuffled order),
    starts at a time uniform in ``[0, start_span)`` and sends ``turns[0]..turns[1]`` turns
    (uniform), each an exponential gap (mean ``mean_gap``) after the previous one's
    arrival; requests are ordered by arrival time, so conversations interleave. Lengths in
    tokens are uniform in the given inclusive ranges.

    Raises:
        ValueError: fewer than one system prompt or conversation, or ``turns[0] < 1``.
    """
    if num_system < 1 or num_conversations < 1 or turns[0] < 1 or turns[1] < turns[0]:
        raise ValueError(
            f"chat_workload: need num_system >= 1, num_conversations >= 1 and 1 <= turns[0] <= "
            f"turns[1]; got {num_system}, {num_conversations}, {turns}"
        )
    rng = random.Random(seed)
    systems = [
        [IM_START, ROLE_SYSTEM, NEWLINE] + _content(rng, system_len) + [IM_END, NEWLINE]
        for _ in range(num_system)
    ]
    sys_of = [c % num_system for c in range(num_conversations)]
    rng.shuffle(sys_of)
    events = []  # (time, conversation, turn, prompt, output)
    for c in range(num_conversations):
        t = rng.uniform(0.0, start_span)
        prompt = list(systems[sys_of[c]])
        for k in range(rng.randint(*turns)):
            if k:
                t += rng.expovariate(1.0 / mean_gap)
                prompt = prompt + events[-1][4] + [NEWLINE]
            prompt = prompt + [IM_START, ROLE_USER, NEWLINE] + _content(rng, user_len) + [IM_END, NEWLINE]
            prompt += [IM_START, ROLE_ASSISTANT, NEWLINE]
            output = _content(rng, output_len) + [IM_END]
            events.append((t, c, k, prompt, output))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    rid_of: Dict[Tuple[int, int], int] = {}
    records = []
    for rid, (_, c, k, prompt, output) in enumerate(events):
        rid_of[(c, k)] = rid
        records.append(
            TraceRecord(rid, tuple(prompt), tuple(output), sys_of[c], rid_of[(c, k - 1)] if k else None)
        )
    return records


def first_turns_by_system(records: Sequence[TraceRecord]) -> Dict[int, List[int]]:
    """For each system prompt, the rids of the first turns of its conversations, in arrival
    order (a first turn is a record without ``parent``)."""
    out: Dict[int, List[int]] = {}
    for r in records:
        if r.parent is None:
            out.setdefault(r.sys, []).append(r.rid)
    return out


def sharer_hits(records: Sequence[TraceRecord], prefix_lens: Sequence[int], k: int) -> Tuple[int, int, int]:
    """``(requests, hit_tokens, shared_tokens)`` over the first turns of the ``k``-th
    conversation (1-based) of every system prompt that has one: how many there are, the
    tokens they hit (``prefix_lens``, by rid) and the tokens they share with an earlier
    request (longest common prefix with any earlier ``tokens + output``, capped at
    ``len - 1``: the most any cache could hit)."""
    n = hit = shared = 0
    for rids in first_turns_by_system(records).values():
        if len(rids) < k:
            continue
        rid = rids[k - 1]
        toks = records[rid].tokens[:-1]
        best = 0
        for prev in records[:rid]:
            seq = prev.tokens + prev.output
            m, lim = 0, min(len(seq), len(toks))
            while m < lim and seq[m] == toks[m]:
                m += 1
            best = max(best, m)
        n += 1
        hit += prefix_lens[rid]
        shared += best
    return n, hit, shared
