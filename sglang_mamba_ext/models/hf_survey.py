"""The survey of SGLang 0.5.23's hybrid causal-LM classes (issue 40, item 1; ``docs/families.md``):
:data:`SGLANG_HYBRID_CLASSES` (one row per class, verified by reading each module: architecture,
config class, linear-layer kind), :func:`list_archs` (what ``make_tiny_model.py --list-archs``
prints, with each class's status from :mod:`.hf_tiny`'s builders) and
:func:`scan_sglang_hybrid_modules` (the rule the table was found by, re-run by the tests against
the installed SGLang: its model files are parsed, not imported). No torch, no SGLang import.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from typing import Dict, List, NamedTuple, Optional, Tuple

__all__ = ["SGLANG_HYBRID_CLASSES", "SGLangHybridClass", "SCAN_EXCLUDED_CLASSES", "SCAN_EXCLUDED_MODULES",
           "arch_status", "list_archs", "scan_sglang_hybrid_modules"]


class SGLangHybridClass(NamedTuple):
    """One hybrid causal-LM class of SGLang: ``module`` in ``sglang/srt/models/`` (the ``--arch``
    name), ``arch`` (an ``EntryClass`` entry, the ``architectures`` value), ``config`` (the config
    class SGLang loads it with), ``kind`` (its linear layers), ``note``."""

    module: str
    arch: str
    config: str
    kind: str
    note: str = ""


_C = SGLangHybridClass
#: Every hybrid causal-LM class of SGLang 0.5.23 (VLMs count through their text model), found by
#: :func:`scan_sglang_hybrid_modules` and classified by reading each module: which layer class
#: holds the linear state and which SGLang backend runs it (``configs/hybrid_arch.py``,
#: ``configs/linear_attn_model_registry.py``). Config classes are SGLang's (``srt/configs``);
#: Lfm2*, Mamba*, FalconMamba* subclass transformers' own. Kinds: ``GDN`` (Gated DeltaNet, SGLang's
#: GDN backend), ``KDA`` (Kimi Delta Attention, SGLang's KDA backend), ``Mamba2``, ``Mamba1``
#: (conv + selective scan), ``short conv`` (LFM2's gated causal conv), ``lightning`` (linear
#: attention with a fixed per-head decay, SGLang's lightning backend), and per-family extras.
SGLANG_HYBRID_CLASSES: Tuple[SGLangHybridClass, ...] = (
    _C("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig", "GDN", "MoE"),
    _C("qwen3_5_text", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", "GDN", "Qwen3.5 text only"),
    _C("qwen3_5_text", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", "GDN", "Qwen3.5 text only, MoE"),
    _C("qwen3_5", "Qwen3_5ForConditionalGeneration", "Qwen3_5Config", "GDN", "VLM"),
    _C("qwen3_5", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig", "GDN", "VLM, MoE"),
    _C("qwen4_exp", "Qwen4ExpForConditionalGeneration", "Qwen4ExpConfig", "GDN + PLE short conv",
       "VLM; Qwen3.5 GDN layers plus a dilated short conv state per PLE layer"),
    _C("gigachat35", "GigaChat35ForCausalLM", "GigaChat35Config", "GDN",
       "MLA attention; in SGLang's linear-attention registry"),
    _C("interns2_mobius", "InternS2MobiusForConditionalGeneration", "InternS2MobiusConfig", "GDN",
       "VLM on Qwen3.5 MoE layers"),
    _C("interns2preview", "InternS2PreviewForConditionalGeneration", "InternS2PreviewConfig", "GDN",
       "VLM, a Qwen3.5 MoE subclass"),
    _C("minicpmv", "MiniCPMV4_6ForConditionalGeneration", "MiniCPMV4_6Config", "GDN", "VLM on Qwen3.5"),
    _C("minicpmv", "MiniCPMV4_7ForConditionalGeneration", "MiniCPMV4_7Config", "GDN", "VLM on Qwen3.5"),
    _C("jet_nemotron", "JetNemotronForCausalLM", "JetNemotronConfig", "GDN + dynamic conv",
       "JetBlock: gated delta rule after an input-generated conv kernel"),
    _C("jet_vlm", "JetVLMForConditionalGeneration", "JetVLMConfig", "GDN + dynamic conv", "VLM on JetNemotron"),
    _C("kimi_linear", "KimiLinearForCausalLM", "KimiLinearConfig", "KDA", "MLA attention, MoE"),
    _C("kimi_k3", "KimiK3LinearForCausalLM", "KimiLinearConfig", "KDA", "K3's KDA (optional full-rank gate)"),
    _C("kimi_k3", "KimiK3ForConditionalGeneration", "KimiK3Config", "KDA", "VLM"),
    _C("bailing_moe_v3", "BailingMoeV3ForCausalLM", "BailingHybridConfig", "KDA", "use_kda; MoE"),
    _C("bailing_mm_v3", "BailingMoeV3VLForConditionalGeneration", "BailingMoeV3VLConfig", "KDA",
       "VLM on BailingMoeV3"),
    _C("glm5_next", "Glm5NextForConditionalGeneration", "Glm5NextConfig", "KDA",
       "GLM's linear layers (low-rank f/g gates) on SGLang's KDA backend; VLM"),
    _C("bailing_moe_linear", "BailingMoeV2_5ForCausalLM", "BailingHybridConfig", "lightning",
       "Ling 2.5 linear attention (use_kda false)"),
    _C("minicpm", "MiniCPMSALAForCausalLM", "MiniCPMHybridConfig", "lightning", "layers by mixer_types"),
    _C("minicpm", "MiniCPMForCausalLM", "MiniCPMHybridConfig", "lightning", "alias of MiniCPMSALAForCausalLM"),
    _C("nemotron_h", "NemotronHForCausalLM", "NemotronHConfig", "Mamba2"),
    _C("nemotron_h", "NemotronHPuzzleForCausalLM", "NemotronHPuzzleConfig", "Mamba2", "per-block configs"),
    _C("nano_nemotron_vl", "NemotronH_Nano_VL_V2", "NemotronH_Nano_VL_V2_Config", "Mamba2", "VLM on NemotronH"),
    _C("nano_nemotron_vl", "NemotronH_Nano_Omni_Reasoning_V3", "NemotronH_Nano_Omni_Reasoning_V3_Config",
       "Mamba2", "omni model on NemotronH"),
    _C("nano_nemotron_vl", "NemotronH_Omni_Reasoning_V3", "NemotronH_Omni_Reasoning_V3_Config", "Mamba2",
       "omni model on NemotronH"),
    _C("falcon_h1", "FalconH1ForCausalLM", "FalconH1Config", "Mamba2", "Mamba2 beside attention in each layer"),
    _C("granitemoehybrid", "GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", "Mamba2", "MoE"),
    _C("mamba2", "Mamba2ForCausalLM", "Mamba2Config", "Mamba2", "no attention"),
    _C("falcon_mamba", "FalconMambaForCausalLM", "FalconMambaConfig", "Mamba1", "no attention"),
    _C("mamba", "MambaForCausalLM", "MambaConfig", "Mamba1", "no attention; a FalconMamba subclass"),
    _C("lfm2", "Lfm2ForCausalLM", "Lfm2Config", "short conv"),
    _C("lfm2_moe", "Lfm2MoeForCausalLM", "Lfm2MoeConfig", "short conv", "MoE"),
    _C("lfm2_vl", "Lfm2VlForConditionalGeneration", "Lfm2VlConfig", "short conv", "VLM on Lfm2"),
    _C("inkling", "InklingForConditionalGeneration", "InklingMMConfig", "short conv",
       "sconv on keys, values, attention and MLP outputs when use_sconv (six conv streams per layer on "
       "its own InklingShortConvAttnBackend; every layer full or sliding-window attention with a "
       "relative-position bias); VLM + audio"),
    _C("zaya", "ZayaForCausalLM", "ZayaConfig", "CCA conv",
       "compressed convolutional attention: a conv state (last two q||k inputs, previous hidden state) "
       "beside the KV cache of the attention layers; MoE"),
)
del _C

#: ``EntryClass`` entries of the scanned modules that are not hybrid causal LMs, with why.
SCAN_EXCLUDED_CLASSES: Dict[str, str] = {
    "Lfm2BidirectionalModel": "bidirectional LFM2 encoder for embeddings, not a causal LM",
    "InklingForConditionalGenerationMTP": "MTP draft",
    "MiniCPMV": "MiniCPM-V 2.x-4.5: Llama / Qwen2 / Qwen3 language models, no linear layers",
}
#: Modules the import closure reaches that hold no hybrid class, with why.
SCAN_EXCLUDED_MODULES: Dict[str, str] = {
    "minicpmo": "imports MiniCPM-V's base classes only; its language model is Qwen2",
}
#: Source markers of a linear / SSM / short-conv layer in a model file (layer classes, their
#: backends and state-pool parameters).
_LINEAR_MARKERS = re.compile(
    r"MambaMixer|GatedDeltaNet|DeltaAttention|RadixLinearAttention|ShortConv|short_conv|LightningMixer|"
    r"lightning_backend|seg_la|JetBlock|mamba2_cache_params|Mamba2CacheParams|MambaPool|"
    r"hybrid_linear_attn_backend|causal_conv1d")
#: ``EntryClass`` names of speculative drafts (MTP / NextN / DSpark heads), not served alone.
_DRAFT_NAME = re.compile(r"MTP|NextN|DSpark|Draft")


def _sglang_models_dir() -> str:
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise RuntimeError("sglang is not installed")
    return os.path.join(os.path.dirname(spec.origin), "srt", "models")


def _entry_and_imports(source: str) -> Tuple[List[str], set]:
    tree = ast.parse(source)
    entry: List[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EntryClass"
                                                for t in node.targets):
            elts = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            entry = [e.id for e in elts if isinstance(e, ast.Name)]
    imports = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("sglang.srt.models."):
                imports.add(node.module.split(".")[3])
            elif node.module == "sglang.srt.models":
                imports.update(a.name for a in node.names)
    return entry, imports


def scan_sglang_hybrid_modules(models_dir: Optional[str] = None) -> Dict[str, List[str]]:
    """The hybrid modules of SGLang's ``srt/models`` and their hybrid ``EntryClass`` names, by the
    rule the survey used (files are parsed, not imported):

    1. a module whose source names a linear-layer marker (:data:`_LINEAR_MARKERS`: a Mamba
       mixer, a GDN / KDA / delta-rule layer, ``RadixLinearAttention``, a short conv, a lightning
       mixer, SGLang's hybrid backend or its state pool);
    2. and, repeated until nothing changes, a module importing from such a module
       (``from sglang.srt.models.X import ...`` or ``from sglang.srt.models import X``): VLMs
       and wrappers around a hybrid text model;
    3. less modules without ``EntryClass``, ``EntryClass`` names of drafts (MTP / NextN / DSpark,
       :data:`_DRAFT_NAME`) and those in :data:`SCAN_EXCLUDED_CLASSES`, modules left with none,
       and :data:`SCAN_EXCLUDED_MODULES`.

    ``models_dir`` defaults to the installed SGLang's. Returns module -> class names (sorted)."""
    models_dir = models_dir or _sglang_models_dir()
    info = {}
    for fn in sorted(os.listdir(models_dir)):
        if fn.endswith(".py"):
            with open(os.path.join(models_dir, fn), encoding="utf-8") as f:
                src = f.read()
            entry, imports = _entry_and_imports(src)
            info[fn[:-3]] = (entry, imports, bool(_LINEAR_MARKERS.search(src)))
    hybrid = {m for m, (_, _, marked) in info.items() if marked}
    while True:
        more = {m for m, (_, imports, _) in info.items() if imports & hybrid} - hybrid
        if not more:
            break
        hybrid |= more
    out = {}
    for m in sorted(hybrid - set(SCAN_EXCLUDED_MODULES)):
        names = sorted(n for n in info[m][0] if not _DRAFT_NAME.search(n) and n not in SCAN_EXCLUDED_CLASSES)
        if names:
            out[m] = names
    return out


def arch_status(cls: SGLangHybridClass) -> str:
    """``supported`` (an ``--arch`` served with exact checkpoints, checked end to end),
    ``build only`` (an ``--arch`` builds its tiny checkpoint; serving not verified yet) or
    ``not yet``."""
    from sglang_mamba_ext.models.hf_tiny import _FAMILIES, SERVED_ARCHS

    for name, fam in _FAMILIES.items():
        if fam.get("module", name) == cls.module and fam["cls"] == cls.arch:
            return "supported" if name in SERVED_ARCHS else "build only"
    return "not yet"


def arch_name(cls: SGLangHybridClass) -> str:
    """The ``--arch`` value that builds ``cls``'s tiny checkpoint (it differs from the module
    name where one module holds several classes, e.g. ``kimi_k3_vl``), or ``-`` for none."""
    from sglang_mamba_ext.models.hf_tiny import _FAMILIES

    for name, fam in _FAMILIES.items():
        if fam.get("module", name) == cls.module and fam["cls"] == cls.arch:
            return name
    return "-"


def list_archs() -> List[str]:
    """One line per class of :data:`SGLANG_HYBRID_CLASSES` (the ``--arch`` value that builds it
    or ``-``, module, architecture, linear-layer kind, status; columns padded), what
    ``make_tiny_model.py --list-archs`` prints."""
    rows = [(arch_name(c), c.module, c.arch, c.kind, arch_status(c)) for c in SGLANG_HYBRID_CLASSES]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
