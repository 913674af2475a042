#!/usr/bin/env bash
# Prefill/decode disaggregation on CPU (docs/serving.md, "Prefill/decode disaggregation"): a prefill
# server with this plugin's cache, a decode server and sglang-router in PD mode in front, all
# serving the tiny hybrid model. Does its own set-up like serve_cpu.sh: ./.venv
# (scripts/setup_env.sh, which also installs mooncake's non-CUDA transfer engine and the Debian
# libraries it loads) and the tiny model in ./.tiny_model (no download). Then
#
#   prefill: sglang.launch_server --device cpu --enable-mamba-radix --disaggregation-mode prefill
#            --disaggregation-transfer-backend mooncake_tcp --warmups kda_cache ...
#   decode:  sglang.launch_server --device cpu --disaggregation-mode decode
#            --disaggregation-transfer-backend mooncake_tcp   (no plugin flag: see docs/serving.md)
#   router:  sglang_router.launch_router --pd-disaggregation --prefill URL BOOTSTRAP --decode URL
#
# KV and SSM state travel from prefill to decode over mooncake's TCP transport.
# Environment: HOST (router's address, default 127.0.0.1), PORT (router's port, default 30000),
# PREFILL_PORT / DECODE_PORT / BOOTSTRAP_PORT (defaults PORT+1, PORT+2, PORT+3; the servers
# listen on 127.0.0.1), TINY_MODEL_DIR, WARMUP_FILE (as in serve_cpu.sh; set and empty: no
# warm-up), START_TIMEOUT (seconds, default 600), PREFILL_ARGS / DECODE_ARGS (extra arguments
# for one server only, split on spaces, e.g. PREFILL_ARGS="--tp 2"), ROUTER (`rust`, the
# default: sglang-router's gateway; `mini`: its Python --mini-lb, which forwards request bodies
# as sent, so `cache_salt` reaches the servers; the Rust one drops it: docs/serving.md,
# "Tenant isolation"), ROUTER_ARGS (extra router arguments, split on spaces, e.g.
# ROUTER_ARGS="--retry-max-retries 1": docs/serving.md, Faults). Extra arguments reach both
# servers.
# When all three answer, prints one line `router: http://HOST:PORT` on stdout. Ctrl-C or
# SIGTERM stops all of them; if one of them exits, the others are stopped too and the exit
# status is non-zero. Logs: LOG_DIR (default a new temporary directory, printed on stderr).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/tiny_env.sh"
host="${HOST:-127.0.0.1}"
port="${PORT:-30000}"
pport="${PREFILL_PORT:-$((port + 1))}"
dport="${DECODE_PORT:-$((port + 2))}"
bport="${BOOTSTRAP_PORT:-$((port + 3))}"
timeout="${START_TIMEOUT:-600}"
case "${ROUTER:-rust}" in
  rust) router_mode=(); ready=/readiness ;;
  mini) router_mode=(--mini-lb); ready=/health ;;
  *) echo "[serve-pd] error: ROUTER=${ROUTER} is not one of: rust, mini" >&2; exit 2 ;;
esac
logs="${LOG_DIR:-$(mktemp -d -t serve_cpu_pd.XXXXXX)}"
# A taken port would leave a server hung in its shutdown and the health probe talking to the
# other listener: refuse before starting anything.
for p in "$port" "$pport" "$dport" "$bport"; do
  if ! "$vpy" -c "import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], int(sys.argv[2])))" \
      "$([ "$p" = "$port" ] && echo "$host" || echo 127.0.0.1)" "$p" 2>/dev/null; then
    echo "[serve-pd] error: port $p is already in use; choose free ones with PORT (router; the servers take PORT+1..PORT+3) or PREFILL_PORT / DECODE_PORT / BOOTSTRAP_PORT" >&2
    exit 1
  fi
done
mkdir -p "$logs"
echo "[serve-pd] logs in $logs" >&2
warm=(--warmups kda_cache --warmup-prompts-file "${WARMUP_FILE-$root/examples/warmup_prompts.jsonl}")
[ -z "${WARMUP_FILE-x}" ] && warm=()

read -r -a prefill_args <<<"${PREFILL_ARGS:-}"
read -r -a decode_args <<<"${DECODE_ARGS:-}"
read -r -a router_args <<<"${ROUTER_ARGS:-}"
pids=()
stop_all() {
  trap - INT TERM EXIT
  local pid
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  sleep 2
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
trap 'stop_all' EXIT

# Each in its own process group (setsid), so stopping one stops its scheduler processes too.
start() {  # name, command...
  local name="$1"; shift
  setsid "$@" >"$logs/$name.log" 2>&1 &
  pids+=("$!")
}
start prefill "$vpy" -m sglang.launch_server --model-path "$model" --device cpu --enable-mamba-radix \
  "${warm[@]}" --disaggregation-mode prefill --disaggregation-transfer-backend mooncake_tcp \
  --disaggregation-bootstrap-port "$bport" --host 127.0.0.1 --port "$pport" "${prefill_args[@]}" "$@"
start decode "$vpy" -m sglang.launch_server --model-path "$model" --device cpu \
  --disaggregation-mode decode --disaggregation-transfer-backend mooncake_tcp \
  --host 127.0.0.1 --port "$dport" "${decode_args[@]}" "$@"

healthy() {  # URL: answers 200
  "$vpy" - "$1" <<'PY' 2>/dev/null
import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=5).status == 200 else 1)
except Exception:
    sys.exit(1)
PY
}
names=(prefill decode router)
wait_ready() {  # name, url (a health endpoint)
  local deadline=$(( $(date +%s) + timeout )) i
  until healthy "$2"; do
    for i in "${!pids[@]}"; do
      if ! kill -0 "${pids[$i]}" 2>/dev/null; then
        echo "[serve-pd] ${names[$i]} exited during start-up; end of $logs/${names[$i]}.log:" >&2
        tail -n 30 "$logs/${names[$i]}.log" >&2
        exit 1
      fi
    done
    if [ "$(date +%s)" -gt "$deadline" ]; then
      echo "[serve-pd] $1 not healthy after $timeout s; see $logs/$1.log" >&2
      exit 1
    fi
    sleep 2
  done
}
wait_ready prefill "http://127.0.0.1:$pport/health"
wait_ready decode "http://127.0.0.1:$dport/health"
start router "$vpy" -m sglang_router.launch_router --pd-disaggregation "${router_mode[@]}" \
  --prefill "http://127.0.0.1:$pport" "$bport" --decode "http://127.0.0.1:$dport" \
  --host "$host" --port "$port" "${router_args[@]}"
# Rust /readiness: 200 once the router has admitted a healthy prefill and decode worker
# (--mini-lb has no admission: its /health answers once it listens).
wait_ready router "http://$host:$port$ready"
if [ "${ROUTER:-rust}" = rust ]; then
  echo "[serve-pd] note: sglang-router drops cache_salt from /generate and chat requests (extra_key too on chat); for tenant isolation use extra_key on /generate, /v1/completions, or ROUTER=mini (docs/serving.md, Tenant isolation)" >&2
else
  echo "[serve-pd] note: --mini-lb forwards request bodies as sent (cache_salt kept); it picks the one prefill/decode pair, no cache-aware routing" >&2
fi
echo "router: http://$host:$port"
# Serve until a signal arrives or one of the three exits.
set +e
wait -n "${pids[@]}"
rc=$?
echo "[serve-pd] a process exited (status $rc); stopping the others" >&2
exit $(( rc == 0 ? 1 : rc ))
