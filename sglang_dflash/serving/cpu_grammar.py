"""CPU stand-ins for SGLang 0.5.17's xgrammar backend, so grammar-constrained requests run on the CPU test servers.

SGLang's xgrammar backend assumes an accelerator in two places: it pins every token bitmask (pinning needs a CUDA
driver) and applies masks with its CUDA / Triton kernels only (CPU logits raise "Unsupported device"). On CPU the
bitmask is allocated unpinned and applied with xgrammar's own CPU implementation; the bits, and so the masked
logits, are the same. Both stand-ins pass through untouched whenever CUDA is present / the logits are not on CPU.
"""

from __future__ import annotations

import torch


def allocate_token_bitmask(original, vocab_size: int, batch_size: int) -> torch.Tensor:
    if torch.cuda.is_available():
        return original(vocab_size, batch_size)
    from sglang.srt.constrained.xgrammar_backend import bitmask_dtype, get_bitmask_shape

    return torch.full(get_bitmask_shape(batch_size, vocab_size), -1, dtype=bitmask_dtype)


def apply_vocab_mask(original, self, logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
    if logits.device.type != "cpu":
        return original(self, logits=logits, vocab_mask=vocab_mask)
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device))
