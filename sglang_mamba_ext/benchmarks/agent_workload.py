"""An agent-shaped synthetic workload for the hit-rate benchmark (:mod:`.hit_rate`,
``--workload agent``; issue 38), generated in code from a seed (no file). Three request
shapes the shared trace and the chat workload (:mod:`.chat_workload`) lack, arriving
interleaved:

- **agentic tool loops**: a session starts from one of a few tool-set system prompts (about
  1,000 tokens) and a user task; every step's prompt is the previous step's prompt, its
  output (a tool call) and the tool's result, so the context grows every step and each
  step's prefix is exactly the previous sequence;
- **RAG**: a question over a few documents drawn from a shared pool, placed in varying order
  after one of two short RAG system prompts (two prompts share the system prompt and, only
  when they start with the same document, that document); some get a follow-up turn;
- **regenerations**: a request resent with the same prompt (a new sample; the next step or
  turn continues from the regenerated output).

Token layout: :mod:`.chat_workload`'s ChatML-like template (ids 1-6), plus ``ROLE_TOOL``
(7) for tool results and ``DOC_SEP`` (8) before each document; content ids are drawn from
``[10, 32000)``. ``sys`` of a record is the tool set (``0..num_toolsets-1``) or the RAG
system prompt (``num_toolsets + i``); ``parent`` is the request whose ``tokens + output``
the prompt starts with (for a regeneration: its original's parent).
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Tuple

from sglang_mamba_ext.benchmarks.chat_workload import (
    CONTENT_MIN, IM_END, IM_START, NEWLINE, ROLE_ASSISTANT, ROLE_SYSTEM, ROLE_USER, VOCAB,
)
from sglang_mamba_ext.benchmarks.common import TraceRecord

ROLE_TOOL, DOC_SEP = 7, 8

#: Defaults of :func:`agent_workload` (what the benchmark prints). Lengths in tokens,
#: inclusive ranges; times in arbitrary units (only the arrival order matters).
DEFAULTS = dict(
    seed=0,
    num_toolsets=4,
    toolset_len=(900, 1100),
    agent_sessions=36,
    steps=(3, 8),
    task_len=(30, 120),
    call_len=(20, 100),
    result_len=(40, 250),
    num_rag_systems=2,
    rag_system_len=(200, 400),
    num_docs=30,
    doc_len=(150, 400),
    docs_per_query=(2, 4),
    rag_queries=100,
    question_len=(15, 60),
    answer_len=(30, 200),
    followup_prob=0.3,
    regen_prob=0.15,
    step_gap=2.0,
    turn_gap=8.0,
    start_span=300.0,
)


def _content(rng: random.Random, lo_hi: Tuple[int, int]) -> List[int]:
    return [rng.randrange(CONTENT_MIN, VOCAB) for _ in range(rng.randint(*lo_hi))]


def _turn(role: int, body: List[int]) -> List[int]:
    return [IM_START, role, NEWLINE] + body + [IM_END, NEWLINE]


GEN_PROMPT = [IM_START, ROLE_ASSISTANT, NEWLINE]


def agent_workload(seed: int = DEFAULTS["seed"], **overrides) -> List[TraceRecord]:
    """The workload's requests in arrival order (``rid`` 0..N-1), the same for the same
    seed and overrides (keys of :data:`DEFAULTS` but ``seed``).

    A session (agent or RAG) starts at a time uniform in ``[0, start_span)``; an agent's
    steps follow each other after exponential gaps of mean ``step_gap`` (tool calls), a
    RAG follow-up after ``turn_gap`` (a user). After any request, with probability
    ``regen_prob``, a regeneration of it arrives one ``step_gap`` later and the session
    goes on from its output.

    Raises:
        ValueError: an unknown override, a count below its minimum (one tool set, one RAG
            system prompt, ``docs_per_query[1] <= num_docs``, ``steps[0] >= 1``) or a
            probability outside ``[0, 1]``.
    """
    unknown = set(overrides) - (set(DEFAULTS) - {"seed"})
    if unknown:
        raise ValueError(f"agent_workload: unknown parameter(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    p = dict(DEFAULTS, **overrides)
    if (p["num_toolsets"] < 1 or p["num_rag_systems"] < 1 or p["steps"][0] < 1
            or p["steps"][1] < p["steps"][0] or not 1 <= p["docs_per_query"][0] <= p["docs_per_query"][1] <= p["num_docs"]
            or p["agent_sessions"] < 0 or p["rag_queries"] < 0
            or not all(0.0 <= p[k] <= 1.0 for k in ("followup_prob", "regen_prob"))):
        raise ValueError(
            "agent_workload: need num_toolsets, num_rag_systems >= 1, 1 <= steps[0] <= steps[1], "
            "1 <= docs_per_query[0] <= docs_per_query[1] <= num_docs, non-negative session counts "
            f"and probabilities in [0, 1]; got {overrides}"
        )
    rng = random.Random(seed)
    toolsets = [_turn(ROLE_SYSTEM, _content(rng, p["toolset_len"])) for _ in range(p["num_toolsets"])]
    rag_systems = [_turn(ROLE_SYSTEM, _content(rng, p["rag_system_len"])) for _ in range(p["num_rag_systems"])]
    docs = [[DOC_SEP] + _content(rng, p["doc_len"]) for _ in range(p["num_docs"])]
    # (time, session, index in session, prompt, output, sys, parent key or None)
    events: List[tuple] = []

    def emit(t, s, k, prompt, sys_, parent) -> Tuple[float, int, tuple, List[int]]:
        """One request and, maybe, its regeneration; the key and output the session goes on
        from."""
        out = _content(rng, p["call_len"] if sys_ < p["num_toolsets"] else p["answer_len"]) + [IM_END]
        events.append((t, s, k, prompt, out, sys_, parent))
        key = (s, k)
        if rng.random() < p["regen_prob"]:
            t += rng.expovariate(1.0 / p["step_gap"])
            out = _content(rng, p["call_len"] if sys_ < p["num_toolsets"] else p["answer_len"]) + [IM_END]
            events.append((t, s, k + 0.5, prompt, out, sys_, parent))
            key = (s, k + 0.5)
        return t, key, out

    session = 0
    for _ in range(p["agent_sessions"]):
        ts = rng.randrange(p["num_toolsets"])
        t = rng.uniform(0.0, p["start_span"])
        prompt = toolsets[ts] + _turn(ROLE_USER, _content(rng, p["task_len"])) + GEN_PROMPT
        parent: Optional[tuple] = None
        for k in range(rng.randint(*p["steps"])):
            if k:
                t += rng.expovariate(1.0 / p["step_gap"])
                prompt = prompt + out + [NEWLINE] + _turn(ROLE_TOOL, _content(rng, p["result_len"])) + GEN_PROMPT
            t, parent, out = emit(t, session, k, prompt, ts, parent)
        session += 1
    for _ in range(p["rag_queries"]):
        rs = rng.randrange(p["num_rag_systems"])
        t = rng.uniform(0.0, p["start_span"])
        picked = rng.sample(range(p["num_docs"]), rng.randint(*p["docs_per_query"]))
        body = [tok for d in picked for tok in docs[d]] + [NEWLINE] + _content(rng, p["question_len"])
        prompt = rag_systems[rs] + _turn(ROLE_USER, body) + GEN_PROMPT
        t, parent, out = emit(t, session, 0, prompt, p["num_toolsets"] + rs, None)
        if rng.random() < p["followup_prob"]:
            t += rng.expovariate(1.0 / p["turn_gap"])
            prompt = prompt + out + [NEWLINE] + _turn(ROLE_USER, _content(rng, p["question_len"])) + GEN_PROMPT
            emit(t, session, 1, prompt, p["num_toolsets"] + rs, parent)
        session += 1
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    rid_of: Dict[tuple, int] = {}
    records = []
    for rid, (_, s, k, prompt, out, sys_, parent) in enumerate(events):
        rid_of[(s, k)] = rid
        records.append(TraceRecord(rid, tuple(prompt), tuple(out), sys_, None if parent is None else rid_of[parent]))
    return records


def shape_counts(records: List[TraceRecord], num_toolsets: int = DEFAULTS["num_toolsets"]) -> Dict[str, int]:
    """Requests per shape: ``agent_steps`` (tool-set sessions), ``rag`` (RAG prompts,
    follow-ups included) and ``regenerations`` (a prompt equal to an earlier request's)."""
    seen = set()
    counts = {"agent_steps": 0, "rag": 0, "regenerations": 0}
    for r in records:
        counts["agent_steps" if r.sys < num_toolsets else "rag"] += 1
        counts["regenerations"] += r.tokens in seen
        seen.add(r.tokens)
    return counts
