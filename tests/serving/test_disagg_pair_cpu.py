"""A prefill-decode pair on CPU, our worker on both servers, KV moved by SGLang's mooncake transfer over TCP
(issue #49 item 3), chunked prefill and radix hits on the prefill side: greedy output equal to plain decoding, and
the decode server's verify steps and accepted drafts equal to one DFLASH server's for the same prompts (the
drafter's context K/V came through the transfer exactly; a
prefill server without the drafter is the negative control: same outputs, other acceptance); and aborts
mid-transfer (issue #49 item 1: on the decode server, the prefill server or both) lose nothing.

Opt-in: needs the non-CUDA mooncake wheel and the RDMA user libraries it links against, which CI does not install:
    pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 && apt-get install -y libibverbs1 librdmacm1
No router: the client posts one body with the bootstrap fields to both servers, as SGLang's mini load balancer does.
"""

import json
import random
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("sglang")
try:
    from mooncake.engine import TransferEngine  # noqa: F401
except Exception as e:  # ImportError, or the .so's missing libibverbs
    pytest.skip(f"mooncake transfer engine not importable ({e}): see the module docstring", allow_module_level=True)

from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server  # noqa: E402

from .compare import FLOAT32, SPEC_ARGS, port, wait_all_healthy  # noqa: E402

PREFILL, DECODE, PLAIN, SINGLE, NO_DRAFT = 30090, 30091, 30092, 30093, 30094
BOOTSTRAP = 8998


def _post(url, body):
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=300).read())


GREEDY = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}


def _relay_body(ids, sp, bootstrap_port, **extra):
    """One /generate body for both servers of a pair: the bootstrap fields pair the two halves of the request."""
    return {"input_ids": ids, "sampling_params": sp, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.randint(0, 2 ** 62), **extra}


def _relay(prefill, decode, ids, sp, bootstrap_port):
    body = _relay_body(ids, sp, bootstrap_port)
    out = {}
    t = threading.Thread(target=lambda: out.__setitem__("prefill", _post(prefill.url, body)))
    t.start()
    out["decode"] = _post(decode.url, body)
    t.join()
    return out["decode"]


@pytest.fixture(scope="module")
def servers(dflash_pair):
    """The PD pair (prefill with chunks of 16 + decode, our worker on both), plain decoding, one DFLASH server, and
    the negative control's prefill server without the drafter: started once for the module's tests."""
    root, target, draft, _ = dflash_pair
    env = {**cpu_server_env(root / "stub"), "SGLANG_DFLASH_PD": "1", "SGLANG_DFLASH_ADAPTIVE": "0",
           # SGLang's early send of a radix hit's cached pages records a CUDA event under overlap scheduling, which a
           # CPU server has none of: the cached pages go with the request's last chunk instead (GPU: early, default)
           "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
           # a request aborted on the prefill server mid-transfer leaves the decode server waiting for its KV until
           # SGLang's waiting timeout (300 s by default) fails it: 15 s here, far above a transfer's time
           "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "15"}
    base = [a for a in CPU_SERVER_ARGS if a != "--disable-overlap-schedule"] + FLOAT32
    dflash = SPEC_ARGS + ["--speculative-draft-model-path", str(draft)]
    pd = ["--disaggregation-transfer-backend", "mooncake_tcp"]
    servers = {
        # chunked prefill: prompts of 20-41 tokens in chunks of 16 (each chunk's drafter context written, then sent)
        "prefill": launch_server(target, port(PREFILL), root / "pd_prefill.log", base + dflash + pd + [
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port(BOOTSTRAP)),
            "--chunked-prefill-size", "16"], env),
        "decode": launch_server(target, port(DECODE), root / "pd_decode_pair.log",
                                base + dflash + pd + ["--disaggregation-mode", "decode"], env),
        "plain": launch_server(target, port(PLAIN), root / "pd_plain.log", base, env),
        "single": launch_server(target, port(SINGLE), root / "pd_single.log", base + dflash, env),
        # the negative control: a prefill server without the drafter sends no drafter context (the decode server's
        # drafter reads what its pool held before)
        "no_draft": launch_server(target, port(NO_DRAFT), root / "pd_prefill_plain.log", base + pd + [
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port(BOOTSTRAP + 1))], env),
    }
    try:
        wait_all_healthy(*servers.values())
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def _pair_equals_plain(servers, ids, label):
    """The pair's greedy answer to ids: plain decoding's output, with one DFLASH server's verify steps and accepted
    drafts (the drafter's context came through the transfer exactly). Returns (plain's answer, the single's meta)."""
    got = _relay(servers["prefill"], servers["decode"], ids, GREEDY, port(BOOTSTRAP))
    plain = _post(servers["plain"].url, {"input_ids": ids, "sampling_params": GREEDY})
    one = _post(servers["single"].url, {"input_ids": ids, "sampling_params": GREEDY})["meta_info"]
    assert got["output_ids"] == plain["output_ids"], f"{label}: PD + DFLASH differs from plain decoding"
    m = got["meta_info"]
    assert (m["spec_verify_ct"], m["spec_accepted_drafts"]) == (one["spec_verify_ct"],
                                                                one["spec_accepted_drafts"]), (label, m, one)
    return plain, one


def test_pd_pair_equals_plain_decoding_with_the_drafters_context(servers):
    same_steps, control_differs = 0, 0
    for i in range(10):  # prompts 8 and 9 repeat 0 and 1: radix hits on the prefill server (their cached pages
        # are sent as they are, drafter rows included)
        ids = [1 + (13 * (i % 8) + 7 * j) % 480 for j in range(20 + 3 * (i % 8))]
        plain, one = _pair_equals_plain(servers, ids, f"prompt {i}")
        same_steps += one["spec_accepted_drafts"] > 0
        bare = _relay(servers["no_draft"], servers["decode"], ids, GREEDY, port(BOOTSTRAP + 1))
        assert bare["output_ids"] == plain["output_ids"]  # still lossless
        control_differs += (bare["meta_info"]["spec_verify_ct"], bare["meta_info"]["spec_accepted_drafts"]) != (
            one["spec_verify_ct"], one["spec_accepted_drafts"])
    assert same_steps >= 2, "too few prompts with an accepted draft to tell a transferred context from none"
    assert control_differs >= 2, "the check did not see the drafter's context missing"


def _post_any(url, body):
    """The /generate answer, or {"http_status": N} where the server answered with an error (an aborted request may)."""
    try:
        return _post(url, body)
    except urllib.error.HTTPError as e:
        return {"http_status": e.code}


def _aborted_relay(prefill, decode, ids, sp, rid, abort_on, delay_s):
    """One relayed request that `abort_on` (servers) abort after delay_s, while its prompt is still being prefilled
    in chunks of 16 and sent: both posts' answers, or the name of a post that never came back."""
    body = _relay_body(ids, sp, port(BOOTSTRAP), rid=rid)
    out = {}
    posts = [threading.Thread(target=lambda n=n, s=s: out.__setitem__(n, _post_any(s.url, body)), daemon=True)
             for n, s in (("prefill", prefill), ("decode", decode))]
    for t in posts:
        t.start()
    time.sleep(delay_s)
    for s in abort_on:
        urllib.request.urlopen(urllib.request.Request(s.url + "/abort_request", json.dumps({"rid": rid}).encode(),
                                                      {"Content-Type": "application/json"}), timeout=30).read()
    for t in posts:
        t.join(timeout=120)
    return out, [n for n, t in zip(("prefill", "decode"), posts) if t.is_alive()]


@pytest.mark.parametrize("abort_on", ["decode", "prefill", "both"])
def test_an_abort_mid_transfer_loses_nothing(servers, abort_on):
    """A request aborted while its long prompt is prefilled (chunks of 16) and moved: neither post hangs, both
    servers' KV pools go back to what they held before (draft rows included: they share the target's slots), and
    the pair's next request is still plain decoding's output with the single server's acceptance."""
    from benchmarks.soak import pool, wait_idle

    prefill, decode = servers["prefill"], servers["decode"]
    start = {n: (pool(s.url) or {}).get("num_used_tokens") or 0 for n, s in (("prefill", prefill), ("decode", decode))}
    sp = GREEDY | {"max_new_tokens": 64}
    # 1,900 tokens in chunks of 16: ~120 prefill forwards, each chunk's K/V sent as it is written, so an abort
    # 0.5 s in lands mid-transfer (the tiny target's context is 2,048)
    # a prompt of its own per case: a radix hit on the prefill server would send it at once, before the abort
    salt = ("decode", "prefill", "both").index(abort_on)
    long_prompt = [1 + (5 * j + 101 * salt) % 480 for j in range(1900)]
    targets = {"decode": [decode], "prefill": [prefill], "both": [prefill, decode]}[abort_on]
    answers, hung = _aborted_relay(prefill, decode, long_prompt, sp, f"abort-{abort_on}-{random.getrandbits(32)}",
                                   targets, delay_s=0.5)
    assert not hung, f"posts that never came back after the abort: {hung}"
    finish = (answers["decode"].get("meta_info") or {}).get("finish_reason") or {}
    assert "http_status" in answers["decode"] or (finish.get("type") == "abort"
                                                  and not answers["decode"].get("output_ids")), (
        f"the decode server decoded a request aborted mid-transfer: {answers}")
    for n, s in (("prefill", prefill), ("decode", decode)):
        idle, last, _ = wait_idle(s.url, start[n], timeout_s=60)
        assert idle, f"{n} server did not go back to its KV pool after the abort: {last} (start {start[n]})"
    _pair_equals_plain(servers, [1 + (11 * j) % 480 for j in range(33)], f"after an abort ({abort_on})")
