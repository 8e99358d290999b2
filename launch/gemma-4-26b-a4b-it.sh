#!/usr/bin/env bash
# Gemma-4-26B-A4B-it + z-lab/gemma-4-26B-A4B-it-DFlash: the seed recipe - target attention triton, draft
# attention fa4, 16 draft tokens, 32768 batched tokens (vLLM's max-num-batched-tokens; in SGLang the chunked-prefill
# size and the prefill token budget).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NAME=gemma-4-26b-a4b-it
TARGET=google/gemma-4-26B-A4B-it
DRAFT=z-lab/gemma-4-26B-A4B-it-DFlash
COMMON_ARGS=(--attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.85
             --chunked-prefill-size 32768 --max-prefill-tokens 32768 --cuda-graph-max-bs-decode 128
             --max-running-requests 128 --trust-remote-code)
SPEC_ARGS=(--speculative-algorithm DFLASH  # the block size (--speculative-num-draft-tokens) comes from the drafter
           --speculative-draft-attention-backend "${DRAFT_ATTN_BACKEND:-fa4}")
NOTES=("fa4 draft attention is the published recipe; it served on an H100 with the Qwen3-8B shape"
       "(benchmarks/results/fa4-draft-h100; the CUTLASS DSL must be installed); DRAFT_ATTN_BACKEND=triton is the fallback")
launch_main "$@"
