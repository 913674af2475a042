#!/usr/bin/env bash
# Deferred-verify GPU check (docs/design.md, "Deferred update" and "Replay"): Triton replay /
# tree verify vs torch references at Kimi-Linear-48B-A3B layer shapes, the glue's on-chip
# verify entry vs torch at Kimi-Linear / Qwen3-Next TP-2 per-rank shapes, replay time vs a
# verify-sized recurrent forward, on-chip verify time vs the one-layer-buffer verify
# (onchip_vs_one_layer=), and peak memory of snapshot vs deferred verify. Needs only
# torch + Triton + a CUDA GPU (no SGLang, no network); finishes in under 400 s (BUDGET). Last
# lines: memory_ratio=<x>, replay_overhead=<y>. Then the Mamba2/SSD in-chunk writer
# (ops/inchunk/gpu_check_mamba2.py): correctness vs torch and a chunked SSD scan, cost per
# checkpoint at Nemotron-H-8B shapes, per offset (63, 511, 2047); last line mamba2_inchunk_cost_ratio=<w>. Then the
# Mamba2 deferred verify (ops/gpu_check_mamba2_spec.py): on-chip tree verify and replay vs torch
# at Nemotron-Nano-9B-v2 shapes, mamba2_onchip_vs_buffered=, mamba2_replay_overhead=,
# mamba2_memory_ratio=. Then the state
# tiers (benchmarks/tiers_gpu.py): a hit's copy from the int8 checkpoint pool and from the host
# tier vs the device copy-on-write, Qwen3-Next shapes; last line int8_load_ratio=... Last, the
# GDN / KDA in-chunk checkpoint writer (docs/design.md, "Prefix checkpoints"): correctness vs
# torch and fla's chunked kernels, cost per checkpoint by offset (63, 511, 2047; since issue 39
# each starts from the prefill's chunk state below it, as served; the writer's own chunked pass
# timed beside it: inchunk_selfpass_cost_ratio=) vs the prefill it saves; last line
# inchunk_cost_ratio=<z> (sglang_mamba_ext/speculative/ops/inchunk/gpu_check.py).
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
    sys.exit('gpu_check.sh: no CUDA device (torch ' + torch.__version__ + '); on CPU run: TRITON_INTERPRET=1 python -m sglang_mamba_ext.speculative.ops.gpu_check --tiny (and ...ops.inchunk.gpu_check --tiny); CPU timings mean nothing')
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
# One section: run module NAME with at most CAP s of what is left of BUDGET s (the whole check
# stays under BUDGET so that a rerun fits the device time); output also to $OUT/gpu_check.txt.
BUDGET=400
section() {
  local label="$1" module="$2" cap="$3" left=$((BUDGET - SECONDS))
  if [ "$left" -gt "$cap" ]; then left="$cap"; fi
  if [ "$left" -lt 20 ]; then echo "gpu_check.sh: no time left for the $label section"; exit 1; fi
  if [ -n "${OUT:-}" ]; then
    timeout "$left" "$py" -m "$module" "${@:4}" 2>&1 | tee -a "$OUT/gpu_check.txt"
  else
    timeout "$left" "$py" -m "$module" "${@:4}"
  fi
}
if [ -n "${OUT:-}" ]; then : > "$OUT/gpu_check.txt"; fi
# On an H200 (2026-12-04): speculative ~25 s, Mamba2 ~20 s, tiers ~10 s; the GDN / KDA in-chunk
# check 130 s in one run and past 190 s in another (fla's first-run autotuning, then the
# token-scan writer's timing at p=2047, replaced since by the chunked writer; its kernels use
# fixed tile sizes, no autotuning): it runs last, with what is left.
section speculative sglang_mamba_ext.speculative.ops.gpu_check 100 "$@"
# Mamba2 / SSD in-chunk writer (Nemotron-H, Falcon-H1, GraniteMoeHybrid)
section "Mamba2 in-chunk" sglang_mamba_ext.speculative.ops.inchunk.gpu_check_mamba2 60 "$@"
# deferred verify for Mamba2 targets (issue 41 item 3): on-chip tree verify vs buffered, replay
section "Mamba2 deferred verify" sglang_mamba_ext.speculative.ops.gpu_check_mamba2_spec 40 "$@"
# what a hit costs from each tier of the tree's states (int8 checkpoints, host tier), torch only
section tiers sglang_mamba_ext.benchmarks.tiers_gpu 40
# in-chunk checkpoints, GDN / KDA
section in-chunk sglang_mamba_ext.speculative.ops.inchunk.gpu_check 400 "$@"
