"""The ``kda_cache`` warmup and its prompts file, driven through SGLang's own
``execute_warmups`` with a stand-in tokenizer manager (no server)."""

import asyncio
import json
import os
import tempfile
import types
import unittest
from unittest import mock

from sglang_mamba_ext.plugin import warmup as W


class _Tokenizer:
    """Stand-in tokenizer: a character is a token; the chat template wraps each message."""

    def encode(self, text):
        return [1] + [ord(c) % 500 + 3 for c in text]

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        assert tokenize and not add_generation_prompt
        ids = [1]
        for m in messages:
            ids += [2] + [ord(c) % 500 + 3 for c in m["role"] + ":" + m["content"]] + [2]
        return ids


class _TokenizerManager:
    """Records every GenerateReqInput; answers with one output token (a function of the
    prompt) and ``cached_tokens`` = all but the last prompt token."""

    def __init__(self, context_len=64, max_req_input_len=None, vocab_size=None):
        self.tokenizer = _Tokenizer()
        self.context_len = context_len
        self.max_req_input_len = max_req_input_len
        self.model_config = types.SimpleNamespace(vocab_size=vocab_size)
        self.requests = []

    async def generate_request(self, obj, request=None):
        self.requests.append(obj)
        ids = list(obj.input_ids)
        yield {"output_ids": [sum(ids) % 97], "meta_info": {"cached_tokens": len(ids) - 1}}


class _Files(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def write(self, text, name="p.txt"):
        path = os.path.join(self.dir.name, name)
        with open(path, "w") as f:
            f.write(text)
        return path


class TestPromptsFile(_Files):
    def test_json_list_with_lines(self):
        path = self.write('[\n  "first prompt",\n\n  "second"\n]\n')
        prompts = W.load_prompts(path)
        self.assertEqual([(p.kind, p.value, p.line) for p in prompts], [("text", "first prompt", 2), ("text", "second", 4)])

    def test_jsonl_kinds(self):
        path = self.write(
            '{"text": "hello"}\n\n'
            '{"input_ids": [5, 6, 7]}\n'
            '{"messages": [{"role": "system", "content": "be brief"}]}\n'
        )
        prompts = W.load_prompts(path)
        self.assertEqual([(p.kind, p.line) for p in prompts], [("text", 1), ("input_ids", 3), ("messages", 4)])
        self.assertEqual(prompts[1].value, [5, 6, 7])

    def test_bad_files_name_file_and_line(self):
        cases = {
            "missing": (os.path.join(self.dir.name, "nope.json"), "cannot read"),
            "directory": (self.dir.name, "cannot read"),
            "empty": (self.write("  \n", "e.json"), "empty"),
            "empty list": (self.write("[]", "l.json"), "no prompts"),
            "not json list": (self.write('[\n"a",\n"b"\n', "nj.json"), ":4: not valid JSON"),
            "not json line": (self.write('{"text": "a"}\n{"text": }\n', "nl.jsonl"), ":2: not valid JSON"),
            "list item type": (self.write('[\n "a",\n 3\n]', "t.json"), ":3: item 1 must be a non-empty string"),
            "unknown key": (self.write('{"text": "a"}\n{"prompt": "b"}\n', "k.jsonl"), ":2: each line needs exactly one"),
            "two keys": (self.write('{"text": "a", "input_ids": [1]}\n', "k2.jsonl"), ":1: each line needs exactly one"),
            "ids type": (self.write('{"input_ids": [1, "x"]}\n', "i.jsonl"), ':1: "input_ids" must be'),
            "messages type": (self.write('{"messages": [{"content": "x"}]}\n', "m.jsonl"), ':1: "messages"[0]'),
            "line not object": (self.write('"just a string"\n', "s.jsonl"), ":1: expected an object"),
            "pretty-printed object": (
                self.write('{\n  "text": "a"\n}\n', "p.json"), "one JSON value spread over several lines"
            ),
        }
        for name, (path, needle) in cases.items():
            with self.subTest(name):
                with self.assertRaises(ValueError) as cm:
                    W.load_prompts(path)
                msg = str(cm.exception)
                self.assertIn("--warmup-prompts-file", msg)
                self.assertIn(path, msg)
                self.assertIn(needle, msg)


class TestWarmupRun(_Files):
    def _run(self, path, tm):
        from sglang.srt.entrypoints.warmup import _warmup_registry, execute_warmups

        W.register_warmup()
        self.assertIs(_warmup_registry["kda_cache"], W.kda_cache_warmup)
        with mock.patch.object(W.S, "current_settings", return_value={"warmup_prompts_file": path}):
            asyncio.run(execute_warmups("null", ["kda_cache"], tm))

    def test_sends_each_prompt_twice(self):
        path = self.write(
            '{"text": "sys prompt"}\n'
            '{"input_ids": [9, 8, 7, 6]}\n'
            '{"messages": [{"role": "system", "content": "hi"}]}\n'
        )
        tm = _TokenizerManager()
        with self.assertLogs(W.logger, "INFO") as logs:
            self._run(path, tm)
        tok = _Tokenizer()
        firsts = [
            tok.encode("sys prompt"),
            [9, 8, 7, 6],
            tok.apply_chat_template([{"role": "system", "content": "hi"}]),
        ]
        seconds = [ids + [sum(ids) % 97] for ids in firsts]
        self.assertEqual([list(r.input_ids) for r in tm.requests], firsts + seconds)
        for r in tm.requests:
            self.assertEqual(r.sampling_params["max_new_tokens"], 1)
            self.assertEqual(r.sampling_params["temperature"], 0.0)
        tokens = sum(len(x) for x in firsts)
        hit = sum(len(x) - 1 for x in seconds)
        self.assertTrue(
            any(f"3 prompts ({tokens} tokens) prefilled into the cache" in m and f"hit {hit} cached tokens" in m for m in logs.output),
            logs.output,
        )

    def test_too_long_prompt_is_skipped(self):
        path = self.write(json.dumps(["short", "x" * 100]))
        tm = _TokenizerManager(context_len=32)
        with self.assertLogs(W.logger, "WARNING") as logs:
            self._run(path, tm)
        self.assertEqual(len(tm.requests), 2)  # only "short", twice
        self.assertTrue(any(f"{path}:1: prompt of 101 tokens skipped" in m for m in logs.output), logs.output)

    def test_prompt_over_sglang_input_limit_is_skipped(self):
        """SGLang refuses inputs of max_req_input_len tokens or more (a few tokens under the
        context length); the second pass sends one token more than the first."""
        path = self.write('{"input_ids": [5, 6, 7, 8]}\n{"input_ids": [5, 6, 7, 8, 9, 10]}\n')
        tm = _TokenizerManager(context_len=64, max_req_input_len=6)
        with self.assertLogs(W.logger, "WARNING") as logs:
            self._run(path, tm)
        self.assertEqual([list(r.input_ids)[:4] for r in tm.requests], [[5, 6, 7, 8]] * 2)
        self.assertTrue(any(f"{path}:2: prompt of 6 tokens skipped" in m for m in logs.output), logs.output)

    def test_warns_when_the_pools_cannot_keep_the_prompts(self):
        path = self.write('{"input_ids": [5, 6, 7, 8]}\n{"input_ids": [9, 10, 11]}\n')
        tm = _TokenizerManager()
        with self.assertNoLogs(W.logger, "WARNING"):
            self._run(path, tm)  # the fake cache hits every prompt token: no warning
        forgetful = _TokenizerManager()

        async def generate_request(obj, request=None):
            forgetful.requests.append(obj)
            ids = list(obj.input_ids)
            yield {"output_ids": [1], "meta_info": {"cached_tokens": min(1, len(ids) - 1)}}

        forgetful.generate_request = generate_request
        with self.assertLogs(W.logger, "WARNING") as logs:
            self._run(path, forgetful)
        self.assertTrue(any("hit 2 of 7 prompt tokens" in m for m in logs.output), logs.output)

    def test_token_id_outside_vocabulary_fails_naming_file_and_line(self):
        path = self.write('{"input_ids": [5, 6]}\n{"input_ids": [5, 6, 99999]}\n')
        tm = _TokenizerManager(vocab_size=768)
        with self.assertRaises(ValueError) as cm:
            self._run(path, tm)
        self.assertIn(f"{path}:2", str(cm.exception))
        self.assertIn("99999", str(cm.exception))
        self.assertEqual(tm.requests, [])  # checked before anything is sent

    def test_missing_file_setting_fails(self):
        tm = _TokenizerManager()
        from sglang.srt.entrypoints.warmup import execute_warmups

        W.register_warmup()
        with mock.patch.object(W.S, "current_settings", return_value={}):
            with self.assertRaises(ValueError) as cm:
                asyncio.run(execute_warmups("null", ["kda_cache"], tm))
        self.assertIn("--warmup-prompts-file", str(cm.exception))
        self.assertEqual(tm.requests, [])


if __name__ == "__main__":
    unittest.main()
