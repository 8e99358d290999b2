#!/usr/bin/env bash
# The seed smoke job (#33): every launch preset's exact command started on the lent GPU with --dummy, none / ours /
# builtin, seconds to healthy, greedy equality against the preset's none and step cost at c = 1, 8, 32
# (benchmarks/seed_recipes.py says what and how). One call runs the phases its deadline allows and stops; the next call
# (back to back: /tmp lives while the machine is warm) resumes where it stopped. Recipes already committed under
# benchmarks/results/seed-recipes are skipped, so a later session goes on from the commit.
#   bash benchmarks/gpu_seed_smoke.sh                 # in every call, from the repo root (after any gpu_stage.sh)
# DEADLINE_S (default 540): no phase starts later than PHASE_S (300 s) before it; RECIPES=a,b picks recipes.
# Results: /tmp/seed-smoke/<recipe>/ (driver folders) and <recipe>.json (records); $OUT/seed-smoke.tar.gz
# (records, summaries, gzipped server logs; greedy outputs left out) and $OUT/table.md after each call.
set -uo pipefail
source benchmarks/gpu_env.sh || exit 1
RUN=/tmp/seed-smoke
mkdir -p "$RUN"
python3 -m benchmarks.seed_recipes run --out "$RUN" --done benchmarks/results/seed-recipes \
  --deadline-s "${DEADLINE_S:-540}" ${RECIPES:+--recipes "$RECIPES"}
rc=$?
rm -rf /tmp/seed-table && mkdir -p /tmp/seed-table
cp benchmarks/results/seed-recipes/*.json "$RUN"/*.json /tmp/seed-table/ 2>/dev/null
python3 -m benchmarks.seed_recipes table /tmp/seed-table > /dev/null
if [ -n "${OUT:-}" ]; then
  find "$RUN" -name '*.server.log' -exec gzip -f {} \;
  tar czf "$OUT/seed-smoke.tar.gz" -C "$RUN" --exclude='*.outputs.jsonl.gz' --exclude='*.png' . \
    && cp /tmp/seed-table/table.md "$OUT/"
  cat /tmp/seed-table/table.md
fi
exit $rc
