"""DFlash2's q-drawn drafts through the worker, without a server: DFlashWorker._draft_temperature (SGLang's sampling
info -> the temperature each row is drafted at), _draft (the eager head: DFlash2DraftModel.propose, the selector's
walk), _accept (verify_sampled_q for the drafts drawn from q), on stand-ins as in test_worker_accept_cpu.py.

The target is fixed per block position (its logits at position j do not depend on the drafts before it), so a
lossless step commits, at every position j it reaches, a token distributed as p_j, the target's processed
distribution at j (temperature, top-k, top-p; given that the drafts before j were accepted, the draft at j is a
fresh draw from q and the rule keeps or replaces it so that the token follows p_j). Each request of a batch of
N_PER_GROUP rows per sampling setting is one independent trial of one decode step. Checked:
- the law: the committed token at every position of every sampled setting against p_j (one grouped chi-square,
  power stated by tests/_stats.detectable_tv);
- the acceptance: d_1 is kept at the rate sum_x min(p_0(x), q_1(x)) of the min(1, p/q) rule; the point-mass rule
  on the same drafts (sum_x q_1(x) p_0(x)) and argmax drafts (p_0 at q_1's argmax) are both far outside the bound,
  and a law test cannot see them (both are exact in law, they only accept less);
- greedy rows of a mixed batch: the selector's argmax path, committed exactly as verify_greedy commits it.
Planted bugs (in the worker's own source) fail these checks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")
pytest.importorskip("scipy")

from sglang_dflash import acceptance  # noqa: E402
from sglang_dflash.dflash2 import CandidateSelector  # noqa: E402
from sglang_dflash.kernels.greedy_accept import commit_outputs, greedy_accept_torch  # noqa: E402
from sglang_dflash.sampling import SamplingParams, SamplingTensors, processed_probs  # noqa: E402
from sglang_dflash.serving import worker  # noqa: E402
from sglang_dflash.serving.draft_model2 import DFlash2DraftModel  # noqa: E402

from _stats import detectable_tv, grouped_chi2  # noqa: E402
from .test_worker_accept_cpu import sampling_info  # noqa: E402

V, B, K, RANK = 12, 4, 4, 3  # vocabulary, block, selector candidates, codebook rank; hidden size = V (see below)
N_PER_GROUP = 8000
BONUS, MASK = 3, V - 1
ALPHA = 1e-4  # the law test's threshold (a fixed seed: the outcome is the same every run)
GREEDY = {"temperature": 0.0}
BATCHES = {
    "mixed": {"T 0.8": {"temperature": 0.8}, "T 1.3, top-k 6": {"temperature": 1.3, "top_k": 6},
              "T 1, top-p 0.85": {"temperature": 1.0, "top_p": 0.85}, "greedy": GREEDY},
    "sampled, no filter": {"T 0.7": {"temperature": 0.7}, "T 1.5": {"temperature": 1.5}},
}


def pair():
    """(target logits [B, V] by block position, draft hidden rows [B, H], selector). H = V and the stand-in's draft
    logits are its hidden rows: a drafter that roughly knows the target (position i's row = the target's row i-1
    plus noise). Codebooks large enough that the transition from the previous draft reorders the candidates, so
    q_i depends on d_{i-1}."""
    g = torch.Generator().manual_seed(36)
    target = torch.randn(B, V, generator=g) * 2
    hidden = torch.cat([torch.zeros(1, V), target[:-1] + torch.randn(B - 1, V, generator=g)])
    selector = CandidateSelector(SimpleNamespace(selector_top_k=K, vocab_size=V, selector_rank=RANK, hidden_size=V))
    with torch.no_grad():
        selector.predecessor_codebook.copy_(torch.randn(V, RANK, generator=g))
        selector.successor_codebook.copy_(torch.randn(V, RANK, generator=g))
        selector.hidden_projection.weight.copy_(torch.randn(RANK, V, generator=g) * 0.4)
    return target, hidden, selector


def stand_in(hidden_rows, selector, n):
    """A worker whose draft pass returns the fixed hidden rows for n blocks, whose draft model is DFlash2DraftModel's
    own head code on the stand-in's draft logits, and whose accept runs on the torch twins (one rank)."""
    model = SimpleNamespace(vocab=SimpleNamespace(head_sharded=False), candidate_selector=selector,
                            draft_logits=lambda h: h.float())
    model.propose = lambda *a: DFlash2DraftModel.propose(model, *a)
    model.greedy_drafts = lambda *a: DFlash2DraftModel.greedy_drafts(model, *a)
    out = SimpleNamespace(can_run_graph=False, logits_output=SimpleNamespace(hidden_states=hidden_rows.repeat(n, 1)))
    me = SimpleNamespace(block=B, cfg=SimpleNamespace(is_dflash2=True), draft_model=model, _draft_spec_info=None,
                         draft_runner=SimpleNamespace(forward=lambda fb: out, decode_cuda_graph_runner=None),
                         _graph_head_bs=set(), _logged_q_drafts=False, _greedy_accept=greedy_accept_torch,
                         _tp_group=None)
    me._sampled = lambda *a: worker.DFlashWorker._sampled(me, *a)
    me._rank0_outcome = lambda *a: worker.DFlashWorker._rank0_outcome(me, *a)
    me._draft_forward = lambda *a: worker.DFlashWorker._draft_forward(me, *a)
    return me


@torch.no_grad()
def decode_step(rows: list[dict], k: int, seed: int = 0):
    """One step of the worker's draft -> accept for these requests on the fixed pair, verifying k drafts; returns
    (draft, commit_lens, tokens, target logits [B, V], selector)."""
    torch.manual_seed(seed)  # the draws (q's and the accept's) come from the global generator, as in the worker
    target, hidden, selector = pair()
    n = len(rows)
    me = stand_in(hidden, selector, n)
    batch = SimpleNamespace(sampling_info=sampling_info(rows), req_pool_indices=torch.arange(n))
    block_ids = torch.full((n, B), MASK, dtype=torch.int64)
    block_ids[:, 0] = BONUS
    zeros, prefix = torch.zeros_like(block_ids), torch.full((n,), 20)
    temperature = worker.DFlashWorker._draft_temperature(me, batch)
    draft = worker.DFlashWorker._draft(me, batch, block_ids, zeros, zeros, prefix, (None, None), n, k, temperature)
    verify_ids = torch.cat([block_ids[:, :1], draft.tokens], dim=1)
    logits = target[:k + 1].expand(n, k + 1, V)
    commit, tokens, *outputs = worker.DFlashWorker._accept(me, batch, verify_ids, logits, prefix, draft)
    for got, want in zip(outputs, commit_outputs(commit, tokens, prefix)):
        assert torch.equal(got, want)
    return draft, commit, tokens, target, selector


def target_probs(target, params: dict) -> torch.Tensor:
    """p_j for every block position j: [B, V], our definition of the processed distribution."""
    s = SamplingTensors.from_params([SamplingParams(**params)], V).repeat_interleave(B)
    return processed_probs(target, s)


def run(batch: str, k: int):
    groups = BATCHES[batch]
    rows = [params for params in groups.values() for _ in range(N_PER_GROUP)]
    draft, commit, tokens, target, selector = decode_step(rows, k)
    return groups, draft, commit, tokens, target, selector


def check_law(groups, commit, tokens, target, k):
    observations = []
    for g, (name, params) in enumerate(groups.items()):
        if params is GREEDY:
            continue
        mine = slice(g * N_PER_GROUP, (g + 1) * N_PER_GROUP)
        p = target_probs(target, params)
        for j in range(k + 1):  # committed token j exists where the drafts before it were all accepted
            reached = commit[mine] > j
            observations.append((torch.bincount(tokens[mine][reached, j], minlength=V), p[j]))
    pvalue, draws, df, impossible = grouped_chi2(observations)
    assert not impossible, "a committed token outside the target's processed support"
    assert pvalue > ALPHA, (f"committed tokens do not follow the target's distribution: p = {pvalue:.2e} over {draws} "
                            f"tokens (this test detects a mean TV of {detectable_tv(draws, df, ALPHA):.3f})")


@torch.no_grad()
def first_draft_rates(params, target, selector):
    """(the min(1, p/q) rule's acceptance rate of d_1, the point-mass rule's, argmax drafts') for a request with
    these params: q_1 from the selector itself (every request has the same bonus, so one q_1 per temperature; it
    does not depend on the draw)."""
    _, hidden, _ = pair()
    rows = hidden[None, 1:2]
    first = selector.walk(rows, rows.float(), torch.tensor([BONUS]), torch.tensor([params["temperature"]]))
    q1 = torch.zeros(V).index_put_((first.candidates[0, 0],), first.q[0, 0])
    p0 = target_probs(target, params)[0]
    return float(torch.minimum(p0, q1).sum()), float((p0 * q1).sum()), float(p0[q1.argmax()])


def check_acceptance(groups, commit, target, selector):
    for g, (name, params) in enumerate(groups.items()):
        if params is GREEDY:
            continue
        exact, point_mass, argmax = first_draft_rates(params, target, selector)
        sigma = (exact * (1 - exact) / N_PER_GROUP) ** 0.5
        # the check has power against the two ways of losing the gain (both exact in law)
        assert min(abs(exact - point_mass), abs(exact - argmax)) > 8 * sigma, (name, exact, point_mass, argmax)
        rate = float((commit[g * N_PER_GROUP:(g + 1) * N_PER_GROUP] > 1).double().mean())
        assert abs(rate - exact) < 5 * sigma, \
            f"{name}: d_1 kept at {rate:.3f}, the min(1, p/q) rule keeps it at {exact:.3f} (point mass " \
            f"{point_mass:.3f}, argmax drafts {argmax:.3f})"


def check_greedy_rows(groups, draft, commit, tokens, target, selector, k):
    names = list(groups)
    if "greedy" not in names:
        return
    mine = slice(names.index("greedy") * N_PER_GROUP, (names.index("greedy") + 1) * N_PER_GROUP)
    _, hidden, _ = pair()
    with torch.no_grad():
        argmax_path = selector.walk(hidden[None, 1:k + 1], hidden[None, 1:k + 1].float(), torch.tensor([BONUS])).tokens
    assert (draft.tokens[mine] == argmax_path).all(), "greedy rows were not drafted with the selector's argmax path"
    want_commit, want_tokens = acceptance.verify_greedy(argmax_path, target[None, :k + 1])
    assert (commit[mine] == want_commit).all() and (tokens[mine] == want_tokens).all()


@pytest.mark.parametrize("k", [B - 1, 1])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_q_drawn_drafts_commit_the_targets_distribution(batch, k):
    groups, draft, commit, tokens, target, selector = run(batch, k)
    assert draft.q is not None and draft.tokens.shape == (len(commit), k)
    check_law(groups, commit, tokens, target, k)
    check_acceptance(groups, commit, target, selector)
    check_greedy_rows(groups, draft, commit, tokens, target, selector, k)
    assert (commit > 1).any() and (commit == k + 1).any()  # every prefix length is reached


def test_greedy_batches_keep_point_mass_drafts():
    """No sampled row: no q (the argmax path, the one the draft CUDA graphs record), and the greedy accept."""
    draft, commit, tokens, target, selector = decode_step([GREEDY] * 4, B - 1)
    assert draft.q is None


# planted in the worker's source (test_mutations_algorithm.plant): (method, old, new, the check that must fail).
# The first two and the last lose the gain of q-drawn drafts but stay exact in law: only the acceptance rate sees them.
Q_BUGS = {
    "q drafts verified by the point-mass rule": (
        "_sampled", "return verify_sampled_q(drafts, probs, drawn_from.candidates, drawn_from.q)",
        "return verify_sampled(drafts, probs)", "acceptance"),
    "the accept never told of q": (
        "_accept", "drawn_from = draft if draft is not None and draft.q is not None else None", "drawn_from = None",
        "acceptance"),
    "q of the previous position": (
        "_sampled", "drawn_from.candidates, drawn_from.q)", "drawn_from.candidates, drawn_from.q.roll(1, dims=1))",
        "law"),
    "greedy rows drawn from q at temperature 1": (
        "_draft_temperature", "info.top_ks.reshape(-1) <= 1", "info.top_ks.reshape(-1) < 1", "greedy rows"),
    "sampled rows drafted with the argmax": ("_draft_temperature", "info.is_all_greedy:", "True:", "acceptance"),
}


@pytest.mark.parametrize("bug", list(Q_BUGS))
def test_planted_bug_is_caught(bug, monkeypatch):
    from test_mutations_algorithm import plant

    name, old, new, check = Q_BUGS[bug]
    plant(monkeypatch, worker.DFlashWorker, name, old, new)
    groups, draft, commit, tokens, target, selector = run("mixed", B - 1)
    checks = {"law": lambda: check_law(groups, commit, tokens, target, B - 1),
              "acceptance": lambda: check_acceptance(groups, commit, target, selector),
              "greedy rows": lambda: check_greedy_rows(groups, draft, commit, tokens, target, selector, B - 1)}
    with pytest.raises(AssertionError):
        checks[check]()
