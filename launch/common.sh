# launch/common.sh - shared body of the launch scripts (sourced, not run).
#
# A model script sets, then calls `launch_main "$@"`:
#   NAME          preset name (also the sglang_dflash.targets.shapes name for --dummy)
#   TARGET        default target (HF id or directory; the TARGET_PATH env var overrides)
#   DRAFT         default DFlash drafter (the DRAFT_PATH env var overrides)
#   PREPARE       optional: Python code that creates the default TARGET when it is missing (run once, not on
#                 --dry-run, not when TARGET_PATH is set)
#   COMMON_ARGS   launch_server arguments for every method (array)
#   SPEC_ARGS     extra arguments for the speculative methods (array); no --speculative-num-draft-tokens: our
#                 startup and SGLang's builtin DFLASH both take the block size from the drafter's config.json
#   BUILTIN_OK    0 when SGLang's builtin DFLASH cannot serve this target (default 1)
#   NOTES         lines printed with --help
#
# Options of every script:
#   --method ours|builtin|none   ours (default): our worker through the plugin; builtin: SGLang's own DFLASH
#                                worker, selected with $DFLASH_WORKER_ENV (default SGLANG_DFLASH_WORKER=builtin);
#                                none: the target alone
#   --dummy DIR                  exact-shape random weights: writes DIR/target and DIR/draft configs with
#                                `python -m sglang_dflash.targets.shapes write NAME DIR` if absent, and serves them with
#                                --load-format dummy (+ draft) --skip-tokenizer-init, weights re-drawn like a
#                                model's with the decisive chain head (SGLANG_DFLASH_DUMMY_WEIGHTS=chain: greedy
#                                outputs no bf16 rounding flips, so equality with plain decoding is exact).
#                                Cost only: never report acceptance from it.
#   --cpu                        a CPU machine: hands target + drafter to `python -m sglang_dflash serve
#                                --device cpu`, which sets SGLang's CPU engine up (stub libcuda, float32,
#                                torch_native attention, bounded KV pool) and prints the exact command. The
#                                preset's GPU flags are dropped; --method ours, or none (serve --no-speculation,
#                                the baseline); not builtin (SGLang's builtin DFLASH refuses CPU devices)
#   --port N --host H            (default 30000, 127.0.0.1)
#   --dry-run                    print the command (one line, env prefix included) and exit
#   -- ARGS                      appended to the launch_server arguments
set -euo pipefail

launch_usage() {
  sed -n '/^# Options/,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  echo
  echo "preset $NAME: target $TARGET, drafter $DRAFT"
  for n in "${NOTES[@]:-}"; do [ -n "$n" ] && echo "  note: $n"; done
  return 0
}

launch_main() {
  local method=ours dummy="" port=30000 host=127.0.0.1 dry=0 cpu=0 extra=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --method) method=${2:?--method needs a value}; shift 2 ;;
      --dummy) dummy=${2:?--dummy needs a directory}; shift 2 ;;
      --port) port=${2:?}; shift 2 ;;
      --host) host=${2:?}; shift 2 ;;
      --dry-run) dry=1; shift ;;
      --cpu) cpu=1; shift ;;
      -h|--help) launch_usage; return 0 ;;
      --) shift; extra=("$@"); break ;;
      *) echo "[$NAME] unknown option $1 (see --help)" >&2; return 2 ;;
    esac
  done
  case "$method" in ours|builtin|none) ;; *) echo "[$NAME] --method $method: use ours, builtin or none" >&2; return 2 ;; esac
  if [ "$method" = builtin ] && [ "${BUILTIN_OK:-1}" = 0 ]; then
    echo "[$NAME] SGLang 0.5.17's builtin DFLASH cannot serve this target (its model class has no" \
         "set_dflash_layers_to_capture); use --method ours or none" >&2
    return 2
  fi
  local target=${TARGET_PATH:-$TARGET} draft=${DRAFT_PATH:-$DRAFT}
  if [ -n "${PREPARE:-}" ] && [ -z "${TARGET_PATH:-}" ] && [ -z "$dummy" ] && [ "$dry" = 0 ] \
     && [ ! -f "$target/config.json" ]; then
    echo "[$NAME] creating the target $target: ${PYTHON:-python3} -c \"$PREPARE\"" >&2
    ${PYTHON:-python3} -c "$PREPARE" >&2
  fi
  if [ "$cpu" = 1 ]; then
    if [ "$method" = builtin ]; then
      echo "[$NAME] --cpu --method builtin: SGLang's builtin DFLASH refuses CPU devices. Fix: use --method ours" \
           "(our worker) or --method none (plain decoding)" >&2
      return 2
    fi
    local sargs=(--device cpu --host "$host" --port "$port") more=()
    if [ -n "$dummy" ]; then
      target="$dummy/target"; draft="$dummy/draft"
      if [ "$dry" = 0 ] && [ ! -f "$target/config.json" ]; then
        ${PYTHON:-python3} -m sglang_dflash.targets.shapes write "$NAME" "$dummy" >&2
      fi
      more=(--load-format dummy --skip-tokenizer-init)
      [ "$method" = ours ] && more+=(--speculative-draft-load-format dummy)
    fi
    sargs+=(--target "$target")
    # none: serve's plain decoding, the same CPU settings without the DFLASH flags (no drafter)
    if [ "$method" = none ]; then sargs+=(--no-speculation); else sargs+=(--draft "$draft"); fi
    [ "$dry" = 1 ] && sargs+=(--dry-run)
    local switch=${DFLASH_WORKER_ENV:-SGLANG_DFLASH_WORKER=builtin}
    exec env -u "${switch%%=*}" "${PYTHON:-python3}" -m sglang_dflash serve \
      "${sargs[@]}" -- "${more[@]}" "${extra[@]}"
  fi
  local args=(--model-path "$target" --host "$host" --port "$port" "${COMMON_ARGS[@]}")
  if [ -n "$dummy" ]; then
    target="$dummy/target"; draft="$dummy/draft"
    if [ "$dry" = 0 ] && [ ! -f "$target/config.json" ]; then
      ${PYTHON:-python3} -m sglang_dflash.targets.shapes write "$NAME" "$dummy" >&2
    fi
    args=(--model-path "$target" --host "$host" --port "$port" "${COMMON_ARGS[@]}"
          --load-format dummy --skip-tokenizer-init)
  fi
  local envs=()
  local var=${DFLASH_WORKER_ENV:-SGLANG_DFLASH_WORKER=builtin}
  if [ "$method" != none ]; then
    args+=(--speculative-draft-model-path "$draft" "${SPEC_ARGS[@]}")
    [ -n "$dummy" ] && args+=(--speculative-draft-load-format dummy)
    if [ "$method" = builtin ]; then envs=("$var"); else envs=("-u" "${var%%=*}"); fi
  fi
  # random weights scaled like a trained model's, with the decisive chain head (sglang_dflash/targets/chain_head.py:
  # greedy outputs that no bf16 rounding flips), for every method alike
  [ -n "$dummy" ] && envs+=(SGLANG_DFLASH_DUMMY_WEIGHTS=chain)
  args+=("${extra[@]}")
  if [ "$dry" = 1 ]; then
    printf '%s' "env"; printf ' %q' "${envs[@]}" "${PYTHON:-python3}" -m sglang.launch_server "${args[@]}"; echo
    return 0
  fi
  exec env "${envs[@]}" "${PYTHON:-python3}" -m sglang.launch_server "${args[@]}"
}
