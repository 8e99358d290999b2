"""A prefill-decode pair on CPU, our worker on both servers, KV moved by SGLang's mooncake transfer over TCP
(issue #49 item 3), chunked prefill and radix hits on the prefill side: greedy output equal to plain decoding, and
the decode server's verify steps and accepted drafts equal to one DFLASH server's for the same prompts (the drafter's context K/V came through the transfer exactly; a
prefill server without the drafter is the negative control: same outputs, other acceptance).

Opt-in: needs the non-CUDA mooncake wheel and the RDMA user libraries it links against, which CI does not install:
    pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 && apt-get install -y libibverbs1 librdmacm1
No router: the client posts one body with the bootstrap fields to both servers, as SGLang's mini load balancer does.
"""

import json
import random
import threading
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


def _relay(prefill, decode, ids, sp, bootstrap_port):
    body = {"input_ids": ids, "sampling_params": sp, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.randint(0, 2 ** 62)}
    out = {}
    t = threading.Thread(target=lambda: out.__setitem__("prefill", _post(prefill.url, body)))
    t.start()
    out["decode"] = _post(decode.url, body)
    t.join()
    return out["decode"]


def test_pd_pair_equals_plain_decoding_with_the_drafters_context(dflash_pair):
    root, target, draft, _ = dflash_pair
    env = {**cpu_server_env(root / "stub"), "SGLANG_DFLASH_PD": "1", "SGLANG_DFLASH_ADAPTIVE": "0",
           # SGLang's early send of a radix hit's cached pages records a CUDA event under overlap scheduling, which a
           # CPU server has none of: the cached pages go with the request's last chunk instead (GPU: early, default)
           "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0"}
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
        sp = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
        same_steps, control_differs = 0, 0
        for i in range(10):  # prompts 8 and 9 repeat 0 and 1: radix hits on the prefill server (their cached pages
            # are sent as they are, drafter rows included)
            ids = [1 + (13 * (i % 8) + 7 * j) % 480 for j in range(20 + 3 * (i % 8))]
            got = _relay(servers["prefill"], servers["decode"], ids, sp, port(BOOTSTRAP))
            plain = _post(servers["plain"].url, {"input_ids": ids, "sampling_params": sp})
            one = _post(servers["single"].url, {"input_ids": ids, "sampling_params": sp})["meta_info"]
            assert got["output_ids"] == plain["output_ids"], f"prompt {i}: PD + DFLASH differs from plain decoding"
            m = got["meta_info"]
            assert (m["spec_verify_ct"], m["spec_accepted_drafts"]) == (one["spec_verify_ct"],
                                                                        one["spec_accepted_drafts"]), (i, m, one)
            same_steps += one["spec_accepted_drafts"] > 0
            bare = _relay(servers["no_draft"], servers["decode"], ids, sp, port(BOOTSTRAP + 1))
            assert bare["output_ids"] == plain["output_ids"]  # still lossless
            control_differs += (bare["meta_info"]["spec_verify_ct"], bare["meta_info"]["spec_accepted_drafts"]) != (
                one["spec_verify_ct"], one["spec_accepted_drafts"])
        assert same_steps >= 2, "too few prompts with an accepted draft to tell a transferred context from none"
        assert control_differs >= 2, "the check did not see the drafter's context missing"
    finally:
        for s in servers.values():
            s.stop()
