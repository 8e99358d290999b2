#!/usr/bin/env bash
# launch/pd/serve.sh - a launch preset as a prefill-decode pair on one two-GPU host (issue #49; docs/notes-pd.md):
# the preset's own command twice, prefill on GPU 0 and decode on GPU 1, KV moved by SGLang's transfer engine, and
# SGLang's router in front on the usual port, so an OpenAI client talks to it as to one server.
#
#   bash launch/pd/serve.sh PRESET [--method ours|none] [--dummy DIR] [--port 30000] [--host H] [--dry-run] [-- ARGS]
#
#   PRESET        a script of launch/ (qwen3-8b, llama3.1-8b-instruct: full-attention targets; the others are
#                 refused at start-up under PD until their pools' transfer beside the drafter's is tested)
#   --method      ours (default: our DFLASH worker on both servers, SGLANG_DFLASH_PD=1), or none (the same pair
#                 without speculation, the baseline). SGLang 0.5.17's builtin DFLASH has no PD relay (#36140).
#   --port        the router's (default 30000); the prefill server takes PORT + 1, the decode server PORT + 2
#   -- ARGS       appended to both servers' launch_server arguments
# Environment: PD_BACKEND (mooncake; nixl works the same way, not tested here), PD_BOOTSTRAP_PORT (8998),
# PREFILL_GPU / DECODE_GPU (0 / 1).
# Needs, beside the serving stack: the transfer engine (pip install mooncake-transfer-engine==0.3.13.post1, or
# the -non-cuda wheel on a CPU machine, with libibverbs1 / librdmacm1) and the router
# (pip install sglang-router==0.3.2, tested with SGLang 0.5.17: benchmarks/results/pd-cpu).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
preset=${1:?usage: bash launch/pd/serve.sh PRESET [--method ours|none] [--dummy DIR] [--port N] [--dry-run]}
shift
method=ours port=30000 host=127.0.0.1 dry=0 dummy=() extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --method) method=${2:?}; shift 2 ;;
    --dummy) dummy=(--dummy "${2:?}"); shift 2 ;;
    --port) port=${2:?}; shift 2 ;;
    --host) host=${2:?}; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "[pd] unknown option $1" >&2; exit 2 ;;
  esac
done
case "$method" in ours|none) ;; *) echo "[pd] --method $method: use ours or none (SGLang 0.5.17's builtin DFLASH" \
  "has no prefill-decode relay, sgl-project/sglang#36140)" >&2; exit 2 ;; esac
script="$here/$preset.sh"
[ -f "$script" ] || { echo "[pd] no preset $script" >&2; exit 2; }
backend=${PD_BACKEND:-mooncake} boot=${PD_BOOTSTRAP_PORT:-8998}
pre_port=$((port + 1)) dec_port=$((port + 2))
pd_env=(); [ "$method" = ours ] && pd_env=(SGLANG_DFLASH_PD=1)
opts=(--method "$method" --host "$host" "${dummy[@]}")
[ "$dry" = 1 ] && opts+=(--dry-run)
prefill=(bash "$script" "${opts[@]}" --port "$pre_port" -- "${extra[@]}"
         --disaggregation-mode prefill --disaggregation-transfer-backend "$backend"
         --disaggregation-bootstrap-port "$boot" --base-gpu-id "${PREFILL_GPU:-0}")
decode=(bash "$script" "${opts[@]}" --port "$dec_port" -- "${extra[@]}"
        --disaggregation-mode decode --disaggregation-transfer-backend "$backend" --base-gpu-id "${DECODE_GPU:-1}")
router=("${PYTHON:-python3}" -m sglang_router.launch_router --pd-disaggregation
        --prefill "http://$host:$pre_port" "$boot" --decode "http://$host:$dec_port" --host "$host" --port "$port")
if [ "$dry" = 1 ]; then  # three lines: prefill, decode, router
  for cmd in prefill decode; do
    declare -n c=$cmd
    printf '%s' "${pd_env[*]:+${pd_env[*]} }"; "${c[@]}"
  done
  printf '%q ' "${router[@]}"; echo
  exit 0
fi
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT INT TERM
env "${pd_env[@]}" "${prefill[@]}" & pids+=($!)
env "${pd_env[@]}" "${decode[@]}" & pids+=($!)
for p in "$pre_port" "$dec_port"; do  # the router wants both servers up
  until curl -sf "http://$host:$p/health" > /dev/null; do sleep 5; done
done
echo "[pd] prefill :$pre_port and decode :$dec_port healthy; router on :$port"
"${router[@]}" & pids+=($!)
wait -n "${pids[@]}"
