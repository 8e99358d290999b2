"""Drafter training: anchors and block masks (blocks), the position-decayed loss, the training loop (loop: `Trainer`, batched,
bf16, checkpoint/resume; `train_drafter` runs it on in-memory sequences), data (prompts, TokenStore), generation of
the target's own responses, tau evaluation, and the end-to-end pipeline (`python -m sglang_dflash.train`)."""
