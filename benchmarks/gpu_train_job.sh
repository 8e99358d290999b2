#!/usr/bin/env bash
# Train a drafter for a staged real target on the lent GPU machine and measure its tau two ways, as ONE background
# job that outlives the 600 s limit of a call (start it with setsid; later calls poll $OUT_DIR/DONE):
#   1. python -m sglang_dflash.train run: the target's own responses, training to a deadline, the saved drafter,
#      a quick tau with the reference engine on held-out prompts;
#   2. the SGLang server (none vs ours, benchmarks.driver): tau and tok/s on the benchmark prompt sets.
# Needs: source benchmarks/gpu_env.sh; bash benchmarks/gpu_stage.sh TARGET (-> /tmp/TARGET); the prompts file.
#   setsid nohup bash benchmarks/gpu_train_job.sh gemma3 .carry/gemma3_prompts.pt /tmp/job_gemma3 > /dev/null 2>&1 &
# Knobs (environment): LAYERS, GEN_BUDGET_S, DEADLINE_S (the train run's whole budget), TRAIN_ARGS (extra),
# DATA (an earlier data.pt: train on it instead of generating), BENCH_CONC, BENCH_TOKENS, MEM_FRACTION
# (the server's share of GPU memory: other jobs may share the GPU; then read its tok/s as tau-only).
set -u
target=${1:?target: smollm2|gemma3}; prompts=${2:?prompts file}; out=${3:?output dir}
mkdir -p "$out"
# run from a snapshot of the tree: later calls re-sync the repo folder while this job is still running
snap=/tmp/snap_$(basename "$out"); rm -rf "$snap"; mkdir -p "$snap"
tar -C . --exclude=./.devstack --exclude=./.stage -cf - . | tar -C "$snap" -xf - && cd "$snap" || exit 1
export PYTHONPATH="$snap:${PYTHONPATH:-}"
echo "$(date -u +%FT%TZ) start $target on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" > "$out/job.log"
python3 -m sglang_dflash.train run --target "$target" --hf-dir "/tmp/$target" --prompts "$prompts" \
  --out "$out/train" --layers "${LAYERS:-3}" --gen-budget-s "${GEN_BUDGET_S:-150}" --deadline-s "${DEADLINE_S:-600}" \
  --reserve-s 150 --n-eval-run 8 --eval-new-tokens 128 --no-greedy-check --keep-data --no-state --fresh --quiet \
  ${DATA:+--data "$DATA"} ${TRAIN_ARGS:-} > "$out/train.log" 2>&1
echo "$(date -u +%FT%TZ) train exit $?" >> "$out/job.log"
if [ -f "$out/train/drafter/config.json" ]; then
  python3 -m benchmarks.driver --target "/tmp/$target" --draft "$out/train/drafter" --methods none,ours \
    --common-args "--attention-backend triton --sampling-backend pytorch --grammar-backend none \
      --mem-fraction-static ${MEM_FRACTION:-0.3} --cuda-graph-max-bs-decode 32 --max-running-requests 32" \
    --out "$out/server" -- --datasets humaneval,mtbench,gsm --temperatures 0,1 --concurrency "${BENCH_CONC:-8}" \
    --max-new-tokens "${BENCH_TOKENS:-128}" --rounds 1 --min-convs 16 > "$out/server.log" 2>&1
  echo "$(date -u +%FT%TZ) server bench exit $?" >> "$out/job.log"
fi
touch "$out/DONE"
