#!/usr/bin/env bash
# Gemma-4-26B-A4B-it + z-lab/gemma-4-26B-A4B-it-DFlash: the seed recipe - target attention triton, draft
# attention fa4, 16 draft tokens, 32768 batched tokens (vLLM's max-num-batched-tokens; in SGLang the chunked-prefill
# size and the prefill token budget). SGLang 0.5.17 captures prefill CUDA graphs up to the chunk size by default:
# at 32768 tokens they took 10.6 GB and 235 s of start-up on an H200, and with --mem-fraction-static 0.85 both DFLASH
# workers then ran out of memory capturing their own graphs (benchmarks/results/seed-recipes); longer prefills are
# compute-bound, so graphs stop at 8192 tokens (--cuda-graph-max-bs-prefill) and the rest of the recipe stays.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NAME=gemma-4-26b-a4b-it
TARGET=google/gemma-4-26B-A4B-it
DRAFT=z-lab/gemma-4-26B-A4B-it-DFlash
COMMON_ARGS=(--attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.85
             --chunked-prefill-size 32768 --max-prefill-tokens 32768 --cuda-graph-max-bs-decode 128
             --cuda-graph-max-bs-prefill 8192
             --max-running-requests 128 --trust-remote-code)
# DFLASH also captures its verify, draft and width graphs (6.75 + 2.13 + 6.86 GB on an H200 on 2026-11-28, where the
# 0.85 above left ours 0.57 GB for every eager forward, e.g. a prefill chunk over 8192 tokens), so the speculative
# methods give 5% of the card back from the KV cache (the last --mem-fraction-static wins); plain keeps 0.85
SPEC_ARGS=(--speculative-algorithm DFLASH  # the block size (--speculative-num-draft-tokens) comes from the drafter
           --speculative-draft-attention-backend "${DRAFT_ATTN_BACKEND:-fa4}" --mem-fraction-static 0.80)
NOTES=("fa4 draft attention is the published recipe; it served on an H100 with the Qwen3-8B shape"
       "(benchmarks/results/fa4-draft-h100; the CUTLASS DSL must be installed); DRAFT_ATTN_BACKEND=triton is the fallback")
launch_main "$@"
