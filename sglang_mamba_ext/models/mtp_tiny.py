"""Tiny MTP draft heads in the checkpoint format of SGLang's own MTP classes (issue 41, item 1).

``build_mtp_draft(arch, target_dir, out_dir)`` writes, next to a tiny target built by
:func:`sglang_mamba_ext.models.hf_tiny.build_hf_tiny_model`, the draft directory that SGLang
0.5.23 loads for ``--speculative-algorithm NEXTN --speculative-draft-model-path DIR``:

- ``config.json``: the target's config (SGLang's ``ModelConfig`` turns the architecture into the
  MTP class for a draft worker: ``Qwen3NextForCausalLM`` -> ``Qwen3NextForCausalLMMTP``,
  ``Qwen3_5ForCausalLM`` -> ``Qwen3_5ForCausalLMMTP``, ``NemotronHForCausalLM`` ->
  ``NemotronHForCausalLMMTP``) with ``num_nextn_predict_layers`` 1 and, for Nemotron-H, the MTP
  block pattern ``mtp_hybrid_override_pattern`` (:data:`NEMOTRON_MTP_PATTERN`: one attention
  block; SGLang's Nemotron-H MTP builds ``*`` and ``E`` blocks only);
- ``model.safetensors``: only ``mtp.*`` tensors, float16, named as the released checkpoints name
  them (what each class's ``load_weights`` maps): Qwen3-Next / Qwen3.5 ``mtp.fc``,
  ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.0.*`` (one decoder layer
  with full attention), ``mtp.norm``; Nemotron-H ``mtp.layers.0.{enorm,hnorm,eh_proj,norm,mixer.*,
  final_layernorm}``. No embedding or LM head: SGLang shares the target's with the draft
  (``set_embed_and_head``);
- the target's tokenizer files.

How it is initialised so that it often agrees with the target: the MTP decoder layer is a copy of
the target's first full-attention layer with its output projections zeroed (attention ``o_proj``
and the MLP / experts' ``down_proj``), so SGLang runs that layer's attention (with the draft's own
KV) and MLP kernels but the layer adds nothing to the residual; the head is then
``lm_head(norm(fc([norm(embed(x_{t+1})), norm(h_t)])))`` with the target's own embedding and LM
head. ``fc`` and the three norms are fitted (Adam, a few hundred full-batch steps, seconds on CPU)
so that it predicts the target's greedy token after ``x_{t+1}`` from the target's last hidden
state ``h_t`` (after its final norm, what SGLang hands the draft), on the target's own greedy
continuations of seeded random prompts. Its agreement on held-out continuations is returned
and written to ``mtp_tiny.json`` in the draft directory. Deterministic for a seed.

This module imports torch (and transformers in the build subprocess), not ``sglang``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Dict, List

import torch

__all__ = ["MTP_ARCHS", "MTP_CLASSES", "NEMOTRON_MTP_PATTERN", "build_mtp_draft", "mtp_weight_names"]

#: ``--arch`` names with an MTP draft builder, and SGLang's MTP class each one loads as.
MTP_CLASSES: Dict[str, str] = {
    "qwen3_next": "Qwen3NextForCausalLMMTP",
    "qwen3_5_text": "Qwen3_5ForCausalLMMTP",
    "nemotron_h": "NemotronHForCausalLMMTP",
}
MTP_ARCHS = tuple(MTP_CLASSES)
#: Nemotron-H MTP block pattern written to the draft's config (one attention block).
NEMOTRON_MTP_PATTERN = "*"
#: File with the build's numbers (agreement before / after fitting, steps, seed).
STATS_FILE = "mtp_tiny.json"

_PROMPTS, _PROMPT_LEN, _NEW_TOKENS = 40, 12, 36
_HELD_OUT = 8  # prompts kept out of fitting, for the agreement figure


def _first_attention_layer(arch: str, cfg: Dict) -> int:
    if arch == "nemotron_h":
        return cfg["hybrid_override_pattern"].index("*")
    return list(cfg["layer_types"]).index("full_attention")


def _target_prefix(arch: str) -> str:
    return "backbone.layers." if arch == "nemotron_h" else "model.layers."


def _zeroed(arch: str, suffix: str) -> bool:
    """Whether a copied layer tensor (name after the layer index) is an output projection."""
    if arch == "nemotron_h":
        return suffix == "mixer.o_proj.weight"
    return suffix == "self_attn.o_proj.weight" or suffix.endswith("down_proj.weight")


def mtp_weight_names(arch: str, target_names: List[str], cfg: Dict) -> List[str]:
    """The ``mtp.*`` tensor names the draft of ``arch`` holds, from the target's tensor names
    (``target_names``) and its config: the head's own tensors, then the copied layer's."""
    layer = _first_attention_layer(arch, cfg)
    prefix = f"{_target_prefix(arch)}{layer}."
    copied = sorted(n[len(prefix):] for n in target_names if n.startswith(prefix))
    if arch == "nemotron_h":
        head = ["mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
                "mtp.layers.0.final_layernorm.weight"]
    else:
        head = ["mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                "mtp.norm.weight"]
    return head + [f"mtp.layers.0.{s}" for s in copied]


def build_mtp_draft(arch: str, target_dir: str, out_dir: str, seed: int = 0, steps: int = 400,
                    timeout: float = 900.0) -> Dict:
    """Write the MTP draft of the tiny ``arch`` target in ``target_dir`` to ``out_dir``
    (created); returns the build's numbers (also in ``out_dir/mtp_tiny.json``): ``agreement``
    (held-out share of positions where the draft's first token equals the target's greedy
    token), ``agreement_init`` (the same before fitting), ``steps``, ``seed``, ``mtp_class``.

    Runs in a subprocess (transformers' own target class on its plain-torch path, as
    :mod:`.hf_tiny` builds the target).

    Raises:
        ValueError: ``arch`` has no MTP builder (:data:`MTP_ARCHS`) or ``target_dir`` is not a
            tiny checkpoint of ``arch``.
        RuntimeError: the build subprocess failed (its stderr tail in the message).
    """
    from sglang_mamba_ext.models.hf_tiny import MARKER_KEY

    if arch not in MTP_CLASSES:
        raise ValueError(f"no MTP draft builder for --arch {arch!r}; choose from {', '.join(MTP_ARCHS)}")
    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        got = json.load(f).get(MARKER_KEY)
    if got != arch:
        raise ValueError(f"{target_dir} is not a tiny {arch} checkpoint (config {MARKER_KEY}={got!r})")
    job = json.dumps({"arch": arch, "target": os.path.abspath(target_dir), "out": os.path.abspath(out_dir),
                      "seed": int(seed), "steps": int(steps)})
    proc = subprocess.run([sys.executable, "-m", __name__, "--build"], input=job, text=True,
                          capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"building the {arch} MTP draft failed ({proc.returncode}): {proc.stderr[-2000:]}")
    with open(os.path.join(out_dir, STATS_FILE), encoding="utf-8") as f:
        return json.load(f)


# -- build subprocess -----------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm; ``offset``: the weight is stored as ``w`` with scale ``1 + w`` (Qwen3-Next /
    Qwen3.5, SGLang's GemmaRMSNorm), else scale ``w`` (Nemotron-H)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * ((1.0 + w) if offset else w)


@torch.no_grad()
def _greedy_data(model, vocab: int, seed: int):
    """Target's greedy continuations of seeded random prompts, with its last hidden states and
    its greedy prediction at every position (full recompute per step, as hf_tiny's reference)."""
    gen = torch.Generator().manual_seed(seed + 7)
    ids = torch.randint(5, vocab, (_PROMPTS, _PROMPT_LEN), generator=gen)
    for _ in range(_NEW_TOKENS):
        nxt = model(input_ids=ids).logits[:, -1].argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    out = model(input_ids=ids, output_hidden_states=True)
    return ids, out.hidden_states[-1].float(), out.logits.argmax(-1)


def _build_main(job: Dict) -> None:
    from sglang_mamba_ext.models.hf_tiny import _block_kernel_packages

    _block_kernel_packages()
    import transformers
    from safetensors import safe_open
    from safetensors.torch import save_file

    arch, target, out = job["arch"], job["target"], job["out"]
    seed, steps = job["seed"], job["steps"]
    with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    embed = model.get_input_embeddings().weight.detach().float()
    head = model.get_output_embeddings().weight.detach().float()
    ids, hid, pred = _greedy_data(model, cfg["vocab_size"], seed)

    H = cfg["hidden_size"]
    nemotron = arch == "nemotron_h"
    eps = cfg.get("layer_norm_epsilon", 1e-5) if nemotron else cfg.get("rms_norm_eps", 1e-6)
    offset = not nemotron
    # pairs: draft input (x_{i+1}, h_i) -> target's greedy token after x_{i+1} (pred[i+1])
    x_next, h_prev, label = ids[:, 1:], hid[:, :-1], pred[:, 1:]
    n_fit = _PROMPTS - _HELD_OUT
    gen = torch.Generator().manual_seed(seed + 11)
    norm_init = torch.zeros(H) if offset else torch.ones(H)
    params = {
        "fc": torch.randn(H, 2 * H, generator=gen) / (2 * H) ** 0.5,
        "norm_e": norm_init.clone(), "norm_h": norm_init.clone(), "norm_out": norm_init.clone(),
    }
    for p in params.values():
        p.requires_grad_(True)

    def logits(rows):
        e = _rms(embed[x_next[rows]], params["norm_e"], eps, offset)
        h = _rms(h_prev[rows], params["norm_h"], eps, offset)
        z = torch.cat([e, h], dim=-1) @ params["fc"].T
        return _rms(z, params["norm_out"], eps, offset) @ head.T

    fit, held = slice(0, n_fit), slice(n_fit, _PROMPTS)
    cont = slice(_PROMPT_LEN - 1, None)  # positions whose input token is a generated one

    def agreement() -> float:
        with torch.no_grad():
            return float((logits(held).argmax(-1)[:, cont] == label[held][:, cont]).float().mean())

    before = agreement()
    opt = torch.optim.Adam(params.values(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(logits(fit).reshape(-1, head.shape[0]), label[fit].reshape(-1))
        loss.backward()
        opt.step()
    after = agreement()

    layer = _first_attention_layer(arch, cfg)
    prefix = f"{_target_prefix(arch)}{layer}."
    tensors: Dict[str, torch.Tensor] = {}
    with safe_open(os.path.join(target, "model.safetensors"), "pt") as f:
        names = list(f.keys())
        for n in names:
            if n.startswith(prefix):
                s = n[len(prefix):]
                t = f.get_tensor(n)
                tensors[f"mtp.layers.0.{s}"] = torch.zeros_like(t) if _zeroed(arch, s) else t
    fc = params["fc"].detach()
    if nemotron:
        tensors.update({"mtp.layers.0.enorm.weight": params["norm_e"], "mtp.layers.0.hnorm.weight": params["norm_h"],
                        "mtp.layers.0.eh_proj.weight": fc, "mtp.layers.0.final_layernorm.weight": params["norm_out"]})
    else:
        tensors.update({"mtp.fc.weight": fc, "mtp.pre_fc_norm_embedding.weight": params["norm_e"],
                        "mtp.pre_fc_norm_hidden.weight": params["norm_h"], "mtp.norm.weight": params["norm_out"]})
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in tensors.items()}
    assert sorted(tensors) == sorted(mtp_weight_names(arch, names, cfg))

    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(target):  # tokenizer and generation files
        if name not in ("config.json", "model.safetensors") and os.path.isfile(os.path.join(target, name)):
            shutil.copy2(os.path.join(target, name), os.path.join(out, name))
    dcfg = dict(cfg, num_nextn_predict_layers=1)
    if nemotron:
        dcfg["mtp_hybrid_override_pattern"] = NEMOTRON_MTP_PATTERN
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(dcfg, f, indent=2, sort_keys=True)
        f.write("\n")
    stats = {"arch": arch, "mtp_class": MTP_CLASSES[arch], "agreement_init": round(before, 4),
             "agreement": round(after, 4), "steps": steps, "seed": seed, "loss": round(float(loss), 4)}
    with open(os.path.join(out, STATS_FILE), "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=2, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--build"]:
        _build_main(json.loads(sys.stdin.read()))
    else:
        raise SystemExit("usage: python -m sglang_mamba_ext.models.mtp_tiny --build < job.json")
