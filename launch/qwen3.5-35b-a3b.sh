#!/usr/bin/env bash
# Qwen3.5-35B-A3B (hybrid Gated-DeltaNet + attention, MoE) + z-lab/Qwen3.5-35B-A3B-DFlash.
# The hybrid target's recurrent state needs SGLang's extra-buffer mamba scheduling for speculative decoding.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NAME=qwen3.5-35b-a3b
TARGET=Qwen/Qwen3.5-35B-A3B
DRAFT=z-lab/Qwen3.5-35B-A3B-DFlash
COMMON_ARGS=(--attention-backend "${ATTN_BACKEND:-triton}" --sampling-backend pytorch --mem-fraction-static 0.8
             --cuda-graph-max-bs-decode 128 --max-running-requests 128 --mamba-radix-cache-strategy extra_buffer
             --trust-remote-code)
SPEC_ARGS=(--speculative-algorithm DFLASH  # the block size (--speculative-num-draft-tokens) comes from the drafter
           --speculative-draft-attention-backend "${DRAFT_ATTN_BACKEND:-triton}")
NOTES=("drafter shape for --dummy is UNVERIFIED (sources disagree)"
       "published example uses trtllm_mha (Blackwell) + fa4; triton is the portable choice")
launch_main "$@"
