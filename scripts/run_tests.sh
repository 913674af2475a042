#!/usr/bin/env bash
# The test command (README.md): sets up ./.venv if needed, then runs the whole suite on CPU.
# Extra arguments go to pytest (e.g. scripts/run_tests.sh -k core -x).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vpy="$("$root/scripts/setup_env.sh" | tail -n 1)"
cd "$root"
exec "$vpy" -m pytest -q tests "$@"
