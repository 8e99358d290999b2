"""Training data = the target's own responses: from a running SGLang server (`generate_with_server`, the way to
generate training data: the server's own kernels and sampler, continuous batching), or in batches with
transformers' left-padded `generate` (`generate_responses`: CPU runs and the tiny test pipeline).

Each response runs until the stop token (kept, so the drafter learns to predict it) or max_new_tokens. Greedy by
default; a fraction of the prompts can be answered by sampling (temperature 1), so the drafter also sees contexts
off the greedy path, as it will when serving sampled requests.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .data import TokenStore


@torch.inference_mode()
def generate_responses(model, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: list[int],
                       pad_id: int, batch_size: int = 256, sample_fraction: float = 0.0, seed: int = 0,
                       sources: list[str] | None = None, progress: bool = True,
                       time_budget_s: float | None = None) -> TokenStore:
    """Return a TokenStore of prompt + response per prompt (same order as `prompts`). With a time budget, batches
    that would start after it are skipped and their prompts left out (meta['skipped_prompts'] says how many)."""
    from transformers import GenerationConfig

    dev = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    responses: dict[int, list[int]] = {}
    g = torch.Generator().manual_seed(seed)
    t0, n_tok = time.time(), 0
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    for bi, idx in enumerate(tqdm(batches, disable=not progress, desc="generate")):
        if time_budget_s is not None and bi and (time.time() - t0) * (bi + 1) / bi > time_budget_s:
            break
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p = prompts[i]
            ids[r, width - len(p):] = torch.tensor(p)
            att[r, width - len(p):] = 1
        sample = bool(torch.rand((), generator=g) < sample_fraction)
        if sample:
            torch.manual_seed(seed * 1000 + bi)
        gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, temperature=1.0 if sample else None,
                              top_k=0 if sample else None, top_p=1.0 if sample else None,
                              eos_token_id=list(stop_token_ids), pad_token_id=pad_id)
        out = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), generation_config=gc)
        new = out[:, width:].tolist()
        for r, i in enumerate(idx):
            resp = new[r]
            for k, tok in enumerate(resp):
                if tok in stop_token_ids:
                    resp = resp[: k + 1]
                    break
            responses[i] = resp
            n_tok += len(resp)
    done = sorted(responses)
    sources = sources or [""] * len(prompts)
    seqs = [list(prompts[i]) + responses[i] for i in done]
    vocab = model.get_output_embeddings().weight.shape[0]
    meta = {"max_new_tokens": max_new_tokens, "sample_fraction": sample_fraction, "response_tokens": n_tok,
            "generate_s": round(time.time() - t0, 1), "skipped_prompts": len(prompts) - len(done),
            "generator": "transformers"}
    return TokenStore.from_lists(seqs, [len(prompts[i]) for i in done], [sources[i] for i in done], vocab, meta)


# ------------------------------------------------------------------------------------------- through SGLang
# Training data must be the target's own tokens as the SERVER produces them (its kernels, its dtype, its sampler):
# that is the distribution the drafter meets when it serves. The server also generates far faster than transformers'
# padded `generate` (continuous batching, no padding, CUDA graphs).

def sampled_prompt_mask(n: int, sample_fraction: float, seed: int) -> list[bool]:
    """Which of n prompts are answered by sampling at T=1: exactly round(n * fraction) of them, chosen by `seed`."""
    import random

    k = int(round(n * min(max(sample_fraction, 0.0), 1.0)))
    picked = set(random.Random(seed).sample(range(n), k))
    return [i in picked for i in range(n)]


def sampling_seed_of(seed: int, index: int) -> int:
    """The per-request sampling_seed of prompt `index` (distinct per prompt, independent of request order)."""
    return seed * 1_000_003 + index


def server_request(prompt: list[int], max_new_tokens: int, stop_token_ids: list[int], sample: bool,
                   sampling_seed: int | None = None, sampling: dict | None = None) -> dict:
    """The body of SGLang's native POST /generate for one prompt (field names of SGLang 0.5.17's GenerateReqInput
    and SamplingParams). Greedy is temperature 0 (SGLang turns it into top_k = 1); sampling is plain T=1 over the
    whole vocabulary (top_k -1, top_p 1, min_p 0), the distribution the drafter must learn, unless `sampling`
    overrides some of those fields (self-prompting samples requests with its own temperature / top_p). no_stop_trim
    keeps the stop token in the text; output_ids keep it regardless, and the drafter must learn to predict it."""
    sp = {"max_new_tokens": int(max_new_tokens), "temperature": 1.0 if sample else 0.0, "top_k": -1, "top_p": 1.0,
          "min_p": 0.0, "stop_token_ids": [int(t) for t in stop_token_ids], "skip_special_tokens": False,
          "no_stop_trim": True, "ignore_eos": False}
    if sample and sampling:
        sp.update(sampling)
    if sample and sampling_seed is not None:
        # honoured only by a server started with --enable-deterministic-inference (SGLang 0.5.17 ignores it
        # otherwise: the sample is then valid but not reproducible)
        sp["sampling_seed"] = int(sampling_seed)
    return {"input_ids": [int(t) for t in prompt], "sampling_params": sp, "stream": False}


def batch_request(bodies: list[dict]) -> dict:
    """One /generate body for several prompts (SGLang's batch form: lists of input_ids and of sampling_params; the
    answer is a list in the same order). A single body is sent as it is."""
    if len(bodies) == 1:
        return bodies[0]
    return {"input_ids": [b["input_ids"] for b in bodies], "sampling_params": [b["sampling_params"] for b in bodies],
            "stream": False}


def post_generate(url: str, body: dict, timeout_s: float) -> dict | list[dict]:
    """POST {url}/generate and return the parsed answer; raises RuntimeError with the server's message on an HTTP
    error and socket.timeout / URLError when the server does not answer in time."""
    import urllib.error
    import urllib.request

    import orjson  # the serve extra, installed wherever an SGLang server runs (as for benchmarks/client.py)

    req = urllib.request.Request(url.rstrip("/") + "/generate", orjson.dumps(body),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return orjson.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"/generate answered HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None


def _response_ids(answer: dict, prompt_len: int, max_new_tokens: int, vocab_size: int) -> list[int]:
    """The generated token ids of one /generate answer, checked: the server must report the prompt length we sent
    (so prompt and response are not offset) and no more than max_new_tokens ids, all inside the vocabulary."""
    if "output_ids" not in answer:
        raise RuntimeError(f"/generate answer without output_ids: {str(answer)[:300]}")
    ids = [int(t) for t in answer["output_ids"]]
    meta = answer.get("meta_info") or {}
    if meta.get("prompt_tokens", prompt_len) != prompt_len:
        raise RuntimeError(f"the server counted {meta['prompt_tokens']} prompt tokens, we sent {prompt_len}")
    if meta.get("completion_tokens", len(ids)) != len(ids) or len(ids) > max_new_tokens:
        raise RuntimeError(f"{len(ids)} output ids (completion_tokens {meta.get('completion_tokens')}, "
                           f"max_new_tokens {max_new_tokens})")
    if any(t < 0 or t >= vocab_size for t in ids):
        raise RuntimeError(f"output id outside the vocabulary of {vocab_size}: {ids}")
    return ids


def generate_with_server(url: str, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: list[int],
                         vocab_size: int, sample_fraction: float = 0.0, seed: int = 0,
                         sources: list[str] | None = None, concurrency: int = 256, progress: bool = True,
                         time_budget_s: float | None = None, request_timeout_s: float = 3600.0,
                         sample: list[bool] | None = None, group: int = 1,
                         sampling: dict | None = None) -> TokenStore:
    """The target's own responses from a running SGLang server (native /generate, token ids in and out), as a
    TokenStore of prompt + response per prompt in the order of `prompts` (the same layout and meta keys as
    `generate_responses`, plus generator="sglang").

    Each response runs until a stop token (kept) or max_new_tokens. round(n * sample_fraction) prompts, chosen by
    `seed`, are answered by sampling at T=1 with a per-request sampling_seed (`sampling`: other SamplingParams fields
    for those, as in `server_request`); the rest greedily (`sample`, one flag per prompt, overrides that choice: e.g.
    every prompt twice, greedy and sampled). `concurrency`
    prompts are in flight at once, `group` consecutive prompts per HTTP request (SGLang's batch form of /generate;
    threads = concurrency / group). Groups matter on a small target: prompts that arrive one by one as others
    finish are prefilled one or two at a time, and those eager prefills, not the decode steps, then bound the
    server (benchmarks/results/drafter-run5-smollm2-h100/generation_server.log.gz: 4,329 prefill batches, mostly
    of 1-3 prompts, against 144 logged decode batches). With `time_budget_s`, no request starts after
    the budget and requests still running then are abandoned (the server aborts them when the connection closes):
    their prompts are left out (meta skipped_prompts). A request that fails is left out too, with every prompt of its
    group (meta failed_prompts, first_error); if every request fails the server's error is raised."""
    import concurrent.futures as cf
    import socket
    import threading
    import urllib.error

    n = len(prompts)
    if sample is None:
        sample = sampled_prompt_mask(n, sample_fraction, seed)
    elif len(sample) != n:
        raise ValueError(f"sample has {len(sample)} flags for {n} prompts")
    else:  # the fraction actually sampled, for the meta
        sample_fraction = round(sum(sample) / max(n, 1), 4)
    t0 = time.time()
    deadline = None if time_budget_s is None else t0 + time_budget_s
    stop = threading.Event()

    if group < 1:
        raise ValueError(f"group={group}: at least one prompt per request")
    groups = [list(range(g, min(g + group, n))) for g in range(0, n, group)]

    def one(idx: list[int]):
        if stop.is_set() or (deadline is not None and time.time() >= deadline):
            return idx, None, None
        timeout = request_timeout_s if deadline is None else max(1.0, min(request_timeout_s, deadline - time.time()))
        bodies = [server_request(prompts[i], max_new_tokens, stop_token_ids, sample[i], sampling_seed_of(seed, i),
                                 sampling) for i in idx]
        try:
            answers = post_generate(url, batch_request(bodies), timeout)
            answers = answers if len(idx) > 1 else [answers]
            if not isinstance(answers, list) or len(answers) != len(idx):
                raise RuntimeError(f"a batch of {len(idx)} prompts got {len(answers)} answers")
            return idx, [_response_ids(a, len(prompts[i]), max_new_tokens, vocab_size)
                         for a, i in zip(answers, idx)], None
        except (socket.timeout, TimeoutError, RuntimeError, urllib.error.URLError, OSError, ValueError) as e:
            if deadline is not None and time.time() >= deadline - 1.0:
                return idx, None, None  # cut by the budget: skipped, not failed
            return idx, None, f"{type(e).__name__} (timeout {timeout:.0f} s): {e}"

    responses: dict[int, list[int]] = {}
    errors: list[str] = []
    n_tok = 0
    n_failed = 0
    bar = tqdm(total=n, disable=not progress, desc="generate (sglang)")
    pool = cf.ThreadPoolExecutor(max_workers=max(1, -(-int(concurrency) // group)), thread_name_prefix="sglang-gen")
    try:
        futures = [pool.submit(one, idx) for idx in groups]
        # the last in-flight requests end by their own timeout at the deadline; wait a little beyond it
        wait_s = None if deadline is None else max(0.0, deadline - time.time()) + 30.0
        try:
            for fut in cf.as_completed(futures, timeout=wait_s):
                idx, ids, err = fut.result()
                if ids is not None:
                    for i, r in zip(idx, ids):
                        responses[i] = r
                        n_tok += len(r)
                elif err is not None:
                    errors.append(f"prompts {idx[0]}..{idx[-1]}: {err}")
                    n_failed += len(idx)
                bar.update(len(idx))
                bar.set_postfix(tok_s=f"{n_tok / max(time.time() - t0, 1e-6):.0f}", failed=n_failed, refresh=False)
        except cf.TimeoutError:
            pass  # past the budget: what has not finished is left out
    finally:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
    if errors and not responses:
        raise RuntimeError(f"every /generate request to {url} failed; first error: {errors[0]}")
    done = sorted(responses)
    sources = sources or [""] * n
    seqs = [list(prompts[i]) + responses[i] for i in done]
    meta = {"max_new_tokens": max_new_tokens, "sample_fraction": sample_fraction, "response_tokens": n_tok,
            "generate_s": round(time.time() - t0, 1), "skipped_prompts": n - len(done) - n_failed,
            "generator": "sglang", "failed_prompts": n_failed, "request_group": group,
            "sampled_prompts": sum(sample[i] for i in done), "server_url": url}
    if errors:
        meta["first_error"] = errors[0]
    return TokenStore.from_lists(seqs, [len(prompts[i]) for i in done], [sources[i] for i in done], vocab_size,
                                 meta)


def launch_generation_server(model_dir: str | Path, log_dir: str | Path, device: str | None = None,
                             extra_args: list[str] = (), port: int | None = None):
    """Start a plain SGLang server (no speculation) on `model_dir` for generating training data; returns the
    testing.Server at once (call .wait_healthy, and .stop when done). Token ids in, token ids out: the server
    runs with --skip-tokenizer-init (no detokenizing, and a checkpoint without a tokenizer works). On a CPU-only
    machine it gets the stub libcuda and the CPU arguments of the CPU tests, in float32 like the CPU trainer."""
    import torch

    from ..testing import CPU_SERVER_ARGS, build_stub_libcuda, cpu_server_env, free_port, launch_server

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    args = ["--skip-tokenizer-init", *extra_args]
    if device == "cpu":
        env = cpu_server_env(build_stub_libcuda(log_dir / "stub"))
        args = [*CPU_SERVER_ARGS, "--dtype", "float32", *args]
    else:
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint directory: never reach for the hub
        if not any(a.startswith("--mem-fraction-static") for a in extra_args):
            args = ["--mem-fraction-static", "0.7", *args]  # room for the trainer's own copy of the target
    return launch_server(model_dir, port or free_port(), log_dir / "generation_server.log", args, env)


@contextmanager
def generation_server(model_dir: str | Path, log_dir: str | Path, device: str | None = None,
                      extra_args: list[str] = (), startup_s: float = 900.0):
    """A healthy generation server for the duration of a `with` block (its URL), stopped afterwards (also on
    errors): its process group is killed by PID."""
    server = launch_generation_server(model_dir, log_dir, device, extra_args)
    try:
        server.wait_healthy(startup_s)
        yield server.url
    finally:
        server.stop()
