#!/usr/bin/env bash
# The main job (README.md): stock SGLang 0.5.23 serving the tiny hybrid model on CPU with
# this plugin. Does all its own set-up: ./.venv (scripts/setup_env.sh), the tiny model in
# ./.tiny_model (built once by scripts/make_tiny_model.py, no download), then
#
#   python -m sglang.launch_server --model-path .tiny_model --device cpu --enable-mamba-radix \
#       --warmups kda_cache --warmup-prompts-file examples/warmup_prompts.jsonl --host H --port P
#
# Environment: HOST (default 127.0.0.1), PORT (default 30000), TINY_MODEL_DIR, WARMUP_FILE.
# Extra arguments are passed to sglang.launch_server. The plugin adds CPU defaults for flags
# not given (the model is the project's tiny one and --enable-mamba-radix is on; see
# docs/design.md, "CPU serving"); an explicit flag always wins. A bad flag or prompts file
# stops at once with exit status 2 and a last line "sglang serve: error: ...".
# Stop the server with Ctrl-C.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/tiny_env.sh"
# WARMUP_FILE= (set and empty) serves without the kda_cache warm-up.
warm=(--warmups kda_cache --warmup-prompts-file "${WARMUP_FILE-$root/examples/warmup_prompts.jsonl}")
[ -z "${WARMUP_FILE-x}" ] && warm=()
exec "$vpy" -m sglang.launch_server \
  --model-path "$model" \
  --device cpu \
  --enable-mamba-radix \
  "${warm[@]}" \
  --host "${HOST:-127.0.0.1}" \
  --port "${PORT:-30000}" \
  "$@"
