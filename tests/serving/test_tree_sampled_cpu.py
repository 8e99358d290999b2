"""Sampled tree steps in the worker (issue #38, "sampled trees"), without a server: DFlashWorker._tree_decode_step
on the stand-in of tests/serving/test_tree_graphs_cpu.py, with a batch holding greedy and sampled rows (SGLang's
sampling info, built as tests/serving/test_worker_accept_cpu.py builds it) and known target logits.

- The step commits exactly what tree_acceptance.verify_tree_sampled draws from the same seed on the target's
  processed probabilities, computed here from our own SamplingParams (sampling.processed_probs), so the worker's
  mapping of SGLang's sampling info and its rule are both checked; the step's outputs are commit_outputs of that
  commit, and req_to_token is left as tree_acceptance.commit_path leaves it for the drawn path.
- Greedy rows of the mixed batch commit exactly verify_tree_greedy's tokens at every seed.
- A batch whose rows are all greedy takes the greedy one-launch path even with SGLang's sticky is_all_greedy off.
- Planted mistakes (the greedy rule for sampled rows, the filters or the temperature ignored) are caught.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("sglang")

from sglang_dflash.kernels.greedy_accept import commit_outputs  # noqa: E402
from sglang_dflash.kernels.tree_accept import tree_accept_torch  # noqa: E402
from sglang_dflash.sampling import SamplingParams, SamplingTensors, processed_probs  # noqa: E402
from sglang_dflash.serving import tree_step, worker  # noqa: E402
from sglang_dflash.tree_acceptance import commit_path, verify_tree_greedy, verify_tree_sampled  # noqa: E402

from .test_tree_graphs_cpu import N, V, _step_stand_in  # noqa: E402
from .test_worker_accept_cpu import GREEDY, sampling_info  # noqa: E402

MIXED = [GREEDY, {"temperature": 0.8}, {"temperature": 1.0, "top_k": 5},
         {"temperature": 1.2, "top_p": 0.8, "min_p": 0.05}]
SEEDS = range(12)


def _target(tree, seed: int) -> torch.Tensor:
    """Logits [bs, N, V] under which paths through the tree are likely: each node's token is boosted at its
    parent's row with probability 0.6, so rows accept a few nodes and sometimes a later sibling."""
    g = torch.Generator().manual_seed(seed)
    bs = tree.tokens.shape[0]
    logits = torch.randn(bs, N, V, generator=g)
    boost = (torch.rand(bs, N, generator=g) < 0.6) & (tree.tokens >= 0)
    boost[:, 0] = False
    for b, i in boost.nonzero().tolist():
        logits[b, tree.parents[b, i], tree.tokens[b, i]] += 3.0
    return logits


def _step(rows, graphs, seed):
    """One tree step of the stand-in on a batch of ``rows`` (SamplingParams dicts); returns (its result, the tree,
    the target logits, prefix, req_pool_indices, req_to_token before and after, the draw seed)."""
    bs = len(rows)
    info = sampling_info(rows)
    torch.manual_seed(seed)
    target = torch.zeros(bs, N, V)  # filled below, once the stand-in's tree is known; _verify reads it at the step
    _, me, batch, state, prefix, tree, _ = _step_stand_in(bs, graphs, graphs is not None, seed=seed,
                                                          sampling=(info, info.top_ks.tolist()), target=target)
    target.copy_(_target(tree, seed))
    before = me.req_to_token_pool.req_to_token.clone()
    torch.manual_seed(1000 + seed)
    out = worker.DFlashWorker._tree_decode_step(me, batch, state, prefix, bs, None)
    return me, out, tree, target, prefix, batch.req_pool_indices, before, 1000 + seed


def check_sampled_steps(rows, graphs=None):
    """The step's commits against verify_tree_sampled's (same seed) on our processed probabilities, at every seed
    of SEEDS; returns how many sampled rows committed a path and how many commits moved a slot."""
    greedy = torch.tensor([r["temperature"] == 0 for r in rows])
    ours = SamplingTensors.from_params([SamplingParams(**r) for r in rows], V)
    deep = moved = differs = 0
    for seed in SEEDS:
        me, out, tree, target, prefix, pool_rows, before, draw = _step(rows, graphs, seed)
        probs = processed_probs(target.reshape(-1, V), ours.repeat_interleave(N)).view(len(rows), N, V)
        torch.manual_seed(draw)
        commit, tokens, path = verify_tree_sampled(tree, probs)
        want = commit_outputs(commit, tokens, prefix)
        got = (out.next_token_ids, out.next_draft_input.bonus_tokens, out.accept_lens, out.new_seq_lens)
        for name, g, w in zip(("next_ids", "bonus", "accept_lens", "new_seq_lens"), got, want):
            assert g.tolist() == w.tolist(), (name, seed, g, w)
        commit_path(before, pool_rows, prefix, path)
        assert torch.equal(me.req_to_token_pool.req_to_token, before), f"req_to_token is not commit_path's ({seed})"
        # greedy rows: exactly the greedy tree rule's commit, whatever the sampled rows drew
        g_commit, g_tokens, _ = verify_tree_greedy(tree, target)
        assert torch.equal(commit[greedy], g_commit[greedy]) and torch.equal(tokens[greedy], g_tokens[greedy])
        deep += int((commit[~greedy] >= 2).sum())
        moved += int((path[:, 1:] != torch.arange(1, N)).logical_and(path[:, 1:] >= 0).any(dim=1).sum())
        differs += int((tokens[~greedy] != g_tokens[~greedy]).any(dim=1).sum())
    return deep, moved, differs


@pytest.mark.parametrize("graphs", [None, 4], ids=["eager", "graphed"])
def test_sampled_tree_step_commits_what_verify_tree_sampled_draws(graphs, caplog):
    with caplog.at_level(logging.INFO, logger="sglang_dflash"):
        deep, moved, differs = check_sampled_steps(MIXED, graphs)
    # the comparison saw the tree at work: sampled rows accepted paths, some off the first child (a permutation
    # that is not the identity), and sampled rows drew other tokens than the greedy rule would
    assert deep > 0 and moved > 0 and differs > 0, (deep, moved, differs)
    assert f"first sampled tree step ({N} nodes, batch of 4, 3 sampled rows)" in caplog.text


def test_all_greedy_rows_take_the_greedy_path_despite_sglangs_sticky_flag():
    """SGLang's is_all_greedy stays off once a sampled request has been merged; a batch of greedy rows still takes
    the greedy one-launch accept (the sampled rule would commit the same, at the cost of the dense probabilities);
    one sampled row sends the batch through the sampled accept."""
    calls = []

    def greedy_spy(*a):
        calls.append("greedy")
        return tree_accept_torch(*a)

    real = worker.DFlashWorker._tree_accept_sampled

    def sampled_spy(self, *a):
        calls.append("sampled")
        return real(self, *a)

    for rows, path in (([GREEDY] * 3, "greedy"), ([GREEDY, GREEDY, {"temperature": 0.7}], "sampled")):
        info = sampling_info(rows)
        info.is_all_greedy = False  # sticky
        target = torch.zeros(3, N, V)
        _, me, batch, state, prefix, tree, _ = _step_stand_in(3, None, False, sampling=(info, info.top_ks.tolist()),
                                                              target=target)
        target.copy_(_target(tree, 0))
        me._tree_accept = greedy_spy
        me._tree_accept_sampled = sampled_spy.__get__(me)
        calls.clear()
        out = worker.DFlashWorker._tree_decode_step(me, batch, state, prefix, 3, None)
        assert calls == [path]
        g_commit = verify_tree_greedy(tree, target)[0]
        assert out.accept_lens[:2].tolist() == g_commit[:2].tolist()


def test_mutant_greedy_rule_for_sampled_rows_is_caught(monkeypatch):
    monkeypatch.setattr(tree_step, "all_greedy", lambda batch: True)
    with pytest.raises(AssertionError):
        check_sampled_steps(MIXED)


def test_mutant_ignoring_the_filter_flags_is_caught(monkeypatch):
    real = worker.processed_probs  # the sort-free path for every batch: greedy rows (top_k = 1) become softmaxes
    monkeypatch.setattr(worker, "processed_probs", lambda logits, s, filtered=True: real(logits, s, False))
    with pytest.raises(AssertionError):
        check_sampled_steps(MIXED)


def test_mutant_ignoring_temperature_is_caught(monkeypatch):
    real = worker._batch_sampling  # the mapping of SGLang's sampling info, planted with every temperature 1

    def mapped_at_t1(info, vocab):
        s, filtered = real(info, vocab)
        return SamplingTensors(torch.ones_like(s.temperature), s.top_k, s.top_p, s.min_p), filtered

    monkeypatch.setattr(worker, "_batch_sampling", mapped_at_t1)
    with pytest.raises(AssertionError):
        check_sampled_steps([{"temperature": 0.5}, {"temperature": 1.7}])
