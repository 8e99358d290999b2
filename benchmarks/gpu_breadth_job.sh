#!/usr/bin/env bash
# One background GPU job for the breadth issues: tensor parallelism (#32) and hybrid / MoE targets (#31). Started on
# the lent GPU machine once the device stack is installed, then polled (a machine idle 30 s goes back):
#   nohup bash benchmarks/gpu_breadth_job.sh > /tmp/job/log 2>&1 &
# It runs from a snapshot under /tmp/job/snap (the device re-syncs the repo folder at every call).
#   tp2     driver, Qwen3-8B shape (random weights), --tp-size 2 on two GPUs: TP2_METHODS (none, ours-fixed, ours,
#           builtin), greedy, c = 1, 8, 32, 64; the report's cross-check compares every greedy output with none's
#                                                                                                 -> /tmp/job/tp2
#   tp2gemma  the same for the Gemma-4-31B shape at --tp-size 2 (61 GB of bf16 weights over two GPUs), c = 1, 8, 32, 64
#                                                                                           -> /tmp/job/tp2gemma
#   tp2eq   greedy equality at --tp-size 2 on many prompts: TP2EQ_SHAPES (qwen3-8b,gemma-4-31b-it) x none / ours /
#           ours-fixed, 256 prompts at c = 1 and at c = 32, 64 new tokens each            -> /tmp/job/tp2eq-<shape>
#   hybrid  driver, Qwen3.5-35B-A3B shape (hybrid Gated DeltaNet + attention, MoE; random weights) on one GPU with
#           SGLang's extra-buffer mamba radix cache and its default prefill CUDA graphs (the path that crashed):
#           HYBRID_METHODS (none, ours-fixed, ours, builtin: SGLang 0.5.17's builtin refuses this class at start,
#           recorded as skipped), greedy, c = 1, 8, 32                                          -> /tmp/job/hybrid
#   gptoss  driver, gpt-oss-20b shape (alternating sliding / full attention with sinks, MoE; bf16 random weights):
#           GPTOSS_METHODS (none, ours-fixed, builtin), greedy, c = 1, 8, 32                    -> /tmp/job/gptoss
#   fa4     draft attention on fa4 (SGLang's vendored flash_attn.cute, SM90 path; needs `gpu_stage.sh fa4` first),
#           Qwen3-8B shape, one GPU: none / ours-fixed / builtin with draft triton (-> /tmp/job/fa4-triton), then
#           ours-fixed / builtin with draft fa4 (-> /tmp/job/fa4, cross-checked against the same none), c = 1, 8, 32
# PHASES picks and orders them (default tp2); /tmp/job/<phase>.done marks each finished phase, and
# /tmp/job/results.tar.gz holds every result so far.
set -uo pipefail
JOB=/tmp/job
SNAP=$JOB/snap
mkdir -p "$JOB" && rm -rf "$SNAP" && mkdir -p "$SNAP"
tar --exclude=./.devstack --exclude=./.stage --exclude=./.carry -cf - . | tar -C "$SNAP" -xf -
cd "$SNAP" && source benchmarks/gpu_env.sh || exit 1
# the Qwen3-8B runs' settings (gpu_step_job.sh), plus the ranks
COMMON_TP2="--attention-backend triton --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.8
 --cuda-graph-max-bs-decode 64 --max-running-requests 64 --trust-remote-code --disable-prefill-cuda-graph
 --cuda-graph-bs-decode 1 2 4 8 16 32 64 --tp-size 2"
# the preset's flags (launch/qwen3.5-35b-a3b.sh) at max batch 32; prefill CUDA graphs left on (SGLang's default)
COMMON_HYBRID="--attention-backend triton --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.85
 --cuda-graph-max-bs-decode 32 --max-running-requests 32 --mamba-radix-cache-strategy extra_buffer --trust-remote-code
 --cuda-graph-bs-decode 1 2 4 8 16 32"
COMMON_8B="--attention-backend triton --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.8
 --cuda-graph-max-bs-decode 32 --max-running-requests 32 --trust-remote-code --disable-prefill-cuda-graph
 --cuda-graph-bs-decode 1 2 4 8 16 32"
COMMON_TP2_GEMMA="--attention-backend triton --sampling-backend pytorch --grammar-backend none
 --mem-fraction-static 0.85 --cuda-graph-max-bs-decode 64 --max-running-requests 64 --trust-remote-code
 --disable-prefill-cuda-graph --cuda-graph-bs-decode 1 2 4 8 16 32 64 --tp-size 2"
COMMON_GPTOSS="--attention-backend triton --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.85
 --cuda-graph-max-bs-decode 32 --max-running-requests 32 --trust-remote-code --disable-prefill-cuda-graph
 --cuda-graph-bs-decode 1 2 4 8 16 32"

cost() {  # RUN SHAPE METHODS CONCURRENCY COMMON VOCAB: gpu_cost_run.sh (driver + report) into RUN
  OUT= RUN=$1 SHAPE=$2 METHODS=$3 CONCURRENCY=$4 COMMON_ARGS=$5 RANDOM_VOCAB=$6 SPEC_ARGS="${SPEC_ARGS:-}" TEMPERATURES=0 ROUNDS=2 \
    DEADLINE_S=2400 bash benchmarks/gpu_cost_run.sh
}

for phase in $(echo "${PHASES:-tp2}" | tr , ' '); do
  echo "=== $phase $(date -u +%T)"
  case $phase in
    tp2) cost $JOB/tp2 qwen3-8b "${TP2_METHODS:-none,ours-fixed,ours,builtin}" 1,8,32,64 "$COMMON_TP2" 151000 ;;
    tp2gemma) cost $JOB/tp2gemma gemma-4-31b-it "${TP2_METHODS:-none,ours-fixed,ours,builtin}" 1,8,32,64 \
                "$COMMON_TP2_GEMMA" 262000 ;;
    tp2eq)
      for shape in $(echo "${TP2EQ_SHAPES:-qwen3-8b,gemma-4-31b-it}" | tr , ' '); do
        common=$COMMON_TP2; vocab=151000
        [ "$shape" = gemma-4-31b-it ] && { common=$COMMON_TP2_GEMMA; vocab=262000; }
        [ -d "/tmp/shape-$shape" ] || python3 -m sglang_dflash.targets.shapes write "$shape" "/tmp/shape-$shape"
        python3 -m benchmarks.driver --target "/tmp/shape-$shape/target" --draft "/tmp/shape-$shape/draft" --dummy \
          --methods none,ours,ours-fixed --out "$JOB/tp2eq-$shape" --wait-s 400 --common-args "$common" \
          --title "$shape at --tp-size 2: greedy equality" -- --datasets random --temperatures 0 --concurrency 1,32 \
          --max-new-tokens 64 --ignore-eos --random-input-len 128 --random-vocab $vocab --rounds 1 --min-convs 256 \
          --no-progress
        python3 -m benchmarks.report "$JOB/tp2eq-$shape" --title "$shape at --tp-size 2: greedy equality" >/dev/null
      done ;;
    hybrid) cost $JOB/hybrid qwen3.5-35b-a3b "${HYBRID_METHODS:-none,ours-fixed,ours,builtin}" 1,8,32 \
              "$COMMON_HYBRID" 248000 ;;
    fa4)
      cost $JOB/fa4-triton qwen3-8b "${FA4_BASE_METHODS:-none,ours-fixed,builtin}" 1,8,32 "$COMMON_8B" 151000
      mkdir -p $JOB/fa4 && cp $JOB/fa4-triton/none.json $JOB/fa4-triton/none.outputs.jsonl.gz $JOB/fa4/
      SPEC_ARGS="--speculative-algorithm DFLASH --speculative-draft-attention-backend fa4" \
        cost $JOB/fa4 qwen3-8b "${FA4_METHODS:-ours-fixed,builtin}" 1,8,32 "$COMMON_8B" 151000 ;;
    gptoss) cost $JOB/gptoss gpt-oss-20b "${GPTOSS_METHODS:-none,ours-fixed,builtin}" 1,8,32 "$COMMON_GPTOSS" 200000 ;;
  esac
  touch "$JOB/$phase.done"
  done_dirs=$(cd $JOB && ls -d tp2 tp2gemma tp2eq-* hybrid gptoss fa4-triton fa4 2>/dev/null)
  tar czf $JOB/results.tar.gz -C $JOB $done_dirs 2>/dev/null
done
echo "=== all done $(date -u +%T)"
