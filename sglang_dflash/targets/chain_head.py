"""A decisive head for random-weight targets: greedy outputs that bf16 rounding cannot flip (issues #44, #45).

The weights of `random_weights.model_like_init` give context-dependent outputs, but their logits are Gaussian: over
10^5 tokens the top-2 gap is ~1/5 of the logits' spread, so plain decoding at another batch shape (or a verify, which
is another batch shape) picks another token every ~20 tokens (benchmarks/results/floor-h200, second loan). On such
a target greedy equality proves nothing either way, and oracle drafts (serving/oracle_drafts.py) realise tau ~1
because the target leaves its own recording after ~20 tokens.

`SGLANG_DFLASH_DUMMY_WEIGHTS=chain` keeps those weights and the whole network's cost, and adds MARGIN to one logit
per row: the logit of CHAIN[token], where token is the row's input token (a fixed random map drawn from a seed, so
every server, method and tensor-parallel rank of a run serves the same target). The re-drawn heads' logits stay far
below MARGIN (an untied head's have std 4, Gemma's are soft-capped at 30), so every greedy step emits
CHAIN[current token] whatever the batch, the verify width or the rounding: the outputs are a deterministic walk
through the vocabulary (no loop within the first ~sqrt(V) tokens; MoE routing sees varied tokens), equal for every
correct worker. What it tests: everything that decides which tokens are committed and where their K/V goes (a bad
accept, commit or bonus token shows at once); what it does not: the attention's values (the argmax ignores the
context), which the `model` weights and the judge cover.

The margin is added by a forward hook on the target's logits processor, on its output rows (one per input token in
decode and verify; the last prompt token's in a prefill): one gather and one indexed add of [rows] elements, inside
CUDA graphs like the rest of the forward, and the same for plain and speculative servers. Torch only.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("sglang_dflash")

MARGIN = 256.0  # added to the chosen logit: far above any re-drawn head's logit, far inside bf16 / fp16 range
SEED = 20261127


def chain_map(vocab: int, seed: int = SEED, device: torch.device | str = "cpu") -> torch.Tensor:
    """The next token of each token, [vocab] int64: a seeded uniform draw (a random function, not a permutation:
    its walks from different prompts stay apart until they merge, after ~sqrt(vocab) steps on average)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return torch.randint(0, vocab, (vocab,), generator=gen, dtype=torch.int64).to(device)


def chain_walk(start: int, n: int, vocab: int, seed: int = SEED) -> list[int]:
    """The greedy output of a chain target after a prompt ending in `start`: n tokens."""
    table, out, tok = chain_map(vocab, seed), [], int(start)
    for _ in range(n):
        tok = int(table[tok])
        out.append(tok)
    return out


def _vocab_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    vocab = getattr(config, "vocab_size", None)
    if not vocab:
        raise ValueError(f"{type(model).__name__}: no config.vocab_size; the chain head needs it")
    return int(vocab)


class ChainHead:
    """The forward hook (module, args, kwargs, output) that puts MARGIN on CHAIN[input token] in each logits row."""

    def __init__(self, vocab: int, device: torch.device | str, seed: int = SEED):
        self.vocab = int(vocab)
        self.table = chain_map(self.vocab, seed, device)
        self.margin = MARGIN
        self.skipped = 0

    def row_tokens(self, input_ids: torch.Tensor | None, rows: int, meta) -> torch.Tensor | None:
        """The input token behind each logits row, or None where the rows are not one per token or per prompt."""
        if input_ids is None or rows == 0:
            return None
        if input_ids.numel() == rows:  # decode, verify, and a prefill of one-token prompts
            return input_ids.reshape(-1)
        lens = getattr(meta, "extend_seq_lens", None)
        if isinstance(lens, torch.Tensor) and lens.numel() == rows:  # a prefill: each prompt's last token
            return input_ids.reshape(-1)[torch.cumsum(lens, 0) - 1]
        return None

    def __call__(self, module, args, kwargs, output):
        logits = getattr(output, "next_token_logits", None)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            return output
        input_ids = args[0] if args else kwargs.get("input_ids")
        meta = args[3] if len(args) > 3 else kwargs.get("logits_metadata")
        ids = self.row_tokens(input_ids, logits.shape[0], meta)
        if ids is None:
            if logits.shape[0] and not self.skipped:
                logger.warning("sglang-dflash: chain head: %d logits rows for %s input tokens: rows left as they are",
                               logits.shape[0], None if input_ids is None else input_ids.numel())
            self.skipped += int(logits.shape[0] > 0)
            return output
        cols = self.table[ids.long().clamp(0, self.vocab - 1)]
        rows = torch.arange(logits.shape[0], device=logits.device)
        logits[rows, cols] = logits[rows, cols] + self.margin  # one row each: no accumulation, no sort, capturable
        return output


def attach(model: torch.nn.Module, seed: int = SEED) -> ChainHead | None:
    """Hook a ChainHead onto `model.logits_processor`; None (nothing hooked) for a model without one or a drafter
    (its drafts stay its own: only the target is made decisive)."""
    processor = getattr(model, "logits_processor", None)
    name = type(model).__name__
    if not isinstance(processor, torch.nn.Module) or "draft" in name.lower() or "dflash" in name.lower():
        return None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    head = ChainHead(_vocab_size(model), device, seed)
    processor.register_forward_hook(head, with_kwargs=True)
    return head
