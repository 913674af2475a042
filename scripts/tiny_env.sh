# Sourced by scripts/serve_cpu.sh and scripts/serve_cpu_pd.sh: sets `root` (repository),
# `vpy` (the set-up venv's python, scripts/setup_env.sh) and `model` (TINY_MODEL_DIR, default
# ./.tiny_model, built by scripts/make_tiny_model.py on first use; messages on stderr), and
# changes to the repository root.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vpy="$("$root/scripts/setup_env.sh" | tail -n 1)"
cd "$root"
model="${TINY_MODEL_DIR:-$root/.tiny_model}"
if [ ! -f "$model/config.json" ]; then
  echo "[serve] building the tiny hybrid model in $model" >&2
  "$vpy" scripts/make_tiny_model.py --out "$model" >&2
fi
