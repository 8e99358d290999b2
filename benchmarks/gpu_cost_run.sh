#!/usr/bin/env bash
# Step cost / throughput of the methods side by side on exact-shape random weights (acceptance ~1), c = 1..128,
# greedy (TEMPERATURES=0,1 adds T = 1 at the same acceptance). The command behind
# benchmarks/results/{qwen3-8b-random-cost*,adaptive-*,fastpath-*}.
# Run on the lent GPU machine from the repo root, after the device stack is installed (shared/device-stack;
# benchmarks/gpu_env.sh sources it and registers our plugin):
#   SHAPE=qwen3-8b METHODS=none,ours,ours-fixed CONCURRENCY=1,8,32,64,128 RUN=/tmp/run8b bash benchmarks/gpu_cost_run.sh
# Methods (benchmarks/driver.py): none, builtin, ours (adaptive), ours-fixed (full block every step), ours-k<N>.
# RUN accumulates across calls while the machine stays warm (one report over every method run so far).
# Results: $OUT/<name>.tar.gz (JSON, greedy outputs, server logs) and $OUT/summary.md, also when the call's
# deadline (DEADLINE_S, default 560) stops the driver early. COMMON_ARGS replaces the driver's launch_server
# arguments for every method (default: benchmarks/driver.py DEFAULT_COMMON); SPEC_ARGS the speculative methods' extra
# ones (default: driver.py DEFAULT_SPEC, triton draft attention); DRIVER_ARGS more driver arguments (--bracket);
# BENCH_ARGS more bench arguments (--server-metrics, with --enable-metrics in COMMON_ARGS: the TTFT stages).
# The device tool kills a call at its limit (600 s, or less when the session's device time is nearly spent) and
# then returns only what is under $OUT: while the driver runs, RUN is mirrored into $OUT/partial every 15 s, so a
# call cut short still brings back every method that finished. Keep DEADLINE_S >= 60 s under the call's limit_s.
set -uo pipefail
source benchmarks/gpu_env.sh || exit 1
RUN=${RUN:-/tmp/bench-run}
SHAPE=${SHAPE:-qwen3-8b}
if [ -n "${OUT:-}" ]; then
  mkdir -p "$RUN" "$OUT/partial"
  ( while sleep 15; do cp -r "$RUN"/. "$OUT/partial/" 2>/dev/null; done ) &
  MIRROR=$!
  trap 'kill $MIRROR 2>/dev/null' EXIT
fi
[ -d "/tmp/shape-$SHAPE" ] || python3 -m sglang_dflash.targets.shapes write "$SHAPE" "/tmp/shape-$SHAPE" || exit 1
timeout -s TERM "${DEADLINE_S:-560}" python3 -m benchmarks.driver --target "/tmp/shape-$SHAPE/target" \
  --draft "/tmp/shape-$SHAPE/draft" --dummy --methods "${METHODS:-none,builtin,ours}" --out "$RUN" \
  --wait-s "${WAIT_S:-300}" ${COMMON_ARGS:+--common-args "$COMMON_ARGS"} ${SPEC_ARGS:+--spec-args "$SPEC_ARGS"} --title "$SHAPE-shaped random weights: step cost" ${DRIVER_ARGS:-} -- \
  --datasets random --temperatures "${TEMPERATURES:-0}" --concurrency "${CONCURRENCY:-1,8,32,64,128}" --max-new-tokens 256 \
  --ignore-eos --random-input-len 128 --random-vocab "${RANDOM_VOCAB:-151000}" --rounds "${ROUNDS:-2}" \
  --min-convs 4 --no-progress ${BENCH_ARGS:-}
rc=$?
python3 -m benchmarks.report "$RUN" --title "$SHAPE-shaped random weights: step cost" >/dev/null 2>&1
if [ -n "${OUT:-}" ]; then
  kill "$MIRROR" 2>/dev/null; rm -rf "$OUT/partial"
  tar czf "$OUT/${TAR_NAME:-run}.tar.gz" -C "$RUN" . && cp "$RUN/summary.md" "$OUT/" 2>/dev/null
  cat "$RUN/summary.md" 2>/dev/null
fi
exit $rc
