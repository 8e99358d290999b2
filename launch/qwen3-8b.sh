#!/usr/bin/env bash
# Qwen3-8B + z-lab/Qwen3-8B-DFlash-b16 (block 16). Thinking off in prompts: the drafter was trained that way.
# Attention: triton for target and drafter (the devstack ships no FA3 kernels; on a full install fa3 is faster).
# Runtime-checked on an H100 with exact-shape random weights (--dummy), see benchmarks/results/.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NAME=qwen3-8b
TARGET=Qwen/Qwen3-8B
DRAFT=z-lab/Qwen3-8B-DFlash-b16
COMMON_ARGS=(--attention-backend "${ATTN_BACKEND:-triton}" --sampling-backend pytorch --mem-fraction-static 0.8
             --cuda-graph-max-bs-decode 128 --max-running-requests 128)
SPEC_ARGS=(--speculative-algorithm DFLASH  # the block size (--speculative-num-draft-tokens) comes from the drafter
           --speculative-draft-attention-backend "${DRAFT_ATTN_BACKEND:-triton}")
NOTES=("max-running-requests is explicit: SGLang silently caps DFLASH at 48 otherwise")
launch_main "$@"
