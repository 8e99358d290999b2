"""Seeded sampling in the worker (issue #46 item 3), without a server: seeds.RequestSeeds (SGLang's sampling_seed per
request slot), DFlashWorker._step_keys / _draft / _accept (chain), _tree_accept_sampled (tree) and
_seeded_first_tokens (the prefill's token), on the stand-ins of the accept, q-draft and tree tests.

- Reproducible: a seeded row's drafts and commits are the same whatever the global generator's state (on today's
  code every draw came from it, so two runs of one seeded request differed: these tests fail there), and they are
  acceptance.verify_seeded's / tree_acceptance.verify_tree_seeded's commits, with the same mapping of SGLang's
  sampling info as the unseeded rules (greedy rows: verify_greedy's commits).
- Width-free: the committed token of a position does not depend on how many drafts the step verified.
- DFlash2 (drafts drawn from q with the target's noise): the committed tokens follow the target (the q-draft test's
  grouped chi-square), and d_1 is kept at the coupling's rate sum_x 1 / sum_v max(p_v / p_x, q_v / q_x), far from
  the rate of drafts drawn with independent noise (sum p q), so the drafts really share the target's noise.
- The first token: the seeded draw of the last prompt position, from the probabilities SGLang's sampler left.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")
pytest.importorskip("scipy")

from sglang_dflash.acceptance import seeded_targets, verify_greedy, verify_seeded  # noqa: E402
from sglang_dflash.kernels.greedy_accept import commit_outputs, greedy_accept_torch  # noqa: E402
from sglang_dflash.sampling import SamplingParams, SamplingTensors, processed_probs, seeded_sample  # noqa: E402
from sglang_dflash.serving import worker  # noqa: E402
from sglang_dflash.serving.seeds import RequestSeeds  # noqa: E402
from sglang_dflash.tree_acceptance import verify_tree_greedy, verify_tree_seeded  # noqa: E402

from .test_worker_accept_cpu import GREEDY, inputs, sampling_info  # noqa: E402

V = 40


def prefill_batch(rows: list[dict], seeds: list[int | None], slots: list[int], sglang_seeds=None):
    """A prefilled batch as RequestSeeds reads it: SGLang's requests (sampling_seed, top_k as SGLang encodes greedy),
    their slots, and sampling_info.sampling_seed (set by SGLang only under --enable-deterministic-inference)."""
    info = sampling_info(rows)
    info.sampling_seed = sglang_seeds
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(sampling_seed=s, top_k=int(k)), req_pool_idx=slot)
            for s, k, slot in zip(seeds, info.top_ks.tolist(), slots)]
    return SimpleNamespace(reqs=reqs, sampling_info=info, req_pool_indices=torch.tensor(slots))


def ours(rows: list[dict], v: int = V) -> SamplingTensors:
    return SamplingTensors.from_params([SamplingParams(**r) for r in rows], v)


# ------------------------------------------------------------------------------------------- the seed table
def test_request_seeds_track_the_slots():
    seeds = RequestSeeds(16, "cpu")
    rows = [{"temperature": 0.8}, GREEDY, {"temperature": 1.0}, {"temperature": 0.5}]
    mask = seeds.on_prefill(prefill_batch(rows, [7, 9, None, -3], [4, 5, 6, 7]))
    assert mask.tolist() == [True, False, False, True]  # greedy rows need no seed; row 2 has none
    assert seeds.live == {4, 7}
    batch = SimpleNamespace(req_pool_indices=torch.tensor([7, 6, 4]))
    a, b = seeds.keys(batch), seeds.keys(batch)
    assert a[[0, 2]].tolist() == [-3, 7] and torch.equal(a[[0, 2]], b[[0, 2]])
    assert a[1] != b[1]  # an unseeded row: a fresh random key per step
    # slot 4 is reused by a request without a seed: it leaves the live set; no seeded slot left: no keys at all
    assert seeds.on_prefill(prefill_batch([{"temperature": 1.0}], [None], [4])) is None
    assert seeds.live == {7}
    seeds.on_prefill(prefill_batch([{"temperature": 1.0}], [None], [7]))
    assert not seeds.live and seeds.keys(batch) is None
    # --enable-deterministic-inference: SGLang seeds every request (its default where none was given)
    mask = seeds.on_prefill(prefill_batch(rows, [7, None, None, None], [1, 2, 3, 8],
                                          sglang_seeds=torch.tensor([7, 42, 42, 42])))
    assert mask.tolist() == [True, False, True, True] and seeds.live == {1, 3, 8}
    assert seeds.keys(SimpleNamespace(req_pool_indices=torch.tensor([3, 1]))).tolist() == [42, 7]


# ------------------------------------------------------------------------------------------- chain steps
MIXED = [GREEDY, {"temperature": 0.7}, {"temperature": 1.3, "top_k": 5}, {"temperature": 1.0, "top_p": 0.8},
         {"temperature": 0.9}, {"temperature": 1.1, "min_p": 0.05}]
SEEDS = [None, 11, 12, 13, None, 1 << 40]


def stand_in(rows, seeds):
    n = len(rows)
    me = SimpleNamespace(_greedy_accept=greedy_accept_torch, _tp_group=None, _seeds=RequestSeeds(n, "cpu"))
    for name in ("_sampled", "_rank0_outcome", "_rank0_ids", "_step_keys"):
        setattr(me, name, getattr(worker.DFlashWorker, name).__get__(me))
    me._seeds.on_prefill(prefill_batch(rows, seeds, list(range(n))))
    return me, SimpleNamespace(sampling_info=sampling_info(rows), req_pool_indices=torch.arange(n))


def chain_step(rows, seeds, drafts, logits, prefix, draw_seed):
    me, batch = stand_in(rows, seeds)
    torch.manual_seed(draw_seed)
    keys = worker.DFlashWorker._step_keys(me, batch)
    verify_ids = torch.cat([torch.zeros(len(rows), 1, dtype=drafts.dtype), drafts], dim=1)
    commit, tokens, *outputs = worker.DFlashWorker._accept(me, batch, verify_ids, logits, prefix, None, keys)
    for got, want in zip(outputs, commit_outputs(commit, tokens, prefix)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    return commit, tokens, keys


@pytest.mark.parametrize("width", [5, 1])
def test_seeded_rows_commit_the_same_whatever_the_generator(width):
    """Two runs of one step under different global generator states: the seeded rows commit the same tokens (and
    verify_seeded's, on our processed distribution), greedy rows verify_greedy's, unseeded sampled rows differ."""
    seeded = torch.tensor([s is not None for s in SEEDS])
    greedy = torch.tensor([r is GREEDY for r in MIXED])
    prefix = torch.arange(len(MIXED)) + 30
    differs = 0
    for trial in range(20):
        drafts, logits = inputs(len(MIXED), seed=trial, width=width)
        logits = logits[:, :, :V] if logits.shape[-1] > V else logits
        a_commit, a_tokens, keys = chain_step(MIXED, SEEDS, drafts, logits, prefix, draw_seed=trial)
        b_commit, b_tokens, _ = chain_step(MIXED, SEEDS, drafts, logits, prefix, draw_seed=1000 + trial)
        assert torch.equal(a_commit[seeded], b_commit[seeded]) and torch.equal(a_tokens[seeded], b_tokens[seeded])
        w_commit, w_tokens = verify_seeded(drafts, logits, ours(MIXED, logits.shape[-1]), keys, prefix)
        assert torch.equal(a_commit, w_commit) and torch.equal(a_tokens, w_tokens)  # unseeded rows: keys drawn
        g_commit, g_tokens = verify_greedy(drafts, logits)
        assert torch.equal(a_commit[greedy], g_commit[greedy]) and torch.equal(a_tokens[greedy], g_tokens[greedy])
        differs += int((a_tokens[~seeded & ~greedy] != b_tokens[~seeded & ~greedy]).any())
    assert differs > 5, "unseeded rows drew the same tokens in both runs: they are not random"


def test_the_committed_token_of_a_position_does_not_depend_on_the_width():
    """Verifying 4, 2 or 0 drafts of the same block: at every position both steps reach, the same token (the
    adaptive policy may pick any width, from step times: the seeded output must not follow its choice)."""
    drafts, logits = inputs(len(MIXED), seed=3, width=5)
    prefix = torch.arange(len(MIXED)) + 30
    full = chain_step(MIXED, SEEDS, drafts, logits, prefix, 0)
    for k in (2, 0):
        part = chain_step(MIXED, SEEDS, drafts[:, :k], logits[:, :k + 1], prefix, 1)
        seeded = torch.tensor([s is not None for s in SEEDS])
        reach = torch.minimum(full[0], part[0])
        for i in seeded.nonzero()[:, 0].tolist():
            assert full[1][i, :reach[i]].tolist() == part[1][i, :reach[i]].tolist(), (k, i)


# ------------------------------------------------------------------------------------------- DFlash2 drafts
def coupled_rate(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(argmax p / E == argmax q / E) for shared exponentials E over the vocabulary: for each x in both supports,
    E_v >= E_x max(p_v / p_x, q_v / q_x) for all v, which has probability 1 / sum_v max(p_v / p_x, q_v / q_x)."""
    p, q = p.double(), q.double()
    both = ((p > 0) & (q > 0)).nonzero()[:, 0].tolist()
    return sum(1.0 / float(torch.maximum(p / p[x], q / q[x]).sum()) for x in both)


@torch.no_grad()
def q_step(rows, seeds, k, draw_seed):
    """One draft -> accept step of the DFlash2 stand-in (test_worker_q_drafts_cpu) with the rows' seeds stored."""
    from .test_worker_q_drafts_cpu import B, BONUS, MASK, pair
    from .test_worker_q_drafts_cpu import stand_in as q_stand_in

    target, hidden, selector = pair()
    n = len(rows)
    me = q_stand_in(hidden, selector, n)
    me._seeds = RequestSeeds(n, "cpu")
    me._seeds.on_prefill(prefill_batch(rows, seeds, list(range(n))))
    me._rank0_ids = worker.DFlashWorker._rank0_ids.__get__(me)
    batch = SimpleNamespace(sampling_info=sampling_info(rows), req_pool_indices=torch.arange(n))
    block_ids = torch.full((n, B), MASK, dtype=torch.int64)
    block_ids[:, 0] = BONUS
    zeros, prefix = torch.zeros_like(block_ids), torch.full((n,), 20)
    torch.manual_seed(draw_seed)
    keys = worker.DFlashWorker._step_keys(me, batch)
    temperature = worker.DFlashWorker._draft_temperature(me, batch)
    draft = worker.DFlashWorker._draft(me, batch, block_ids, zeros, zeros, prefix, (None, None), n, k, temperature,
                                       keys)
    verify_ids = torch.cat([block_ids[:, :1], draft.tokens], dim=1)
    commit, tokens, *_ = worker.DFlashWorker._accept(me, batch, verify_ids, target[:k + 1].expand(n, k + 1, -1),
                                                     prefix, draft, keys)
    return draft, commit, tokens, target, selector


def test_dflash2_seeded_drafts_share_the_targets_noise():
    from .test_worker_q_drafts_cpu import BATCHES, BONUS, N_PER_GROUP, B, check_greedy_rows, check_law
    from .test_worker_q_drafts_cpu import first_draft_rates, pair, target_probs

    groups = BATCHES["mixed"]
    rows = [params for params in groups.values() for _ in range(N_PER_GROUP)]
    seeds = [10**6 + i if i % 2 else None for i in range(len(rows))]  # unseeded rows: random keys, the same rule
    draft, commit, tokens, target, selector = q_step(rows, seeds, B - 1, draw_seed=0)
    check_law(groups, commit, tokens, target, B - 1)
    check_greedy_rows(groups, draft, commit, tokens, target, selector, B - 1)
    _, hidden, _ = pair()
    first_rows = hidden[None, 1:2]
    for g, (name, params) in enumerate(groups.items()):
        if params["temperature"] == 0:
            continue
        exact, independent, _ = first_draft_rates(params, target, selector)
        with torch.no_grad():  # q_1, as first_draft_rates draws it: every request has the same bonus
            first = selector.walk(first_rows, first_rows.float(), torch.tensor([BONUS]),
                                  torch.tensor([params["temperature"]]))
        q1 = torch.zeros(target.shape[-1]).index_put_((first.candidates[0, 0],), first.q[0, 0])
        coupled = coupled_rate(target_probs(target, params)[0], q1)
        sigma = (coupled * (1 - coupled) / N_PER_GROUP) ** 0.5
        assert abs(coupled - independent) > 8 * sigma, (name, coupled, independent)  # the check has power
        rate = float((commit[g * N_PER_GROUP:(g + 1) * N_PER_GROUP] > 1).double().mean())
        assert abs(rate - coupled) < 5 * sigma, \
            f"{name}: d_1 kept at {rate:.3f}; drafts sharing the target's noise keep it at {coupled:.3f} " \
            f"(independent draws {independent:.3f}, the min(1, p/q) rule {exact:.3f})"
    # reproducible: another generator state, the same drafts and commits on the seeded rows
    again = q_step(rows, seeds, B - 1, draw_seed=1)
    mine = torch.tensor([s is not None for s in seeds])
    assert torch.equal(draft.tokens[mine], again[0].tokens[mine]) and torch.equal(tokens[mine], again[2][mine])
    assert not torch.equal(tokens[~mine], again[2][~mine])


# ------------------------------------------------------------------------------------------- tree steps
def test_seeded_tree_step_commits_verify_tree_seeded():
    """The worker's sampled tree step with seeded rows (and a greedy one): verify_tree_seeded's commits and
    outputs, req_to_token permuted along its paths, the same under another generator state."""
    from sglang_dflash.tree_acceptance import commit_path

    from .test_tree_graphs_cpu import N, _step_stand_in
    from .test_tree_graphs_cpu import V as TV
    from .test_tree_sampled_cpu import MIXED as TREE_ROWS
    from .test_tree_sampled_cpu import _target

    bs, seeds = len(TREE_ROWS), [None, 5, 6, 1 << 50]  # row 0 is greedy
    outputs = []
    for draw_seed in (0, 1):
        info = sampling_info(TREE_ROWS)
        target = torch.zeros(bs, N, TV)
        _, me, batch, state, prefix, tree, _ = _step_stand_in(bs, None, False, sampling=(info, info.top_ks.tolist()),
                                                              target=target)
        target.copy_(_target(tree, 3))
        me._seeds.on_prefill(prefill_batch(TREE_ROWS, seeds, batch.req_pool_indices.tolist()))
        before = me.req_to_token_pool.req_to_token.clone()
        torch.manual_seed(draw_seed)
        out = worker.DFlashWorker._tree_decode_step(me, batch, state, prefix, bs, None)
        commit, tokens, path = verify_tree_seeded(tree, target, ours(TREE_ROWS, TV), me._seeds.of(batch), prefix)
        got = (out.next_token_ids, out.next_draft_input.bonus_tokens, out.accept_lens, out.new_seq_lens)
        for name, g, w in zip(("next_ids", "bonus", "accept_lens", "new_seq_lens"), got,
                              commit_outputs(commit, tokens, prefix)):
            assert g.tolist() == w.tolist(), name
        commit_path(before, batch.req_pool_indices, prefix, path)
        assert torch.equal(me.req_to_token_pool.req_to_token, before)
        g_commit, _, _ = verify_tree_greedy(tree, target)
        assert commit[0] == g_commit[0]
        outputs.append([t.tolist() for t in got])
    assert outputs[0] == outputs[1]
    assert max(outputs[0][2][1:]) >= 2, "no seeded row accepted a node: the comparison says little"


# ------------------------------------------------------------------------------------------- the first token
def _sglang_sampler():
    from sglang.srt.layers.sampler import Sampler

    sampler = Sampler.__new__(Sampler)  # its __init__ needs a TP group; the flags are all _probs_after_sampling reads
    object.__setattr__(sampler, "use_ascend_backend", False)
    object.__setattr__(sampler, "use_log_softmax_logprob", False)
    return sampler


@pytest.mark.parametrize("return_logprob", [False, True])
def test_first_token_is_the_seeded_draw_of_the_last_prompt_position(return_logprob):
    rows = MIXED
    n = len(rows)
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(n, V, generator=g) * 2
    info = sampling_info(rows)
    # what SGLang's sampler leaves in next_token_logits: softmax(logits / T) (greedy rows at T = 1), and its tokens
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    sglang_tokens = torch.full((n,), V + 1)  # never a real draw: shows which rows were replaced
    me = SimpleNamespace(model_runner=SimpleNamespace(sampler=_sglang_sampler()), _logged_first_token_skip=False,
                         _seeds=RequestSeeds(n, "cpu"))
    batch = prefill_batch(rows, SEEDS, list(range(n)))
    batch.seq_lens, batch.return_logprob = torch.arange(n) + 12, return_logprob
    seeded = me._seeds.on_prefill(batch)
    out = SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=probs.clone()), next_token_ids=sglang_tokens)
    first = worker.DFlashWorker._seeded_first_tokens(me, batch, out, seeded)
    if return_logprob:  # SGLang computed the logprobs for its own token: it stays
        assert torch.equal(first, sglang_tokens) and me._logged_first_token_skip
        return
    keys = torch.tensor([s or 0 for s in SEEDS])
    want = seeded_sample(logits, ours(rows), keys, batch.seq_lens - 1)
    assert torch.equal(first[seeded], want[seeded])
    assert torch.equal(first[~seeded], sglang_tokens[~seeded])
    # the draw of a seeded row is the token the decode steps would draw at that position (the same stream)
    x = seeded_targets(logits[:, None], ours(rows), keys, (batch.seq_lens - 1)[:, None])[:, 0]
    assert torch.equal(first[seeded], x[seeded])
    assert processed_probs(logits, ours(rows))[seeded, first[seeded]].gt(0).all()
