#!/usr/bin/env python
"""Example client: replays a multi-turn chat workload against a running SGLang server and
prints, per request, how many prompt tokens the server found in its prefix cache.

The workload (``examples/conversations.json``): several users share a few system prompts
(``examples/system_prompts.json``); each user's follow-up turn extends the previous turn
(system + user + assistant reply + next user message). Turns are interleaved across users,
as a real server sees them. Each prompt is rendered with the model's chat template and
sent to ``/generate`` with greedy sampling; ``meta_info.cached_tokens`` is the server's count
of prompt tokens served from the cache.

Usage (server started by ``scripts/serve_cpu.sh``)::

    python examples/multiturn_client.py --port 30000
    python examples/multiturn_client.py --url http://host:port --model-path DIR --max-new-tokens 32
    python examples/multiturn_client.py --port 30000 --chat   # through /v1/chat/completions

Exit status: 0 on success, 1 if the server cannot be reached or answers with an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="server base URL (default http://127.0.0.1:PORT)")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", "30000")))
    p.add_argument(
        "--model-path",
        default=os.environ.get("TINY_MODEL_DIR", os.path.join(REPO, ".tiny_model")),
        help="model directory whose tokenizer renders the chat template (default: %(default)s)",
    )
    p.add_argument("--conversations", default=os.path.join(HERE, "conversations.json"))
    p.add_argument("--system-prompts", default=os.path.join(HERE, "system_prompts.json"))
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send the messages to /v1/chat/completions (the server applies the template and, "
        "under --enable-mamba-radix, saves states at message boundaries) instead of rendered text to /generate",
    )
    return p.parse_args(argv)


def load_workload(conv_path: str, sys_path: str):
    """(system prompts, conversations) from the two JSON files, checked."""
    with open(sys_path) as f:
        systems = json.load(f)
    with open(conv_path) as f:
        convs = json.load(f)
    if not isinstance(systems, list) or not all(isinstance(s, str) for s in systems):
        raise SystemExit(f"{sys_path}: expected a JSON list of strings")
    for i, c in enumerate(convs):
        if not (isinstance(c, dict) and isinstance(c.get("turns"), list) and 0 <= c.get("system", -1) < len(systems)):
            raise SystemExit(f"{conv_path}: conversation {i} needs 'system' (index) and 'turns' (list)")
    return systems, convs


def interleave(convs):
    """(conversation index, turn index) in arrival order: round k sends turn k of every
    conversation that has one."""
    order = []
    for k in range(max(len(c["turns"]) for c in convs)):
        order.extend((i, k) for i, c in enumerate(convs) if k < len(c["turns"]))
    return order


def main(argv=None) -> int:
    args = parse_args(argv)
    import requests
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()

    url = args.url or f"http://127.0.0.1:{args.port}"
    if not os.path.isdir(args.model_path):
        print(f"--model-path {args.model_path}: no such directory (build it with scripts/make_tiny_model.py)")
        return 1
    tok = AutoTokenizer.from_pretrained(args.model_path)
    systems, convs = load_workload(args.conversations, args.system_prompts)
    history = [[{"role": "system", "content": systems[c["system"]]}] for c in convs]

    try:
        requests.get(f"{url}/health", timeout=10).raise_for_status()
    except Exception as e:  # noqa: BLE001 - any failure means the server is not usable
        print(f"cannot reach the server at {url}: {e}")
        return 1

    print(f"{'req':>3} {'conv':>4} {'turn':>4} {'prompt':>6} {'cached':>6} {'hit%':>5} {'ms':>6}")
    total_prompt = total_cached = 0
    for n, (ci, k) in enumerate(interleave(convs)):
        history[ci].append({"role": "user", "content": convs[ci]["turns"][k]})
        t0 = time.perf_counter()
        if args.chat:
            body = {"model": "default", "messages": history[ci], "max_tokens": args.max_new_tokens,
                    "temperature": 0, "return_meta_info": True}
            r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=args.timeout)
        else:
            text = tok.apply_chat_template(history[ci], tokenize=False, add_generation_prompt=True)
            r = requests.post(
                f"{url}/generate",
                json={"text": text, "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 0}},
                timeout=args.timeout,
            )
        ms = (time.perf_counter() - t0) * 1000
        if r.status_code != 200:
            print(f"request {n}: HTTP {r.status_code}: {r.text[:200]}")
            return 1
        out = r.json()
        if args.chat:
            choice = out["choices"][0]
            out = {"text": choice["message"]["content"] or "", "meta_info": choice["meta_info"]}
        meta = out["meta_info"]
        prompt, cached = int(meta["prompt_tokens"]), int(meta.get("cached_tokens", 0))
        total_prompt += prompt
        total_cached += cached
        history[ci].append({"role": "assistant", "content": out["text"]})
        print(f"{n:>3} {ci:>4} {k:>4} {prompt:>6} {cached:>6} {100 * cached / prompt:>5.1f} {ms:>6.0f}")
    print(f"total: {total_prompt} prompt tokens, {total_cached} served from the cache "
          f"({100 * total_cached / max(total_prompt, 1):.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
