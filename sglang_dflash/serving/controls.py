"""Per-request sampling controls inside a DFLASH decode step: penalties, min_new_tokens, grammars, logit_bias and
logprobs.

A verify scores the block [bonus, d_1..d_k] in one target pass; row i predicts the token after d_i. Every control
here is applied to row i with the state plain decoding would have if d_1..d_i were accepted (the pure maths is
sglang_dflash/penalties.py), so the processed distributions, and with them the greedy tokens, the sampled
acceptance and the logprobs, are plain decoding's.

Penalty state lives here, one row per request slot of SGLang's req_to_token pool (``req_pool_indices`` index it),
not in SGLang's penalizer orchestrator: SGLang's DFLASH scheduling path never feeds output tokens to the
orchestrator (DFlashDraftInputV2.prepare_for_decode does not cumulate them), and the orchestrator lives on the
scheduler's stream, where the worker's committed tokens exist only after a host sync. A slot row is reset when its
request is prefilled, to the state after the output the request already has (none, or a retracted request's earlier
output: SGLang's own orchestrator starts from zero there, so a plain SGLang server forgets it), advanced over the
prefill's token, then over each step's committed tokens, all on the worker's stream without host sync. The
tables are allocated at the first prefill that uses a penalty or min_new_tokens; SGLang's own host flag
(``sampling_info.acc_additive_penalties`` is set whenever its orchestrator says a penalizer is required for the
running batch) decides per step whether any row needs them, so batches without controls pay nothing.

Order of processing, as SGLang's ``SamplingBatchInfo.apply_logits_bias``: additive penalties (frequency, presence,
min_new_tokens), the repetition penalty, the grammar mask, then logit_bias. Temperature / top-k / top-p / min-p come after, in the
acceptance (sglang_dflash.sampling.processed_probs); logprobs are SGLang's sampler's: log_softmax of the processed
logits for all-greedy batches, log(softmax(logits / temperature)) otherwise (SGLANG_RETURN_ORIGINAL_LOGPROB: before
temperature).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..penalties import BlockState, PenaltyRows, advance, apply_penalties, block_state, penalty_terms


def request_uses_penalties(sampling_params) -> bool:
    return (sampling_params.frequency_penalty != 0.0 or sampling_params.presence_penalty != 0.0
            or sampling_params.repetition_penalty != 1.0 or sampling_params.min_new_tokens > 0)


def min_new_tokens_stop_ids(req) -> set[int]:
    """The ids min_new_tokens holds back, as SGLang's BatchedMinNewTokensPenalizer chooses them: the request's
    stop_token_ids, the tokenizer's additional stop ids and its eos id (not the model config's eos_token_ids)."""
    ids = set(req.sampling_params.stop_token_ids or ())
    tok = getattr(req, "tokenizer", None)
    if tok is not None:
        ids |= set(getattr(tok, "additional_stop_token_ids", None) or ())
        if getattr(tok, "eos_token_id", None) is not None:
            ids.add(tok.eos_token_id)
    return ids


class SlotPenalties:
    """PenaltyRows for every request slot of the req_to_token pool."""

    def __init__(self, slots: int, vocab: int, device):
        z = dict(device=device)
        self.freq_acc = torch.zeros((slots, vocab), dtype=torch.float32, **z)
        self.seen = torch.zeros((slots, vocab), dtype=torch.bool, **z)
        self.stop = torch.zeros((slots, vocab), dtype=torch.bool, **z)
        self.out_len = torch.zeros((slots,), dtype=torch.int64, **z)
        self.frequency = torch.zeros((slots,), dtype=torch.float32, **z)
        self.presence = torch.zeros((slots,), dtype=torch.float32, **z)
        self.repetition = torch.ones((slots,), dtype=torch.float32, **z)
        self.min_new = torch.zeros((slots,), dtype=torch.int64, **z)

    def rows(self, idx: torch.Tensor) -> PenaltyRows:
        return PenaltyRows(freq_acc=self.freq_acc[idx], seen=self.seen[idx], out_len=self.out_len[idx],
                           frequency=self.frequency[idx], presence=self.presence[idx],
                           repetition=self.repetition[idx], min_new=self.min_new[idx], stop=self.stop[idx])

    def store(self, idx: torch.Tensor, freq_acc, seen, out_len) -> None:
        self.freq_acc[idx], self.seen[idx], self.out_len[idx] = freq_acc, seen, out_len


@dataclass
class PendingPenalties:
    """What a decode step's commit needs from its processing: the slots and the block's per-row state."""

    idx: torch.Tensor
    rows: PenaltyRows
    state: BlockState


class SamplingControls:
    def __init__(self, slots: int, vocab: int, device):
        self.slots, self.vocab, self.device = slots, vocab, device
        self.table: SlotPenalties | None = None  # allocated at the first prefill that needs it

    # ----------------------------------------------------------------------------------------------- prefill
    def _begin(self, batch) -> torch.Tensor | None:
        """The prefilled requests' settings into their slots (allocating the table at the first request that uses
        a control); their slot indices, or None while no request has used one."""
        reqs = batch.reqs
        if self.table is None:
            if not any(request_uses_penalties(r.sampling_params) for r in reqs):
                return None
            self.table = SlotPenalties(self.slots, self.vocab, self.device)
        n, dev = len(reqs), self.device
        sp = [r.sampling_params for r in reqs]
        idx = batch.req_pool_indices.to(device=dev, dtype=torch.int64)
        t = self.table
        t.frequency[idx] = torch.tensor([p.frequency_penalty for p in sp], dtype=torch.float32).to(dev)
        t.presence[idx] = torch.tensor([p.presence_penalty for p in sp], dtype=torch.float32).to(dev)
        t.repetition[idx] = torch.tensor([p.repetition_penalty for p in sp], dtype=torch.float32).to(dev)
        t.min_new[idx] = torch.tensor([p.min_new_tokens for p in sp], dtype=torch.int64).to(dev)
        stop = torch.zeros((n, self.vocab), dtype=torch.bool)
        pairs = [(i, s) for i, r in enumerate(reqs) for s in min_new_tokens_stop_ids(r) if 0 <= s < self.vocab]
        if pairs:
            stop[torch.tensor(pairs).T.unbind()] = True
        t.stop[idx] = stop.to(dev)
        return idx

    def _earlier_output(self, reqs, idx: torch.Tensor):
        """(freq_acc [n, V], seen [n, V], out_len [n]) after the output each request already has: none for a new
        request; a retracted request is prefilled again with its earlier output in its context (SGLang keeps
        output_ids), and its state counts those tokens, as plain decoding without the retraction did. (SGLang's own
        penalizers start such a request from zero, so a plain server forgets them when it retracts; found by
        benchmarks/soak.py.)"""
        n, dev = len(reqs), self.device
        freq_acc = torch.zeros((n, self.vocab), dtype=torch.float32, device=dev)
        seen = torch.zeros((n, self.vocab), dtype=torch.bool, device=dev)
        prior = [r.output_ids for r in reqs]
        if any(len(o) for o in prior):
            rows = torch.tensor([i for i, o in enumerate(prior) for _ in o], dtype=torch.int64).to(dev)
            toks = torch.tensor([x for o in prior for x in o], dtype=torch.int64).clamp(0, self.vocab - 1).to(dev)
            freq_acc.index_put_((rows, toks), self.table.frequency[idx][rows], accumulate=True)
            seen[rows, toks] = True
        return freq_acc, seen, torch.tensor([len(o) for o in prior], dtype=torch.int64).to(dev)

    def before_prefill(self, batch) -> None:
        """A retracted request's prefill token must be chosen under the penalties of its earlier output too, and
        SGLang's sampler takes them from its orchestrator, which starts that request from zero: its rows of the
        prefill's penalty tensors (additive, then the repetition scaling, SGLang's order) are replaced with ours on
        a copy of the batch's sampling info (the scheduler's own is untouched). Nothing is done unless some
        prefilled request has earlier output and a penalty (one host pass over the prefilled requests)."""
        reqs, info = batch.reqs, batch.sampling_info
        hits = [i for i, r in enumerate(reqs) if len(r.output_ids) and request_uses_penalties(r.sampling_params)]
        if not hits or info is None:
            return
        idx = self._begin(batch)
        freq_acc, seen, out_len = self._earlier_output(reqs, idx)
        t = self.table
        additive, scaling = penalty_terms(freq_acc, seen, out_len, t.presence[idx], t.repetition[idx], t.min_new[idx],
                                          t.stop[idx])
        info = dataclasses.replace(info)
        if info.penalizer_orchestrator is not None:  # without overlap scheduling SGLang applies it to the logits
            info.update_penalties()  # its tensors for every other row, as overlap scheduling computes them
            info.penalizer_orchestrator = None
        n, v = additive.shape
        add = info.acc_additive_penalties
        add = torch.zeros((n, v), dtype=torch.float32, device=additive.device) if add is None else add.clone()
        scale = info.acc_scaling_penalties
        scale = torch.ones((n, v), dtype=torch.float32, device=additive.device) if scale is None else scale.clone()
        rows = torch.tensor(hits, dtype=torch.int64, device=additive.device)
        add[rows], scale[rows] = additive[rows].to(add.dtype), scaling[rows].to(scale.dtype)
        info.acc_additive_penalties, info.acc_scaling_penalties = add, scale
        batch.sampling_info = info

    def on_prefill(self, batch, first_tokens: torch.Tensor) -> None:
        """Reset the prefilled requests' slots (settings from their SamplingParams) to the state after their earlier
        output (`_earlier_output`) and the token the prefill produced. Host work is one pass over the newly
        prefilled requests, and only once some request has used a control."""
        idx = self._begin(batch)
        if idx is None:
            return
        freq_acc, seen, out_len = self._earlier_output(batch.reqs, idx)
        # the prefill's token is the next output token (a non-final chunk's placeholder is counted too, and reset
        # again when the request's last chunk is prefilled)
        first = first_tokens.to(torch.int64).clamp(0, self.vocab - 1)[:, None]
        freq_acc.scatter_add_(1, first, self.table.frequency[idx][:, None])
        seen.scatter_(1, first, True)
        self.table.store(idx, freq_acc, seen, out_len + 1)

    def on_relay(self, batch) -> None:
        """Prefill-decode disaggregation: the relayed requests' slots (their prefill ran on another server) to the
        state after the output they bring (the prefill's first token; all of it for a retracted one that resumes):
        what `on_prefill` stores for a request prefilled here (disagg.py)."""
        idx = self._begin(batch)
        if idx is None:
            return
        freq_acc, seen, out_len = self._earlier_output(batch.reqs, idx)
        self.table.store(idx, freq_acc, seen, out_len)

    # ------------------------------------------------------------------------------------------ decode step
    @staticmethod
    def grammar_chain(batch, block_ids: torch.Tensor):
        """For batches with a grammar request: start copying the block [bonus, d_1..d_k] to the host (SGLang's
        chain tree for the grammar traversal), before the verify is launched so the copy overlaps it."""
        if not getattr(batch, "has_grammar", False):
            return None
        from sglang.srt.speculative.spec_utils import GrammarTree

        return GrammarTree.from_linear_chain(block_ids)

    def process(self, batch, logits: torch.Tensor, block_ids: torch.Tensor, grammar_chain=None,
                grammar_barrier=None):
        """logits [bs, W, V] of the verify rows -> (logits with penalties, min_new_tokens, the grammar mask and
        logit_bias applied per row, what commit needs or None).

        Grammar: SGLang's matcher of each constrained request already holds the committed output (the bonus
        included; ``grammar_barrier`` first advances it over a previous step's result still in the scheduler's
        queue). SGLang's tree traversal walks the chain, filling row i's mask after accepting d_1..d_i and rolling
        the matcher back afterwards; a draft the grammar refuses ends the walk (its row keeps an all-allowed mask,
        but the draft is masked at its parent's row, so no acceptance rule can keep it or anything behind it).
        The scheduler then advances the matchers over the committed tokens, as for every spec-v2 worker."""
        info = batch.sampling_info
        pending = None
        if info is not None and info.acc_additive_penalties is not None:
            if self.table is None:
                raise RuntimeError("a DFLASH decode batch needs penalties but no prefill recorded their settings; "
                                   "this is a bug in sglang-dflash's controls bookkeeping")
            idx = batch.req_pool_indices.to(torch.int64)
            rows = self.table.rows(idx)
            state = block_state(rows, block_ids)
            logits = apply_penalties(logits, rows, state)
            pending = PendingPenalties(idx=idx, rows=rows, state=state)
        if grammar_chain is not None:
            from sglang.srt.speculative.spec_utils import build_grammar_vocab_mask

            mask = build_grammar_vocab_mask(reqs=batch.reqs, tree=grammar_chain, sampling_info=info,
                                            device=logits.device, barrier=grammar_barrier)
            if mask is not None:
                logits = logits.contiguous()
                mask.apply(logits.view(-1, logits.shape[-1]))  # in place, row r * W + i
        if info is not None and info.logit_bias is not None:
            logits = logits + info.logit_bias[:, None, :]
        return logits, pending

    def commit(self, pending: PendingPenalties | None, tokens: torch.Tensor, commit_lens: torch.Tensor) -> None:
        if pending is not None:
            self.table.store(pending.idx, *advance(pending.rows, pending.state, tokens, commit_lens))

    def logprobs(self, batch, logits: torch.Tensor, tokens: torch.Tensor):
        """SGLang's decode logprob output for the committed tokens (None unless some request asked): row j of
        request i is the target's processed distribution of its j-th committed token. The output processor reads
        next_token_logprobs as [bs, W] and the top / token-id lists at i * W + j."""
        if not batch.return_logprob:
            return None
        from sglang.srt.layers import sampler as sglang_sampler
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.layers.logprob_processor import OutputLogprobProcessor

        bs, w, v = logits.shape
        flat = logits.reshape(bs * w, v).float()
        info = batch.sampling_info
        if info is None or info.is_all_greedy or sglang_sampler.SGLANG_RETURN_ORIGINAL_LOGPROB:
            lp = torch.log_softmax(flat, dim=-1)
        else:  # SGLang's sampler divides by the temperature and takes the log of its softmax
            temps = info.temperatures.reshape(-1).float().repeat_interleave(w)
            lp = torch.log(torch.softmax(flat / temps[:, None], dim=-1))
        top = [n for n in (batch.top_logprobs_nums or [0] * bs) for _ in range(w)]
        ids = [t for t in (batch.token_ids_logprobs or [None] * bs) for _ in range(w)]
        result = OutputLogprobProcessor().compute_logprobs(lp, top, ids, tokens.reshape(-1).clamp_min(0))
        if result.token_ids_logprobs_val is not None:
            # rows without requested ids come back as [] lists; the output processor calls .tolist() on every row
            empty = torch.empty((0,), dtype=lp.dtype, device=lp.device)
            result.token_ids_logprobs_val = [empty if isinstance(v, list) else v for v in result.token_ids_logprobs_val]
        out = LogitsProcessorOutput(next_token_logits=None)
        result.write_output_to(out)
        out.next_token_logprobs = out.next_token_logprobs.view(bs, w)
        return out
