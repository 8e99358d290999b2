"""Tree steps under CUDA graphs (serving/tree_graphs.py), without a GPU: what can be checked on the CPU.

- ``TreeBuffers``: a stored tree reads back as the eager step's tree, verify inputs and kernel mask; pad rows always
  hold a valid tree mask; the whole draft-graph tail (draft logits -> tree -> buffers) passes the capturability
  check (tests/_capturable.py).
- The draft head hook with the tree on writes the tree the eager build gives, and the chain's greedy drafts.
- ``TreeVerifyGraphs.capture`` builds SGLang's graph runner (a stand-in here) while ``tree_step.active()`` holds a
  TreeVerify whose kernel mask is the static buffers themselves (the pointers the captured launches keep).
- ``DFlashWorker._tree_decode_step`` on stand-ins: a graphed step verifies from the static buffers through the tree
  graph runner (no attention call claims the tree in a replay, and that is no error) and commits the accepted path
  (req_to_token as tree_acceptance.commit_path leaves it); a batch past the captured sizes takes the eager path on the
  step's own tensors; the log counts both.
"""

from __future__ import annotations

import logging
import types
from types import SimpleNamespace

import pytest
import torch
from _capturable import assert_capturable

from sglang_dflash.draft_tree import build_draft_tree
from sglang_dflash.kernels.block_inputs import block_inputs_torch
from sglang_dflash.kernels.tree_accept import tree_accept_torch
from sglang_dflash.serving import tree_step
from sglang_dflash.serving.tree_graphs import TreeBuffers, TreeVerifyGraphs
from sglang_dflash.tree_acceptance import commit_path

B, H, V, N = 8, 6, 30, 6


def _logits(bs: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(bs * (B - 1), V, generator=torch.Generator().manual_seed(seed)) * 3


def _model():
    """A draft model stand-in: the draft logits are a fixed projection of the hidden rows."""
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(9))
    return SimpleNamespace(vocab=SimpleNamespace(head_rows=(0, V), greedy=lambda logits: logits.argmax(-1)),
                           draft_logits=lambda hidden: hidden @ head.T,
                           greedy_drafts=lambda hidden, anchors: (hidden @ head.T).argmax(-1))


def _pool(bs: int):
    req_to_token = torch.randperm(8 * 64).view(8, 64)
    return torch.randint(3, 40, (bs,)), torch.randperm(8)[:bs], req_to_token


def test_stored_tree_reads_back_as_the_eager_steps_tree():
    bs = 3
    tree = build_draft_tree(torch.tensor([4, 5, 6]), _logits(bs).view(bs, B - 1, V), N)
    prefix, rows, req_to_token = _pool(bs)
    buffers = TreeBuffers(max_bs=5, size=N, device="cpu")
    buffers.store(tree, prefix, rows, req_to_token)
    got = buffers.tree(bs)
    for field in ("tokens", "parents", "depth", "ancestors", "log_prob"):
        assert torch.equal(getattr(got, field), getattr(tree, field)), field
    for a, b in zip(buffers.verify_inputs(bs), tree_step.verify_inputs(tree, prefix, rows, req_to_token)):
        assert torch.equal(a, b)
    tv, want = buffers.verify(bs), tree_step.TreeVerify.of(tree)
    assert all(torch.equal(a, b) for a, b in zip(tv.kernel_mask, want.kernel_mask))
    assert torch.equal(tv.parents, want.parents) and tv.size == N
    # the kernel mask views start at the buffers' first element: the pointer a captured launch holds
    assert tv.kernel_mask[0].data_ptr() == buffers.bits.data_ptr()
    assert tv.kernel_mask[1].data_ptr() == buffers.kernel_depth.data_ptr()


def test_pad_rows_hold_valid_tree_masks():
    """Rows a padded replay reads beyond the batch: the causal chain at start, later a tree: own bit always set,
    depths below N, ancestors only among earlier nodes."""
    buffers = TreeBuffers(max_bs=4, size=N, device="cpu")
    node = torch.arange(N)

    def valid(bits, depth):
        bits, depth = bits.view(-1, N), depth.view(-1, N)
        own = (bits >> node) & 1
        later = bits >> (node + 1)  # no bit at or above a later node
        return bool((own == 1).all() and (later == 0).all() and (depth < N).all() and (depth >= 0).all())

    assert valid(buffers.bits, buffers.kernel_depth)
    assert torch.equal(buffers.bits[:N], (2 << node) - 1) and torch.equal(buffers.kernel_depth[:N].long(), node)
    tree = build_draft_tree(torch.tensor([1, 2]), _logits(2).view(2, B - 1, V), N)
    buffers.store(tree, *_pool(2))
    assert valid(buffers.bits, buffers.kernel_depth)


def test_draft_graph_tail_is_capturable():
    """What the draft CUDA graph records for the tree head: draft logits -> tree -> static buffers, checked op by
    op for host syncs, data-dependent shapes and host-to-device copies."""
    bs = 4
    model = _model()
    buffers = TreeBuffers(max_bs=bs, size=N, device="cpu")
    hidden, anchors = torch.randn(bs * (B - 1), H), torch.tensor([1, 2, 3, 4])
    prefix, rows, req_to_token = _pool(bs)

    def tail():
        logits = model.draft_logits(hidden)
        buffers.store(tree_step.tree_of_logits(model, logits, anchors, N), prefix, rows, req_to_token)

    assert_capturable(tail)


def _head_stand_in(bs_cap: int):
    from sglang_dflash.serving import worker

    me = SimpleNamespace(block=B, _graph_head_bs=set(), _graph_tree_bs=set(), _graph_greedy_head=True,
                         _graph_drafts=torch.full((bs_cap, B - 1), -1, dtype=torch.int64), _tree_size=N,
                         _tree_buffers=TreeBuffers(bs_cap, N, "cpu"), draft_model=_model())
    return worker, me


@pytest.mark.parametrize("greedy_head", [True, False])
def test_draft_head_hook_builds_the_tree(greedy_head):
    pytest.importorskip("sglang")
    bs = 3
    worker, me = _head_stand_in(4)
    me._graph_greedy_head = greedy_head
    prefix, rows, req_to_token = _pool(bs)
    me.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
    hidden = torch.randn(bs * B, H)
    ids = torch.tensor([[7] + [0] * (B - 1), [8] + [0] * (B - 1), [9] + [0] * (B - 1)]).reshape(-1)
    fb = SimpleNamespace(input_ids=ids, seq_lens=prefix, req_pool_indices=rows)
    worker.DFlashWorker._capture_draft_head(me, None, SimpleNamespace(hidden_states=hidden), fb, bs * B)
    assert me._graph_tree_bs == {bs}
    rows_h = hidden.view(bs, B, H)[:, 1:].reshape(-1, H)
    want = tree_step.build_tree(me.draft_model, rows_h, torch.tensor([7, 8, 9]), N)
    got = me._tree_buffers.tree(bs)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
    assert torch.equal(me._tree_buffers.verify_inputs(bs)[2],
                       tree_step.verify_inputs(want, prefix, rows, req_to_token)[2])
    if greedy_head:  # the chain's drafts from the same logits: what greedy_drafts gives
        assert me._graph_head_bs == {(B, bs)}  # (draft width, batch size)
        assert torch.equal(me._graph_drafts[:bs], me.draft_model.greedy_drafts(rows_h, None).view(bs, B - 1))
    else:
        assert me._graph_head_bs == set() and (me._graph_drafts == -1).all()


def test_draft_head_hook_leaves_large_batches_to_the_eager_build(monkeypatch):
    pytest.importorskip("sglang")
    worker, me = _head_stand_in(4)
    monkeypatch.setattr(worker, "GRAPH_TREE_MAX_ROWS", 2 * (B - 1))
    me.req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros(8, 64, dtype=torch.int64))
    for bs in (3, 2):
        zeros = torch.zeros(bs, dtype=torch.int64)
        fb = SimpleNamespace(input_ids=torch.zeros(bs * B, dtype=torch.int64), seq_lens=zeros + 1,
                             req_pool_indices=zeros)
        worker.DFlashWorker._capture_draft_head(me, None, SimpleNamespace(hidden_states=torch.randn(bs * B, H)), fb,
                                                bs * B)
    assert me._graph_tree_bs == {2} and me._graph_head_bs == {(B, 3), (B, 2)}


class _FakeGraphRunner:
    """SGLang's DecodeCudaGraphRunner as the capture sees it: it runs the forward under whatever tree is active
    (here: one attention claim per captured size) and keeps the kernel mask pointers the launches would hold."""

    seen: list = []

    def __init__(self, model_runner, attn_backend=None, speculative_num_draft_tokens=None):
        tree = tree_step.active()
        assert tree is not None, "tree verify graphs captured without an active tree: they would attend causally"
        self.capture_bs, self.max_bs, self.disable_padding = [1, 2, 4], 4, False
        for _ in self.capture_bs:
            tree.claim(speculative_num_draft_tokens)
        _FakeGraphRunner.seen.append((tree.kernel_mask[0].data_ptr(), tree.kernel_mask[1].data_ptr(),
                                      tree.kernel_mask[0].numel(), attn_backend, speculative_num_draft_tokens))


@pytest.fixture
def fake_capture(monkeypatch):
    pytest.importorskip("sglang")
    from sglang.srt.model_executor.runner import decode_cuda_graph_runner
    from sglang.srt import utils

    monkeypatch.setattr(decode_cuda_graph_runner, "DecodeCudaGraphRunner", _FakeGraphRunner)
    monkeypatch.setattr(utils, "get_available_gpu_memory", lambda *a, **k: 10.0)
    _FakeGraphRunner.seen = []
    backends = iter(["tree backend"])
    return SimpleNamespace(decode_cuda_graph_runner="chain graphs", attn_backend="chain backend", device="cpu",
                           gpu_id=0, _get_attention_backend=lambda: next(backends))


def test_capture_binds_the_static_mask_buffers(fake_capture):
    buffers = TreeBuffers(max_bs=4, size=N, device="cpu")
    graphs = TreeVerifyGraphs(fake_capture, buffers)
    graphs.capture()
    (bits_ptr, depth_ptr, numel, backend, width), = _FakeGraphRunner.seen
    assert (bits_ptr, depth_ptr) == (buffers.bits.data_ptr(), buffers.kernel_depth.data_ptr())
    assert numel == 4 * N and backend == "tree backend" and width == N
    assert tree_step.active() is None
    assert graphs.fits(3) and graphs.fits(4) and not graphs.fits(5)
    with graphs.target():
        assert fake_capture.decode_cuda_graph_runner is graphs.runner and fake_capture.attn_backend == "tree backend"
    assert (fake_capture.decode_cuda_graph_runner, fake_capture.attn_backend) == ("chain graphs", "chain backend")


def test_capture_refuses_graphs_larger_than_the_buffers(fake_capture):
    with pytest.raises(RuntimeError, match="tree buffers hold 2 rows"):
        TreeVerifyGraphs(fake_capture, TreeBuffers(max_bs=2, size=N, device="cpu")).capture()


def test_no_target_graphs_no_tree_graphs(fake_capture):
    fake_capture.decode_cuda_graph_runner = None
    graphs = TreeVerifyGraphs(fake_capture, TreeBuffers(max_bs=4, size=N, device="cpu"))
    graphs.capture()
    assert graphs.runner is None and not graphs.fits(1) and _FakeGraphRunner.seen == []


# ------------------------------------------------------------------------------------ the worker's tree step
SEED = 0


def _step_stand_in(bs: int, graphs_max_bs: int | None, built_in_graph: bool, sampling=None, target=None,
                   seed: int = SEED):
    """A DFlashWorker stand-in for _tree_decode_step: real block inputs and tree code, a draft runner whose forward
    reports a replay of bs (whose tail wrote the tree when built_in_graph), and a target whose _verify records what
    it was handed and reports a replay when the tree graph runner is in place. ``sampling``: (SGLang's sampling
    info, the requests' SGLang top_k) of the batch, all-greedy when None; ``target``: the verify's logits
    [bs, N, V] (default: logits accepting the root's last child)."""
    from sglang_dflash.serving import worker

    # seeded: the graphed test needs a tree whose accepted child of the root is not node 1 (a commit that is not the
    # identity permutation), and an unseeded draw, after whatever ran before in the session, gave none in a CI run
    torch.manual_seed(seed)
    prefix, rows, req_to_token = _pool(bs)
    hidden = torch.randn(bs * B, H)
    model = _model()
    buf = torch.zeros(8, B, dtype=torch.int64)
    me = SimpleNamespace(block=B, _tree_size=N, _logged_tree_step=False, _logged_sampled_tree=False,
                         draft_model=model, device="cpu",
                         req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                         cfg=SimpleNamespace(mask_token_id=1), _block_ids=buf.clone(), _positions=buf.clone(),
                         _cache_loc=buf.clone(), _verify_ids=buf.clone().view(-1),
                         _fill_block_inputs=block_inputs_torch, _tree_accept=tree_accept_torch,
                         _control=SimpleNamespace(step_end=lambda: None),
                         _tree_counts={"verify graphed": 0, "verify eager": 0, "built in graph": 0, "built eagerly": 0},
                         _graph_tree_bs={bs} if built_in_graph else set(),
                         model_runner=SimpleNamespace(decode_cuda_graph_runner="chain graphs", attn_backend="chain"))
    me.draft_runner = SimpleNamespace(decode_cuda_graph_runner=SimpleNamespace(bs=bs))
    from sglang_dflash.serving.seeds import RequestSeeds

    me._seeds = RequestSeeds(req_to_token.shape[0], "cpu")  # no seeded request: the generator's rules
    me._step_keys = types.MethodType(worker.DFlashWorker._step_keys, me)
    me._tree_buffers = TreeBuffers(8, N, "cpu") if graphs_max_bs is not None else None
    me._tree_graphs = None
    if graphs_max_bs is not None:
        me._tree_graphs = TreeVerifyGraphs(me.model_runner, me._tree_buffers)
        me._tree_graphs.runner = SimpleNamespace(capture_bs=[1, 2, 4], max_bs=graphs_max_bs, disable_padding=False)
        me._tree_graphs.backend = "tree"
    bonus = torch.randint(5, V, (bs,))
    anchors_tree = tree_step.build_tree(model, hidden.view(bs, B, H)[:, 1:].reshape(-1, H), bonus, N)
    if built_in_graph:  # what the replayed draft graph's tail left in the buffers
        me._tree_buffers.store(anchors_tree, prefix, rows, req_to_token)

    def draft_forward(batch, block_ids, positions, cache_loc, prefix_, host_lens, bs_):
        return SimpleNamespace(can_run_graph=True, logits_output=SimpleNamespace(hidden_states=hidden))

    seen = {}

    def verify(batch, ids, positions, cache_loc, host_lens, bs_, width):
        tree = tree_step.active()
        graphed = me.model_runner.decode_cuda_graph_runner is getattr(me._tree_graphs, "runner", False)
        seen.update(ids=ids.clone(), positions=positions.clone(), cache_loc=cache_loc.clone(), graphed=graphed,
                    runner=me.model_runner.decode_cuda_graph_runner, mask=tree.kernel_mask, ids_ptr=ids.data_ptr())
        if not graphed:
            tree.claim(width)  # an eager forward's attention hooks take the tree
        # target logits that accept the root's last child and reject below it (a child past node 1 where the root
        # has several: its slot must move to column prefix + 1)
        logits = torch.full((bs_, width, V), -5.0)
        t = tree_step.active()
        src = me._tree_buffers.tree(bs_) if graphed else anchors_tree
        kid = torch.where((src.parents == 0) & (src.tokens >= 0), torch.arange(width), 0).max(dim=1).values
        logits[torch.arange(bs_), 0, src.tokens[torch.arange(bs_), kid]] = 5.0
        seen["kid"] = kid
        assert t is tree
        if target is not None:
            logits = target.clone()
        seen["logits"] = logits
        return logits.view(bs_ * width, V), graphed

    me._draft_forward, me._verify = draft_forward, verify
    me._host_lens = lambda batch, state, width: (None, None)
    me._block_inputs = types.MethodType(worker.DFlashWorker._block_inputs, me)
    me._count_tree_step = types.MethodType(worker.DFlashWorker._count_tree_step, me)
    me._tree_accept_sampled = types.MethodType(worker.DFlashWorker._tree_accept_sampled, me)
    info, top_ks = sampling if sampling is not None else (None, [1] * bs)
    batch = SimpleNamespace(req_pool_indices=rows, sampling_info=info,
                            reqs=[SimpleNamespace(sampling_params=SimpleNamespace(top_k=k)) for k in top_ks])
    state = SimpleNamespace(bonus_tokens=bonus)
    return worker, me, batch, state, prefix, anchors_tree, seen


def _accept_lens(tree, seen, prefix):
    from sglang_dflash.kernels.greedy_accept import commit_outputs
    from sglang_dflash.tree_acceptance import verify_tree_greedy

    commit_lens, tokens, _ = verify_tree_greedy(tree, seen["logits"])
    assert (commit_lens >= 2).all()  # node 1 accepted: the step committed through the tree
    return commit_outputs(commit_lens, tokens, prefix)[2].tolist()


@pytest.mark.parametrize("built_in_graph", [True, False])
def test_graphed_tree_step_verifies_from_the_static_buffers(built_in_graph, caplog):
    pytest.importorskip("sglang")
    bs = 3
    worker, me, batch, state, prefix, tree, seen = _step_stand_in(bs, graphs_max_bs=4, built_in_graph=built_in_graph)
    before = me.req_to_token_pool.req_to_token.clone()
    with caplog.at_level(logging.INFO, logger="sglang_dflash"):
        out = worker.DFlashWorker._tree_decode_step(me, batch, state, prefix, bs, None)
    assert seen["graphed"] and seen["runner"] is me._tree_graphs.runner
    assert seen["mask"][0].data_ptr() == me._tree_buffers.bits.data_ptr()  # what the captured launches read
    assert seen["ids_ptr"] == me._tree_buffers.ids.data_ptr()
    want = tree_step.verify_inputs(tree, prefix, batch.req_pool_indices, before)
    for name, w in zip(("ids", "positions", "cache_loc"), want):
        assert torch.equal(seen[name], w), name
    assert me.model_runner.decode_cuda_graph_runner == "chain graphs" and tree_step.active() is None
    assert out.accept_lens.tolist() == _accept_lens(tree, seen, prefix) and out.can_run_cuda_graph
    from sglang_dflash.tree_acceptance import verify_tree_greedy

    assert (seen["kid"] > 1).any()  # so the commit is not the identity permutation
    commit_path(before, batch.req_pool_indices, prefix, verify_tree_greedy(tree, seen["logits"])[2])
    assert torch.equal(me.req_to_token_pool.req_to_token, before)  # the step committed the accepted path
    assert me._tree_counts == {"verify graphed": 1, "verify eager": 0, "built in graph": int(built_in_graph),
                               "built eagerly": int(not built_in_graph)}
    from benchmarks.tree_graph_check import tree_counts  # what the GPU runs read from the server log

    assert tree_counts(caplog.text) == {"steps": 1, "verify_graphed": 1, "verify_eager": 0,
                                        "built_in_graph": int(built_in_graph), "built_eagerly": int(not built_in_graph)}


def test_startup_line_says_whether_tree_steps_run_graphed(caplog):
    pytest.importorskip("sglang")
    from benchmarks.tree_graph_check import startup_line
    from sglang_dflash.serving import worker

    runner = SimpleNamespace(capture_bs=[1, 2, 4])
    graphed = SimpleNamespace(_tree_size=N, _tree_graphs=SimpleNamespace(runner=runner), _graph_tree_bs={4, 1})
    eager = SimpleNamespace(_tree_size=N, _tree_graphs=None, _graph_tree_bs=set())
    with caplog.at_level(logging.INFO, logger="sglang_dflash"):
        worker.DFlashWorker._log_tree_graphs(graphed)
        assert startup_line(caplog.text) == (
            f"tree steps ({N} nodes): verify replays tree verify CUDA graphs for batch sizes [1, 2, 4] (larger: "
            "eager); tree build inside the draft CUDA graphs for batch sizes [1, 4] (others: eager)")
        caplog.clear()
        worker.DFlashWorker._log_tree_graphs(eager)
        assert startup_line(caplog.text) == (f"tree steps ({N} nodes): verify eager (no target verify graphs); "
                                             "tree build eager")


def test_tree_step_past_the_captured_sizes_is_eager():
    pytest.importorskip("sglang")
    bs = 3
    worker, me, batch, state, prefix, tree, seen = _step_stand_in(bs, graphs_max_bs=2, built_in_graph=False)
    out = worker.DFlashWorker._tree_decode_step(me, batch, state, prefix, bs, None)
    assert not seen["graphed"] and seen["runner"] is None  # tree_step.eager hid the chain's graphs
    assert seen["ids_ptr"] != me._tree_buffers.ids.data_ptr()  # the step's own tensors, nothing stored
    assert torch.equal(seen["ids"], tree.tokens.clamp(min=0))
    assert out.accept_lens.tolist() == _accept_lens(tree, seen, prefix) and not out.can_run_cuda_graph
    assert me._tree_counts["verify eager"] == 1 and me._tree_counts["built eagerly"] == 1


def test_tree_step_without_graphs_is_todays_eager_step():
    pytest.importorskip("sglang")
    bs = 2
    worker, me, batch, state, prefix, tree, seen = _step_stand_in(bs, graphs_max_bs=None, built_in_graph=False)
    out = worker.DFlashWorker._tree_decode_step(me, batch, state, prefix, bs, None)
    assert not seen["graphed"] and seen["runner"] is None
    assert torch.equal(seen["positions"], prefix[:, None] + tree.depth)
    assert out.accept_lens.tolist() == _accept_lens(tree, seen, prefix)
