#!/usr/bin/env bash
# Issue #37, item 3: the soak on one GPU (H100), not yet run. For each pair in PAIRS, on one GPU:
#   1. the plain server (no speculation) alone under the soak's load: its latencies are the reference
#      (SOAK_S seconds at CONCURRENCY)                                               -> $JOB/<pair>/plain.json
#   2. ours (adaptive widths on, SGLang's defaults: overlap scheduling, CUDA graphs) under the same load, every
#      greedy answer replayed on the plain server and judged (benchmarks/soak.py: identical, or a near-tie of the
#      plain server under TIE_TOL whose rest then equals the plain continuation), requests slower than 2x the
#      plain run's p99 listed, /health and the KV pool polled, the pool back to its idle size at the end
#                                                                                    -> $JOB/<pair>/ours.json
#   plus both servers' logs and meta.json (command, device, date, commit). Pass: ours.json "ok" (0 mismatches
#   outside near-ties, no error, no health failure, pool idle again, none over 2x plain's p99) and, per the
#   issue, >= 2,000 greedy answers compared ("compared").
# Pairs: qwen3-8b (exact shape, random weights: --load-format dummy with SGLANG_DFLASH_DUMMY_WEIGHTS=chain, vocab
# 151,936, prompts of random ids) and
# smollm2 (SmolLM2-135M-Instruct staged at /tmp/smollm2 by `benchmarks/gpu_stage.sh smollm2`, the shipped drafter,
# chat prompts from benchmarks/data). Started on the lent machine after the device stack is installed:
#   PAIRS=qwen3-8b,smollm2 nohup bash benchmarks/gpu_soak_job.sh > /tmp/job/soak.log 2>&1 &
# then copy $JOB (default /tmp/job/soak) to benchmarks/results/soak-h100/. Both servers share the GPU
# (MEM_FRACTION each); the plain one idles while ours is soaked.
set -uo pipefail
JOB=${JOB:-/tmp/job/soak}
SOAK_S=${SOAK_S:-300}
CONCURRENCY=${CONCURRENCY:-128}
TIE_TOL=${TIE_TOL:-0.25}  # bf16: the GPU e2e runs saw near-ties up to 0.21 nats (benchmarks/results/gpu_e2e_smollm2)
MEM_FRACTION=${MEM_FRACTION:-0.4}
source benchmarks/gpu_env.sh || exit 1
COMMON="--attention-backend triton --sampling-backend pytorch --grammar-backend xgrammar --mem-fraction-static
 $MEM_FRACTION --cuda-graph-max-bs-decode $CONCURRENCY --max-running-requests $CONCURRENCY --trust-remote-code
 --enable-cache-report"
DRAFTER=sglang_dflash/assets/SmolLM2-135M-Instruct-DFlash-b16

wait_health() {  # URL PID LOG
  for _ in $(seq 600); do
    curl -sf "$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "server died:"; tail -40 "$3"; return 1; }
    sleep 1
  done
  echo "server not healthy after 600 s"; return 1
}

stop() {  # PID: SIGTERM to its group, then KILL (testing.Server.stop's order)
  kill -TERM -"$1" 2>/dev/null; for _ in $(seq 60); do kill -0 -"$1" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -"$1" 2>/dev/null
}

soak_pair() {  # NAME TARGET DRAFT VOCAB PROMPTS EXTRA_SERVER_ARGS EXTRA_SPEC_ARGS
  local name=$1 target=$2 draft=$3 vocab=$4 prompts=$5 extra=$6 spec_extra=$7 out=$JOB/$1
  mkdir -p "$out"
  setsid python3 -m sglang.launch_server --model-path "$target" --port 30000 $COMMON $extra > "$out/plain.log" 2>&1 &
  local plain=$!
  wait_health http://127.0.0.1:30000 $plain "$out/plain.log" || { stop $plain; return 1; }
  local common_soak="--duration-s $SOAK_S --concurrency $CONCURRENCY --vocab $vocab --max-new-tokens 1024
    --reserve 32 --stall-clients 2 --stall-s 30 $prompts"
  python3 -m benchmarks.soak --url http://127.0.0.1:30000 $common_soak --server-pid $plain --out "$out/plain.json" \
    | tee "$out/plain.txt"
  setsid python3 -m sglang.launch_server --model-path "$target" --port 30001 $COMMON $extra \
    --speculative-algorithm DFLASH --speculative-draft-model-path "$draft" $spec_extra > "$out/ours.log" 2>&1 &
  local ours=$!
  wait_health http://127.0.0.1:30001 $ours "$out/ours.log" || { stop $ours; stop $plain; return 1; }
  python3 -m benchmarks.soak --url http://127.0.0.1:30001 --baseline-url http://127.0.0.1:30000 $common_soak \
    --server-pid $ours --tie-tol "$TIE_TOL" --reference-report "$out/plain.json" --out "$out/ours.json" \
    | tee "$out/ours.txt"
  stop $ours; stop $plain
  python3 - "$out" "$name" <<'EOF'
import json, subprocess, sys, datetime
out, name = sys.argv[1], sys.argv[2]
dev = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                     text=True).stdout.strip()
rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
json.dump({"pair": name, "device": dev, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "commit": rev or "(snapshot)", "job": "benchmarks/gpu_soak_job.sh"}, open(f"{out}/meta.json", "w"), indent=1)
EOF
  gzip -f "$out"/*.log
}

mkdir -p "$JOB"
for pair in $(echo "${PAIRS:-qwen3-8b,smollm2}" | tr , ' '); do
  echo "=== $pair $(date -u +%T)"
  case $pair in
    qwen3-8b)
      [ -d /tmp/shape-qwen3-8b ] || python3 -m sglang_dflash.targets.shapes write qwen3-8b /tmp/shape-qwen3-8b || exit 1
      # the chain target (random weights re-drawn like a model's + the decisive head): greedy answers no bf16
      # rounding flips, so every mismatch the soak reports is a lossless failure, not a near-tie. The shape has no
      # tokenizer: --skip-tokenizer-init (without it SGLang's warm-up request, text, reached the model as zero tokens
      # and killed the plain server, 2026-11-28), so the soak sends token ids only (no chat, completions, grammar)
      SGLANG_DFLASH_DUMMY_WEIGHTS=chain soak_pair qwen3-8b /tmp/shape-qwen3-8b/target /tmp/shape-qwen3-8b/draft 151936 \
        "" "--load-format dummy --skip-tokenizer-init --grammar-backend none" "--speculative-draft-load-format dummy" ;;
    smollm2)
      [ -e /tmp/smollm2/model.safetensors ] || { echo "stage /tmp/smollm2 first (gpu_stage.sh smollm2)"; exit 1; }
      python3 - <<'EOF'
import json
from benchmarks import prompts
from sglang_dflash.targets.smollm2 import load_tokenizer
json.dump(prompts.chat_prompt_ids(load_tokenizer(), 400), open("/tmp/smollm2-soak-prompts.json", "w"))
EOF
      soak_pair smollm2 /tmp/smollm2 "$DRAFTER" 49152 "--prompts /tmp/smollm2-soak-prompts.json" \
        "--dtype bfloat16 --enable-fp32-lm-head" "" ;;
  esac
  tar czf "$JOB/results.tar.gz" -C "$JOB" --exclude=results.tar.gz .
done
echo "=== all done $(date -u +%T)"
