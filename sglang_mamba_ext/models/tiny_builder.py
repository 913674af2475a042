"""Build the tiny hybrid test model (``docs/design.md``, "Tiny hybrid model"): config, seeded
random weights and a local byte-level BPE, written to ``out_dir`` as ``config.json``
(``architectures: ["TinyHybridForCausalLM"]``, ``model_type: "tiny_hybrid"``,
``torch_dtype: "float32"``, ``layer_types``), ``model.safetensors`` (float32),
``tokenizer.json``, ``tokenizer_config.json`` (with a chat template),
``special_tokens_map.json`` and ``generation_config.json``. Used by
``scripts/make_tiny_model.py`` and by tests that need a model directory. Nothing is
downloaded (the tokenizer is trained with the ``tokenizers`` library on the small corpus
below, so any text encodes and round-trips), and the output is the same bytes for a given
seed.
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, Optional

import torch

from sglang_mamba_ext.models.tiny_hybrid import (
    ARCHITECTURE,
    TinyHybridConfig,
    TinyHybridReference,
)

__all__ = ["build_tiny_model", "build_tokenizer", "write_tokenizer_files", "DEFAULT_CONFIG", "CHAT_TEMPLATE", "SPECIAL_TOKENS"]

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4

# A ChatML-style template: one block per message, then the assistant header.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOKENIZER_VOCAB_SIZE = 768

# Model sizes: small enough for fast CPU serving. K != V on purpose so that a transposed SSM
# state layout cannot go unnoticed.
DEFAULT_CONFIG: Dict = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    linear_gate_rank=16,
    tie_word_embeddings=False,
)

#: Linear-layer head layout of the KDA variant served by SGLang's own ``KDAAttnBackend``
#: (``linear_kernels="sglang"``, ``linear_gate="kda"``): SGLang's KDA pool is Kimi-Linear's
#: (``srt/configs/mamba_utils.py::KimiLinearStateShape``: one head count and one head size for
#: q, k and v), so key and value heads and dims are equal here.
KDA_SGLANG_LINEAR_HEADS: Dict = dict(
    linear_num_key_heads=4,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A hybrid language model mixes full attention
layers with linear attention layers; the linear layers keep a fixed-size state per request
instead of a key-value cache that grows with the sequence. A prefix cache stores both the
attention keys and values and the state of every linear layer, so a request that shares a
system prompt with an earlier one can skip the shared part of the prefill.
Once upon a time there was a small model that lived on a CPU. Every morning it read the
tokens of the day, one by one, and wrote down what it thought would come next. Some days it
was right, most days it was wrong, but it was always quick.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
for (int i = 0; i < n; ++i) { sum += values[i] * weights[i]; }
SELECT name, count(*) FROM requests WHERE cached_tokens > 0 GROUP BY name;
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14159 2.71828 1e-6
Le renard brun saute par-dessus le chien paresseux. Der schnelle braune Fuchs springt.
El zorro marrón salta sobre el perro perezoso. Быстрая коричневая лиса прыгает.
敏捷的棕色狐狸跳过了懒狗。 素早い茶色の狐がのろまな犬を飛び越える。 빠른 갈색 여우.
Emoji and symbols: 🙂 🚀 ✓ → ← ∑ ∫ ≤ ≥ ≠ ± × ÷ € £ ¥ © ®
User: Hello! Who are you?
Assistant: I am a tiny test model. I answer in random tokens, but I answer quickly.
User: What is the capital of France?
Assistant: Paris is the capital of France.
"""


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE):
    """Train a byte-level BPE on the built-in corpus.

    Returns a ``tokenizers.Tokenizer`` whose first ids are ``SPECIAL_TOKENS`` (pad 0, bos 1,
    eos 2, im_start 3, im_end 4), then the 256 byte symbols, then merges. Any text encodes
    and decodes back exactly (byte-level pre-tokenizer and decoder, no normaliser)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return tok


def _init_weights(model: TinyHybridReference, generator: torch.Generator) -> None:
    """Seeded random init chosen so greedy decoding varies with context: unit-variance
    embeddings, ``N(0, 1/fan_in)`` linears (so every block moves the residual stream), an
    untied LM head, KDA-style decay parameters (A in [1, 16], dt in [1e-3, 1e-1])."""
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=generator))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=generator).log())
            elif name.endswith("dt_bias"):
                lo, hi = math.log(1e-3), math.log(1e-1)
                dt = torch.exp(torch.empty(p.shape).uniform_(lo, hi, generator=generator))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif name.endswith("conv_weight"):
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))
            elif p.dim() == 2:  # nn.Linear weights [out, in]
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[1]))
            elif name.endswith("weight"):  # norm weights
                p.fill_(1.0)
            else:
                raise AssertionError(f"no init rule for {name}")


def build_tiny_model(out_dir: str, seed: int = 0, config_overrides: Optional[Dict] = None,
                     linear_kernels: str = "tiny") -> str:
    """Write a complete tiny model directory (see module docstring); returns ``out_dir``.

    Args:
        out_dir: created if missing; existing files of the same names are overwritten.
        seed: weights seed (the tokenizer does not depend on it).
        config_overrides: optional changes to :data:`DEFAULT_CONFIG`.
        linear_kernels: ``"tiny"`` (architecture ``TinyHybridForCausalLM``, the plugin's torch
            backend; ``torch_dtype`` float32) or ``"sglang"`` (``TinyHybridGDNForCausalLM`` /
            ``TinyHybridKDAForCausalLM`` by ``linear_gate``: SGLang's own backend;
            ``torch_dtype`` float16). Same weights either way for the same config; with
            ``"sglang"`` and the KDA gate the linear heads default to
            :data:`KDA_SGLANG_LINEAR_HEADS` (``config_overrides`` still win).

    Raises:
        ValueError: an unknown ``linear_kernels``, or a KDA/sglang config whose linear key and
            value heads or head dims differ (SGLang's KDA backend needs them equal).
    """
    if linear_kernels not in ("tiny", "sglang"):
        raise ValueError(f"linear_kernels must be 'tiny' or 'sglang', got {linear_kernels!r}")
    overrides = dict(config_overrides or {})
    kda_sglang = linear_kernels == "sglang" and overrides.get("linear_gate", "kda") == "kda"  # TinyHybridConfig default
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer()
    vocab_size = tok.get_vocab_size()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}

    cfg = dict(DEFAULT_CONFIG)
    if kda_sglang:
        cfg.update(KDA_SGLANG_LINEAR_HEADS)
    cfg.update(overrides)
    if kda_sglang:
        check_kda_sglang_heads(cfg)
    config = TinyHybridConfig(
        vocab_size=vocab_size,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        architectures=[ARCHITECTURE],
        **cfg,
    )
    generator = torch.Generator().manual_seed(seed)
    model = TinyHybridReference(config)
    _init_weights(model, generator)
    state = {k: v.detach().contiguous().float() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})

    arch = ARCHITECTURE
    if linear_kernels == "sglang":
        arch = "TinyHybridGDNForCausalLM" if config.linear_gate == "gdn" else "TinyHybridKDAForCausalLM"
    config_json = dict(
        cfg,
        architectures=[arch],
        model_type=config.model_type,
        torch_dtype="float16" if linear_kernels == "sglang" else "float32",
        vocab_size=vocab_size,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
    )
    _write_json(os.path.join(out_dir, "config.json"), config_json)

    write_tokenizer_files(out_dir, tok, max_len=cfg["max_position_embeddings"])
    return out_dir


def write_tokenizer_files(out_dir: str, tok, max_len: int) -> None:
    """Write ``tok`` (from :func:`build_tokenizer`) to ``out_dir`` as ``tokenizer.json``,
    ``tokenizer_config.json`` (ChatML template, no BOS/EOS added), ``special_tokens_map.json``
    and ``generation_config.json``; ``max_len`` is the tokenizer's ``model_max_length``
    (tokens)."""
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
               "additional_special_tokens": [IM_START, IM_END]}
    _write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": max_len,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
            **special,
        },
    )
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), special)
    _write_json(
        os.path.join(out_dir, "generation_config.json"),
        {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]},
    )


def check_kda_sglang_heads(cfg: Dict) -> None:
    """Refuse a linear-head layout SGLang's KDA backend cannot serve: it sizes its pool as
    Kimi-Linear does (conv ``[W-1, 3*HV*V]``, state ``[HV, V, V]``) and splits ``mixed_qkv`` with
    one head count and size for q, k and v.

    Raises:
        ValueError: ``linear_num_key_heads != linear_num_value_heads`` or
            ``linear_key_head_dim != linear_value_head_dim`` (names the keys to change)."""
    bad = [(a, b) for a, b in (("linear_num_key_heads", "linear_num_value_heads"),
                               ("linear_key_head_dim", "linear_value_head_dim")) if cfg[a] != cfg[b]]
    if bad:
        raise ValueError(
            "KDA model for SGLang's KDA backend (linear_kernels='sglang'): "
            + ", ".join(f"{a}={cfg[a]} != {b}={cfg[b]}" for a, b in bad)
            + " (SGLang's Kimi-Linear pool layout needs them equal)"
        )


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def build_tiny_draft(out_dir: str, target_dir: str) -> str:
    """Write the frozen-KV draft matching the tiny model in ``target_dir`` to ``out_dir``
    (``config.json`` with ``model_type: "tiny_hybrid_draft"``, ``architectures:
    ["TinyHybridDraftForCausalLM"]``, ``model.safetensors`` float32, and the target's
    tokenizer files copied): one full-attention layer per target full-attention layer,
    initialised from the target's weights (:func:`sglang_mamba_ext.models.tiny_draft.
    draft_init_from_target`). Deterministic for a given target; returns ``out_dir``.

    Raises:
        FileNotFoundError: ``target_dir`` lacks ``config.json`` / ``model.safetensors``."""
    import shutil

    from safetensors.torch import load_file, save_file

    from sglang_mamba_ext.models.tiny_draft import (
        DRAFT_ARCHITECTURE,
        DRAFT_MODEL_TYPE,
        TinyHybridDraftConfig,
        TinyHybridDraftCore,
        draft_config_for,
        draft_init_from_target,
    )

    for name in ("config.json", "model.safetensors"):
        if not os.path.isfile(os.path.join(target_dir, name)):
            raise FileNotFoundError(f"{os.path.join(target_dir, name)} not found (build the target first)")
    target_cfg = TinyHybridConfig.from_pretrained(target_dir)
    cfg = draft_config_for(target_cfg)
    draft = TinyHybridDraftCore(TinyHybridDraftConfig(architectures=[DRAFT_ARCHITECTURE], **cfg))
    draft_init_from_target(draft, load_file(os.path.join(target_dir, "model.safetensors")))
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.detach().contiguous().float() for k, v in draft.state_dict().items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(out_dir, "config.json"),
                dict(cfg, architectures=[DRAFT_ARCHITECTURE], model_type=DRAFT_MODEL_TYPE, torch_dtype="float32"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        src = os.path.join(target_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out_dir, name))
    return out_dir
