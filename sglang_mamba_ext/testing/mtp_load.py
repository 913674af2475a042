"""Load a tiny MTP draft (``sglang_mamba_ext.models.mtp_tiny``) into SGLang's own MTP class,
in-process on CPU, without a server (issue 41, item 1): what a draft worker's ``ModelRunner``
does at start-up, reduced to the config, the class and its ``load_weights``.

``python -m sglang_mamba_ext.testing.mtp_load TARGET_DIR DRAFT_DIR`` prints one JSON line:
``{"architecture": <what SGLang's ModelConfig names the draft>, "class": <the class SGLang's
model registry resolves>, "unloaded": [parameters the draft's file did not fill],
"unused": [checkpoint tensors that filled no parameter], "equal": {checkpoint name: whether the
loaded parameter equals it}}``. Parameters start as NaN; a parameter is "unloaded" while any
NaN is left after ``load_weights`` (the embedding and LM head are the target's, shared at
start-up by ``set_embed_and_head``, and are listed like any other). Run it in its own process:
it initialises a one-rank gloo group.
"""

from __future__ import annotations

import json
import sys


def check(target: str, draft: str, port: int = 29533) -> dict:
    import torch
    from safetensors.torch import load_file

    from sglang_mamba_ext.benchmarks.scheduler import apply_plugin

    apply_plugin()
    from sglang.srt.server_args import prepare_server_args

    from sglang_mamba_ext.testing.model_load import load_nan_filled

    sa = prepare_server_args([
        "--model-path", target, "--device", "cpu", "--speculative-algorithm", "NEXTN",
        "--speculative-draft-model-path", draft, "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
    ])
    ckpt = load_file(f"{draft}/model.safetensors")
    mc, cls, model = load_nan_filled(sa, draft, port, ckpt, is_draft_model=True)
    params = dict(model.named_parameters())
    unloaded = sorted(n for n, p in params.items() if torch.isnan(p).any())
    # a checkpoint tensor is used when some parameter holds its values (fused parameters
    # hold them as a slice): compare against every loaded parameter's rows
    equal, unused = {}, []
    for name, t in ckpt.items():
        t = t.to(torch.float16).reshape(-1, t.shape[-1]) if t.dim() > 1 else t.to(torch.float16)
        hit = False
        for p in params.values():
            if p.shape[-1] != t.shape[-1] or torch.isnan(p).any():
                continue
            flat = p.detach().reshape(-1, p.shape[-1]) if p.dim() > 1 else p.detach()
            if flat.dim() == 1:
                hit = bool(torch.equal(flat, t))
            else:
                hit = any(torch.equal(flat[i:i + t.shape[0]], t) for i in range(0, flat.shape[0] - t.shape[0] + 1, t.shape[0]))
            if hit:
                break
        equal[name] = hit
        if not hit:
            unused.append(name)
    return {"architecture": mc.hf_config.architectures[0], "class": cls.__name__, "unloaded": unloaded,
            "unused": unused, "equal": equal}


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 29533)))
