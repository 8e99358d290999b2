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
# DFLASH also captures its verify, draft and width graphs: at 0.85 on an H200 ours ran out of memory at its width-4
# graphs (2.27 GB free; the 26B's widths 4 and 8 took 5.84 GB; benchmarks/results/seed-recipes), so the
# speculative methods give 10% of the card back from the KV cache (the last --mem-fraction-static wins), which also
# leaves room for eager forwards such as a prefill chunk over 8192 tokens; plain keeps 0.85
SPEC_ARGS=(--speculative-algorithm DFLASH  # the block size (--speculative-num-draft-tokens) comes from the drafter
           --speculative-draft-attention-backend "${DRAFT_ATTN_BACKEND:-fa4}" --mem-fraction-static 0.75)
NOTES=("31B bf16 weights are ~58.5 GB: the speculative methods need an H200 (on one 80 GB H100, 0.75 leaves no KV cache)"
       "drafter shape for --dummy is UNVERIFIED (single source)")
launch_main "$@"
