"""sglang_dflash.penalties against a straightforward loop that replays plain decoding one token at a time.

The loop keeps SGLang's penalizer state the way plain decoding does (penaltylib: frequency_penalty scatter-added
once per output token, presence / repetition set on first occurrence, the output length counted per token) and
processes one row the way SamplingBatchInfo.apply_logits_bias does. The batched block functions must give the
same float32 values bit for bit at every block row, and the same state after any commit length."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_dflash.penalties import PenaltyRows, advance, apply_penalties, block_state

V = 23  # a small vocabulary, so drafts repeat tokens of the history and of the block itself


class PlainState:
    def __init__(self, f, p, r, m, stop):
        self.f, self.p, self.r, self.m, self.stop = f, p, r, m, stop
        self.freq = torch.zeros(V)
        self.pres = torch.zeros(V)
        self.rep = torch.ones(V)
        self.seen = torch.zeros(V, dtype=torch.bool)
        self.length = 0

    def cumulate(self, tok):
        self.seen[tok] = True
        self.freq[tok] += torch.tensor(self.f, dtype=torch.float32)
        self.pres[tok] = self.p
        self.rep[tok] = self.r
        self.length += 1

    def process(self, logits):
        acc = torch.zeros(V)
        acc -= self.freq
        acc -= self.pres
        if self.length < self.m:
            acc[list(self.stop)] += float("-inf")
        out = logits + acc
        return torch.where(out < 0, out * self.rep, out / self.rep)

    def copy(self):
        c = PlainState(self.f, self.p, self.r, self.m, self.stop)
        c.freq, c.pres, c.rep, c.length = self.freq.clone(), self.pres.clone(), self.rep.clone(), self.length
        c.seen = self.seen.clone()
        return c


def _case(seed, n=5, w=7):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    plain, hist = [], []
    for i in range(n):
        f = rng.choice([0.0, 0.3, 0.7, -0.45, 1.1])
        p = rng.choice([0.0, 0.25, -0.6, 0.9])
        r = rng.choice([1.0, 1.3, 0.8, 2.0])
        m = rng.randrange(0, 12)
        stop = {rng.randrange(V) for _ in range(rng.randrange(1, 3))}
        st = PlainState(f, p, r, m, stop)
        h = [rng.randrange(V) for _ in range(rng.randrange(1, 9))]  # output so far, the bonus last
        for t in h:
            st.cumulate(t)
        plain.append(st)
        hist.append(h)
    rows = PenaltyRows(
        freq_acc=torch.stack([s.freq for s in plain]), seen=torch.stack([s.seen for s in plain]),
        out_len=torch.tensor([s.length for s in plain]), frequency=torch.tensor([s.f for s in plain]),
        presence=torch.tensor([s.p for s in plain]), repetition=torch.tensor([s.r for s in plain]),
        min_new=torch.tensor([s.m for s in plain]),
        stop=torch.stack([torch.isin(torch.arange(V), torch.tensor(sorted(s.stop))) for s in plain]))
    block = torch.tensor([[h[-1]] + [rng.randrange(V) for _ in range(w - 1)] for h in hist])
    logits = torch.randn(n, w, V) * 3
    return plain, rows, block, logits


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("w", [1, 2, 7])
def test_block_rows_equal_plain_decoding(seed, w):
    plain, rows, block, logits = _case(seed, w=w)
    state = block_state(rows, block)
    got = apply_penalties(logits, rows, state)
    for i, st in enumerate(plain):
        s = st.copy()
        for j in range(w):
            if j:
                s.cumulate(int(block[i, j]))  # row j sits behind drafts 1..j
            want = s.process(logits[i, j])
            assert torch.equal(got[i, j], want), f"request {i}, block row {j}: {got[i, j]} vs {want}"


@pytest.mark.parametrize("seed", range(6))
def test_advance_equals_plain_state(seed):
    w = 7
    plain, rows, block, logits = _case(seed, w=w)
    state = block_state(rows, block)
    rng = random.Random(100 + seed)
    commit_lens = torch.tensor([rng.randrange(1, w + 1) for _ in plain])
    tokens = torch.full((len(plain), w), -1)
    for i, c in enumerate(commit_lens.tolist()):
        tokens[i, :c - 1] = block[i, 1:c]
        tokens[i, c - 1] = rng.randrange(V)  # the target's own token after the accepted drafts
    freq_acc, seen, out_len = advance(rows, state, tokens, commit_lens)
    for i, st in enumerate(plain):
        s = st.copy()
        for t in tokens[i, :int(commit_lens[i])].tolist():
            s.cumulate(t)
        assert torch.equal(freq_acc[i], s.freq), f"request {i}: frequency state"
        assert torch.equal(seen[i], s.seen), f"request {i}: seen"
        assert int(out_len[i]) == s.length
        # the next step's first row, from the advanced state, is plain decoding's next distribution
        nxt = PenaltyRows(freq_acc=freq_acc, seen=seen, out_len=out_len, frequency=rows.frequency,
                          presence=rows.presence, repetition=rows.repetition, min_new=rows.min_new, stop=rows.stop)
        row0 = apply_penalties(logits[:, :1], nxt, block_state(nxt, block[:, :1]))
        assert torch.equal(row0[i, 0], s.process(logits[i, 0]))


def test_min_new_tokens_holds_stop_ids_exactly_before_the_minimum():
    rows = PenaltyRows(freq_acc=torch.zeros(1, V), seen=torch.zeros(1, V, dtype=torch.bool),
                       out_len=torch.tensor([3]), frequency=torch.zeros(1), presence=torch.zeros(1),
                       repetition=torch.ones(1), min_new=torch.tensor([6]),
                       stop=torch.zeros(1, V, dtype=torch.bool).index_fill_(1, torch.tensor([2, 5]), True))
    block = torch.tensor([[1, 7, 8, 9, 10, 11]])
    out = apply_penalties(torch.zeros(1, 6, V), rows, block_state(rows, block))
    # row j is generated after 3 + j output tokens: held while 3 + j < 6
    held = [bool(torch.isinf(out[0, j, 2])) for j in range(6)]
    assert held == [True, True, True, False, False, False]
    assert torch.isinf(out[0, :3, 5]).all() and not torch.isinf(out[0, :, 7]).any()


def test_prefill_of_a_retracted_request_counts_its_earlier_output():
    """A retracted request is prefilled again with its earlier output in its context: the slot's state after that
    prefill is plain decoding's after the whole output (frequency sums bit for bit, seen, length for
    min_new_tokens), not a fresh request's. Found by the soak (benchmarks/soak.py): greedy with a penalty diverged
    from plain decoding after a retraction under a small KV pool."""
    from types import SimpleNamespace

    from sglang_dflash.penalties import BlockState
    from sglang_dflash.serving.controls import SamplingControls

    def req(f, p, r, m, out):
        return SimpleNamespace(output_ids=list(out), tokenizer=None, sampling_params=SimpleNamespace(
            frequency_penalty=f, presence_penalty=p, repetition_penalty=r, min_new_tokens=m, stop_token_ids={3}))

    earlier = [[5, 9, 5, 5, 2], [], [7]]  # a retracted request, a fresh one, one retracted after one token
    reqs = [req(0.7, 0.25, 1.3, 9, earlier[0]), req(-0.45, 0.0, 1.0, 2, earlier[1]), req(1.1, 0.9, 2.0, 0, earlier[2])]
    first = torch.tensor([5, 11, 7])
    controls = SamplingControls(slots=8, vocab=V, device="cpu")
    controls.on_prefill(SimpleNamespace(reqs=reqs, req_pool_indices=torch.tensor([6, 1, 3])), first)
    rows = controls.table.rows(torch.tensor([6, 1, 3]))
    logits = torch.randn(3, 1, V) * 3
    processed = apply_penalties(logits, rows, BlockState(rows.freq_acc[:, None], rows.seen[:, None],
                                                         rows.out_len[:, None]))
    for i, (r, out) in enumerate(zip(reqs, earlier)):
        sp = r.sampling_params
        plain = PlainState(sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty, sp.min_new_tokens, {3})
        for t in out + [int(first[i])]:
            plain.cumulate(t)
        assert torch.equal(rows.freq_acc[i], plain.freq) and torch.equal(rows.seen[i], plain.seen), i
        assert int(rows.out_len[i]) == plain.length == len(out) + 1
        assert torch.equal(processed[i, 0], plain.process(logits[i, 0])), i


def test_prefill_token_of_a_retracted_request_is_sampled_under_its_earlier_output():
    """SGLang samples a prefill's token with its orchestrator's penalty tensors, which start a retracted request
    from zero: before_prefill replaces that request's rows (on a copy of the sampling info) with the penalties of its
    earlier output, so (logits + additive) scaled = plain decoding's processed logits at that point; other rows and
    the scheduler's own sampling info are untouched. Without it the soak saw the first token after a retraction
    differ from plain decoding."""
    import dataclasses
    from types import SimpleNamespace

    from sglang_dflash.serving.controls import SamplingControls

    @dataclasses.dataclass
    class Info:  # the fields of SGLang's SamplingBatchInfo that the prefill's penalties live in (overlap mode)
        penalizer_orchestrator: object
        acc_additive_penalties: torch.Tensor
        acc_scaling_penalties: torch.Tensor

    def req(f, p, r, m, out):
        return SimpleNamespace(output_ids=list(out), tokenizer=None, sampling_params=SimpleNamespace(
            frequency_penalty=f, presence_penalty=p, repetition_penalty=r, min_new_tokens=m, stop_token_ids={3}))

    earlier = [[5, 9, 5, 5, 2], [], [3, 7]]
    reqs = [req(0.7, 0.25, 1.3, 9, earlier[0]), req(0.5, 0.0, 1.0, 2, earlier[1]), req(0.0, 0.0, 1.0, 0, earlier[2])]
    sglang_add, sglang_scale = torch.randn(3, V), torch.rand(3, V) + 0.5  # stand-ins for SGLang's fresh-state rows
    info = Info(None, sglang_add.clone(), sglang_scale.clone())
    batch = SimpleNamespace(reqs=reqs, req_pool_indices=torch.tensor([6, 1, 3]), sampling_info=info)
    SamplingControls(slots=8, vocab=V, device="cpu").before_prefill(batch)
    assert batch.sampling_info is not info and torch.equal(info.acc_additive_penalties, sglang_add)
    got = batch.sampling_info
    # the request without penalties and the fresh one keep SGLang's rows
    assert torch.equal(got.acc_additive_penalties[1:], sglang_add[1:])
    assert torch.equal(got.acc_scaling_penalties[1:], sglang_scale[1:])
    sp = reqs[0].sampling_params
    plain = PlainState(sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty, sp.min_new_tokens, {3})
    for t in earlier[0]:
        plain.cumulate(t)
    logits = torch.randn(V) * 3
    out = logits + got.acc_additive_penalties[0]
    scale = got.acc_scaling_penalties[0]
    assert torch.equal(torch.where(out < 0, out * scale, out / scale), plain.process(logits))
    assert torch.isinf(got.acc_additive_penalties[0, 3])  # min_new_tokens 9 still holds the stop id back
