#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: a virtual environment at ./.venv holding
# torch 2.14.1, sglang 0.5.23 and this package (editable, with its [test] extra, which also
# registers the SGLang plugin entry point), and the Debian libraries mooncake's transfer
# engine loads (libibverbs1, libnl-3-200, libnl-route-3-200: prefill/decode disaggregation,
# installed with apt-get as root or through passwordless sudo; otherwise it warns, naming them,
# and goes on: only PD needs them, and its tests are skipped without them). Safe to run again:
# it installs only what is missing or at the wrong version. Prints the python to use on its
# last line.
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
for name in ("sglang-mamba-ext", "pytest", "pytest-xdist", "hypothesis", "fla-core", "requests", "sglang-router",
             "mooncake-transfer-engine-non-cuda", "librosa"):
    md.version(name)
eps = md.entry_points(group="sglang.srt.plugins")
if not any(ep.value.startswith("sglang_mamba_ext.") for ep in eps):
    sys.exit(1)
import sglang_mamba_ext
PY
}

# System libraries of mooncake-transfer-engine-non-cuda (its engine.so links them even when
# only the TCP transport is used).
sys_libs=(libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200)
deb_pkgs=(libibverbs1 libnl-3-200 libnl-route-3-200)
missing_libs() {
  local lib known
  # ldconfig lives in sbin, which a non-root PATH may lack; read its list once (piped into
  # `grep -q`, ldconfig could die of SIGPIPE and, under pipefail, report a present library)
  known="$(PATH="$PATH:/usr/sbin:/sbin" ldconfig -p 2>/dev/null || true)"
  for lib in "${sys_libs[@]}"; do
    grep -qF "$lib" <<<"$known" || echo "$lib"
  done
}
if [ -n "$(missing_libs)" ]; then
  if [ "$(id -u)" -eq 0 ]; then apt_get=(apt-get)
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then apt_get=(sudo -n apt-get)
  else apt_get=()
  fi
  if [ "${#apt_get[@]}" -eq 0 ] || ! command -v apt-get >/dev/null; then
    echo "[setup] warning: missing system libraries $(missing_libs | tr '\n' ' ')(mooncake's transfer engine, needed only for prefill/decode disaggregation; its tests will be skipped): as root, apt-get install -y ${deb_pkgs[*]}" >&2
  else
    echo "[setup] installing Debian packages ${deb_pkgs[*]} (mooncake's transfer engine needs them)" >&2
    export DEBIAN_FRONTEND=noninteractive
    { "${apt_get[@]}" install -y -q "${deb_pkgs[@]}" 2>/dev/null || { "${apt_get[@]}" update -q && "${apt_get[@]}" install -y -q "${deb_pkgs[@]}"; }; } >&2 || {
      echo "[setup] error: apt-get could not install ${deb_pkgs[*]}; install them, then run this again" >&2
      exit 1
    }
    if [ -n "$(missing_libs)" ]; then
      echo "[setup] error: still missing after apt-get: $(missing_libs | tr '\n' ' ')" >&2
      exit 1
    fi
  fi
fi

if ! check; then
  echo "[setup] installing torch 2.14.1, sglang 0.5.23 and sglang-mamba-ext[test] (a few minutes on first run)" >&2
  "$vpy" -m pip install -q --upgrade pip >&2
  # torch first, pinned, so sglang's resolver does not pick another build.
  "$vpy" -m pip install -q "torch==2.14.1" >&2
  "$vpy" -m pip install -q -e ".[test]" >&2
  check || { echo "[setup] installation incomplete: see the pip output above" >&2; exit 1; }
fi
if [ -z "$(missing_libs)" ] && ! "$vpy" -c "import mooncake.engine" 2>/dev/null; then
  echo "[setup] error: mooncake's transfer engine does not load (python -c 'import mooncake.engine' in $venv)" >&2
  exit 1
fi
echo "$vpy"
