"""Training data through a real SGLang server (sglang_dflash.train.generate.generate_with_server), on CPU.

One plain SGLang server on a tiny float32 Qwen3 target, launched exactly as the training pipeline launches its
generation server (launch_generation_server: --skip-tokenizer-init, token ids in and out). Checked:
- greedy, one prompt per request and in batch requests of 4: every stored sequence is prompt + the target's own
  greedy continuation computed in float32 by the reference engine (target-only decoding), with prompt_lens right,
  the stop token kept as the last token, responses that hit max_new_tokens exactly that long. One stop id is a
  token the target really emits mid-way (found from an unstopped greedy run), so stopping is exercised; an offset
  between prompt and response, a dropped or extra token, a trimmed stop token or a wrong order fails the
  comparison;
- sample_fraction=1: every prompt is sampled at T=1 (the outputs differ from greedy: temperature really reached
  the server), the tokens are valid (inside the vocabulary, stop only as the last token), the sampled prompts and
  their per-request seeds are fixed by `seed`;
- a zero time budget leaves every prompt out, and an unreachable server raises with the cause;
- `python -m sglang_dflash.train generate --tiny --passes greedy,sampled` end to end (its own server on the
  pipeline's tiny target).
"""

from __future__ import annotations

import shutil

import pytest

pytestmark = pytest.mark.server
pytest.importorskip("sglang")
if shutil.which("gcc") is None:
    pytest.skip("gcc is needed to build the stub libcuda.so.1", allow_module_level=True)

from sglang_dflash.reference.engine import ReferenceEngine  # noqa: E402
from sglang_dflash.sampling import SamplingParams  # noqa: E402
from sglang_dflash.testing import save_tiny_target  # noqa: E402
from sglang_dflash.train.generate import (generate_with_server, launch_generation_server,  # noqa: E402
                                          sampled_prompt_mask, sampling_seed_of, server_request)

from .compare import STARTUP_S, port  # noqa: E402
from .models import random_prompts  # noqa: E402

PORT = 30050
EOS = 1  # the tiny tokenizer's <|endoftext|>, the checkpoint's eos_token_id
MAX_NEW = 40
N_PROMPTS = 6


def _reference(model, prompts, stop_ids, max_new):
    """Target-only greedy decoding in float32 (the reference engine): the tokens the server must reproduce."""
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=tuple(stop_ids))
    return [r.output_ids for r in ReferenceEngine(model).generate_target_only(prompts, params)]


def test_generate_command_launches_its_own_server(tmp_path):
    """`python -m sglang_dflash.train generate --tiny --passes greedy,sampled`: the pipeline writes its tiny target,
    launches a server on it, answers every prompt twice (greedy, then T=1; interleaved), stops the server and saves
    data.pt. The greedy answers equal target-only decoding; the sampled ones leave the greedy path somewhere. First in
    this module: it runs before the module's own server starts (one server at a time)."""
    import torch

    from sglang_dflash.train.data import TokenStore
    from sglang_dflash.train.pipeline import load_target, main, tiny_prompts

    out = tmp_path / "data.pt"
    main(["generate", "--tiny", "--out", str(out), "--passes", "greedy,sampled", "--max-train-prompts", "8",
          "--max-new-tokens", "24", "--quiet"])
    data = TokenStore.load(out)
    prompts = tiny_prompts(8, 0)
    ref = _reference(load_target("tiny", torch.float32, "cpu")[0], prompts, [EOS], 24)
    assert len(data) == 16 and data.meta["generator"] == "sglang" and data.meta["sampled_prompts"] == 8
    assert data.prompt_lens.tolist() == [len(p) for p in prompts for _ in range(2)]
    sampled_outs = []
    for i, p in enumerate(prompts):
        greedy, sampled = data.tokens(2 * i).tolist(), data.tokens(2 * i + 1).tolist()
        assert greedy[: len(p)] == p and sampled[: len(p)] == p
        assert greedy[len(p):] == ref[i], f"prompt {i}: {greedy[len(p):]} != target-only greedy {ref[i]}"
        sampled_outs.append(sampled[len(p):])
    assert sampled_outs != ref, "the sampled pass gave exactly the greedy responses"
    assert (tmp_path / "tiny_target_hf" / "config.json").is_file() and (tmp_path / "generation_server.log").is_file()


def test_self_prompts_command_samples_the_targets_own_requests(tmp_path, monkeypatch, smollm2_plain):
    """`python -m sglang_dflash.train self-prompts` on SmolLM2-135M-Instruct (real weights; --server-url: the package's
    plain float32 SmolLM2 server, conftest.smollm2_plain, instead of a server of its own: one start less), one
    request per MT-Bench style, greedy (--query-temperature 0) so the server's requests can be checked: each style's
    request is target-only greedy decoding (reference engine, float32) of that style's prefix up to <|im_end|>, kept
    exactly when that decoding ends the turn within the token limit; the prompts file holds each kept request in the
    chat template with the default system message, the held-out sets as `prepare` writes them, and the text beside it.
    A prefix cut in the wrong place, a lost or extra token, a wrong end token or a request kept unfinished fails.
    The held-out sets are two stand-in prompts per set (CI does not install the prompt packages of the train extra)."""
    import json

    import torch

    from sglang_dflash.targets import smollm2
    from sglang_dflash.train import data, pipeline
    from sglang_dflash.train.data import Prompt
    from sglang_dflash.train.pipeline import load_prompts, main
    from sglang_dflash.train.self_prompts import QUERY_STYLES, query_prefix

    def stand_in_eval_prompts(n_per_set):
        return {name: [Prompt(name, str(i), f"Held-out {name} question {i}: what is {i} + {i}?") for i in range(2)]
                for name in ("humaneval", "mtbench", "gsm")}

    monkeypatch.setattr(pipeline, "eval_prompts", stand_in_eval_prompts)  # the held-out sets written
    monkeypatch.setattr(data, "eval_prompts", stand_in_eval_prompts)  # the texts no request may equal

    from .compare import wait_all_healthy

    target_dir = smollm2_plain.target  # the fixture skips where the SmolLM2 GGUF is not installed
    tok = smollm2.load_tokenizer(target_dir)
    out, max_query = tmp_path / "self.pt", 48
    wait_all_healthy(smollm2_plain.server)
    main(["self-prompts", "--target", "smollm2", "--hf-dir", str(target_dir), "--out", str(out), "--n", "8",
          "--query-temperature", "0", "--max-query-tokens", str(max_query), "--n-eval", "2", "--quiet",
          "--concurrency", "8", "--server-url", smollm2_plain.server.url])

    model = smollm2.load_target(torch.float32, "cpu", hf_dir=target_dir)
    expected = {}
    for style, system in QUERY_STYLES.items():
        prefix, end = query_prefix(tok, system)
        params = SamplingParams(max_new_tokens=max_query, stop_token_ids=(end, *smollm2.STOP_IDS))
        ids = ReferenceEngine(model).generate_target_only([prefix], params)[0].output_ids
        finished = ids[-1:] == [end] and not set(ids[:-1]) & set(tok.all_special_ids)
        if finished and len(tok.decode(ids[:-1]).strip()) >= 16:
            expected[f"self-{style}"] = tok.decode(ids[:-1]).strip()
    assert expected, "no style's greedy request ends within the limit: the test checks nothing (raise max_query)"

    store, held_out = load_prompts(str(out))
    got = {src: store.tokens(i).tolist() for i, src in enumerate(store.sources)}
    assert set(got) == set(expected), f"kept {sorted(got)}, target-only decoding finishes {sorted(expected)}"
    for src, text in expected.items():
        assert got[src] == smollm2.chat_ids(tok, text), f"{src}: the stored prompt is not {text!r} in the template"
    assert held_out == {k: [smollm2.chat_ids(tok, p.text) for p in ps] for k, ps in stand_in_eval_prompts(2).items()}
    lines = [json.loads(x) for x in out.with_suffix(".requests.jsonl").read_text().splitlines()]
    assert {x["style"]: x["text"] for x in lines} == expected
    meta = store.meta["self_prompts"]
    assert meta["sampled"] == 8 and meta["kept"] == len(expected) and meta["failed_prompts"] == 0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen_server")
    model = save_tiny_target(root / "target", peak=8.0)
    server = launch_generation_server(root / "target", root, device="cpu", port=port(PORT))
    try:
        vocab = model.config.vocab_size
        prompts = random_prompts(N_PROMPTS, vocab, seed=7)
        # a stop id the target really emits: the 6th greedy token of prompt 0 without stops (not EOS itself)
        free = _reference(model, prompts[:1], [EOS], MAX_NEW)[0]
        stop_tok = next(t for t in free[5:] if t != EOS)
        stop_ids = [EOS, stop_tok]
        server.wait_healthy(STARTUP_S)
        yield {"server": server, "model": model, "vocab": vocab, "prompts": prompts, "stop_ids": stop_ids}
    finally:
        server.stop()


@pytest.mark.parametrize("group", [1, 4])
def test_greedy_equals_target_only_decoding(setup, group):
    """group 4: the prompts go as batch requests (4 and 2 prompts), and each answer must land on its own prompt."""
    s = setup
    prompts, stop_ids = s["prompts"], s["stop_ids"]
    ref = _reference(s["model"], prompts, stop_ids, MAX_NEW)
    sources = [f"src{i}" for i in range(len(prompts))]
    store = generate_with_server(s["server"].url, prompts, MAX_NEW, stop_ids, s["vocab"], sample_fraction=0.0,
                                 sources=sources, concurrency=3, progress=False, group=group)
    assert len(store) == len(prompts) and store.meta["skipped_prompts"] == 0 and store.meta["failed_prompts"] == 0
    assert store.meta["request_group"] == group
    assert store.meta["generator"] == "sglang" and store.meta["sampled_prompts"] == 0
    assert store.sources == sources
    assert store.prompt_lens.tolist() == [len(p) for p in prompts]
    for i, (p, r) in enumerate(zip(prompts, ref)):
        toks = store.tokens(i).tolist()
        assert toks[: len(p)] == p, f"prompt {i} is not stored first"
        assert toks[len(p):] == r, f"prompt {i}: server response {toks[len(p):]} != target-only greedy {r}"
    assert store.meta["response_tokens"] == sum(len(r) for r in ref)
    stopped = [r for r in ref if r[-1] in stop_ids]
    assert stopped, "no reference response hit a stop id: the stop path is not exercised"
    assert any(len(r) < MAX_NEW for r in stopped)
    for r in ref:
        assert r[-1] in stop_ids or len(r) == MAX_NEW
    # the same keys as the transformers generator's data, so `run --data` reads either
    for key in ("max_new_tokens", "sample_fraction", "response_tokens", "generate_s", "skipped_prompts"):
        assert key in store.meta


def test_sampled_responses_are_valid_and_seeded(setup):
    s = setup
    prompts, stop_ids, vocab = s["prompts"], s["stop_ids"], s["vocab"]
    greedy = _reference(s["model"], prompts, stop_ids, MAX_NEW)
    store = generate_with_server(s["server"].url, prompts, MAX_NEW, stop_ids, vocab, sample_fraction=1.0, seed=3,
                                 concurrency=3, progress=False)
    assert len(store) == len(prompts) and store.meta["sampled_prompts"] == len(prompts)
    assert store.prompt_lens.tolist() == [len(p) for p in prompts]
    outs = []
    for i, p in enumerate(prompts):
        toks = store.tokens(i).tolist()
        assert toks[: len(p)] == p
        out = toks[len(p):]
        assert 1 <= len(out) <= MAX_NEW and all(0 <= t < vocab for t in out)
        assert not any(t in stop_ids for t in out[:-1]), f"a stop id inside sampled response {i}: {out}"
        assert out[-1] in stop_ids or len(out) == MAX_NEW
        outs.append(out)
    # at T=1 over 6 x up to 40 tokens of this target some token leaves the greedy path (greedy: top_k = 1)
    assert outs != greedy, "sample_fraction=1 gave exactly the greedy responses: temperature 1 never reached the server"
    # which prompts are sampled and their per-request seeds are fixed by the seed
    assert sampled_prompt_mask(100, 0.25, 3) == sampled_prompt_mask(100, 0.25, 3)
    assert sum(sampled_prompt_mask(100, 0.25, 3)) == 25 and sampled_prompt_mask(100, 0.25, 3) != \
        sampled_prompt_mask(100, 0.25, 4)
    body = server_request(prompts[0], MAX_NEW, stop_ids, True, sampling_seed_of(3, 0))
    assert body["sampling_params"]["sampling_seed"] == sampling_seed_of(3, 0) != sampling_seed_of(3, 1)
    assert body["sampling_params"]["temperature"] == 1.0 and body["sampling_params"]["top_k"] == -1


def test_time_budget_and_errors(setup):
    s = setup
    store = generate_with_server(s["server"].url, s["prompts"], MAX_NEW, s["stop_ids"], s["vocab"],
                                 time_budget_s=0.0, progress=False)
    assert len(store) == 0 and store.meta["skipped_prompts"] == len(s["prompts"])
    with pytest.raises(RuntimeError, match="every /generate request"):
        generate_with_server("http://127.0.0.1:9", s["prompts"][:2], 4, s["stop_ids"], s["vocab"], progress=False)
    # a failed batch request names the prompts of its group (one group here: which fails first is not ordered)
    with pytest.raises(RuntimeError, match=r"every /generate request.*prompts 0\.\.1"):
        generate_with_server("http://127.0.0.1:9", s["prompts"][:2], 4, s["stop_ids"], s["vocab"], progress=False,
                             group=2)
