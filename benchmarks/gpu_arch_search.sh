#!/usr/bin/env bash
# Drafter architecture search (#15 item 3): several drafter shapes trained SIDE BY SIDE on one GPU from the same data
# for the same wall-clock budget, then each measured by tau on the held-out sets (reference engine, float32). Equal
# wall clock on a shared GPU is the fair budget: a deeper drafter gets fewer steps, as it would in any fixed-time run.
# Each config runs benchmarks/gpu_train_job.sh (phases train + tau; no generation, no server) in $out/<name>.
# Needs: source benchmarks/gpu_env.sh; the target staged at /tmp/TARGET; DATA (a data.pt from `train generate`).
#   CONFIGS="l1:1:1536 l2:2:1536" DATA=/tmp/data.pt setsid nohup bash benchmarks/gpu_arch_search.sh smollm2 \
#       .carry/prompts.pt /tmp/arch > /dev/null 2>&1 &
# Knobs: CONFIGS (name:layers:mlp_width ...), TRAIN_S (each run's budget, 540), BATCH (32), EVAL_TEMPS ("0"),
# N_EVAL (32), EVAL_NEW (128). Writes $out/summary.{md,json}, $out/arch_search.png, then $out/DONE.
set -u
target=${1:?target: smollm2|gemma3}; prompts=${2:?prompts file}; out=${3:?output dir}
: "${DATA:?DATA=path of a data.pt}"
mkdir -p "$out"
echo "$(date -u +%FT%TZ) start: ${CONFIGS:=l1:1:1536 l2:2:1536 l3:3:1024 l5:5:1536}" >> "$out/search.log"
for c in $CONFIGS; do
  IFS=: read -r name layers width <<< "$c"
  LAYERS=$layers TRAIN_ARGS="--drafter-intermediate $width" SKIP=data,server DATA=$DATA BATCH=${BATCH:-32} \
    TRAIN_S=${TRAIN_S:-540} EVAL_TEMPS="${EVAL_TEMPS:-0}" N_EVAL=${N_EVAL:-32} EVAL_NEW=${EVAL_NEW:-128} \
    bash benchmarks/gpu_train_job.sh "$target" "$prompts" "$out/$name" &
done
wait
python3 -m benchmarks.arch_search "$out" >> "$out/search.log" 2>&1
echo "$(date -u +%FT%TZ) done" >> "$out/search.log"
touch "$out/DONE"
