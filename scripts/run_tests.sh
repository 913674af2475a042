#!/usr/bin/env bash
# The test command (README.md): sets up ./.venv if needed, then runs the whole suite on CPU,
# the server (e2e) and slow tests included. Extra arguments go to pytest, e.g.
#   scripts/run_tests.sh -m "not e2e and not slow"   # the fast part (no SGLang server)
#   scripts/run_tests.sh -k core -x
# Markers (pytest.ini): e2e = starts an SGLang server; slow = over ~30 s on 2 cores.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vpy="$("$root/scripts/setup_env.sh" | tail -n 1)"
cd "$root"
exec "$vpy" -m pytest -q tests "$@"
