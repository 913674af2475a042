"""The survey of SGLang 0.5.23's hybrid model classes (issue 40, item 1;
``sglang_mamba_ext/models/hf_tiny.py``: ``SGLANG_HYBRID_CLASSES``, ``list_archs``,
``scan_sglang_hybrid_modules``) and ``scripts/make_tiny_model.py --list-archs``.

The expected set is derived, not hard-coded: the installed SGLang's ``srt/models`` is scanned by
the documented rule (``scan_sglang_hybrid_modules``: files parsed, not imported) and must give
exactly the table's modules and classes; SGLang's own hybrid detection
(``srt/configs/hybrid_arch.py``) must name no config class the table lacks. No server, no
SGLang import."""

import ast
import os
import subprocess
import sys
import tempfile
import unittest

from sglang_mamba_ext.models import hf_tiny
from sglang_mamba_ext.models.hf_tiny import (ARCHS, SERVED_ARCHS, SGLANG_HYBRID_CLASSES, arch_class, arch_module,
                                              arch_status, list_archs,
                                             scan_sglang_hybrid_modules)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "make_tiny_model.py")

# The six families served with exact checkpoints before issue 40 (docs/families.md).
SIX = {
    "qwen3_next": "Qwen3NextForCausalLM", "kimi_linear": "KimiLinearForCausalLM",
    "nemotron_h": "NemotronHForCausalLM", "falcon_h1": "FalconH1ForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM", "lfm2": "Lfm2ForCausalLM",
}
# Config classes hybrid_arch.py tests that are not a table row's top-level config: the text
# config of a multimodal row (InklingMMConfig's text_config).
TEXT_ONLY_CONFIGS = {"InklingModelConfig"}


def _table_by_module():
    out = {}
    for c in SGLANG_HYBRID_CLASSES:
        out.setdefault(c.module, []).append(c.arch)
    return {m: sorted(v) for m, v in out.items()}


class TestSurvey(unittest.TestCase):
    def test_table_equals_scan_of_installed_sglang(self):
        scanned = scan_sglang_hybrid_modules()
        table = _table_by_module()
        self.assertEqual(sorted(scanned), sorted(table), "hybrid modules: scan vs table")
        self.assertEqual(scanned, table, "hybrid classes per module: scan vs table")

    def test_rows_unique_and_kinds_known(self):
        archs = [c.arch for c in SGLANG_HYBRID_CLASSES]
        self.assertEqual(len(archs), len(set(archs)))
        kinds = {c.kind for c in SGLANG_HYBRID_CLASSES}
        self.assertLessEqual({"GDN", "KDA", "Mamba2", "Mamba1", "short conv", "lightning"}, kinds)

    def test_sglang_hybrid_detection_configs_in_table(self):
        """Every config class SGLang's hybrid detection imports (configs/hybrid_arch.py) is a row's
        config (or a row's text config), so the scan missed no family SGLang treats as hybrid."""
        path = os.path.join(os.path.dirname(hf_tiny._sglang_models_dir()), "configs", "hybrid_arch.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        imported = {a.name for node in tree.body if isinstance(node, ast.ImportFrom)
                    and node.module == "sglang.srt.configs" for a in node.names}
        self.assertGreater(len(imported), 15)
        table_configs = {c.config for c in SGLANG_HYBRID_CLASSES}
        self.assertEqual(imported - table_configs - TEXT_ONLY_CONFIGS, set())

    def test_scan_rule_on_a_fake_models_dir(self):
        """The rule itself: a marked module, a module importing it, a draft, an excluded class,
        a module without EntryClass and a plain one."""
        files = {
            "hyb.py": "class HybForCausalLM:\n    mixer = 'MambaMixer2'\nEntryClass = [HybForCausalLM]\n",
            "vlm.py": "from sglang.srt.models.hyb import HybForCausalLM\nclass VlmForConditionalGeneration: pass\n"
                      "EntryClass = VlmForConditionalGeneration\n",
            "txt.py": "from sglang.srt.models import vlm\nclass TxtForCausalLM: pass\n"
                      "class Lfm2BidirectionalModel: pass\nEntryClass = [TxtForCausalLM, Lfm2BidirectionalModel]\n",
            "hyb_mtp.py": "from sglang.srt.models.hyb import HybForCausalLM\nclass HybForCausalLMMTP: pass\n"
                          "EntryClass = [HybForCausalLMMTP]\n",
            "utils_hyb.py": "x = 'causal_conv1d'\n",
            "plain.py": "class PlainForCausalLM: pass\nEntryClass = PlainForCausalLM\n",
        }
        with tempfile.TemporaryDirectory() as d:
            for name, src in files.items():
                with open(os.path.join(d, name), "w") as f:
                    f.write(src)
            self.assertEqual(scan_sglang_hybrid_modules(d), {
                "hyb": ["HybForCausalLM"], "vlm": ["VlmForConditionalGeneration"], "txt": ["TxtForCausalLM"]})


class TestListArchs(unittest.TestCase):
    def test_statuses(self):
        status = {c.arch: arch_status(c) for c in SGLANG_HYBRID_CLASSES}
        # issue 40: Qwen3.5 dense and MoE text (one SGLang module, two --arch names), LFM2 MoE
        # the VLMs on those text models (Qwen3.5 dense and MoE, LFM2-VL), pure Mamba2
        served = {**SIX, "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                  "lfm2_moe": "Lfm2MoeForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
                  "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "lfm2_vl": "Lfm2VlForConditionalGeneration",
                  "mamba2": "Mamba2ForCausalLM", "nemotron_h_puzzle": "NemotronHPuzzleForCausalLM",
                  "interns2preview": "InternS2PreviewForConditionalGeneration",
                  "gigachat35": "GigaChat35ForCausalLM", "bailing_moe_v3": "BailingMoeV3ForCausalLM",
                  "interns2_mobius": "InternS2MobiusForConditionalGeneration",
                  "bailing_mm_v3": "BailingMoeV3VLForConditionalGeneration"}
        served["bailing_moe_linear"] = "BailingMoeV2_5ForCausalLM"  # Ling 2.5, lightning attention
        served["minicpm"] = "MiniCPMSALAForCausalLM"  # MiniCPM-SALA, lightning attention
        served["minicpm_causal"] = "MiniCPMForCausalLM"  # its alias in the same module
        served.update(falcon_mamba="FalconMambaForCausalLM", mamba="MambaForCausalLM")  # Mamba1, no attention
        served["kimi_k3"] = "KimiK3LinearForCausalLM"  # Kimi-K3's text class, KDA (declared by the plugin)
        served["kimi_k3_vl"] = "KimiK3ForConditionalGeneration"  # Kimi-K3's VLM, text-only (kimi_k3 module)
        served["jet_nemotron"] = "JetNemotronForCausalLM"  # JetBlock: dynamic conv + delta rule (the Jet writer)
        served["jet_vlm"] = "JetVLMForConditionalGeneration"  # its VLM (SigLIP tower, NVILA projector), text-only
        served.update(minicpmv="MiniCPMV4_6ForConditionalGeneration",  # MiniCPM-V on Qwen3.5, GDN
                      minicpmv4_7="MiniCPMV4_7ForConditionalGeneration")
        served["zaya"] = "ZayaForCausalLM"  # ZAYA1, CCA (the plugin's CCA writer)
        served["inkling"] = "InklingForConditionalGeneration"  # Inkling, text-only: sconv (the plugin's Inkling writer)
        served.update(nano_nemotron_vl="NemotronH_Nano_VL_V2",  # Nemotron-H behind RADIO, Mamba2 (declared)
                      nano_nemotron_omni="NemotronH_Nano_Omni_Reasoning_V3",
                      nano_nemotron_omni_v3="NemotronH_Omni_Reasoning_V3")  # on SGLang's own list
        served["qwen4_exp"] = "Qwen4ExpForConditionalGeneration"  # Qwen4-Exp: GDN + PLE (the plugin's PLE writer)
        served["glm5_next"] = "Glm5NextForConditionalGeneration"  # GLM-5-Next, text-only: KDA + DSA (dense MLA on CPU)
        for name, arch in served.items():
            self.assertEqual(status[arch], "supported", arch)
            self.assertEqual(arch_class(name), arch)
        self.assertEqual(arch_module("qwen3_5_moe_text"), "qwen3_5_text")
        self.assertEqual(arch_module("qwen3_5_moe"), "qwen3_5")
        self.assertEqual(arch_module("nemotron_h_puzzle"), "nemotron_h")
        self.assertEqual(arch_module("minicpmv4_7"), "minicpmv")
        self.assertEqual(arch_module("minicpm_causal"), "minicpm")
        self.assertEqual(set(SERVED_ARCHS), set(served))
        build_only = {c.arch for c in SGLANG_HYBRID_CLASSES if arch_status(c) == "build only"}
        self.assertEqual(build_only, {arch_class(a) for a in set(ARCHS) - set(SERVED_ARCHS)})
        # pure Mamba2: served since the plugin declares it hybrid-cached (docs/families.md)
        self.assertEqual(status["Mamba2ForCausalLM"], "supported")
        self.assertLessEqual(set(status.values()), {"supported", "build only", "not yet"})
        # every surveyed class builds and is served since GLM-5-Next (issue 40, the last "not yet")
        self.assertNotIn("not yet", set(status.values()))
        # Every --arch is a surveyed class of its SGLang module.
        self.assertLessEqual({(arch_module(a), arch_class(a)) for a in ARCHS},
                             {(c.module, c.arch) for c in SGLANG_HYBRID_CLASSES})

    def test_script_prints_one_line_per_class(self):
        proc = subprocess.run([sys.executable, SCRIPT, "--list-archs"], capture_output=True, text=True,
                              timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        lines = proc.stdout.splitlines()
        self.assertEqual(lines, list_archs())
        self.assertEqual(len(lines), len(SGLANG_HYBRID_CLASSES))
        parsed = set()
        for line, c in zip(lines, SGLANG_HYBRID_CLASSES):
            name, module, arch = line.split()[:3]
            status = next(s for s in ("supported", "build only", "not yet") if line.endswith(s))
            kind = line[line.index(arch) + len(arch):len(line) - len(status)].strip()
            parsed.add(module)
            self.assertEqual((module, arch, kind, status), (c.module, c.arch, c.kind, arch_status(c)))
            # the first column is the --arch value that builds the class (- where none does)
            self.assertEqual(name, "-" if status == "not yet" else next(
                a for a in ARCHS if (arch_module(a), arch_class(a)) == (module, arch)))
        self.assertEqual(parsed, set(scan_sglang_hybrid_modules()))
        for module, arch in SIX.items():
            self.assertIn((module, module, arch, "supported"),
                          {tuple(ln.split()[:3]) + (ln.split()[-1],) for ln in lines})
        self.assertIn("kimi_k3_vl", {ln.split()[0] for ln in lines})  # a second class of a module

    def test_list_archs_needs_no_out(self):
        proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("--out is required (unless --list-archs)", proc.stderr)


if __name__ == "__main__":
    unittest.main()
