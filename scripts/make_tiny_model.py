#!/usr/bin/env python
"""Write the tiny hybrid test model (config, seeded weights, local tokenizer) to a directory.

Usage: python scripts/make_tiny_model.py --out DIR [--seed N] [--draft-out DRAFT_DIR]
[--linear-gate {kda,gdn}] [--linear-kernels {tiny,sglang}]
       python scripts/make_tiny_model.py --arch ARCH --out DIR [--seed N] [--draft-out DRAFT_DIR]
       python scripts/make_tiny_model.py --list-archs

``--arch`` writes a tiny checkpoint of one of SGLang's own hybrid families instead
(``qwen3_next``, ``kimi_linear``, ``nemotron_h``, ``falcon_h1``, ``granitemoehybrid``,
``lfm2``, ``qwen3_5_text``, ``qwen3_5_moe_text`` (SGLang's ``Qwen3_5MoeForCausalLM`` of its
``qwen3_5_text`` module), ``lfm2_moe``, the VLMs ``qwen3_5``, ``qwen3_5_moe`` (SGLang's
``Qwen3_5MoeForConditionalGeneration`` of its ``qwen3_5`` module) and ``lfm2_vl`` (tiny vision
towers and the processor configs SGLang loads at start-up; served text-only), ``mamba2``),
served by SGLang's own model class for it; built by transformers' own class
(``sglang_mamba_ext/models/hf_tiny.py``), float16, the same tokenizer.

``--arch qwen3_next|qwen3_5_text|nemotron_h --draft-out DIR`` also writes the family's own MTP
draft as SGLang's MTP class loads it (``Qwen3NextForCausalLMMTP``, ``Qwen3_5ForCausalLMMTP``,
``NemotronHForCausalLMMTP``; ``sglang_mamba_ext/models/mtp_tiny.py``), fitted to the target so
that it often agrees with it, for ``--speculative-algorithm NEXTN
--speculative-draft-model-path DIR``.

``--list-archs`` prints every hybrid causal-LM class of SGLang 0.5.23, one line each: the
``--arch`` value that builds it (``-`` for none; it differs from the module where one module
holds several classes, e.g. ``kimi_k3_vl``), SGLang's module name, architecture, linear-layer
kind, status (``supported``, ``build only`` or ``not yet``).

``--linear-gate gdn`` gives the linear layers Gated DeltaNet's per-head decay gate (Qwen3-Next)
instead of KDA's per-channel one (Kimi-Linear, the default).

``--draft-out`` also writes the matching frozen-KV draft (``model_type`` ``tiny_hybrid_draft``,
same tokenizer, initialised from the target's weights) for SGLang's
``--speculative-algorithm FROZEN_KV_MTP --speculative-draft-model-path DRAFT_DIR``.

No downloads; deterministic for a seed. Serve it on CPU with
``python -m sglang.launch_server --model-path DIR --device cpu ...`` once this package is
installed (its SGLang plugin registers the model).
"""

import argparse
import sys

from sglang_mamba_ext.models.hf_tiny import ARCHS, list_archs
from sglang_mamba_ext.models.tiny_builder import build_tiny_draft, build_tiny_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="output model directory (created); required unless --list-archs")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    parser.add_argument("--draft-out", default=None,
                        help="also write the matching draft here (created): the frozen-KV draft of the tiny "
                             "hybrid model, or with --arch qwen3_next|qwen3_5_text|nemotron_h the family's own "
                             "MTP draft")
    parser.add_argument("--linear-gate", choices=["kda", "gdn"], default="kda",
                        help="decay gate of the linear layers: kda (per key channel, default) or gdn "
                             "(per value head)")
    parser.add_argument("--linear-kernels", choices=["tiny", "sglang"], default="tiny",
                        help="who serves the linear layers: tiny (the plugin's torch backend, float32, "
                             "default) or sglang (SGLang's own GDN/KDA backend by --linear-gate, "
                             "float16; on CPU under Triton's interpreter)")
    parser.add_argument("--arch", choices=ARCHS, default=None,
                        help="write a tiny checkpoint of this SGLang hybrid family instead of the tiny "
                             "hybrid model (no --draft-out, --linear-gate or --linear-kernels with it)")
    parser.add_argument("--list-archs", action="store_true",
                        help="print SGLang's hybrid classes (--arch value, module, architecture, linear-layer kind, status) "
                             "and exit")
    args = parser.parse_args(argv)
    if args.list_archs:
        print("\n".join(list_archs()))
        return 0
    if not args.out:
        parser.error("--out is required (unless --list-archs)")
    if args.arch:
        from sglang_mamba_ext.models.mtp_tiny import MTP_ARCHS, build_mtp_draft

        given = [f for f, v in (("--draft-out", args.draft_out and args.arch not in MTP_ARCHS),
                                ("--linear-gate", args.linear_gate != "kda"),
                                ("--linear-kernels", args.linear_kernels != "tiny")) if v]
        if given:
            parser.error(f"--arch {args.arch} cannot be combined with {', '.join(given)}: those shape the "
                         f"tiny hybrid model only (--draft-out: with --arch {', '.join(MTP_ARCHS)} only, "
                         "their MTP draft); drop them or drop --arch")
        from sglang_mamba_ext.models.hf_tiny import build_hf_tiny_model

        out = build_hf_tiny_model(args.arch, args.out, seed=args.seed)
        print(f"wrote tiny {args.arch} checkpoint to {out}")
        if args.draft_out:
            st = build_mtp_draft(args.arch, out, args.draft_out, seed=args.seed)
            print(f"wrote tiny {st['mtp_class']} draft to {args.draft_out} (agrees with the target on "
                  f"{st['agreement']:.0%} of held-out greedy tokens)")
        return 0
    out = build_tiny_model(args.out, seed=args.seed, config_overrides={"linear_gate": args.linear_gate},
                           linear_kernels=args.linear_kernels)
    print(f"wrote tiny hybrid model to {out}")
    if args.draft_out:
        draft = build_tiny_draft(args.draft_out, out)
        print(f"wrote tiny frozen-KV draft to {draft}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
