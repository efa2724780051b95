#!/usr/bin/env bash
# AR against the server's default configuration: start `adaspec serve` on 127.0.0.1 twice (plain
# autoregressive: -d none; default: auto over prompt-lookup, suffix, none), drive each with
# `adaspec bench-serve` at concurrency 1, 4 and 16, print both tables. Usage:
#   scripts/bench_serve.sh [MODEL] [OUT_DIR]      (defaults: smollm2, bench-serve/)
# Environment: SERVE_ARGS (e.g. "--threads 1"), BENCH_ARGS (e.g. "--max-tokens 32 --requests 8"), PORT.
set -euo pipefail
MODEL=${MODEL:-${1:-smollm2}}
OUT=${2:-bench-serve}
PORT=${PORT:-8123}
ADASPEC=${ADASPEC:-adaspec}
mkdir -p "$OUT"

run() {  # run LABEL [serve options...]
  local label=$1; shift
  $ADASPEC serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --no-state --log-level warning ${SERVE_ARGS:-} "$@" \
    > "$OUT/$label.server.log" 2>&1 &
  local pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.5; done
  $ADASPEC bench-serve --url "http://127.0.0.1:$PORT/v1" --label "$label" --json "$OUT/$label.json" \
    ${BENCH_ARGS:-} | tee "$OUT/$label.md"
  kill -TERM $pid; wait $pid || true
  trap - EXIT
}

run "AR" -d none -s static -l static
run "default"
