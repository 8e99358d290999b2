#!/usr/bin/env bash
# Gemma-4-31B-it + z-lab/gemma-4-31B-it-DFlash (same recipe as the 26B-A4B).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NAME=gemma-4-31b-it
TARGET=google/gemma-4-31B-it
DRAFT=z-lab/gemma-4-31B-it-DFlash
COMMON_ARGS=(--attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.85
             --chunked-prefill-size 32768 --max-prefill-tokens 32768 --cuda-graph-max-bs-decode 128
             --cuda-graph-max-bs-prefill 8192
             --max-running-requests 128 --trust-remote-code)
SPEC_ARGS=(--speculative-algorithm DFLASH  # the block size (--speculative-num-draft-tokens) comes from the drafter
           --speculative-draft-attention-backend "${DRAFT_ATTN_BACKEND:-fa4}")
NOTES=("31B bf16 weights are ~61 GB: on one 80 GB H100 lower --mem-fraction-static only with care"
       "drafter shape for --dummy is UNVERIFIED (single source)")
launch_main "$@"
