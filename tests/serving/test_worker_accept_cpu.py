"""The worker's mapping of SGLang's sampling info onto our acceptance rules (DFlashWorker._accept and _sampled),
without a server.

SGLang encodes a greedy request as temperature 1, top_k 1 (sampling_params.py), and says with host-side flags
(need_top_k/top_p/min_p_sampling) whether any row of the batch filters. _accept must turn that into exactly the
distribution sglang_dflash.sampling defines for the same requests: greedy rows a point mass on the argmax, sampled
rows softmax(logits / T) filtered by top-k, top-p, min-p. _accept reads only batch.sampling_info, so it is called
unbound (on a stand-in worker holding the torch twins of the step kernels) on a SimpleNamespace batch built the way
SamplingBatchInfo.from_schedule_batch (SGLang 0.5.17) builds one,
and the probabilities it hands to verify_sampled are compared with processed_probs of our own SamplingParams.
Batches where no row filters go to verify_sampled_logits (same law, tests/test_acceptance_logits.py); there the
distribution it samples, softmax(logits / temperature), is the one compared.
The mutation tests plant the easy mistakes (ignoring the flags, ignoring temperature) and check this fails.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.sampling.sampling_params import TOP_K_ALL  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams as SGLangParams  # noqa: E402

from sglang_dflash import acceptance  # noqa: E402
from sglang_dflash.kernels.greedy_accept import commit_outputs, greedy_accept_torch  # noqa: E402
from sglang_dflash.sampling import SamplingParams, SamplingTensors, processed_probs  # noqa: E402
from sglang_dflash.serving import worker  # noqa: E402

V, B = 40, 5


def sampling_info(rows: list[dict]):
    """SamplingBatchInfo's fields for requests with these sampling params, as SGLang computes them."""
    sp = [SGLangParams(**r) for r in rows]  # the constructor maps temperature 0 to (1.0, top_k 1), top_k -1 to ALL
    return SimpleNamespace(
        temperatures=torch.tensor([p.temperature for p in sp], dtype=torch.float).view(-1, 1),
        top_ps=torch.tensor([p.top_p for p in sp], dtype=torch.float),
        top_ks=torch.tensor([p.top_k for p in sp], dtype=torch.int32),
        min_ps=torch.tensor([p.min_p for p in sp], dtype=torch.float),
        is_all_greedy=all(p.top_k <= 1 for p in sp),
        need_top_p_sampling=any(p.top_p != 1.0 for p in sp),
        need_top_k_sampling=any(p.top_k != TOP_K_ALL for p in sp),
        need_min_p_sampling=any(p.min_p > 0 for p in sp),
        logit_bias=None)


def ours(rows: list[dict]) -> SamplingTensors:
    return SamplingTensors.from_params([SamplingParams(**r) for r in rows], V)


def inputs(n: int, seed: int = 0, width: int = B):
    """(drafts [n, width-1], logits [n, width, V]); width 1 is a plain (k = 0) step: no drafts."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, width, V, generator=g) * 3
    # drafts: the target's argmax at some positions (so greedy rows accept a few), random elsewhere
    drafts = torch.where(torch.rand(n, width - 1, generator=g) < 0.7, logits[:, :-1].argmax(-1),
                         torch.randint(0, V, (n, width - 1), generator=g))
    return drafts, logits


def run_accept(rows, drafts, logits, monkeypatch, bug=None):
    """DFlashWorker._accept on a fake batch; returns (commit_lens, tokens, probs handed to verify_sampled, or those
    verify_sampled_logits samples from, or None). bug: (old, new) source planted into _sampled after the spies."""
    seen = {}

    def spy(d, probs, generator=None):
        seen["probs"] = probs.clone()
        return acceptance.verify_sampled(d, probs, generator)

    def logits_spy(d, lg, temperature, generator=None):
        n, b, v = lg.shape  # the logits rule samples softmax(logits / T), a point mass where T == 0
        s = SamplingTensors(temperature.float(), torch.full_like(temperature, v, dtype=torch.int64),
                            torch.ones_like(temperature), torch.zeros_like(temperature))
        seen["probs"] = processed_probs(lg.reshape(n * b, v), s.repeat_interleave(b)).view(n, b, v)
        return acceptance.verify_sampled_logits(d, lg, temperature, generator)

    monkeypatch.setattr(worker, "verify_sampled", spy)
    monkeypatch.setattr(worker, "verify_sampled_logits", logits_spy)
    if bug is not None:  # after the spies: plant compiles the mutant with a copy of the module's globals
        from test_mutations_algorithm import plant

        plant(monkeypatch, worker.DFlashWorker, "_sampled", *bug)
    n = drafts.shape[0]
    me = SimpleNamespace(_greedy_accept=greedy_accept_torch)
    me._sampled = lambda *a: worker.DFlashWorker._sampled(me, *a)
    me._tp_group = None  # one rank: _rank0_outcome hands the outcome back unchanged
    me._rank0_outcome = lambda *a: worker.DFlashWorker._rank0_outcome(me, *a)
    verify_ids = torch.cat([torch.zeros(n, 1, dtype=drafts.dtype), drafts], dim=1)  # [bonus, drafts]
    prefix = torch.arange(n) + 10
    commit, tokens, next_ids, bonus, accept_lens, new_lens = worker.DFlashWorker._accept(
        me, SimpleNamespace(sampling_info=sampling_info(rows)), verify_ids, logits, prefix, None)
    # the step's outputs follow from (commit, tokens) by their one definition, whichever path made them
    for got, want in zip((next_ids, bonus, accept_lens, new_lens), commit_outputs(commit, tokens, prefix)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    return commit, tokens, seen.get("probs")


GREEDY = {"temperature": 0.0}
CASES = {
    "all greedy": [GREEDY] * 4,
    "greedy + plain sampled": [GREEDY, {"temperature": 0.7}, GREEDY, {"temperature": 1.3}],
    "filters": [{"temperature": 0.9, "top_k": 5}, {"temperature": 1.1, "top_p": 0.8}, GREEDY,
                {"temperature": 0.6, "min_p": 0.1}, {"temperature": 1.0, "top_k": 3, "top_p": 0.7, "min_p": 0.05}],
    "sampled, no filter": [{"temperature": 0.5}, {"temperature": 1.7}],
}


def check_mapping(rows, monkeypatch, bug=None, width=B):
    drafts, logits = inputs(len(rows), width=width)
    commit, tokens, probs = run_accept(rows, drafts, logits, monkeypatch, bug)
    greedy_rows = torch.tensor([r["temperature"] == 0 for r in rows])
    g_commit, g_tokens = acceptance.verify_greedy(drafts, logits)
    # greedy rows commit exactly what verify_greedy commits, whatever the batch holds
    assert torch.equal(commit[greedy_rows], g_commit[greedy_rows]), (commit, g_commit)
    assert torch.equal(tokens[greedy_rows], g_tokens[greedy_rows])
    if greedy_rows.all():
        return
    assert probs is not None, "a batch with sampled rows did not go through verify_sampled(_logits)"
    want = processed_probs(logits.reshape(-1, V), ours(rows).repeat_interleave(width)).view(len(rows), width, V)
    torch.testing.assert_close(probs, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_accept_maps_sampling_info_to_our_distribution(case, monkeypatch):
    check_mapping(CASES[case], monkeypatch)


@pytest.mark.parametrize("case", list(CASES))
def test_plain_step_takes_the_same_path(case, monkeypatch):
    """A k = 0 step (width 1, no drafts) goes through the same rules and output definition as a drafted one: one
    token per row, the argmax for greedy rows, a sample of the same distribution for the others."""
    check_mapping(CASES[case], monkeypatch, width=1)
    drafts, logits = inputs(len(CASES[case]), width=1)
    commit, tokens, _ = run_accept(CASES[case], drafts, logits, monkeypatch)
    assert torch.equal(commit, torch.ones_like(commit)) and tokens.shape == (len(CASES[case]), 1)


def test_greedy_rows_in_a_mixed_batch_accept_several_drafts(monkeypatch):
    # the setting of the server's mixed-batch test: greedy rows whose drafts are right commit several tokens
    rows = CASES["greedy + plain sampled"]
    drafts, logits = inputs(len(rows))
    drafts[0] = logits[0, :-1].argmax(-1)  # every draft of row 0 right
    commit, tokens, _ = run_accept(rows, drafts, logits, monkeypatch)
    assert commit[0] == B and torch.equal(tokens[0], logits[0].argmax(-1))


def test_mutant_ignoring_the_filter_flags_is_caught(monkeypatch):
    # planted bug: the sort-free path for every batch (greedy rows, top_k = 1, are then full softmaxes)
    real = worker.processed_probs
    monkeypatch.setattr(worker, "processed_probs", lambda logits, s, filtered=True: real(logits, s, False))
    with pytest.raises(AssertionError):
        check_mapping(CASES["greedy + plain sampled"], monkeypatch)


def test_mutant_ignoring_temperature_is_caught(monkeypatch):
    real = worker.processed_probs

    def at_t1(logits, s, filtered=True):
        return real(logits, SamplingTensors(torch.ones_like(s.temperature), s.top_k, s.top_p, s.min_p), filtered)

    monkeypatch.setattr(worker, "processed_probs", at_t1)
    with pytest.raises(AssertionError):
        check_mapping(CASES["filters"], monkeypatch)


# planted in _sampled's own source (test_mutations_algorithm.plant): the logits rule's two easy mistakes
ACCEPT_BUGS = {
    "logits rule ignores temperature": ("verify_sampled_logits(drafts, logits, s.temperature)",
                                        "verify_sampled_logits(drafts, logits, torch.ones_like(s.temperature))",
                                        "sampled, no filter"),
    "logits rule for filtered batches too": ("if not filtered and drawn_from is None:", "if drawn_from is None:",
                                             "filters"),
}


@pytest.mark.parametrize("bug", list(ACCEPT_BUGS))
def test_mutant_in_the_logits_branch_is_caught(bug, monkeypatch):
    old, new, case = ACCEPT_BUGS[bug]
    with pytest.raises(AssertionError) as caught:
        check_mapping(CASES[case], monkeypatch, (old, new))
    assert "did not go through" not in str(caught.value)  # caught by the comparison, not by a spy that missed
    assert "mutation site" not in str(caught.value)  # planted: the site still exists in _sampled
