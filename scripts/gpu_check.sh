#!/usr/bin/env bash
# Deferred-verify GPU check (docs/design.md, "Deferred update" and "Replay"): Triton replay /
# tree verify vs torch references at Kimi-Linear-48B-A3B layer shapes, the glue's on-chip
# verify entry vs torch at Kimi-Linear / Qwen3-Next TP-2 per-rank shapes, replay time vs a
# verify-sized recurrent forward, on-chip verify time vs the one-layer-buffer verify
# (onchip_vs_one_layer=), and peak memory of snapshot vs deferred verify. Needs only
# torch + Triton + a CUDA GPU (no SGLang, no network); finishes in well under 5 minutes. Last
# lines: memory_ratio=<x>, replay_overhead=<y>.
# Extra arguments go to `python -m sglang_mamba_ext.speculative.ops.gpu_check` (e.g.
# --state-dtype bf16), run with the repository root on PYTHONPATH (the package need not be
# installed). If $OUT is set, the output is also written to $OUT/gpu_check.txt.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; fi
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c "import sys, torch, triton
if not torch.cuda.is_available():
    sys.exit('gpu_check.sh: no CUDA device (torch ' + torch.__version__ + '); on CPU run: TRITON_INTERPRET=1 python -m sglang_mamba_ext.speculative.ops.gpu_check --tiny')
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [ -n "${OUT:-}" ]; then
  timeout 290 "$py" -m sglang_mamba_ext.speculative.ops.gpu_check "$@" 2>&1 | tee "$OUT/gpu_check.txt"
else
  timeout 290 "$py" -m sglang_mamba_ext.speculative.ops.gpu_check "$@"
fi
