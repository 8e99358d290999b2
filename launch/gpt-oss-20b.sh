#!/usr/bin/env bash
# gpt-oss-20b (24 layers alternating sliding-window (128) and full attention, both with attention sinks; 32-expert
# MoE in MXFP4) + z-lab/gpt-oss-20b-DFlash.
# Attention: triton for target and drafter (SGLang's triton backend serves sinks and windows; our verify kernel hands
# layers with sinks to SGLang's kernel, with one logged reason).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NAME=gpt-oss-20b
TARGET=openai/gpt-oss-20b
DRAFT=z-lab/gpt-oss-20b-DFlash
COMMON_ARGS=(--attention-backend "${ATTN_BACKEND:-triton}" --sampling-backend pytorch --mem-fraction-static 0.8
             --cuda-graph-max-bs-decode 128 --max-running-requests 128 --trust-remote-code)
SPEC_ARGS=(--speculative-algorithm DFLASH  # the block size (--speculative-num-draft-tokens) comes from the drafter
           --speculative-draft-attention-backend "${DRAFT_ATTN_BACKEND:-triton}")
NOTES=("drafter shape for --dummy is UNVERIFIED (no published config seen)"
       "--dummy serves bf16 experts (no quantization_config): the cost of a bf16 deployment, not MXFP4's")
launch_main "$@"
