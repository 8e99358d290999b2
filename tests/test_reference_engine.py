"""The reference engine is lossless: speculative output == target-only output (greedy: token for token; sampled:
in distribution), for Llama, Qwen3 and Gemma3 targets, with a drafter that is often right."""

import dataclasses
import functools
import itertools
import types

import pytest
import torch
from _stats import detectable_tv, grouped_chi2

from sglang_dflash.reference import ReferenceEngine
from sglang_dflash.sampling import SamplingParams, SamplingTensors, processed_probs
from sglang_dflash.targets.tiny import as_dflash2, tiny_dflash2_drafter, tiny_drafter, tiny_target
from sglang_dflash.train.loop import Sequence, greedy_continuations, train_drafter

ARCHS = ["llama", "qwen3", "gemma3"]
BLOCK = 8


def random_prompts(n, seed, lo=3, hi=14, vocab=250):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    """A tiny target and a drafter trained on the target's own greedy continuations of TRAIN_PROMPTS (a few hundred
    CPU steps): it agrees with the target often on those prompts and rarely elsewhere, so tests see full
    acceptance, partial acceptance and immediate rejection."""
    target = tiny_target(request.param)
    prompts = random_prompts(8, seed=0)
    drafter = tiny_drafter(target.config, block_size=BLOCK)
    train_drafter(drafter, target, greedy_continuations(target, prompts, 48), steps=300, lr=1e-2, num_anchors=32,
                  progress=False)
    return request.param, target, drafter, prompts


def test_greedy_equals_target_only_and_accepts_many(pair):
    arch, target, drafter, trained_prompts = pair
    prompts = trained_prompts[:5] + random_prompts(3, seed=99)  # batch of 8, lengths 3..13, ragged acceptance
    engine = ReferenceEngine(target, drafter)
    params = SamplingParams(max_new_tokens=40)
    spec = engine.generate(prompts, params)
    base = engine.generate_target_only(prompts, params)
    for s, b in zip(spec, base):
        assert s.output_ids == b.output_ids, arch
        assert len(s.output_ids) == 40 and s.finish_reason == "length"
    trained = [s.mean_acceptance for s in spec[:5]]
    assert sum(trained) / len(trained) > 2.0, trained
    commits = set(itertools.chain(*(s.commit_lens for s in spec)))
    assert 1 in commits and BLOCK in commits and commits & set(range(2, BLOCK))  # every acceptance regime ran
    # fewer target forwards than tokens: the multi-token path really committed several tokens per pass
    assert sum(s.target_forwards for s in spec[:5]) < sum(len(s.output_ids) for s in spec[:5]) / 2


def test_dflash2_greedy_equals_target_only(pair):
    """DFlash2 drafters, greedy: the selector's argmax path as drafts, output token for token the target's. Two
    drafters per target: the trained pair's backbone with a random selector (accepted often: every acceptance
    regime runs) and a random drafter with random convolutions (the convolutions on the engine's path)."""
    arch, target, drafter, trained_prompts = pair
    prompts = trained_prompts[:5] + random_prompts(3, seed=99)
    params = SamplingParams(max_new_tokens=40)
    base = ReferenceEngine(target).generate_target_only(prompts, params)
    for dflash2 in (as_dflash2(drafter), tiny_dflash2_drafter(target.config, block_size=BLOCK)):
        assert dflash2.config.is_dflash2
        spec = ReferenceEngine(target, dflash2).generate(prompts, params)
        assert [s.output_ids for s in spec] == [b.output_ids for b in base], arch
    commits = set(itertools.chain(*(s.commit_lens for s in ReferenceEngine(target, as_dflash2(drafter)).generate(
        prompts, params))))
    assert 1 in commits and BLOCK in commits and commits & set(range(2, BLOCK)), commits


@pytest.mark.parametrize("arch", ARCHS)
def test_target_only_greedy_equals_no_cache_recompute(arch):
    """The greedy baseline (generate_target_only) runs the same cached forward (HFTarget.forward on a DynamicCache)
    as the speculative path, so a cache bug could sit in both and they would still agree. Here each baseline token
    is recomputed without any cache: one full forward over prompt + output (causal, so row t sees exactly the
    tokens a step-by-step recompute would), argmax. The top-2 gap at every position is checked to be far above
    float32 noise, so equality is neither luck nor broken by rounding. Gemma-3 sequences (up to 37 tokens) cross
    its sliding window of 8."""
    target = tiny_target(arch)
    prompts = random_prompts(4, seed=7)
    results = ReferenceEngine(target).generate_target_only(prompts, SamplingParams(max_new_tokens=24))
    for prompt, r in zip(prompts, results):
        with torch.no_grad():
            logits = target(torch.tensor([prompt + r.output_ids]), use_cache=False).logits[0].float()
        rows = logits[len(prompt) - 1: -1]  # row t predicts token t + 1
        assert rows.argmax(-1).tolist() == r.output_ids, f"{arch}: cached greedy != no-cache recompute, {prompt}"
        top2 = rows.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, f"{arch}: a near-tie makes this comparison fragile, {prompt}"


def test_stop_tokens_and_max_new_tokens(pair):
    arch, target, drafter, prompts = pair
    engine = ReferenceEngine(target, drafter)
    free = engine.generate_target_only(prompts[:4], SamplingParams(max_new_tokens=30))
    # each request stops at a token its free-running output produces at a different depth
    params = [SamplingParams(max_new_tokens=30, stop_token_ids=(r.output_ids[k],))
              for r, k in zip(free, (0, 5, 11, 23))]
    params.append(SamplingParams(max_new_tokens=1))
    params.append(SamplingParams(max_new_tokens=7))
    batch = prompts[:4] + prompts[4:6]
    spec = engine.generate(batch, params)
    base = engine.generate_target_only(batch, params)
    for s, b, p in zip(spec, base, params):
        assert s.output_ids == b.output_ids, arch
        if p.stop_token_ids:
            assert s.finish_reason == "stop" and s.output_ids[-1] == p.stop_token_ids[0]
            assert p.stop_token_ids[0] not in s.output_ids[:-1]
        else:
            assert s.finish_reason == "length" and len(s.output_ids) == p.max_new_tokens


class Order2MarkovLM(torch.nn.Module):
    """A target whose exact next-token distribution is known in closed form, behind the transformers interface the
    reference engine uses (config, embeddings, a forward over a DynamicCache with hidden states): an order-2 Markov
    chain, logits = table[previous token, token]. The previous token of a forward's first position is read back
    from the KV cache, so a cache that keeps a rejected draft, or loses a committed token, changes the
    distribution. Its forward is a table lookup, ~20x cheaper than a tiny transformers model's on this machine, which
    buys the tens of thousands of sampled tokens a powerful distribution test needs. What it cannot show: anything
    specific to a real transformer in sampled mode (the greedy tests above cover the real targets' cached path)."""

    def __init__(self, vocab: int = 6, hidden: int = 32, boost: float = 2.5, seed: int = 0):
        super().__init__()
        import transformers

        g = torch.Generator().manual_seed(seed)
        self.config = transformers.PretrainedConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.prev_embed = torch.nn.Embedding(vocab + 1, hidden)  # row `vocab`: no previous token
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)  # the drafter's output head (the table is ours)
        for w in (self.embed.weight, self.prev_embed.weight, self.lm_head.weight):
            w.data = torch.randn(w.shape, generator=g)
        # random logits over (previous token, token), plus a boost for token + 1 (mod V): a small drafter learns
        # that cycle quickly, so its drafts are accepted often, while the other tokens keep enough mass for
        # temperature and the filters to matter
        self.table = torch.randn(vocab + 1, vocab, vocab, generator=g)
        favoured = (torch.arange(vocab) + 1) % vocab
        self.table[:, torch.arange(vocab), favoured] += boost

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, position_ids=None, past_key_values=None, use_cache=True, output_hidden_states=False,
                logits_to_keep=0, attention_mask=None):  # logits_to_keep: the trainer asks for it; a table lookup
        ids = input_ids[0]                                        # has nothing to save
        history = ids
        if past_key_values is not None:  # the cache stores token ids as 1-dim keys: [1, 1, T, 1]
            kv = ids[None, None, :, None].float()
            history = past_key_values.update(kv, kv, 0)[0][0, 0, :, 0].long()
        if attention_mask is not None:  # a tree verify's 4D additive mask: the previous token is the last VISIBLE
            t, total = len(ids), len(history)  # key before the query's own row (its parent in the tree)
            own = total - t + torch.arange(t)
            key = torch.arange(total)
            before = (attention_mask[0, 0] == 0) & (key[None, :] < own[:, None])
            last = torch.where(before, key, -1).amax(dim=1)
            prev = torch.where(last >= 0, history[last.clamp(min=0)], self.config.vocab_size)
        elif len(history) > len(ids):
            prev = history[-len(ids) - 1:-1]
        else:  # the sequence starts here
            prev = torch.cat([history.new_full((1,), self.config.vocab_size), history[:-1]])
        hidden = None
        if output_hidden_states:
            e = self.embed(ids)[None]
            hidden = (e, e, e + self.prev_embed(prev)[None])
        # the engine reads .logits and .hidden_states only; a plain namespace is 10x cheaper than a ModelOutput
        return types.SimpleNamespace(logits=self.table[prev, ids][None], hidden_states=hidden)

    def next_token_probs(self, s: SamplingParams) -> torch.Tensor:
        """[V+1, V, V]: the processed distribution after (previous token, token); previous = V at the start."""
        v = self.config.vocab_size
        rows = self.table.view(-1, v)
        return processed_probs(rows, SamplingTensors.from_params([s] * len(rows), v)).view(v + 1, v, v)


MARKOV_BLOCK = 4


@functools.cache
def markov_pair():
    """The Markov target and a drafter (block 4) trained on 32 of its sampled continuations: drafts are accepted
    often, so every block position and the bonus after full acceptance are observed thousands of times."""
    target = Order2MarkovLM().eval()
    v = target.config.vocab_size
    drafter = tiny_drafter(target.config, block_size=MARKOV_BLOCK, mask_token_id=v - 1, target_layer_ids=[0, 1])
    prompts = [torch.randint(v, (3,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(32)]
    runs = ReferenceEngine(target, seed=0).generate_target_only(prompts, SamplingParams(temperature=0.8,
                                                                                       max_new_tokens=40))
    data = [Sequence(torch.tensor(r.prompt_ids + r.output_ids), len(r.prompt_ids)) for r in runs]
    train_drafter(drafter, target, data, steps=300, lr=1e-2, num_anchors=16, progress=False)
    return target, drafter


def markov_role_names(block: int) -> list[str]:
    return ["prefill sample"] + [f"d_{j + 1} or its replacement" for j in range(block - 1)] + [
        "bonus after full acceptance"]


def sampled_distribution_failures(target, drafter, params: SamplingParams, n_requests: int, alpha: float,
                                  seed: int = 11, tree_size: int | None = None, seeded: bool = False):
    """Run the engine on n_requests random prompts and check every emitted token against the target's exact
    conditional distribution, grouped by its role (the prefill sample, or its block position in its verify step)
    and the Markov state it was drawn in. A role is a function of the tokens before it (a step ends at the first
    emitted token that differs from its draft), so each group is a set of draws from one known distribution.
    ``seeded``: request i carries SamplingParams.seed = 10^6 + i (the seeded rules; tests/test_seeded_sampling.py).
    Returns ([(role, p-value, draws, df)] failing, [(role, draws, df)] all, commit lengths)."""
    v, block = target.config.vocab_size, drafter.config.block_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(v, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n_requests)]
    per_request = [dataclasses.replace(params, seed=10**6 + i) for i in range(n_requests)] if seeded else params
    results = ReferenceEngine(target, drafter, seed=seed, tree_size=tree_size).generate(prompts, per_request)
    names = markov_role_names(block)
    counts = torch.zeros(len(names), v + 1, v, v)  # role, previous token, token, next token
    rows = []
    for r in results:
        roles = [0] + [1 + j for n in r.commit_lens for j in range(n)]
        seq = [v] + r.prompt_ids + r.output_ids  # v: "no previous token"
        start = 1 + len(r.prompt_ids)
        rows += [(role, seq[t - 2], seq[t - 1], seq[t]) for role, t in zip(roles, range(start, len(seq)))]
    counts.index_put_(tuple(torch.tensor(rows).T), torch.ones(len(rows)), accumulate=True)
    exact = target.next_token_probs(params)
    failures, seen = [], []
    for role, name in enumerate(names):
        states = counts[role].sum(-1).nonzero().tolist()
        pvalue, n, df, _ = grouped_chi2((counts[role, a, b], exact[a, b]) for a, b in states)
        seen.append((name, n, df))
        if pvalue <= alpha:
            failures.append((name, pvalue, n, df))
    return failures, seen, [c for r in results for c in r.commit_lens]


MAX_TV = 0.15
MARKOV_ALPHA = 1e-4  # per role; 5 roles x 4 parameter sets, so a harmless re-roll of the seed fails < 0.2% of the time
SAMPLED = [
    dict(temperature=0.6),
    dict(temperature=1.4, top_k=3),
    dict(temperature=0.8, top_p=0.8),
    dict(temperature=1.2, min_p=0.15),
]


@pytest.mark.parametrize("kw", SAMPLED, ids=["temperature", "top_k", "top_p", "min_p"])
def test_sampled_output_follows_target_distribution(kw, n_requests=1500):
    """Sampled speculative decoding emits the target's distribution at every block position: 1,500 requests x 20
    tokens on the Markov target, each token checked against the exact conditional of its state, per role: the
    prefill sample, d_1..d_3 or their replacements, and the bonus after full acceptance (grouped chi-square,
    threshold 1e-4; tokens of probability 0, i.e. outside top-k / top-p / min-p, fail outright). Every parameter set
    has temperature != 1, so a verify that ignores temperature is caught by each.

    Power at seed 11 (>= 95% against the worst-case direction, _stats.detectable_tv; TV = mean over the role's
    draws of the conditional's total-variation error):
                       prefill      d_1 / repl.    d_2 / repl.    d_3 / repl.    bonus
        temperature 0.6    1500 .119    12520 .044     8174 .045      5151 .055      2655 .073
        T 1.4, top_k 3     1500 .119    15369 .038     7878 .043      3682 .061      1571 .093
        T 0.8, top_p 0.8   1500 .108    12497 .035     8448 .037      5033 .049      2522 .067
        T 1.2, min_p 0.15  1500 .118    14369 .038     8193 .040      4066 .058      1872 .082
    (draws, then the smallest TV detected; 6 to 91 degrees of freedom per cell of this table.)
    A test that cannot see the bonus cannot fail a bug in it: the bonus role must have >= 1,500 draws here."""
    target, drafter = markov_pair()
    params = SamplingParams(max_new_tokens=20, **kw)
    failures, seen, commits = sampled_distribution_failures(target, drafter, params, n_requests, MARKOV_ALPHA)
    assert not failures, f"{kw}: emitted tokens do not follow the target at (role, p-value, draws, df) {failures}"
    assert set(commits) == set(range(1, MARKOV_BLOCK + 1)), "every acceptance length must occur"
    if kw.keys() & {"top_k", "top_p", "min_p"}:  # the filter removes tokens, so ignoring it would emit them
        assert (target.next_token_probs(params) == 0).float().mean() > 0.1
    if n_requests >= 1500:  # the power stated above, enforced (mutation tests run smaller batches)
        for name, draws, df in seen:
            assert detectable_tv(draws, df, MARKOV_ALPHA) < MAX_TV, (kw, name, draws, df)
        assert seen[-1][1] >= 1500, seen


@functools.cache
def markov_dflash2():
    """The Markov pair's drafter as a DFlash2 one (its backbone, a random selector over 3 of the 6 tokens): sampled
    drafts are drawn from the selector's q, which is not the target's p and is zero outside the candidates."""
    target, drafter = markov_pair()
    return target, as_dflash2(drafter, selector_top_k=3)


@pytest.mark.parametrize("kw", SAMPLED[:2], ids=["temperature", "top_k"])
def test_dflash2_sampled_output_follows_target_distribution(kw, n_requests=1500):
    """As test_sampled_output_follows_target_distribution, with a DFlash2 drafter: drafts drawn from q over the
    selector's 3 candidates, verified by verify_sampled_q. Power at seed 11 (draws, smallest TV detected):
                       prefill      d_1 / repl.    d_2 / repl.    d_3 / repl.    bonus
        temperature 0.6    1500 .119    12121 .045     8427 .046      4818 .059      3134 .071
        T 1.4, top_k 3     1500 .119    13041 .041     8396 .046      4478 .063      2585 .080"""
    target, drafter = markov_dflash2()
    params = SamplingParams(max_new_tokens=20, **kw)
    failures, seen, commits = sampled_distribution_failures(target, drafter, params, n_requests, MARKOV_ALPHA)
    assert not failures, f"{kw}: emitted tokens do not follow the target at (role, p-value, draws, df) {failures}"
    assert set(commits) == set(range(1, MARKOV_BLOCK + 1)), "every acceptance length must occur"
    if n_requests >= 1500:
        for name, draws, df in seen:
            assert detectable_tv(draws, df, MARKOV_ALPHA) < MAX_TV, (kw, name, draws, df)
        assert seen[-1][1] >= 1500, seen


def test_dflash2_sampled_first_draft_acceptance_rate(n_requests=300):
    """The verify must use q, not only keep the law: a step keeps d_1 with probability sum_c min(p(c), q_1(c)) (p:
    the target's exact row after the bonus, q_1: the selector's distribution d_1 was drawn from, both recorded per
    step). The point-mass rule would keep it with p(d_1) only, which is also exact in law. Checked as a sum of
    Bernoullis of known means, within 4.5 sigma (~3,000 steps)."""
    target, drafter = markov_dflash2()
    params = SamplingParams(temperature=1.0, max_new_tokens=20)
    v = target.config.vocab_size
    exact = target.next_token_probs(params)
    engine = ReferenceEngine(target, drafter, seed=3)
    expected: dict[int, list[float]] = {}  # per request (first-seen order = prompt order), one mean per step
    draft = engine._draft

    def recording_draft(reqs):
        block = draft(reqs)
        for i, r in enumerate(reqs):
            seq = [v] + r.prompt + r.out
            p = exact[seq[-2], seq[-1]][block.candidates[i, 0]]
            expected.setdefault(id(r), []).append(torch.minimum(p, block.q[i, 0]).sum().item())
        return block

    engine._draft = recording_draft
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(v, (3,), generator=g).tolist() for _ in range(n_requests)]
    results = engine.generate(prompts, params)
    kept = [n > 1 for r in results for n in r.commit_lens]
    means = [e for per_request in expected.values() for e in per_request]
    assert len(kept) == len(means)
    mean, sigma = sum(means), sum(e * (1 - e) for e in means) ** 0.5
    assert abs(sum(kept) - mean) < 4.5 * sigma, f"d_1 kept at rate {sum(kept) / len(kept):.4f}, " \
                                                 f"not {mean / len(means):.4f} ({len(means)} steps)"


def test_sampled_batch_mixes_greedy_rows():
    """A greedy request batched with sampled ones stays token-identical to target-only greedy."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target.config, block_size=BLOCK)
    prompts = random_prompts(4, seed=5)
    params = [SamplingParams(max_new_tokens=24), SamplingParams(temperature=1.0, max_new_tokens=24),
              SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=24), SamplingParams(max_new_tokens=24)]
    base = ReferenceEngine(target).generate_target_only(prompts, SamplingParams(max_new_tokens=24))
    for d in (drafter, tiny_dflash2_drafter(target.config, block_size=BLOCK)):  # DFlash2: greedy rows, q one-hot
        spec = ReferenceEngine(target, d, seed=1).generate(prompts, params)
        assert spec[0].output_ids == base[0].output_ids and spec[3].output_ids == base[3].output_ids
        assert all(len(s.output_ids) == 24 for s in spec)


def test_engine_rejects_mismatched_drafter():
    from sglang_dflash.config import DFlashConfigError

    target = tiny_target("qwen3")
    drafter = tiny_drafter(tiny_target("qwen3", vocab_size=300).config)
    with pytest.raises(DFlashConfigError, match="vocab_size"):
        ReferenceEngine(target, drafter)
