"""finish_order.update_finish_state_in_token_order on SGLang's own Req: a request fed its output in speculative
commits (chunks of 1..8 tokens) finishes exactly where plain decoding (one token per step) finishes: reason,
matched stop, finished length, and the output list intact. SGLang's multi-token rule alone does not (the soak's
case: a stop string inside a commit that reaches max_new_tokens), which shows the check can fail."""

import random

import pytest

pytest.importorskip("sglang")

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_dflash.serving.finish_order import update_finish_state_in_token_order  # noqa: E402

VOCAB = 8  # tokens are letters A..H, so stop strings of two letters match often


class Letters:
    eos_token_id = 7
    additional_stop_token_ids = None

    def decode(self, ids, **_):
        return "".join(chr(65 + i) for i in ids)

    def encode(self, text, **_):
        return [ord(c) - 65 for c in text]


def make_req(max_new, stop=(), stop_ids=(), ignore_eos=False):
    sp = SamplingParams(max_new_tokens=max_new, stop=list(stop), stop_token_ids=list(stop_ids), ignore_eos=ignore_eos)
    sp.normalize(Letters())
    req = Req("r", "", [0, 1], sp, eos_token_ids={7}, vocab_size=VOCAB)
    req.tokenizer = Letters()
    return req


def finish(req, tokens, chunks, rule):
    """Feed `tokens` in commits of the given sizes through `rule` (as SGLang's result processor does) until the
    request finishes; (reason class, matched, finished_len, output ids)."""
    i = 0
    for size in chunks:
        if req.finished() or i >= len(tokens):
            break
        commit = tokens[i:i + size]
        i += len(commit)
        req.output_ids.extend(commit)
        rule(req, len(commit))
    reason = req.finished_reason
    return (type(reason).__name__ if reason else None, getattr(reason, "matched", None), req.finished_len,
            list(req.output_ids))


def plain(req, n):
    Req.update_finish_state(req, n)


def ours(req, n):
    update_finish_state_in_token_order(Req.update_finish_state, req, n)


def cases(n, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        letters = "ABCDEFG"
        stop = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 2))]
        stop_ids = rng.sample(range(VOCAB), rng.randint(0, 2))
        tokens = [rng.randrange(VOCAB) for _ in range(24)]
        chunks = [rng.randint(1, 8) for _ in range(24)]
        yield dict(max_new=rng.randint(1, 20), stop=stop, stop_ids=stop_ids, ignore_eos=rng.random() < 0.3), \
            tokens, chunks


def test_speculative_commits_finish_where_plain_decoding_finishes():
    for i, (kw, tokens, chunks) in enumerate(cases(400)):
        want = finish(make_req(**kw), tokens, [1] * len(tokens), plain)
        got = finish(make_req(**kw), tokens, chunks, ours)
        # the finished output (what the user gets) and why it finished
        assert got[:3] == want[:3], (i, kw, tokens, chunks, got, want)
        n = got[2] if got[2] is not None else len(got[3])
        assert got[3][:n] == want[3][:n]
        assert len(got[3]) >= len(want[3])  # the commit's tokens stay in the list (SGLang trims to finished_len)


def test_sglangs_multi_token_rule_alone_differs():
    # the soak's mismatch: the stop string completes at token 2, the next commit reaches max_new_tokens
    kw = dict(max_new=12, stop=["BC"])
    tokens = [0, 1, 2, 3, 4, 5, 6, 0, 1, 3, 4, 5]
    want = finish(make_req(**kw), tokens, [1] * 12, plain)
    assert want[:3] == ("FINISH_MATCHED_STR", "BC", 3)
    assert finish(make_req(**kw), tokens, [1, 11], ours)[:3] == want[:3]
    assert finish(make_req(**kw), tokens, [1, 11], plain)[:3] == ("FINISH_LENGTH", None, 12)
    differ = sum(finish(make_req(**kw), tokens, chunks, plain)[:3] != finish(make_req(**kw), tokens, [1] * 24,
                                                                             plain)[:3]
                 for kw, tokens, chunks in cases(400))
    assert differ > 0
