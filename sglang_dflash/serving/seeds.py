"""Seeded sampling in the serving worker (issue #46 item 3): each request's ``sampling_seed``, per request slot.

A seeded sampled request draws every output token with the counter-based noise of (seed, position)
(sampling.seeded_sample): its decode steps verify with acceptance.verify_seeded (chain) or
tree_acceptance.verify_tree_seeded (tree), DFlash2 drafts it with the same noise, and its first token (the prefill's,
which SGLang's sampler draws) is drawn again the same way (``DFlashWorker._seeded_first_tokens``). Its output is
then the target's seeded sample stream, whatever k the adaptive policy picks, a tree or a chain, the batch it shares
(docs/STATUS.md, "Precision and exactness", says what that guarantees with and without
--enable-deterministic-inference).

The seeds live on the device, one row per req_to_token slot (as controls.py keeps its state), written at prefill by
one host pass over the prefilled requests; a decode step gathers its rows by req_pool_indices: no host sync, no
per-request Python. Which steps take the seeded rules is a host-side fact, ``live``: the slots whose request has a
seed and samples. A slot leaves it when a request without one is prefilled into it, so the set may still name a
finished request's slot (the step then takes the seeded rule with random keys for every row: the same law), never
misses a live one. A step while ``live`` is empty is exactly as before (the generator's rules, no extra work).

SGLang fills ``sampling_info.sampling_seed`` only under --enable-deterministic-inference, for every request (its
default seed for those without one); then every request is seeded here too, with SGLang's values. Without the flag
the seeds come from the requests' own SamplingParams.
"""

from __future__ import annotations

import torch


def _pinned(values: list, dtype, device) -> torch.Tensor:
    """A host list on the device without waiting for the stream (a pageable copy would: worker._extend_positions)."""
    on_gpu = torch.device(device).type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=on_gpu).to(device, non_blocking=True)


class RequestSeeds:
    def __init__(self, slots: int, device):
        self.device = device
        self.seed = torch.zeros(slots, dtype=torch.int64, device=device)
        self.seeded = torch.zeros(slots, dtype=torch.bool, device=device)
        self.live: set[int] = set()

    def on_prefill(self, batch) -> torch.Tensor | None:
        """Store the prefilled requests' seeds in their slots. Returns the [bs] device mask of seeded sampled rows
        (the prefill's token is drawn again for them), or None when the batch has none."""
        reqs = batch.reqs
        info = batch.sampling_info
        everyone = info is not None and getattr(info, "sampling_seed", None) is not None  # deterministic inference
        if not everyone and not self.live and all(r.sampling_params.sampling_seed is None for r in reqs):
            return None  # the common case: no seed anywhere, nothing to store or forget (one pass, no device work)
        given = [r.sampling_params.sampling_seed for r in reqs]
        slots = [r.req_pool_idx for r in reqs]
        sampled = [r.sampling_params.top_k != 1 for r in reqs]  # SGLang encodes greedy as top_k = 1
        seeded = [(everyone or g is not None) and s for g, s in zip(given, sampled)]
        idx = batch.req_pool_indices.to(device=self.device, dtype=torch.int64)
        if not any(seeded):
            if not self.live.isdisjoint(slots):  # a seeded request's old slot now holds one without a seed
                self.live.difference_update(slots)
                self.seeded[idx] = False
            return None
        if everyone:
            self.seed[idx] = info.sampling_seed.reshape(-1).to(device=self.device, dtype=torch.int64)
        else:
            self.seed[idx] = _pinned([g if g is not None else 0 for g in given], torch.int64, self.device)
        mask = _pinned(seeded, torch.bool, self.device)
        self.seeded[idx] = mask
        for slot, s in zip(slots, seeded):
            (self.live.add if s else self.live.discard)(slot)
        return mask

    def keys(self, batch) -> torch.Tensor | None:
        """[bs] int64 draw keys of a sampled decode step: the request's seed where it has one, a fresh random key
        from the global generator elsewhere (unseeded rows stay random, under the same seeded rule); None while no
        live slot is seeded (the step keeps the generator's rules)."""
        if not self.live:
            return None
        idx = batch.req_pool_indices.to(torch.int64)
        fresh = torch.randint(0, 1 << 62, idx.shape, dtype=torch.int64, device=idx.device)
        return torch.where(self.seeded[idx], self.seed[idx], fresh)

    def of(self, batch) -> torch.Tensor:
        """[bs] the stored seeds of the batch's rows (0 where none)."""
        return self.seed[batch.req_pool_indices.to(torch.int64)]
