"""Drafter training: anchors and block masks (blocks), the position-decayed loss, the training loops (trainer: the
small one-sequence loop; loop: batched, bf16, checkpoint/resume), data (prompts, TokenStore), generation of the
target's own responses, tau evaluation, and the end-to-end pipeline (`python -m sglang_dflash.train`)."""
