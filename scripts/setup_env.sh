#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: a virtual environment at ./.venv holding
# torch 2.14.1, sglang 0.5.23 and this package (editable, with its [test] extra, which also
# registers the SGLang plugin entry point). Safe to run again: it installs only what is
# missing or at the wrong version. Prints the python to use on its last line.
#
# Environment: PYTHON (interpreter to build the venv from, default python3),
#              VENV (venv directory, default ./.venv).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VENV:-$root/.venv}"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating virtual environment $venv" >&2
  "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"

check() {
  "$vpy" - <<'PY' 2>/dev/null
import importlib.metadata as md, sys
want = {"torch": "2.14.1", "sglang": "0.5.23"}
for name, ver in want.items():
    if md.version(name) != ver:
        sys.exit(1)
for name in ("sglang-mamba-ext", "pytest", "hypothesis", "fla-core", "requests", "sglang-router"):
    md.version(name)
eps = md.entry_points(group="sglang.srt.plugins")
if not any(ep.value.startswith("sglang_mamba_ext.") for ep in eps):
    sys.exit(1)
import sglang_mamba_ext
PY
}

if ! check; then
  echo "[setup] installing torch 2.14.1, sglang 0.5.23 and sglang-mamba-ext[test] (a few minutes on first run)" >&2
  "$vpy" -m pip install -q --upgrade pip >&2
  # torch first, pinned, so sglang's resolver does not pick another build.
  "$vpy" -m pip install -q "torch==2.14.1" >&2
  "$vpy" -m pip install -q -e ".[test]" >&2
  check || { echo "[setup] installation incomplete: see the pip output above" >&2; exit 1; }
fi
echo "$vpy"
