"""Tiny random-weight checkpoints of SGLang's own hybrid model families (issue 24, item 1).

``build_hf_tiny_model(arch, out_dir)`` writes a checkpoint that SGLang serves with its own
model class for that family (``sglang/srt/models/<family>.py``) and that transformers loads with
its own class, the float32 reference (:func:`reference_greedy`). The config is written in the
family's released format (the keys SGLang's config classes in ``sglang/srt/configs/`` read, which
transformers' classes also accept), the weights are produced by transformers' own model class
(its 0.02 init; no download), saved in float16 (``torch_dtype`` float16, the dtype SGLang serves
them in on CPU), with the project's tokenizer (``tiny_builder.build_tokenizer``: vocabulary 768,
ChatML template, no BOS). Every family mixes linear (or SSM / short-conv) and full-attention
layers, with MoE where the family has it. The LM head is scaled so that logits are peaked (their
standard deviation about :data:`LOGIT_STD` on a fixed prompt): greedy outputs then depend on the
context and have clear top-2 gaps, so outputs can be checked.

``config.json`` carries :data:`MARKER_KEY` (``"sglang_mamba_ext_tiny": "<arch>"``): the plugin
applies its CPU defaults and CPU bridges to checkpoints with this key (``plugin/cpu_defaults.py``),
and to nothing else unless ``--enable-mamba-radix`` is given.

The survey of SGLang 0.5.23's hybrid classes (issue 40, item 1) lives in :mod:`.hf_survey`
(:data:`SGLANG_HYBRID_CLASSES`, :func:`list_archs`, :func:`scan_sglang_hybrid_modules`) and is
re-exported here; the family table (classes, configs, how each checkpoint is made) in
:mod:`.hf_tiny_families`.

This module imports torch and transformers only (not ``sglang``; the scan reads SGLang's files).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from typing import Dict, List, Sequence

import torch

from sglang_mamba_ext.models import hf_tiny_minicpmv

__all__ = ["ARCHS", "SERVED_ARCHS", "MARKER_KEY", "LOGIT_STD", "SGLANG_HYBRID_CLASSES", "SGLangHybridClass",
           "build_hf_tiny_model", "build_hf_tiny_models", "reference_greedy", "family_config", "arch_status",
           "list_archs", "scan_sglang_hybrid_modules", "arch_module", "arch_class"]

#: Families served by SGLang's own classes with the plugin, checked end to end
#: (``tests/e2e/test_sglang_families_serving.py``), by ``--arch`` name (SGLang's module name).
SERVED_ARCHS = ("qwen3_next", "kimi_linear", "nemotron_h", "falcon_h1", "granitemoehybrid", "lfm2",
                "qwen3_5_text", "qwen3_5_moe_text", "lfm2_moe", "qwen3_5", "qwen3_5_moe", "lfm2_vl", "mamba2",
                "nemotron_h_puzzle", "interns2preview", "gigachat35", "bailing_moe_v3", "interns2_mobius",
                "bailing_mm_v3", "bailing_moe_linear", "minicpm", "kimi_k3")
SERVED_ARCHS += ("falcon_mamba", "mamba")  # Mamba1 (issue 40)
SERVED_ARCHS += ("minicpmv", "minicpmv4_7")  # MiniCPM-V 4.6 / 4.7 (issue 40, hf_tiny_minicpmv.py)
SERVED_ARCHS += ("jet_nemotron",)  # Jet-Nemotron: JetBlock, the plugin's Jet writer (issue 40, hf_tiny_jet_nemotron.py)
SERVED_ARCHS += ("nano_nemotron_vl", "nano_nemotron_omni", "nano_nemotron_omni_v3")  # Nemotron-H Nano VL / Omni (hf_tiny_nano_nemotron_vl.py)
SERVED_ARCHS += ("minicpm_causal",)  # MiniCPMForCausalLM, MiniCPM-SALA's alias (issue 40, hf_tiny_written.py)
SERVED_ARCHS += ("kimi_k3_vl",)  # KimiK3ForConditionalGeneration, text-only (issue 40, hf_tiny_kimi_k3_vl.py)
SERVED_ARCHS += ("inkling",)  # Inkling, sconv (issue 40, hf_tiny_inkling.py)
SERVED_ARCHS += ("qwen4_exp",)  # Qwen4-Exp: GDN + PLE dilated short conv (issue 40, hf_tiny_qwen4_exp.py)
SERVED_ARCHS += ("zaya",)  # ZAYA1, CCA (issue 40, hf_tiny_zaya.py)
SERVED_ARCHS += ("jet_vlm",)  # Jet-Nemotron's VLM, text-only: the Jet writer (issue 40, hf_tiny_jet_vlm.py)
SERVED_ARCHS += ("glm5_next",)  # GLM-5-Next, text-only: KDA + DSA served as dense MLA on CPU (issue 40, hf_tiny_glm5_next.py)
#: Every ``--arch`` that builds a tiny checkpoint: the served ones, then any that build but are
#: not served yet (status ``build only``; none since NemotronH_Omni_Reasoning_V3 was served).
ARCHS = SERVED_ARCHS + ()
#: ``config.json`` key naming the project's tiny checkpoint of a family (value: the arch).
MARKER_KEY = "sglang_mamba_ext_tiny"
#: Target standard deviation of the logits on a fixed prompt (peaked: top-2 gaps well above
#: float16 noise for most positions).
LOGIT_STD = 4.0

# The family table (hidden 64, 4 layers): hf_tiny_families.py
from sglang_mamba_ext.models.hf_tiny_families import _FAMILIES, _HIDDEN, _LAYERS  # noqa: E402,F401


#: A fixed prompt (token ids) for sizing the LM head.
_PROBE_IDS = list(range(5, 133))


def family_config(arch: str) -> Dict:
    """The ``config.json`` fields of ``arch`` before tokenizer ids, dtype and marker are added.

    Raises:
        ValueError: ``arch`` not in :data:`ARCHS`."""
    if arch not in _FAMILIES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    return copy.deepcopy(_FAMILIES[arch]["config"])


def arch_module(arch: str) -> str:
    """SGLang's module (``srt/models/<module>.py``) of ``arch``'s class: the arch name itself,
    except where one module holds two served classes (``qwen3_5_moe_text`` -> ``qwen3_5_text``).

    Raises:
        ValueError: ``arch`` not in :data:`ARCHS`."""
    family_config(arch)
    return _FAMILIES[arch].get("module", arch)


def arch_class(arch: str) -> str:
    """SGLang's (and transformers') class name of ``arch`` (the ``architectures`` entry)."""
    family_config(arch)
    return _FAMILIES[arch]["cls"]


# --- Survey of SGLang 0.5.23's hybrid classes (issue 40, item 1) -------------------------------


def _block_kernel_packages() -> None:
    """Make transformers take its plain-torch recurrences: fla / mamba_ssm / causal_conv1d
    are hidden from imports in this process (their Triton / CUDA kernels do not run on CPU).
    Must run before the family's transformers module is imported."""
    for name in ("fla", "mamba_ssm", "causal_conv1d"):
        sys.modules.setdefault(name, None)  # import then raises ImportError


def _transformers_model(arch: str, config_json: Dict, seed: int):
    import transformers

    fam = _FAMILIES[arch]
    cfg_cls = transformers.AutoConfig.for_model(fam.get("hf_model_type", arch)).__class__
    config = cfg_cls(**{k: v for k, v in config_json.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = getattr(transformers, fam.get("hf_cls", fam["cls"]))(config).float().eval()
    return model


@torch.no_grad()
def _spread_weights(model, seed: int, experts: bool = False) -> None:
    """Re-draw the projection weights as ``N(0, 1/fan_in)`` and the embeddings as ``N(0, 1)``
    (as ``tiny_builder`` does): with transformers' 0.02 init every block barely moves the
    residual stream, so a 4-layer model's greedy output hardly depends on anything but the last
    token, and a wrong cached state would go unnoticed. The SSM / conv parameters (``A_log``,
    ``D``, ``dt_bias``, conv kernels), norms and biases keep the family's own init."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight") or name.endswith("embeddings.weight"):
            p.copy_(torch.randn(p.shape, generator=gen))
        elif name.endswith("weight") and p.dim() in (2, 3) and "conv" not in name and "lm_head" not in name:
            p.copy_(torch.randn(p.shape, generator=gen) / (p.shape[-1] ** 0.5))
        elif experts and p.dim() == 3 and ".experts." in name + ".":
            # transformers' fused expert tensors ([E, out, in], no ".weight" suffix); only for
            # families that ask (spread_experts), so the others' checkpoints stay as they were
            p.copy_(torch.randn(p.shape, generator=gen) / (p.shape[-1] ** 0.5))


@torch.no_grad()
def _mamba1_long_memory(model) -> None:
    """Mamba1's tiny checkpoints (``tune`` of ``falcon_mamba`` / ``mamba``): ``A = -exp(A_log)``
    divided by 16 (transformers' init gives ``-1 .. -16`` per state channel, and at the tiny sizes
    the state then forgets a token within a few dozen steps) and ``x_proj`` scaled by 4 (plain
    Mamba's ``B`` / ``C`` / ``dt`` are not normalized: after the ``N(0, 1/fan_in)`` redraw the state
    barely reaches the output; Falcon-Mamba's norm cancels the scale). One token changed 20
    positions back then moves the next token's log-probability by 0.1-0.3 (``test_make_tiny_arch``),
    so a wrong cached state shows."""
    for layer in model.backbone.layers:
        layer.mixer.A_log.sub_(torch.log(torch.tensor(16.0)))
        layer.mixer.x_proj.weight.mul_(4.0)


@torch.no_grad()
def _scale_lm_head(model) -> None:
    """Scale ``lm_head`` (untied) so that the logits' std on :data:`_PROBE_IDS` is LOGIT_STD."""
    ids = torch.tensor([_PROBE_IDS])
    std = model(input_ids=ids).logits.float().std().item()
    model.lm_head.weight.mul_(LOGIT_STD / max(std, 1e-8))


def build_hf_tiny_model(arch: str, out_dir: str, seed: int = 0, timeout: float = 600.0) -> str:
    """Write the tiny checkpoint of ``arch`` to ``out_dir`` (created); returns ``out_dir``.

    Files: ``config.json`` (the family's ``model_type`` and ``architectures``, ``torch_dtype``
    float16, :data:`MARKER_KEY`), ``model.safetensors`` (float16, a few hundred KB), and the
    tokenizer files of ``tiny_builder`` (vocabulary 768). Deterministic for a seed. Runs
    transformers' own class on CPU in a subprocess (about 7 s), so that this process's kernel
    packages (fla, mamba_ssm) are neither used nor hidden.

    Raises:
        ValueError: ``arch`` not in :data:`ARCHS`.
        RuntimeError: the build subprocess failed (its stderr tail in the message).
    """
    return build_hf_tiny_models({arch: out_dir}, seed=seed, timeout=timeout)[arch]


def build_hf_tiny_models(out_dirs: Dict[str, str], seed: int = 0, timeout: float = 900.0) -> Dict[str, str]:
    """:func:`build_hf_tiny_model` for several families in one subprocess (one transformers
    import); ``out_dirs`` maps arch to output directory. Returns ``out_dirs``.

    Raises:
        ValueError: an arch not in :data:`ARCHS`.
        RuntimeError: the build subprocess failed (its stderr tail in the message).
    """
    for arch in out_dirs:
        family_config(arch)  # ValueError early
    job = json.dumps({"dirs": {a: os.path.abspath(d) for a, d in out_dirs.items()}, "seed": int(seed)})
    proc = subprocess.run([sys.executable, "-m", __name__, "--build"], input=job, text=True,
                          capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"building tiny checkpoints {sorted(out_dirs)} failed ({proc.returncode}): "
                           f"{proc.stderr[-2000:]}")
    return dict(out_dirs)


def _build_main(arch: str, out_dir: str, seed: int) -> None:
    _block_kernel_packages()
    from sglang_mamba_ext.models.tiny_builder import (BOS, EOS, PAD, SPECIAL_TOKENS, TOKENIZER_VOCAB_SIZE,
                                                      build_tokenizer, write_tokenizer_files)

    config_json = family_config(arch)
    os.makedirs(out_dir, exist_ok=True)
    extra_tokens = _FAMILIES[arch].get("special_tokens", {})
    tok = build_tokenizer(TOKENIZER_VOCAB_SIZE - len(extra_tokens))
    if extra_tokens:  # the family's processor tokens at the vocabulary's end (hf_tiny_minicpmv)
        tok.add_special_tokens(list(extra_tokens.values()))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    common = dict(vocab_size=tok.get_vocab_size(), bos_token_id=ids[BOS], eos_token_id=ids[EOS],
                  pad_token_id=ids[PAD], max_position_embeddings=4096, tie_word_embeddings=False,
                  initializer_range=0.02)
    config_json.update(common)
    for key in _FAMILIES[arch].get("top_level_drop", ()):  # kept in the sub-config only
        config_json.pop(key, None)
    sub = _FAMILIES[arch].get("sub")
    if sub:  # a VLM: its text model reads these from its own sub-config
        config_json[sub].update(common)
    if _FAMILIES[arch].get("writer"):
        _build_written(arch, out_dir, config_json, seed)
        write_tokenizer_files(out_dir, tok, max_len=config_json["max_position_embeddings"])
        if _FAMILIES[arch].get("tokenizer_extras"):  # unk_token named (hf_tiny_nano_nemotron_vl)
            from sglang_mamba_ext.models.hf_tiny_nano_nemotron_vl import write_tokenizer_extras

            write_tokenizer_extras(out_dir, extra_tokens)
        if sub and not _FAMILIES[arch].get("no_processor"):  # Inkling: multimodal off, no processor
            _write_processor_configs(arch, out_dir)
        return
    model = _transformers_model(arch, config_json, seed)
    _spread_weights(model, seed, experts=_FAMILIES[arch].get("spread_experts", False))
    if _FAMILIES[arch].get("tune"):  # a family's own adjustment of the drawn weights (a name here, or the function)
        tune = _FAMILIES[arch]["tune"]
        (tune if callable(tune) else globals()[tune])(model)
    if _FAMILIES[arch].get("banks"):
        _tie_routed_experts_to_banks(model, _FAMILIES[arch]["banks"])
    _scale_lm_head(model)
    dtype = _FAMILIES[arch].get("dtype", "float16")  # bfloat16 where SGLang's class needs it (hf_tiny_qwen4_exp)
    model.to(getattr(torch, dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    if _FAMILIES[arch].get("banks"):
        model.save_pretrained(os.path.join(out_dir, REFERENCE_SUBDIR), safe_serialization=True)
        _write_banked_checkpoint(os.path.join(out_dir, "model.safetensors"), _FAMILIES[arch]["banks"])
    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        saved = json.load(f)
    # The released format first (what SGLang's config classes read), then transformers' own
    # derived keys where they do not clash.
    merged = {k: v for k, v in saved.items()
              if k not in _FAMILIES[arch].get("drop", ()) + _FAMILIES[arch].get("top_level_drop", ())}
    for k, v in config_json.items():  # sub-configs (a VLM's text / vision) merged key by key
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = {**merged[k], **v}
        else:
            merged[k] = v
    merged.update(architectures=[_FAMILIES[arch]["cls"]], torch_dtype=dtype, dtype=dtype)
    merged[MARKER_KEY] = arch
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(merged, f, indent=2, sort_keys=True)
        f.write("\n")
    if _FAMILIES[arch].get("rewrite"):  # transformers' files kept in REFERENCE_SUBDIR, the served ones rewritten
        _FAMILIES[arch]["rewrite"](out_dir, REFERENCE_SUBDIR)
    write_tokenizer_files(out_dir, tok, max_len=config_json["max_position_embeddings"])
    if extra_tokens:
        hf_tiny_minicpmv.add_special_tokens_config(out_dir, extra_tokens)
    if _FAMILIES[arch].get("sub"):
        _write_processor_configs(arch, out_dir)


#: Where a family without its own transformers class keeps the float32 reference's checkpoint
#: (transformers' class of the same layers), inside the tiny checkpoint's directory.
REFERENCE_SUBDIR = "hf_reference"


@torch.no_grad()
def _tie_routed_experts_to_banks(model, banks: int) -> None:
    """Set every layer's routed experts and router to those of layer ``i % banks`` (its bank):
    transformers' per-layer MoE then computes what Intern-S2-Mobius's shared banks do."""
    layers = model.model.language_model.layers
    for i, layer in enumerate(layers):
        src = layers[i % banks].mlp
        for name, p in layer.mlp.named_parameters():
            if name.startswith(("experts.", "gate.")):
                p.copy_(src.get_parameter(name))


def _write_banked_checkpoint(path: str, banks: int) -> None:
    """Rewrite transformers' Qwen3.5 MoE checkpoint at ``path`` in Intern-S2-Mobius's names: each
    bank's routed experts and router once, from layer ``b``, the experts fused as the released
    checkpoints hold them (``model.language_model.meta_mlp.<b>.experts.gate_up_proj``
    ``[experts, 2 * inter, hidden]``, gate rows first, and ``.experts.down_proj``
    ``[experts, hidden, inter]``; SGLang's loader reads only these), ``.gate.weight``; no
    per-layer routed experts. transformers saves the experts per expert
    (``experts.<e>.gate_proj`` ...) or fused; both are read."""
    from safetensors.torch import load_file, save_file

    state = load_file(path)
    out, per_expert = {}, {}
    for name, t in state.items():
        parts = name.split(".")
        if name.startswith("model.language_model.layers.") and parts[4:5] == ["mlp"] and parts[5] in ("experts", "gate"):
            layer = int(parts[3])
            if layer >= banks:
                continue
            bank = f"model.language_model.meta_mlp.{layer}."
            if parts[5] == "experts" and parts[6].isdigit():  # experts.<e>.<proj>.weight
                per_expert.setdefault(layer, {})[(int(parts[6]), parts[7])] = t
            else:
                out[bank + ".".join(parts[5:])] = t
            continue
        out[name] = t
    for layer, tensors in per_expert.items():
        n = 1 + max(e for e, _ in tensors)
        bank = f"model.language_model.meta_mlp.{layer}.experts."
        out[bank + "gate_up_proj"] = torch.stack(
            [torch.cat([tensors[(e, "gate_proj")], tensors[(e, "up_proj")]], 0) for e in range(n)])
        out[bank + "down_proj"] = torch.stack([tensors[(e, "down_proj")] for e in range(n)])
    save_file({k: v.contiguous() for k, v in out.items()}, path, metadata={"format": "pt"})


def _build_written(arch: str, out_dir: str, config_json: Dict, seed: int) -> None:
    """A family transformers has no class for: the weights of :mod:`.hf_tiny_written`, float16,
    the LM head scaled by :data:`LOGIT_STD` (logits of std about 1 per unit scale: the final norm
    leaves about unit RMS and the head is N(0, 1/hidden)), and the config as written."""
    from safetensors.torch import save_file

    from sglang_mamba_ext.models import hf_tiny_written

    writer = _FAMILIES[arch]["writer"]  # a function of hf_tiny_written by name, or the function
    # a writer that also saves the float32 reference's checkpoint (writes_reference) is given the directory
    extra = {"out_dir": out_dir} if _FAMILIES[arch].get("writes_reference") else {}
    weights = (writer if callable(writer) else getattr(hf_tiny_written, writer))(config_json, seed, LOGIT_STD, **extra)
    save_file({k: v.to(torch.float16).contiguous() for k, v in weights.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(config_json, architectures=[_FAMILIES[arch]["cls"]], torch_dtype="float16", dtype="float16")
    cfg[MARKER_KEY] = arch
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def _write_processor_configs(arch: str, out_dir: str) -> None:
    """A VLM's image (and video) processor configs, which SGLang's tokenizer manager loads at
    start-up for a multimodal class (``AutoProcessor``) even when only text is sent: the family's
    transformers processors at the tiny vision tower's patch and merge sizes."""
    if callable(_FAMILIES[arch].get("processor")):  # the family's own writer (hf_tiny_kimi_k3_vl)
        _FAMILIES[arch]["processor"](out_dir)
        return
    if _FAMILIES[arch].get("processor") == "minicpmv":
        hf_tiny_minicpmv.write_processor_configs(out_dir)
        return
    if arch == "lfm2_vl":
        from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor

        Lfm2VlImageProcessor(downsample_factor=2, encoder_patch_size=16, tile_size=64, min_image_tokens=4,
                             max_image_tokens=16, max_num_patches=64, do_image_splitting=False,
                             use_thumbnail=False).save_pretrained(out_dir)
        return
    from transformers import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    pixels = dict(size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128})
    Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, **pixels).save_pretrained(out_dir)
    Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, **pixels).save_pretrained(out_dir)
    if _FAMILIES[arch].get("processor_class"):
        # a model_type transformers' AutoProcessor does not know (e.g. intern_s2_preview): name
        # the processor class, as the released checkpoints' processor_config.json does
        with open(os.path.join(out_dir, "processor_config.json"), "w", encoding="utf-8") as f:
            json.dump({"processor_class": _FAMILIES[arch]["processor_class"]}, f, indent=2)
            f.write("\n")


def reference_greedy(model_dir: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     timeout: float = 600.0) -> List[Dict[str, list]]:
    """Greedy continuations of ``prompts`` (token ids) by transformers' own class in float32,
    on its plain-torch path, in a subprocess (so fla / mamba_ssm imported elsewhere in this
    process do not pick the kernels).

    Returns, per prompt, ``{"tokens": [int] * max_new_tokens, "logprobs": [float], "gaps":
    [float]}``: the greedy tokens, their log-probabilities and the top-1 minus top-2 logit
    gap at each step (a step with a gap under ~1e-2 may flip in float16).

    Raises:
        RuntimeError: the subprocess failed (its stderr tail in the message).
    """
    payload = json.dumps({"model_dir": model_dir, "prompts": [list(map(int, p)) for p in prompts],
                          "max_new_tokens": int(max_new_tokens)})
    proc = subprocess.run([sys.executable, "-m", __name__, "--reference"], input=payload, text=True,
                          capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"reference run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@torch.no_grad()
def _reference_main() -> None:
    _block_kernel_packages()
    import transformers

    job = json.loads(sys.stdin.read())
    with open(os.path.join(job["model_dir"], "config.json"), encoding="utf-8") as f:
        saved = json.load(f)
    # the checkpoint's own class (a VLM's ForConditionalGeneration runs text-only input ids);
    # for a class transformers lacks, the one that built the weights (hf_cls)
    fam = _FAMILIES.get(saved.get(MARKER_KEY), {})
    cls = getattr(transformers, fam.get("hf_cls", saved["architectures"][0]))
    kw = {}
    if "hf_model_type" in fam:
        kw["config"] = cls.config_class.from_pretrained(job["model_dir"])
        # transformers picks its checkpoint conversions (per-expert to fused weights) by model_type
        kw["config"].model_type = fam["hf_model_type"]
    model_dir = job["model_dir"]
    if fam.get("banks") or fam.get("writes_reference"):  # its reference checkpoint in transformers' layout, beside it
        model_dir = os.path.join(model_dir, REFERENCE_SUBDIR)
        kw.pop("config", None)
    model = cls.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()
    out = []
    for prompt in job["prompts"]:
        ids = list(prompt)
        toks, lps, gaps = [], [], []
        for _ in range(job["max_new_tokens"]):
            # Full recompute each step (no cache): the simplest exact reference.
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            top2 = torch.topk(logits, 2)
            nxt = int(top2.indices[0])
            toks.append(nxt)
            lps.append(float(torch.log_softmax(logits, -1)[nxt]))
            gaps.append(float(top2.values[0] - top2.values[1]))
            ids.append(nxt)
        out.append({"tokens": toks, "logprobs": lps, "gaps": gaps})
    print(json.dumps(out))


# the survey (hf_survey.py), re-exported: its names were this module's
from sglang_mamba_ext.models.hf_survey import (  # noqa: E402
    SCAN_EXCLUDED_CLASSES, SCAN_EXCLUDED_MODULES, SGLANG_HYBRID_CLASSES, SGLangHybridClass, _sglang_models_dir,
    arch_status, list_archs, scan_sglang_hybrid_modules,
)


if __name__ == "__main__":
    if sys.argv[1:] == ["--reference"]:
        _reference_main()
    elif sys.argv[1:] == ["--build"]:
        _job = json.loads(sys.stdin.read())
        for _arch, _out in _job["dirs"].items():
            _build_main(_arch, _out, _job["seed"])
    else:
        raise SystemExit("usage: python -m sglang_mamba_ext.models.hf_tiny --reference|--build < job.json")
