# Source on the lent GPU machine, from the repo root:  source benchmarks/gpu_env.sh
# Puts the device-stack SGLang (shared/device-stack) first on PYTHONPATH and registers our plugin without pip:
# the GPU machine's setuptools is too old to build our wheel (SPDX license string), so the entry point is declared
# by a hand-written dist-info in the stack's site folder, and the package is imported from this tree.
if [ -f .devstack/part1/install.sh ]; then
  eval "$(bash .devstack/part1/install.sh)" || return 1
else
  source /tmp/devstack/env.sh || { echo "no device stack: carry .devstack/part1 in this call" >&2; return 1; }
fi
_di=/tmp/devstack/site/sglang_dflash-0.1.0.dist-info
mkdir -p "$_di" /tmp/ours
printf 'Metadata-Version: 2.1\nName: sglang-dflash\nVersion: 0.1.0\n' > "$_di/METADATA"
printf '[sglang.srt.plugins]\ndflash = sglang_dflash.serving.plugin:register\n' > "$_di/entry_points.txt"
ln -sfn "$PWD/sglang_dflash" /tmp/ours/sglang_dflash
# kernels/ ships as sglang_dflash.kernels only through the installed package's package-dir mapping
ln -sfn "$PWD/kernels" "$PWD/sglang_dflash/kernels"
export PYTHONPATH="/tmp/ours:$PWD:$PYTHONPATH" PYTHONUNBUFFERED=1
# SGLang's fa4 attention (its vendored flash_attn.cute) needs the CUTLASS DSL: staged by `gpu_stage.sh fa4`
# a prefill-decode pair on two GPUs needs NIXL and SGLang's router: staged by `gpu_stage.sh pd`
[ -d /tmp/pd/site/sglang_router ] && export PYTHONPATH="/tmp/pd/site:$PYTHONPATH"
if [ -d /tmp/fa4/site/quack ]; then
  export PYTHONPATH="/tmp/fa4/site:/tmp/fa4/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
fi
