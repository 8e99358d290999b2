"""Training data = the target's own responses, generated in batches (left-padded transformers `generate`).

Each response runs until the stop token (kept, so the drafter learns to predict it) or max_new_tokens. Greedy by
default; a fraction of the prompts can be answered by sampling (temperature 1), so the drafter also sees contexts
off the greedy path, as it will when serving sampled requests.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from .data import TokenStore


@torch.inference_mode()
def generate_responses(model, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: list[int],
                       pad_id: int, batch_size: int = 256, sample_fraction: float = 0.0, seed: int = 0,
                       sources: list[str] | None = None, progress: bool = True,
                       time_budget_s: float | None = None) -> TokenStore:
    """Return a TokenStore of prompt + response per prompt (same order as `prompts`). With a time budget, batches
    that would start after it are skipped and their prompts left out (meta['skipped_prompts'] says how many)."""
    from transformers import GenerationConfig

    dev = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    responses: dict[int, list[int]] = {}
    g = torch.Generator().manual_seed(seed)
    t0, n_tok = time.time(), 0
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    for bi, idx in enumerate(tqdm(batches, disable=not progress, desc="generate")):
        if time_budget_s is not None and bi and (time.time() - t0) * (bi + 1) / bi > time_budget_s:
            break
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p = prompts[i]
            ids[r, width - len(p):] = torch.tensor(p)
            att[r, width - len(p):] = 1
        sample = bool(torch.rand((), generator=g) < sample_fraction)
        if sample:
            torch.manual_seed(seed * 1000 + bi)
        gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, temperature=1.0 if sample else None,
                              top_k=0 if sample else None, top_p=1.0 if sample else None,
                              eos_token_id=list(stop_token_ids), pad_token_id=pad_id)
        out = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), generation_config=gc)
        new = out[:, width:].tolist()
        for r, i in enumerate(idx):
            resp = new[r]
            for k, tok in enumerate(resp):
                if tok in stop_token_ids:
                    resp = resp[: k + 1]
                    break
            responses[i] = resp
            n_tok += len(resp)
    done = sorted(responses)
    sources = sources or [""] * len(prompts)
    seqs = [list(prompts[i]) + responses[i] for i in done]
    vocab = model.get_output_embeddings().weight.shape[0]
    meta = {"max_new_tokens": max_new_tokens, "sample_fraction": sample_fraction, "response_tokens": n_tok,
            "generate_s": round(time.time() - t0, 1), "skipped_prompts": len(prompts) - len(done)}
    return TokenStore.from_lists(seqs, [len(prompts[i]) for i in done], [sources[i] for i in done], vocab, meta)
