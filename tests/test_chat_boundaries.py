"""Message boundaries of chat requests and the ``kv_hints`` action that carries checkpoint
offsets (issue 16, item 2; ``plugin/chat_boundaries.py``), in process: which messages end a
boundary, the offsets SGLang's own template application gives (the tiny model's chat
template), the envelope, its validation (HTTP 400 messages) and the two chat hooks around a
stand-in for ``OpenAIServingChat`` (inert without ``--enable-mamba-radix``)."""

import unittest
from types import SimpleNamespace
from unittest import mock

from conftest import requires_sglang, tiny_model_dir

ON = {"enable": True}
OFF = {}


def msg(role, content="x"):
    return {"role": role, "content": content}


@requires_sglang
class TestBoundaryMessages(unittest.TestCase):
    def test_which_prefixes_end_a_boundary(self):
        from sglang_mamba_ext.plugin.chat_boundaries import CHAT_TURN_BOUNDARIES, boundary_messages

        S, U, A = "system", "user", "assistant"
        self.assertEqual(boundary_messages([msg(S), msg(U)]), [1])
        self.assertEqual(boundary_messages([msg(S), msg(S), msg(U)]), [2])
        self.assertEqual(boundary_messages([msg(S), msg(U), msg(A), msg(U)]), [1, 3])
        self.assertEqual(boundary_messages([msg(U), msg(A), msg(U), msg(A), msg(U)]), [4, 2])
        self.assertEqual(boundary_messages([msg(U)]), [])
        self.assertEqual(boundary_messages([msg(S)]), [])
        turns = [msg(S)] + [msg(U), msg(A)] * 8 + [msg(U)]
        got = boundary_messages(turns)
        users = [j for j in range(2, len(turns)) if turns[j]["role"] == U]
        self.assertEqual(got, [1] + list(reversed(users[-CHAT_TURN_BOUNDARIES:])))


@requires_sglang
class TestMessageOffsets(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from transformers import AutoTokenizer

        cls.tok = AutoTokenizer.from_pretrained(tiny_model_dir())

    def ids(self, messages, gen):
        out = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
        return list(out["input_ids"]) if hasattr(out, "keys") else list(out)

    def test_offsets_are_the_template_lengths_of_the_prefixes(self):
        from sglang_mamba_ext.plugin.chat_boundaries import message_boundaries

        m = [msg("system", "Be brief."), msg("user", "Hi"), msg("assistant", "Hello."), msg("user", "Bye")]
        full = self.ids(m, True)
        got = message_boundaries(lambda k: self.ids(k, False), m, full)
        self.assertEqual(got, [len(self.ids(m[:1], False)), len(self.ids(m[:3], False))])
        for o in got:
            self.assertLess(o, len(full))

    def test_a_prefix_the_template_renders_differently_is_dropped(self):
        from sglang_mamba_ext.plugin.chat_boundaries import message_boundaries

        m = [msg("system", "Be brief."), msg("user", "Hi")]
        full = self.ids(m, True)
        self.assertEqual(message_boundaries(lambda k: [full[0] + 1] + full[1:5], m, full), [])
        self.assertEqual(message_boundaries(lambda k: full, m, full), [])  # not a proper prefix


@requires_sglang
class TestEnvelope(unittest.TestCase):
    def hints(self, payload, version="1", n=1):
        from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

        from sglang_mamba_ext.plugin.chat_boundaries import ACTION_TYPE

        action = {"action_id": "a", "action_type": ACTION_TYPE, "action_version": version, "payload": payload}
        return decode_kv_hints_envelope({"protocol_version": "1", "message_id": "m", "actions": [action] * n})

    def test_parse_and_refuse(self):
        from sglang_mamba_ext.plugin.chat_boundaries import MAX_OFFSETS, parse_offsets

        self.assertEqual(parse_offsets(None), [])
        self.assertEqual(parse_offsets(self.hints({"offsets": [5, 2]}), 10), [5, 2])
        bad = {
            "outside the prompt": (self.hints({"offsets": [0]}), 10),
            "in [1, 10)": (self.hints({"offsets": [10]}), 10),
            "payload must be": (self.hints({"offsets": ["3"]}), 10),
            f"at most {MAX_OFFSETS}": (self.hints({"offsets": list(range(1, MAX_OFFSETS + 2))}), 100),
            "action_version '2' is not supported": (self.hints({"offsets": [3]}, version="2"), 10),
            "given 2 times": (self.hints({"offsets": [3]}, n=2), 10),
        }
        for text, (env, n) in bad.items():
            with self.subTest(text):
                with self.assertRaises(ValueError) as cm:
                    parse_offsets(env, n)
                self.assertIn(text.strip(), str(cm.exception))
                self.assertIn("mamba_radix.checkpoint_offsets", str(cm.exception))

    def test_other_actions_are_left_alone(self):
        from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

        from sglang_mamba_ext.plugin.chat_boundaries import parse_offsets, request_offsets, with_offsets

        other = decode_kv_hints_envelope({
            "protocol_version": "7", "message_id": "m",
            "actions": [{"action_id": "x", "action_type": "hicache.prefetch", "action_version": "1", "payload": {"a": 1}}],
        })
        self.assertEqual(parse_offsets(other, 3), [])
        both = with_offsets(other, [4, 9])
        self.assertEqual((both.protocol_version, both.message_id), ("7", "m"))
        self.assertEqual(both.actions[0], other.actions[0])
        self.assertEqual(parse_offsets(both, 10), [4, 9])
        self.assertIs(with_offsets(both, [1]), both)  # the caller's offsets win
        fresh = with_offsets(None, [3])
        self.assertEqual(request_offsets(SimpleNamespace(kv_hints=fresh)), [3])
        self.assertEqual(request_offsets(SimpleNamespace(kv_hints=self.hints({"offsets": "3"}))), [])
        self.assertEqual(request_offsets(SimpleNamespace()), [])

    def test_validation_hook_only_under_the_flag(self):
        from sglang_mamba_ext.plugin import request_validation

        obj = SimpleNamespace(input_embeds=None, kv_hints=self.hints({"offsets": [8]}))
        with mock.patch("sglang_mamba_ext.plugin.settings.current_settings", return_value=ON):
            with self.assertRaises(ValueError) as cm:
                request_validation.validate_one_request_before(None, obj, [5] * 8)
            self.assertIn("offset 8 is outside the prompt", str(cm.exception))
            self.assertIsNone(request_validation.validate_one_request_before(None, obj, [5] * 9))
        with mock.patch("sglang_mamba_ext.plugin.settings.current_settings", return_value=OFF):
            self.assertIsNone(request_validation.validate_one_request_before(None, obj, [5] * 8))


@requires_sglang
class TestChatHooks(unittest.TestCase):
    """The AROUND hooks over a stand-in with the two methods' signatures, rendering with the
    tiny model's chat template."""

    @classmethod
    def setUpClass(cls):
        from transformers import AutoTokenizer

        cls.tok = AutoTokenizer.from_pretrained(tiny_model_dir())

    def serving(self):
        from sglang.srt.managers.io_struct import GenerateReqInput

        from sglang_mamba_ext.plugin import chat_boundaries as cb

        tok = self.tok
        calls = []

        class Serving:
            def _render_and_encode_chat_template(self, messages, *, tools, template_kwargs, encode_kwargs, use_cache,
                                                 add_generation_prompt=True):
                calls.append((len(messages), add_generation_prompt, use_cache))
                out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
                return (list(out["input_ids"]) if hasattr(out, "keys") else list(out)), None

            def _convert_to_internal_request(self, request, raw_request=None):
                ids, _ = self._render_and_encode_chat_template(
                    request.messages, tools=None, template_kwargs={}, encode_kwargs={}, use_cache=True
                )
                return GenerateReqInput(input_ids=ids), request

        render, convert = Serving._render_and_encode_chat_template, Serving._convert_to_internal_request
        Serving._render_and_encode_chat_template = lambda s, *a, **k: cb.render_and_encode_around(render, s, *a, **k)
        Serving._convert_to_internal_request = lambda s, *a, **k: cb.convert_to_internal_request_around(convert, s, *a, **k)
        return Serving(), calls

    def test_chat_request_carries_the_system_boundary(self):
        from sglang_mamba_ext.plugin.chat_boundaries import parse_offsets

        m = [msg("system", "You answer in one line."), msg("user", "Name a fox.")]
        serving, calls = self.serving()
        with mock.patch("sglang_mamba_ext.plugin.settings.current_settings", return_value=ON):
            adapted, _ = serving._convert_to_internal_request(SimpleNamespace(messages=m))
        system_end = self.tok.apply_chat_template(m[:1], tokenize=True, add_generation_prompt=False)
        system_end = len(system_end["input_ids"] if hasattr(system_end, "keys") else system_end)
        self.assertEqual(parse_offsets(adapted.kv_hints, len(adapted.input_ids)), [system_end])
        # SGLang's own call, then one for messages[:1] without the generation prompt
        self.assertEqual(calls, [(2, True, True), (1, False, False)])

    def test_inert_without_the_flag(self):
        m = [msg("system", "You answer in one line."), msg("user", "Name a fox.")]
        serving, calls = self.serving()
        with mock.patch("sglang_mamba_ext.plugin.settings.current_settings", return_value=OFF):
            adapted, _ = serving._convert_to_internal_request(SimpleNamespace(messages=m))
        self.assertIsNone(adapted.kv_hints)
        self.assertEqual(calls, [(2, True, True)])

    def test_render_outside_a_conversion_is_untouched(self):
        serving, calls = self.serving()
        with mock.patch("sglang_mamba_ext.plugin.settings.current_settings", return_value=ON):
            serving._render_and_encode_chat_template(
                [msg("system"), msg("user")], tools=None, template_kwargs={}, encode_kwargs={}, use_cache=False
            )
        self.assertEqual(calls, [(2, True, False)])


if __name__ == "__main__":
    unittest.main()
