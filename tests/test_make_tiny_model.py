"""scripts/make_tiny_model.py: deterministic output, byte-level tokenizer, chat template."""

import json
import os
import random
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "make_tiny_model.py")
FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def _run_builder(out, seed):
    env = dict(os.environ, PYTHONHASHSEED="random")
    subprocess.run(
        [sys.executable, SCRIPT, "--out", out, "--seed", str(seed)],
        check=True, env=env, capture_output=True, timeout=300,
    )


def _read(path):
    with open(path, "rb") as f:
        return f.read()


class TestMakeTinyModel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.a = os.path.join(cls.tmp.name, "a")
        cls.b = os.path.join(cls.tmp.name, "b")
        cls.c = os.path.join(cls.tmp.name, "c")
        _run_builder(cls.a, 0)
        _run_builder(cls.b, 0)  # separate process, different hash seed
        from sglang_mamba_ext.models.tiny_builder import build_tiny_model

        build_tiny_model(cls.c, seed=1)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_deterministic_for_a_seed(self):
        for name in FILES:
            self.assertEqual(_read(os.path.join(self.a, name)), _read(os.path.join(self.b, name)), name)

    def test_seed_changes_weights_only(self):
        self.assertNotEqual(
            _read(os.path.join(self.a, "model.safetensors")), _read(os.path.join(self.c, "model.safetensors"))
        )
        self.assertEqual(_read(os.path.join(self.a, "tokenizer.json")), _read(os.path.join(self.c, "tokenizer.json")))

    def test_config(self):
        with open(os.path.join(self.a, "config.json")) as f:
            cfg = json.load(f)
        self.assertEqual(cfg["architectures"], ["TinyHybridForCausalLM"])
        self.assertEqual(cfg["model_type"], "tiny_hybrid")
        self.assertEqual(cfg["torch_dtype"], "float32")
        self.assertEqual(
            cfg["layer_types"], ["full_attention", "linear_attention", "full_attention", "linear_attention"]
        )
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(self.a, "tokenizer.json"))
        self.assertEqual(cfg["vocab_size"], tok.get_vocab_size())
        self.assertTrue(256 < cfg["vocab_size"] <= 2048)
        self.assertEqual(cfg["eos_token_id"], tok.token_to_id("</s>"))
        self.assertEqual(cfg["bos_token_id"], tok.token_to_id("<s>"))

    def test_tokenizer_round_trips_arbitrary_text(self):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.a)
        rng = random.Random(0)
        texts = [
            "",
            " ",
            "\n\t  \r\n",
            "Hello, world!",
            "naïve café — 東京 🙂🚀 ∑∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
            "\x00\x01\x7f control",
            "  leading and trailing  ",
        ]
        for _ in range(20):  # random code points, surrogates excluded
            texts.append(
                "".join(
                    chr(rng.choice([rng.randint(32, 0x7E), rng.randint(0xA0, 0xD7FF), rng.randint(0xE000, 0x10FFFF)]))
                    for _ in range(rng.randint(1, 40))
                )
            )
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False)
            self.assertTrue(all(0 <= i < len(tok) for i in ids))
            self.assertEqual(tok.decode(ids), text)
        # merges make ordinary English text shorter than its bytes
        english = "The quick brown fox jumps over the lazy dog."
        self.assertLess(len(tok.encode(english, add_special_tokens=False)), len(english.encode()) * 0.7)

    def test_chat_template_renders(self):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.a)
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
        ]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        self.assertEqual(
            text,
            "<s><|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
        )
        ids = tok.encode(text, add_special_tokens=False)
        self.assertEqual(ids[0], tok.convert_tokens_to_ids("<s>"))
        self.assertIn(tok.convert_tokens_to_ids("<|im_start|>"), ids)
        self.assertEqual(tok.eos_token, "</s>")


if __name__ == "__main__":
    unittest.main()
