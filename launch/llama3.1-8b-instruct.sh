#!/usr/bin/env bash
# Llama-3.1-8B-Instruct + z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NAME=llama3.1-8b-instruct
TARGET=meta-llama/Llama-3.1-8B-Instruct
DRAFT=z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat
COMMON_ARGS=(--attention-backend "${ATTN_BACKEND:-triton}" --sampling-backend pytorch --mem-fraction-static 0.8
             --cuda-graph-max-bs-decode 128 --max-running-requests 128)
SPEC_ARGS=(--speculative-algorithm DFLASH  # the block size (--speculative-num-draft-tokens) comes from the drafter
           --speculative-draft-attention-backend "${DRAFT_ATTN_BACKEND:-triton}")
NOTES=("drafter shape for --dummy is UNVERIFIED (see sglang_dflash/targets/shapes.py)")
launch_main "$@"
