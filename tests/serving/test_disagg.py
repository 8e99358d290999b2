"""Prefill-decode disaggregation, decode side (serving/disagg.py; issue #49, docs/notes-pd.md): the relayed
requests' draft input is what our prefill returns for them, their slots' controls are what a prefill here stores,
the hooks pass other algorithms and batches through, and start-up refuses what is not served, each with its fix.
No server and no transfer here: units against SGLang's own types and recorded inputs."""

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from sglang_dflash.serving import disagg  # noqa: E402
from sglang_dflash.serving.errors import DFlashStartupError  # noqa: E402

V = 32


class FutureMapStub:  # what the scheduler's overlap path reads the next step's inputs from
    def __init__(self):
        self.published, self.stashed = [], []

    def publish(self, indices, seq_lens):
        self.published.append((indices.clone(), seq_lens.clone()))

    def stash(self, indices, payload):
        self.stashed.append((indices.clone(), payload))


def _batch(overlap: bool):
    return SimpleNamespace(seq_lens=torch.tensor([17, 5, 9]), req_pool_indices=torch.tensor([4, 0, 7]),
                           enable_overlap=overlap)


@pytest.mark.parametrize("overlap", [False, True])
def test_relayed_draft_input_is_what_our_prefill_returns(overlap):
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    batch, first = _batch(overlap), torch.tensor([11, 3, 28], dtype=torch.int32)
    fmap = FutureMapStub()
    got = disagg.relayed_draft_input(batch, first, fmap)
    want = make_draft_input_v2(bonus_tokens=first, new_seq_lens=batch.seq_lens)  # worker._prefill's next_draft_input
    assert type(got) is type(want)
    assert torch.equal(got.bonus_tokens, want.bonus_tokens) and got.bonus_tokens.dtype == torch.int64
    assert torch.equal(got.new_seq_lens, want.new_seq_lens)
    if not overlap:
        assert got.future_indices is None and not fmap.published and not fmap.stashed
        return
    assert torch.equal(got.future_indices, batch.req_pool_indices)
    (idx, lens), = fmap.published
    assert torch.equal(idx, batch.req_pool_indices) and torch.equal(lens, batch.seq_lens)
    (idx, payload), = fmap.stashed
    assert torch.equal(idx, batch.req_pool_indices) and torch.equal(payload.bonus_tokens, first.to(torch.int64))


def test_the_hook_builds_ours_for_dflash_only_in_either_release_layout():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    calls = []

    def original(self, *args, **kwargs):
        calls.append(self)
        return "sglang's"

    batch, first, fmap = _batch(False), torch.tensor([1, 2, 3]), FutureMapStub()
    assert disagg.build_disagg_draft_input(original, SpeculativeAlgorithm.EAGLE, batch, None, first, fmap) == "sglang's"
    for args in ((batch, None, first, fmap), (batch, first, fmap)):  # 0.5.17, 0.5.23
        state = disagg.build_disagg_draft_input(original, SpeculativeAlgorithm.DFLASH, *args)
        assert torch.equal(state.bonus_tokens, first) and torch.equal(state.new_seq_lens, batch.seq_lens)
    assert calls == [SpeculativeAlgorithm.EAGLE]


def test_prebuilt_batch_gives_the_relayed_requests_their_state():
    seen = []
    scheduler = SimpleNamespace(draft_worker=SimpleNamespace(on_relayed=seen.append))
    batch = object()
    assert disagg.prebuilt_batch(lambda self: batch, scheduler) is batch and seen == [batch]
    assert disagg.prebuilt_batch(lambda self: None, scheduler) is None and seen == [batch]  # nothing waiting
    plain = SimpleNamespace(draft_worker=None)  # no speculation on this decode server
    assert disagg.prebuilt_batch(lambda self: batch, plain) is batch


def test_a_relayed_requests_controls_equal_a_prefill_here():
    """A request prefilled on the prefill server arrives with output_ids = [first token] (all of its output for a
    retracted one that resumes): its penalty rows must equal those of the same request prefilled here, where the
    prefill produced that token (so the decode steps after it apply the same penalties)."""
    from sglang_dflash.serving.controls import SamplingControls

    def req(f, p, r, m, out):
        return SimpleNamespace(output_ids=list(out), tokenizer=None, sampling_params=SimpleNamespace(
            frequency_penalty=f, presence_penalty=p, repetition_penalty=r, min_new_tokens=m, stop_token_ids={3}))

    settings = [(0.7, 0.25, 1.3, 9), (-0.45, 0.0, 1.0, 2), (1.1, 0.9, 2.0, 0)]
    earlier = [[5, 9, 5, 5], [], [7]]  # output before the last token: a resumed retraction, a fresh request, ...
    last = [2, 11, 7]
    idx = torch.tensor([6, 1, 3])
    here = SamplingControls(slots=8, vocab=V, device="cpu")
    here.on_prefill(SimpleNamespace(reqs=[req(*s, out) for s, out in zip(settings, earlier)], req_pool_indices=idx),
                    torch.tensor(last))
    relayed = SamplingControls(slots=8, vocab=V, device="cpu")
    relayed.on_relay(SimpleNamespace(reqs=[req(*s, out + [t]) for s, out, t in zip(settings, earlier, last)],
                                     req_pool_indices=idx))
    a, b = here.table.rows(idx), relayed.table.rows(idx)
    for field in ("freq_acc", "seen", "out_len", "frequency", "presence", "repetition", "min_new", "stop"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    # a planted bug: the first token counted twice (on_prefill's rule on a relayed request) differs
    doubled = SamplingControls(slots=8, vocab=V, device="cpu")
    doubled.on_prefill(SimpleNamespace(reqs=[req(*s, out + [t]) for s, out, t in zip(settings, earlier, last)],
                                       req_pool_indices=idx), torch.tensor(last))
    assert not torch.equal(doubled.table.rows(idx).freq_acc, a.freq_acc)


def test_a_decode_side_retraction_keeps_the_drafters_context(monkeypatch):
    """SGLang's decode retraction copies a request's target KV to host memory and back into new slots; the drafter's
    rows (its context K/V, which the next drafts attend to) must come back with them, in SGLang's own pool type."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(64, 1, torch.float32, 2, 4, 3, "cpu", False)  # the drafter's: 3 layers, 2 K/V heads
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn_like(buf))
    req_to_token = torch.zeros((4, 32), dtype=torch.int64)
    req_to_token[2, :10] = torch.arange(30, 40)
    req = SimpleNamespace(req_pool_idx=2, seqlen=11)  # 10 committed positions (the last token has no K/V yet)
    mapping = SimpleNamespace(req_to_token=req_to_token)
    before = [b[30:40].clone() for b in pool.k_buffer + pool.v_buffer]
    calls = []
    monkeypatch.setattr(disagg, "_draft_pool", lambda: pool)
    disagg.offload_kv_cache(lambda *a: calls.append("offload"), req, mapping, "allocator")
    for buf in pool.k_buffer + pool.v_buffer:  # the slots are freed and reused by other requests
        buf[30:40] = 0.0
    req_to_token[2, :10] = torch.arange(50, 60)  # resumed into new slots
    disagg.load_kv_cache(lambda *a: calls.append("load"), req, mapping, "allocator")
    assert calls == ["offload", "load"] and req.dflash_draft_kv_cpu is None
    for b, want in zip(pool.k_buffer + pool.v_buffer, before):
        assert torch.equal(b[50:60], want)
    monkeypatch.setattr(disagg, "_draft_pool", None)  # not a decode server: SGLang's copy alone
    other = SimpleNamespace(req_pool_idx=2, seqlen=11)
    disagg.offload_kv_cache(lambda *a: None, other, mapping, "allocator")
    assert not hasattr(other, "dflash_draft_kv_cpu")


FULL = {"model_type": "qwen3", "sliding_window": None, "use_sliding_window": False}


def _args(mode="decode", backend="mooncake", **extra):
    return SimpleNamespace(disaggregation_mode=mode, disaggregation_transfer_backend=backend, dcp_size=1, **extra)


def test_start_up_serves_and_refuses(monkeypatch):
    monkeypatch.delenv("SGLANG_DISAGG_STAGING_BUFFER", raising=False)
    ok = dict(pd_switch=True, release_ok=True, oracle=False)
    disagg.check_at_launch(_args("null"), FULL, pd_switch=False, release_ok=False, oracle=True)  # one server
    for mode in ("prefill", "decode"):
        disagg.check_at_launch(_args(mode), FULL, **ok)
    disagg.check_at_launch(_args("decode", "fake"), FULL, **ok)  # wiring tests
    refused = {
        "SGLANG_DFLASH_PD=1": (_args(), FULL, dict(ok, pd_switch=False)),
        "SGLang 0.5.17": (_args(), FULL, dict(ok, release_ok=False)),
        "backend mori": (_args(backend="mori"), FULL, ok),
        "--dcp-size 2": (SimpleNamespace(**{**vars(_args()), "dcp_size": 2}), FULL, ok),
        "sliding": ({"layer_types": ["sliding_attention", "full_attention"]}, None, ok),
        "sliding_window 4096": ({**FULL, "sliding_window": 4096, "use_sliding_window": True}, None, ok),
        "recurrent": ({"text_config": {"layer_types": ["linear_attention", "full_attention"]}}, None, ok),
        "MLA": ({"kv_lora_rank": 512}, None, ok),
        "--enable-hierarchical-cache": (_args(enable_hierarchical_cache=True), FULL, ok),
        "oracle drafts": (_args(), FULL, dict(ok, oracle=True)),
    }
    for needle, (args, target, flags) in refused.items():
        if target is None:  # the case is the target's config
            args, target = _args(), args
        with pytest.raises(DFlashStartupError) as e:
            disagg.check_at_launch(args, target, **flags)
        assert needle in str(e.value) and "Fix" in str(e.value), (needle, str(e.value))
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "1")
    with pytest.raises(DFlashStartupError, match="SGLANG_DISAGG_STAGING_BUFFER"):
        disagg.check_at_launch(_args(), FULL, **ok)


def test_hooks_registered_with_our_worker():
    from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_dflash.serving import plugin

    assert hasattr(SchedulerDisaggregationDecodeMixin, plugin._PREBUILT.rsplit(".", 1)[1])
    assert hasattr(SpeculativeAlgorithm, "build_disagg_draft_input")


@pytest.mark.parametrize("prefill_server", [False, True])
def test_a_prefill_server_captures_none_of_our_graphs(monkeypatch, prefill_server):
    """Item 1: a PD prefill server never drafts or verifies, so even with decode graphs forced on (SGLang turns them
    off there by default) it captures no draft, verify-width or tree graphs. The GPU path of init_cuda_graphs on
    stand-ins: what it captures is what the draft worker and the widths are asked for."""
    import sglang.srt.runtime_context as runtime_context
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from sglang_dflash.serving.worker import DFlashWorker

    graphs = SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend=Backend.FULL)))
    monkeypatch.setattr(runtime_context, "get_exec", lambda: SimpleNamespace(graph=graphs))
    asked = {}
    w = object.__new__(DFlashWorker)
    w.device, w._prefill_server, w._tree_size, w._tree_buffers, w._graph_head_bs = "cuda", prefill_server, 0, None, set()
    w.draft_runner = SimpleNamespace(capture_tail_hooks=[])
    w._draft_worker = SimpleNamespace(init_cuda_graphs=lambda capture_decode_cuda_graph: asked.update(
        draft=capture_decode_cuda_graph))
    w._widths = SimpleNamespace(widths=[1, 4, 8, 16], graph_memory_gb=0.0, capture=lambda: asked.update(widths=True))
    w._draft_widths = SimpleNamespace(widths=[4, 8], graph_memory_gb=0.0,  # short drafts' graphs (SHORT_DRAFT=1)
                                      capture=lambda: asked.update(draft_widths=True))
    w.model_runner = SimpleNamespace(decode_cuda_graph_runner=None)
    w.init_cuda_graphs()
    assert asked == ({"draft": False} if prefill_server else {"draft": True, "widths": True, "draft_widths": True})
    assert bool(w.draft_runner.capture_tail_hooks) != prefill_server  # the draft head joins captured graphs only


# ---------------------------------------------------------------------------------- a decode server, on CPU
PD_PORT = 30080


def test_a_decode_server_speculates_on_relayed_requests(dflash_pair):
    """Our worker as the decode server of a PD pair (SGLANG_DFLASH_PD=1), on SGLang's `fake` transfer backend, which
    moves no KV: the wiring, not equality (docs/notes-pd.md, section 5). SGLang 0.5.17's own DFLASH has no draft
    input for a relayed request and fails at its first decode step (sgl-project/sglang#36140); here every request,
    one with penalties too, finishes, through verify steps of drafted blocks."""
    import json
    import urllib.request

    from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server

    from .compare import FLOAT32, SPEC_ARGS, port

    root, target, draft, _ = dflash_pair
    env = {**cpu_server_env(root / "stub"), "SGLANG_DFLASH_PD": "1", "SGLANG_DFLASH_K": "7"}
    args = ([a for a in CPU_SERVER_ARGS if a != "--disable-overlap-schedule"] + FLOAT32 + SPEC_ARGS
            + ["--speculative-draft-model-path", str(draft), "--disaggregation-mode", "decode",
               "--disaggregation-transfer-backend", "fake"])
    srv = launch_server(target, port(PD_PORT), root / "pd_decode.log", args, env)
    try:
        srv.wait_healthy(420)
        out = []
        for i, extra in enumerate(({}, {"frequency_penalty": 0.5, "repetition_penalty": 1.2})):
            body = {"input_ids": [1 + (7 * i + j) % 400 for j in range(24)],
                    "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True, **extra},
                    # a fake relay: the bootstrap host SGLang's fake backend answers (no prefill server behind it)
                    "bootstrap_host": "2.2.2.2", "bootstrap_port": 8998, "bootstrap_room": 1000 + i}
            req = urllib.request.Request(srv.url + "/generate", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            out.append(json.loads(urllib.request.urlopen(req, timeout=180).read()))
    finally:
        srv.stop()
    log = (root / "pd_decode.log").read_text(errors="replace")
    assert "prefill-decode disaggregation, decode side" in log and "sglang-dflash worker ready" in log
    for o in out:
        meta = o["meta_info"]
        assert len(o["output_ids"]) == 20 and meta["finish_reason"]["type"] == "length", o
        assert meta["spec_verify_ct"] > 0 and meta["spec_proposed_drafts"] >= 7 * meta["spec_verify_ct"] - 7, meta
