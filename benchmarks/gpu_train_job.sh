#!/usr/bin/env bash
# Train a drafter for a staged real target on the lent GPU machine and measure it, as ONE background job that
# outlives the 600 s limit of a call (start it with setsid; later calls poll $out/DONE and copy $out back):
#   0. self:   (with SELF_N) python -m sglang_dflash.train self-prompts: SELF_N user requests written by the target
#              itself, one MT-Bench style after another (SELF_STYLES, default mtbench), answered like phase 1's
#              prompts into $out/self_data.pt, which training joins to the other data;
#   1. data:   python -m sglang_dflash.train generate: the target's own responses from an SGLang server, every
#              prompt answered twice (greedy, and T = 1 with a per-request seed), token ids only;
#   2. train:  python -m sglang_dflash.train run --data: training to a deadline (resumable from $out/train/state);
#   3. tau:    python -m sglang_dflash.train eval: the reference engine in float32 on the held-out sets, greedy
#              output checked against target-only decoding; one JSON per (set, T) under $out/drafters/; with
#              BASELINE_DRAFTER also that drafter on the same prompts (tau_baseline.json, drafters_baseline/) and
#              both side by side (train compare -> tau_compare.json);
#   4. server: benchmarks.driver, none vs ours, real prompts, c = $BENCH_CONC, greedy outputs cross-checked.
# Needs: source benchmarks/gpu_env.sh; bash benchmarks/gpu_stage.sh TARGET (-> /tmp/TARGET); the prompts file
# (python -m sglang_dflash.train prepare). Start:
#   setsid nohup bash benchmarks/gpu_train_job.sh smollm2 .carry/prompts.pt /tmp/job_smollm2 > /dev/null 2>&1 &
# Knobs (environment): LAYERS (2), BATCH (16), GEN_BUDGET_S (200), GEN_MEM (the generation server's memory
# fraction, 0.6), GEN_GROUP (prompts per /generate request, 32), GEN_ARGS (extra, e.g. --skip-answered OLD.pt),
# MAX_NEW (256), TRAIN_S (the training run's whole budget, 420), TRAIN_END (train until this epoch second instead),
# TRAIN_ARGS (extra), DATA (an
# earlier data.pt: skip generation), EXTRA_DATA (more data.pt files to train on, joined with it), N_EVAL (32), EVAL_NEW (128), EVAL_TEMPS ("0 1"), BENCH_SETS (humaneval,mtbench,gsm), BENCH_CONC (1,8), BENCH_TOKENS (192),
# DRAFTER (the drafter the tau and server phases measure: $out/train/drafter, or e.g. a shipped one with
# SKIP=data,train), BENCH_METHODS (none,ours; builtin and ours-fixed too for a side-by-side run),
# SKIP (comma list of phases to skip: data,train,tau,server), WAIT_FOR (a file, e.g. another job's DONE, that the
# server phase waits for, up to 10 min), SELF_N (requests to sample in phase 0; unset: no phase 0), SELF_STYLES,
# SELF_BUDGET_S (the sampling's budget, 120), SELF_GEN_BUDGET_S (the answers' budget, 200).
# GEN_PASSES (greedy,sampled; greedy: one greedy answer per prompt), ARCH (dflash; dflash2: train run --arch dflash2,
# sizes in TRAIN_ARGS, e.g. --conv-group-size 64), INIT_DRAFTER (train run --init-drafter: a drafter to start from; for
# ARCH=dflash2 a DFlash drafter gives the backbone), BASELINE_DRAFTER (a drafter the tau phase also measures, to
# compare with; default INIT_DRAFTER when ARCH=dflash2; "none": none), BASELINE_CHECK (1: check its greedy output
# against plain decoding too; default 0, the plain decoding then runs once, for the new drafter).
set -u
target=${1:?target: smollm2|gemma3}; prompts=${2:?prompts file}; out=${3:?output dir}
mkdir -p "$out"
# run from a snapshot of the tree: later calls re-sync the repo folder while this job is still running
snap=/tmp/snap_$(basename "$out"); rm -rf "$snap"; mkdir -p "$snap"
tar -C . --exclude=./.devstack --exclude=./.stage -cf - . | tar -C "$snap" -xf - && cd "$snap" || exit 1
export PYTHONPATH="$snap:${PYTHONPATH:-}"
log() { echo "$(date -u +%FT%TZ) $*" >> "$out/job.log"; }
skip() { case ",${SKIP:-}," in *",$1,"*) return 0 ;; esac; return 1; }
log "start $target on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
T=(--target "$target" --hf-dir "/tmp/$target" --prompts "$prompts")

GEN_SERVER="--attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-prefill-cuda-graph --mem-fraction-static ${GEN_MEM:-0.6} --cuda-graph-max-bs-decode 512 --max-running-requests 512"
# greedy and T = 1 answers of every prompt: two passes through one server (the second pass reuses its prefixes)
answer() {  # answer PROMPTS_FILE DATA_OUT BUDGET_S [extra generate args]
  python3 -m sglang_dflash.train generate --target "$target" --hf-dir "/tmp/$target" --prompts "$1" --out "$2" \
    --passes "${GEN_PASSES:-greedy,sampled}" --max-new-tokens "${MAX_NEW:-256}" --concurrency 512 \
    --request-group "${GEN_GROUP:-32}" \
    --gen-budget-s "$3" --quiet "${@:4}" --server-args="$GEN_SERVER"
}

if [ -n "${SELF_N:-}" ] && ! skip self; then
  python3 -m sglang_dflash.train self-prompts --target "$target" --hf-dir "/tmp/$target" --out "$out/self_prompts.pt" \
    --n "$SELF_N" --styles "${SELF_STYLES:-mtbench}" --concurrency 512 --request-group "${GEN_GROUP:-32}" \
    --gen-budget-s "${SELF_BUDGET_S:-120}" --quiet --server-args="$GEN_SERVER" > "$out/self_prompts.log" 2>&1
  log "self-prompts exit $?"
  answer "$out/self_prompts.pt" "$out/self_data.pt" "${SELF_GEN_BUDGET_S:-200}" > "$out/self_generate.log" 2>&1
  log "self-prompts answered exit $?"
  [ -f "$out/self_data.pt" ] && EXTRA_DATA="${EXTRA_DATA:-} $out/self_data.pt"
fi

data=${DATA:-$out/data.pt}
if ! skip data && [ -z "${DATA:-}" ]; then
  # shellcheck disable=SC2086
  answer "$prompts" "$data" "${GEN_BUDGET_S:-200}" ${GEN_ARGS:-} > "$out/generate.log" 2>&1
  log "generate exit $?"
fi

if ! skip train; then
  # TRAIN_END (epoch seconds): train until then, whatever generation took (a loan ends at a fixed time)
  [ -n "${TRAIN_END:-}" ] && TRAIN_S=$((TRAIN_END - $(date +%s)))
  python3 -m sglang_dflash.train run "${T[@]}" --data "$data" ${EXTRA_DATA:-} --out "$out/train" --layers "${LAYERS:-2}" \
    --arch "${ARCH:-dflash}" ${INIT_DRAFTER:+--init-drafter "$INIT_DRAFTER"} \
    --steps 1000000 --batch-size "${BATCH:-16}" --deadline-s "${TRAIN_S:-420}" --reserve-s 30 --n-eval-run 0 --quiet ${TRAIN_ARGS:-} > "$out/train.log" 2>&1
  log "train exit $?"
fi

drafter=${DRAFTER:-$out/train/drafter}
baseline=${BASELINE_DRAFTER:-}
[ -z "$baseline" ] && [ "${ARCH:-dflash}" = dflash2 ] && baseline=${INIT_DRAFTER:-}
[ "$baseline" = none ] && baseline=
tau() {  # tau DRAFTER NAME [extra eval args]: $out/NAME.json, one JSON per (set, T) under $out/drafters${NAME#tau}/
  python3 -m sglang_dflash.train eval "${T[@]}" --drafter "$1" --device cuda --dtype float32 \
    --n-eval "${N_EVAL:-32}" --eval-new-tokens "${EVAL_NEW:-128}" --temperatures ${EVAL_TEMPS:-0 1} --eval-batch 32 \
    --out "$out/$2.json" --results-dir "$out/drafters${2#tau}" "${@:3}" > "$out/$2.log" 2>&1
  log "$2 exit $? ($1)"
}
if ! skip tau && [ -f "$drafter/config.json" ]; then
  tau "$drafter" tau
  if [ -n "$baseline" ]; then
    check=(--no-greedy-check); [ "${BASELINE_CHECK:-0}" = 1 ] && check=()
    tau "$baseline" tau_baseline "${check[@]}"
    python3 -m sglang_dflash.train compare --new "$out/tau.json" --base "$out/tau_baseline.json" \
      --out "$out/tau_compare.json" > "$out/tau_compare.log" 2>&1
    log "compare exit $?: $(tail -1 "$out/tau_compare.log")"
  fi
fi

if ! skip server && [ -f "$drafter/config.json" ]; then
  # a speed measurement needs the GPU to itself: wait (bounded) for another job sharing the machine to finish
  for _ in $(seq 1 120); do [ -z "${WAIT_FOR:-}" ] || [ -f "$WAIT_FOR" ] && break; sleep 5; done
  python3 -m benchmarks.driver --target "/tmp/$target" --draft "$drafter" --methods "${BENCH_METHODS:-none,ours}" \
    --common-args "--attention-backend triton --sampling-backend pytorch --grammar-backend none \
      --mem-fraction-static 0.5 --cuda-graph-max-bs-decode 32 --max-running-requests 32" \
    --out "$out/server" -- --datasets "${BENCH_SETS:-humaneval,mtbench,gsm}" --temperatures 0 --concurrency "${BENCH_CONC:-1,8}" \
    --max-new-tokens "${BENCH_TOKENS:-192}" --rounds 2 --min-convs 16 > "$out/server.log" 2>&1
  log "server bench exit $?"
fi
touch "$out/DONE"
