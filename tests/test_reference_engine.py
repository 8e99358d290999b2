"""The reference engine is lossless: speculative output == target-only output (greedy: token for token; sampled:
in distribution), for Llama, Qwen3 and Gemma3 targets, with a drafter that is often right."""

import itertools

import pytest
import torch
from _stats import chi2_pvalue

from sglang_dflash.reference import ReferenceEngine
from sglang_dflash.sampling import SamplingParams, SamplingTensors, processed_probs
from sglang_dflash.tiny import tiny_drafter, tiny_target
from sglang_dflash.train.trainer import greedy_continuations, train_drafter

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


def exact_joint(target, prompt, s: SamplingParams, depth=3):
    """The target's processed distribution over the first `depth` emitted tokens, by brute force."""
    v = target.config.vocab_size
    st = SamplingTensors.from_params([s], v)
    probs = {(): 1.0}
    for _ in range(depth):
        prefixes = list(probs)
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        with torch.no_grad():
            logits = target(ids).logits[:, -1].float()
        p_next = processed_probs(logits, SamplingTensors(*(t.expand(len(prefixes)) for t in
                                                           (st.temperature, st.top_k, st.top_p, st.min_p))))
        new = {}
        for prefix, row in zip(prefixes, p_next):
            for t in torch.nonzero(row).flatten().tolist():
                new[prefix + (t,)] = probs[prefix] * row[t].item()
        probs = new
    return probs


SAMPLED = [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=3),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.3, min_p=0.2),
]


@pytest.fixture(scope="module")
def small_vocab_pair():
    """A target over 8 tokens and a drafter trained briefly on its greedy continuations, so drafts are accepted
    often but not always."""
    target = tiny_target("qwen3", vocab_size=8, peak=2.0, seed=3)
    drafter = tiny_drafter(target.config, block_size=4, mask_token_id=7)
    prompts = [[3, 1, 2], [5, 5, 0, 6], [2, 4], [6, 0, 1, 3]]
    train_drafter(drafter, target, greedy_continuations(target, prompts, 24), steps=150, lr=1e-2, num_anchors=16,
                  progress=False)
    return target, drafter


@pytest.mark.parametrize("kw", SAMPLED, ids=["plain", "top_k", "top_p", "min_p"])
def test_sampled_output_follows_target_distribution(small_vocab_pair, kw):
    """Many seeded copies of one prompt: the joint distribution of the first three emitted tokens (the prefill
    token, then tokens from verification, including tokens sampled at and after a rejected draft) must match the
    target's processed distribution (chi-square at a fixed seed; cells of probability 0 must stay empty)."""
    target, drafter = small_vocab_pair
    prompt = [3, 1, 2]
    params = SamplingParams(max_new_tokens=3, **kw)
    n = 1500
    results = ReferenceEngine(target, drafter, seed=11).generate([prompt] * n, params)
    first_step = [r.commit_lens[0] for r in results if r.commit_lens]
    assert 1 in first_step and max(first_step) >= 2  # rejections and acceptances both happened
    joint = exact_joint(target, prompt, params)
    cells = {c: i for i, c in enumerate(joint)}
    counts = torch.zeros(len(cells) + 1)
    for r in results:
        counts[cells.get(tuple(r.output_ids), len(cells))] += 1  # last cell: sequences of probability 0
    assert counts[-1] == 0, "emitted a sequence the target can never produce"
    assert chi2_pvalue(counts[:-1], torch.tensor(list(joint.values()))) > 1e-3


def test_sampled_batch_mixes_greedy_rows():
    """A greedy request batched with sampled ones stays token-identical to target-only greedy."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target.config, block_size=BLOCK)
    prompts = random_prompts(4, seed=5)
    params = [SamplingParams(max_new_tokens=24), SamplingParams(temperature=1.0, max_new_tokens=24),
              SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=24), SamplingParams(max_new_tokens=24)]
    engine = ReferenceEngine(target, drafter, seed=1)
    spec = engine.generate(prompts, params)
    base = engine.generate_target_only(prompts, SamplingParams(max_new_tokens=24))
    assert spec[0].output_ids == base[0].output_ids and spec[3].output_ids == base[3].output_ids
    assert all(len(s.output_ids) == 24 for s in spec)


def test_engine_rejects_mismatched_drafter():
    from sglang_dflash.config import DFlashConfigError

    target = tiny_target("qwen3")
    drafter = tiny_drafter(tiny_target("qwen3", vocab_size=300).config)
    with pytest.raises(DFlashConfigError, match="vocab_size"):
        ReferenceEngine(target, drafter)
