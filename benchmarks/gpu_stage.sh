#!/usr/bin/env bash
# Stage a payload on the lent GPU machine, which has no network and takes at most 64 MiB per call (the repo included).
#
#   bash benchmarks/gpu_stage.sh --split NAME     # CPU machine: .stage/NAME/p0 .. pK (git-ignored), sha256 inside p0
#   bash benchmarks/gpu_stage.sh NAME             # GPU machine, in every call that carries a piece (back to back:
#                                                 # /tmp survives only while the machine stays warm)
#
# NAME   payload                                               staged on the GPU machine as
# smollm2  SmolLM2-135M-Instruct Q4_1 GGUF (98 MB) + gguf wheel      /tmp/smollm2  (bf16 HF checkpoint dir)
# gemma3   Gemma-3-270M Q4_K_M GGUF (253 MB) + gguf wheel            /tmp/gemma3   (bf16 HF checkpoint dir)
# fa4      CUTLASS DSL 4.6 (cu13) + quack-kernels, for SGLang's fa4  /tmp/fa4/site (benchmarks/gpu_env.sh adds it)
# pd       NIXL 1.5.1 (cu13: the KV transfer of a prefill-decode pair  /tmp/pd/site (benchmarks/gpu_env.sh adds it)
#          between two GPUs) + sglang-router 0.3.2 (launch/pd/serve.sh)
#
# p0 is small (P0_MB, 2.5) so that it fits next to .devstack/part1 in the first call; the others are PIECE_MB (46).
# Exit 3 while pieces are missing; 0 once staged.
set -uo pipefail
P0_MB=${P0_MB:-2.5}
PIECE_MB=${PIECE_MB:-46}
FA4_WHEELS="nvidia-cutlass-dsl==4.6.0 nvidia-cutlass-dsl-libs-base==4.6.0 nvidia-cutlass-dsl-libs-core==4.6.0
  nvidia-cutlass-dsl-libs-cu13==4.6.0 quack-kernels==0.6.3"
# nixl is the import name (a shim that loads nixl_cu13 on a CUDA 13 machine); the mooncake engine's wheel needs
# libcudart.so.12 and libibverbs, which the CUDA 13 GPU image lacks
PD_WHEELS="nixl==1.5.1 nixl-cu13==1.5.1 sglang-router==0.3.2"

split_payload() {  # NAME FILE: cut FILE into .stage/NAME/p0..pK
  local name=$1 src=$2 dir=.stage/$1
  rm -rf "$dir" && mkdir -p "$dir/p0"
  local p0=$(python3 -c "print(int($P0_MB * 1e6))") piece=$(python3 -c "print(int($PIECE_MB * 1e6))")
  head -c "$p0" "$src" > "$dir/p0/payload.0"
  tail -c +$((p0 + 1)) "$src" | split -b "$piece" -d -a 1 - "$dir/tmp."
  local k=1
  for f in "$dir"/tmp.*; do mkdir -p "$dir/p$k"; mv "$f" "$dir/p$k/payload.$k"; k=$((k + 1)); done
  echo "$k" > "$dir/p0/pieces"
  sha256sum "$src" | cut -d' ' -f1 > "$dir/p0/sha256"
  grep -qx '/.stage/' .git/info/exclude || echo '/.stage/' >> .git/info/exclude
  du -sh "$dir"/p*
}

site_payload() {  # NAME WHEELS: cp312 / CUDA 13 wheels installed into one site folder, stripped, xz, split
  local work target=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
                     --platform manylinux2014_x86_64)  # the router's abi3 wheel is tagged manylinux2014
  work=$(mktemp -d)
  python3 -m pip download --no-deps -q -d "$work/wheels" "${target[@]}" $2 || return 1
  python3 -m pip install -q --no-deps --no-index --find-links "$work/wheels" --no-compile "${target[@]}" \
    --target "$work/site" $2 || return 1
  rm -rf "$work/site/bin" "$work/site/nvidia_cutlass_dsl/cu13/lib/stubs/aarch64"*
  find "$work/site" -name '*.so*' -exec strip --strip-debug {} \; 2>/dev/null
  tar -C "$work/site" -cf - . | xz -T2 -9 > "$work/$1.tar.xz" || return 1
  split_payload "$1" "$work/$1.tar.xz"; rm -rf "$work"
}

if [ "${1:-}" = "--split" ]; then
  name=${2:?usage: gpu_stage.sh --split smollm2|gemma3|fa4|pd}
  case $name in
    smollm2|gemma3)
      src=$(python3 -c "from sglang_dflash.targets import $name; print($name.gguf_path())") || exit 1
      split_payload "$name" "$src" || exit 1
      python3 -m pip download --no-deps -q -d ".stage/$name/p0" gguf==0.19.0 || exit 1 ;;
    fa4) site_payload fa4 "$FA4_WHEELS" || exit 1 ;;  # ~63 MB
    pd) site_payload pd "$PD_WHEELS" || exit 1 ;;
    *) echo "unknown payload $name" >&2; exit 2 ;;
  esac
  exit 0
fi

name=${1:?usage: gpu_stage.sh smollm2|gemma3|fa4|pd}
stage=/tmp/stage/$name
mkdir -p "$stage"
cp -f .stage/"$name"/p*/* "$stage"/ 2>/dev/null
case $name in
  fa4) done_mark=/tmp/fa4/site/quack ;;
  pd) done_mark=/tmp/pd/site/sglang_router ;;
  *) done_mark=/tmp/$name/model.safetensors ;;
esac
[ -e "$done_mark" ] && { echo "$name staged"; exit 0; }
[ -f "$stage/pieces" ] || { echo "$name: piece 0 missing"; exit 3; }
n=$(cat "$stage/pieces")
for ((k = 0; k < n; k++)); do [ -f "$stage/payload.$k" ] || { echo "$name: piece $k of $n missing"; exit 3; }; done
for ((k = 0; k < n; k++)); do cat "$stage/payload.$k"; done > "$stage/payload"
[ "$(sha256sum "$stage/payload" | cut -d' ' -f1)" = "$(cat "$stage/sha256")" ] || { echo "sha256 mismatch"; exit 1; }
rm -f "$stage"/payload.[0-9]*
case $name in
  fa4|pd)
    mkdir -p /tmp/$name/site && tar -C /tmp/$name/site -xJf "$stage/payload" || exit 1 ;;
  smollm2|gemma3)
    mv "$stage/payload" "$stage/model.gguf"
    python3 -m pip install --no-deps -q --target /tmp/gguf-site "$stage"/gguf-*.whl || exit 1
    env_var=$(echo "$name" | tr a-z A-Z)_GGUF
    env PYTHONPATH="/tmp/gguf-site:$PWD:${PYTHONPATH:-}" "$env_var=$stage/model.gguf" \
      python3 -c "from sglang_dflash.targets import $name; print($name.convert('/tmp/$name'))" || exit 1 ;;
esac
echo "$name staged"
