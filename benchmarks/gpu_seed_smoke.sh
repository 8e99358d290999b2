#!/usr/bin/env bash
# The seed smoke job (#33): every launch preset's exact command started on the lent GPU with --dummy, none / ours /
# builtin, seconds to healthy, greedy equality against the preset's none and step cost at c = 1, 8, 32
# (benchmarks/seed_recipes.py says what and how). One call runs the phases its deadline allows and stops; the next call
# (back to back: /tmp lives while the machine is warm) resumes where it stopped. Recipes already committed under
# benchmarks/results/seed-recipes are skipped, so a later session goes on from the commit.
#   bash benchmarks/gpu_seed_smoke.sh                 # in every call, from the repo root (after any gpu_stage.sh)
# DEADLINE_S (default 540): no phase starts later than PHASE_S (300 s) before it; RECIPES=a,b picks recipes;
# RERUN=a,b runs those again although benchmarks/results/seed-recipes has their record (their preset changed).
# Two recipes at once on a two-GPU machine: one job per GPU, each with its own port and folder, e.g.
#   CUDA_VISIBLE_DEVICES=1 PORT=30001 RUN=/tmp/seed-smoke1 RECIPES=llama3.1-8b-instruct bash benchmarks/gpu_seed_smoke.sh
# Results: $RUN (/tmp/seed-smoke)/<recipe>/ (driver folders) and <recipe>.json (records); $OUT/<RUN's name>.tar.gz
# (records, summaries, gzipped server logs; greedy outputs left out) and $OUT/<RUN's name>-table.md after each call
# (named by RUN, so two jobs' collects in one call do not overwrite each other).
# A job longer than one call: `--background` starts it from a snapshot of the repo under $RUN-snap (the device
# re-syncs the repo folder at every call; setsid, so the call's end does not kill it; log $RUN.log, "SEED JOB DONE"
# at its end), and each later call runs `--collect`: no new phase, only $RUN's results so far into $OUT. E.g.
#   CUDA_VISIBLE_DEVICES=1 PORT=30001 RUN=/tmp/seed-smoke1 DEADLINE_S=1300 RECIPES=gemma-4-31b-it \
#     bash benchmarks/gpu_seed_smoke.sh --background
#   sleep 500; RUN=/tmp/seed-smoke1 bash benchmarks/gpu_seed_smoke.sh --collect
# AFTER=/tmp/seed-smoke0.log with --background queues a job behind another on the same GPU.
set -uo pipefail
RUN=${RUN:-/tmp/seed-smoke}
case ${1:-} in
  --background)
    snap=$RUN-snap
    rm -rf "$snap" && mkdir -p "$snap"
    tar --exclude=./.devstack --exclude=./.stage --exclude=./.carry --exclude=./.git --exclude=./.venv -cf - . | tar -C "$snap" -xf -
    # AFTER=<another job's log>: one GPU, two jobs in a row (the second waits for the first's last line)
    (cd "$snap" && setsid nohup bash -c 'if [ -n "${AFTER:-}" ]; then until grep -qs "SEED JOB DONE" "$AFTER"; do
        sleep 5; done; fi; bash benchmarks/gpu_seed_smoke.sh; echo "SEED JOB DONE rc=$?"' \
      > "$RUN.log" 2>&1 < /dev/null &)
    echo "seed smoke job started from $snap (log $RUN.log)"
    exit 0 ;;
  --collect) source benchmarks/gpu_env.sh || exit 1; rc=0 ;;
  "")
    source benchmarks/gpu_env.sh || exit 1
    mkdir -p "$RUN"
    python3 -m benchmarks.seed_recipes run --out "$RUN" --done benchmarks/results/seed-recipes \
      --deadline-s "${DEADLINE_S:-540}" --port "${PORT:-30000}" ${RECIPES:+--recipes "$RECIPES"} \
      ${RERUN:+--rerun "$RERUN"}
    rc=$? ;;
  *) echo "usage: bash benchmarks/gpu_seed_smoke.sh [--background | --collect]" >&2; exit 2 ;;
esac
table=$RUN-table
rm -rf "$table" && mkdir -p "$table"
# two copies: one cp refuses to overwrite a file it created itself, and this run's record must win
cp benchmarks/results/seed-recipes/*.json "$table"/ 2>/dev/null
cp "$RUN"/*.json "$table"/ 2>/dev/null
python3 -m benchmarks.seed_recipes table "$table" > /dev/null
if [ -n "${OUT:-}" ]; then
  # from a copy: a running job's server still writes its log, and the driver reads it when a start fails
  copy=$RUN-collect
  rm -rf "$copy" && cp -r "$RUN" "$copy" && find "$copy" -name '*.server.log' -exec gzip -f {} \;
  name=$(basename "$RUN")
  tar czf "$OUT/$name.tar.gz" -C "$copy" --exclude='*.outputs.jsonl.gz' --exclude='*.png' . \
    && cp "$table"/table.md "$OUT/$name-table.md"
  [ -f "$RUN.log" ] && tail -n 5 "$RUN.log"
  cat "$table"/table.md
fi
exit $rc
