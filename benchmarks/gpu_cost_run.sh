#!/usr/bin/env bash
# The command behind benchmarks/results/qwen3-8b-random-cost: none vs SGLang's builtin DFLASH (vs ours, when its
# plugin is installed) on exact-shape random Qwen3-8B + Qwen3-8B-DFlash-b16 weights, c = 1..128, greedy.
# Run on the lent GPU machine from the repo root, carrying .devstack/part1 (shared/device-stack/README.md):
#   run(kind="nvidia-h100-x1", carry=[".devstack/part1"], timeout_s=600, command="bash benchmarks/gpu_cost_run.sh")
# Results: $OUT/run.tar.gz (all JSON, greedy outputs, server logs) and $OUT/summary.md; make the plots on any
# machine with matplotlib: python -m benchmarks.report DIR
set -uo pipefail
eval "$(bash .devstack/part1/install.sh)" || exit 1
export PYTHONUNBUFFERED=1
RUN=${RUN:-/tmp/bench-run}
SHAPE=${SHAPE:-qwen3-8b}
python3 -m sglang_dflash.shapes write "$SHAPE" "/tmp/shape-$SHAPE" || exit 1
python3 -m benchmarks.driver --target "/tmp/shape-$SHAPE/target" --draft "/tmp/shape-$SHAPE/draft" --dummy \
  --methods "${METHODS:-none,builtin,ours}" --out "$RUN" --wait-s "${WAIT_S:-300}" \
  --title "$SHAPE-shaped random weights: step cost" -- \
  --datasets random --temperatures 0 --concurrency "${CONCURRENCY:-1,8,32,64,128}" --max-new-tokens 256 \
  --ignore-eos --random-input-len 128 --random-vocab 151000 --rounds 2 --min-convs 4 --no-progress
rc=$?
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/run.tar.gz" -C "$RUN" . && cp "$RUN/summary.md" "$OUT/" 2>/dev/null
fi
exit $rc
