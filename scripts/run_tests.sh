#!/usr/bin/env bash
# The test command (README.md): sets up ./.venv if needed, then runs the whole suite on CPU,
# the server (e2e) and slow tests included. Extra arguments go to pytest, e.g.
#   scripts/run_tests.sh -m "not e2e and not slow"   # the fast part (no SGLang server)
#   scripts/run_tests.sh -k core -x
#   scripts/run_tests.sh tests/test_core_pools.py   # one file (a path replaces `tests`)
# Markers (pytest.ini): e2e = starts an SGLang server; slow = over ~30 s on 2 cores.
# Two pytest-xdist workers by default (TEST_WORKERS=N for N, TEST_WORKERS=0 for one
# process): each test class runs whole on one worker, the multi-server classes one after
# another (tests/conftest.py lays out the work), progress lines name the worker (gw0, gw1).
# Test servers are forked from a pre-imported process (sglang_mamba_ext/testing/zygote.py),
# so a start-up is seconds and a serving test keeps about one core busy: two workers use
# both (docs/testing.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vpy="$("$root/scripts/setup_env.sh" | tail -n 1)"
cd "$root"
workers="${TEST_WORKERS:-2}"
if [ "$workers" != "0" ]; then
  set -- -n "$workers" --dist loadscope --no-loadscope-reorder "$@"
  # One OpenMP thread per process: the two workers and the servers they start each keep about
  # one core busy, and torch's default (one thread per core in every process) oversubscribes
  # the cores (measured on 2 cores, alternating rounds in one run: a serving subset 152 s with
  # one thread vs 202 s with the default). OMP_NUM_THREADS=N before the command overrides it.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
# A test path among the arguments (tests/test_x.py, tests/e2e/test_y.py::TestZ) replaces the
# default `tests`.
target=tests
for arg in "$@"; do
  case "$arg" in
    -*) ;;
    *) if [ -e "${arg%%::*}" ]; then target=; fi ;;
  esac
done
exec "$vpy" -m pytest -q $target "$@"
