"""The serving worker's tree step parts (sglang_dflash/serving/tree_step.py) and the CPU tree attention, without a
server: the req_to_token permutation that commits the accepted path, the verify inputs, the CPU verify attention
under a tree mask against the rule written out row by row, and the gates (which batches take a tree step, the
check that some attention layer applied the tree)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.draft_tree import DEAD, DraftTree, ancestor_mask, build_draft_tree
from sglang_dflash.serving import tree_step
from sglang_dflash.serving.cpu_ops import verify_attention
from sglang_dflash.tree_acceptance import commit_path, verify_tree_greedy

from .test_cpu_glue import _naive_attention


def _random_tree(n: int, size: int, seed: int, vocab: int = 7, block: int = 16) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    return build_draft_tree(torch.randint(0, vocab, (n,), generator=g),
                            torch.randn(n, block - 1, vocab, generator=g) * 2, size)


def test_commit_path_puts_the_path_slots_first():
    torch.manual_seed(0)
    size, vocab = 8, 7
    tree = _random_tree(3, size, seed=1, vocab=vocab)
    # target logits that accept a random-depth path: argmax at each node's row = one of its children, sometimes
    target = torch.randn(3, size, vocab)
    for b in range(3):
        for i in range(1, size):
            if torch.rand(()) < 0.7:
                target[b, tree.parents[b, i], tree.tokens[b, i]] = 50.0
    commit_lens, tokens, path = verify_tree_greedy(tree, target)
    assert commit_lens.max() > 2, "the planted target accepts nothing: the test would not see an order"
    req_to_token = torch.randperm(6 * 40).view(6, 40)
    before = req_to_token.clone()
    pool_rows, prefix = torch.tensor([4, 0, 2]), torch.tensor([5, 11, 0])
    commit_path(req_to_token, pool_rows, prefix, path)
    for b in range(3):
        r, p, c = int(pool_rows[b]), int(prefix[b]), int(commit_lens[b])
        old, new = before[r, p:p + size], req_to_token[r, p:p + size]
        assert new[:c].tolist() == old[path[b, :c]].tolist(), "column prefix + j must hold path node j's slot"
        rest = [i for i in range(size) if i not in path[b, :c].tolist()]
        assert new[c:].tolist() == old[rest].tolist(), "the other nodes' slots follow, in node order"
        assert sorted(new.tolist()) == sorted(old.tolist())  # the request owns the same slots
        assert torch.equal(req_to_token[r, :p], before[r, :p]) and torch.equal(req_to_token[r, p + size:],
                                                                             before[r, p + size:])
    for r in (1, 3, 5):  # rows of other requests
        assert torch.equal(req_to_token[r], before[r])


def test_commit_path_of_a_chain_changes_nothing():
    """A chain tree's path is its first commit_len nodes in order: the permutation is the identity."""
    parents = (torch.arange(6) - 1).expand(2, 6).contiguous()
    path = torch.tensor([[0, 1, 2, -1, -1, -1], [0, -1, -1, -1, -1, -1]])
    req_to_token = torch.randperm(40).view(2, 20)
    before = req_to_token.clone()
    commit_path(req_to_token, torch.tensor([1, 0]), torch.tensor([3, 7]), path)
    assert torch.equal(req_to_token, before) and parents.shape == path.shape


def test_verify_inputs():
    tree = DraftTree(tokens=torch.tensor([[9, 3, 4, DEAD], [5, 6, 7, 8]]),
                     parents=torch.tensor([[-1, 0, 0, 0], [-1, 0, 1, 1]]),
                     depth=torch.tensor([[0, 1, 1, 1], [0, 1, 2, 2]]), ancestors=torch.zeros(2, 4, 4, dtype=torch.bool),
                     log_prob=torch.zeros(2, 4))
    req_to_token = torch.arange(3 * 20).view(3, 20) + 100
    ids, positions, cache_loc = tree_step.verify_inputs(tree, torch.tensor([5, 2]), torch.tensor([2, 0]), req_to_token)
    assert ids.tolist() == [[9, 3, 4, 0], [5, 6, 7, 8]]  # a DEAD node is fed as a valid id
    assert positions.tolist() == [[5, 6, 6, 6], [2, 3, 4, 4]]  # prefix + depth
    assert cache_loc.tolist() == [[145, 146, 147, 148], [102, 103, 104, 105]]  # req_to_token[req, prefix + i]


@pytest.mark.parametrize("window", [None, 3])
def test_cpu_verify_attention_under_a_tree_mask(window):
    """cpu_ops.verify_attention with a tree against the rule row by row: node j (at position prefix + depth_j)
    sees every prefix key and the block keys of its ancestors and itself; the window compares positions."""
    torch.manual_seed(0)
    heads, kv_heads, dim, slots, size = 4, 2, 8, 80, 8
    tree = _random_tree(2, size, seed=3)
    assert (tree.depth.max(dim=1).values < size - 1).all(), "a tree, not a chain: the mask differs from causal"
    k_cache, v_cache = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
    req_to_token = torch.randperm(slots).view(2, 40)
    prefix, pool_rows = torch.tensor([7, 12]), torch.tensor([1, 0])
    q = torch.randn(2 * size, heads, dim)
    out = verify_attention(q, k_cache, v_cache, req_to_token, pool_rows, prefix, size, scale=0.3, causal=True,
                           sliding_window=window, tree_depth=tree.depth, tree_mask=tree.ancestors)
    for i in range(2):
        p = int(prefix[i])
        slots_i = req_to_token[pool_rows[i], :p + size]
        k_pos = torch.cat([torch.arange(p), p + tree.depth[i]])
        for j in range(size):
            visible = torch.cat([torch.ones(p, dtype=torch.bool), tree.ancestors[i, j]])
            if window is not None:
                visible &= k_pos >= p + tree.depth[i, j] - window
            want = _naive_attention(q[i * size + j], k_cache[slots_i], v_cache[slots_i], visible, 0.3)
            torch.testing.assert_close(out[i * size + j], want, rtol=1e-5, atol=1e-5)


def test_cpu_tree_attention_of_a_chain_is_the_causal_verify():
    torch.manual_seed(1)
    size = 5
    parents = (torch.arange(size) - 1).expand(2, size).contiguous()
    k_cache, v_cache, q = torch.randn(40, 2, 8), torch.randn(40, 2, 8), torch.randn(2 * size, 4, 8)
    req_to_token, prefix, rows = torch.randperm(40).view(2, 20), torch.tensor([3, 9]), torch.tensor([0, 1])
    causal = verify_attention(q, k_cache, v_cache, req_to_token, rows, prefix, size, scale=0.5, causal=True)
    tree = verify_attention(q, k_cache, v_cache, req_to_token, rows, prefix, size, scale=0.5, causal=True,
                            tree_depth=torch.arange(size).expand(2, size), tree_mask=ancestor_mask(parents))
    torch.testing.assert_close(tree, causal)


def test_build_tree_uses_the_vocabulary_rows_only():
    """The draft head's lm_head may carry padding rows past the vocabulary: no tree node may draft one."""
    bs, block, vocab, pad = 2, 6, 9, 3
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(bs * (block - 1), vocab + pad, generator=g)
    logits[:, vocab:] = 100.0  # the padding would win every position
    model = SimpleNamespace(vocab=SimpleNamespace(head_rows=(0, vocab)), draft_logits=lambda hidden: logits)
    tree = tree_step.build_tree(model, torch.zeros(bs * (block - 1), 4), torch.tensor([1, 2]), 6)
    assert tree.tokens.shape == (bs, 6) and int(tree.tokens.max()) < vocab
    want = build_draft_tree(torch.tensor([1, 2]), logits[:, :vocab].view(bs, block - 1, vocab), 6)
    assert torch.equal(tree.tokens, want.tokens) and torch.equal(tree.parents, want.parents)


def _batch(top_ks=(1, 1), **info):
    base = dict(is_all_greedy=True, logit_bias=None, acc_additive_penalties=None, acc_scaling_penalties=None)
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(top_k=k)) for k in top_ks]
    return SimpleNamespace(sampling_info=SimpleNamespace(**{**base, **info}), has_grammar=False, return_logprob=False,
                           reqs=reqs)


SAMPLED = dict(is_all_greedy=False, top_ks=(1, 1 << 30))  # a greedy row and a sampled one (SGLang: top_k -1 -> 1 << 30)


ROWS = {"greedy": {}, "mixed": SAMPLED, "sampled": dict(is_all_greedy=False, top_ks=(5, 40))}


@pytest.mark.parametrize("case", list(ROWS))
def test_which_batches_take_a_tree_step(case):
    """Greedy and sampled rows qualify (the worker picks the rule: ``all_greedy``); per-request controls that need
    per-node state, and logprobs, keep the batch on the chain, whatever its rows sample."""
    rows = ROWS[case]
    assert tree_step.applies(_batch(**rows))
    assert not tree_step.applies(_batch(**rows, logit_bias=torch.zeros(1, 4)))
    assert not tree_step.applies(_batch(**rows, acc_additive_penalties=torch.zeros(1, 4)))  # min_new_tokens too
    assert not tree_step.applies(_batch(**rows, acc_scaling_penalties=torch.ones(1, 4)))
    b = _batch(**rows)
    b.has_grammar = True
    assert not tree_step.applies(b)
    b = _batch(**rows)
    b.return_logprob = True
    assert not tree_step.applies(b)


def test_which_tree_steps_take_the_greedy_rule():
    assert tree_step.all_greedy(_batch())
    assert not tree_step.all_greedy(_batch(**SAMPLED))
    assert not tree_step.all_greedy(_batch(is_all_greedy=False, top_ks=(5, 40)))
    # SGLang's is_all_greedy stays off once a sampled request has been merged, even after it left the batch
    assert tree_step.all_greedy(_batch(is_all_greedy=False, top_ks=(1, 1)))
    assert tree_step.all_greedy(SimpleNamespace(sampling_info=None, reqs=[]))


def test_the_tree_reaches_an_attention_hook():
    tree = tree_step.TreeVerify.of(_random_tree(2, 4, seed=0))
    assert tree_step.active() is None
    with tree_step.verifying(tree):
        assert tree_step.active() is tree
        with pytest.raises(RuntimeError, match="width 16"):
            tree.claim(16)
        tree.claim(4)
    assert tree_step.active() is None and tree.parents.shape == (8,)
    with pytest.raises(RuntimeError, match="without any attention layer applying the tree mask"):
        with tree_step.verifying(tree_step.TreeVerify.of(_random_tree(2, 4, seed=0))):
            pass  # no hook claimed it: the verify would have attended causally
    assert tree_step.active() is None


def test_eager_hides_the_graph_runner():
    runner = SimpleNamespace(decode_cuda_graph_runner="graphs")
    with tree_step.eager(runner):
        assert runner.decode_cuda_graph_runner is None
    assert runner.decode_cuda_graph_runner == "graphs"


def _args(**kw):
    base = dict(device="cpu", tp_size=1, page_size=None, attention_backend=None, prefill_attention_backend=None,
                decode_attention_backend=None, speculative_draft_attention_backend=None)
    return SimpleNamespace(**{**base, **kw})


DFLASH = SimpleNamespace(block_size=16, is_dflash2=False, architecture="DFlashDraftModel")


@pytest.mark.parametrize("cfg,args,env,message", [
    (DFLASH, _args(), "17", r"SGLANG_DFLASH_TREE=17: .*block size 16.*Fix"),
    (DFLASH, _args(), "1", r"SGLANG_DFLASH_TREE='1'.*Fix"),
    (SimpleNamespace(block_size=16, is_dflash2=True, architecture="DFlash2DraftModel"), _args(), "8",
     r"DFlash2 drafter.*Fix: SGLANG_DFLASH_TREE=0"),
    (DFLASH, _args(tp_size=2), "8", r"--tp-size 2.*Fix: --tp-size 1"),
    (DFLASH, _args(page_size=16), "8", r"--page-size 16.*Fix: --page-size 1"),
    (DFLASH, _args(device="cuda"), "8", r"needs the target's attention on triton.*no --attention-backend.*Fix"),
    (DFLASH, _args(device="cuda", attention_backend="fa3"), "8", r"--attention-backend fa3.*Fix"),
    (DFLASH, _args(device="cuda", attention_backend="triton", decode_attention_backend="flashinfer"), "8",
     r"--decode-attention-backend flashinfer.*Fix"),
])
def test_tree_setups_refused_at_startup(monkeypatch, cfg, args, env, message):
    from sglang_dflash.serving.startup import DFlashStartupError, check_tree

    monkeypatch.setenv("SGLANG_DFLASH_TREE", env)
    with pytest.raises(DFlashStartupError, match=message):
        check_tree(cfg, args)


def test_tree_setups_accepted_at_startup(monkeypatch):
    from sglang_dflash.serving.startup import check_tree

    monkeypatch.delenv("SGLANG_DFLASH_TREE", raising=False)
    assert check_tree(SimpleNamespace(block_size=16, is_dflash2=True), _args(tp_size=4)) == 0  # off: no checks
    monkeypatch.setenv("SGLANG_DFLASH_TREE", "16")
    assert check_tree(DFLASH, _args()) == 16
    monkeypatch.delenv("SGLANG_DFLASH_VERIFY_ATTENTION", raising=False)
    assert check_tree(DFLASH, _args(device="cuda", attention_backend="triton")) == 16
    monkeypatch.setenv("SGLANG_DFLASH_VERIFY_ATTENTION", "sglang")
    from sglang_dflash.serving.startup import DFlashStartupError

    with pytest.raises(DFlashStartupError, match="SGLANG_DFLASH_VERIFY_ATTENTION=sglang"):
        check_tree(DFLASH, _args(device="cuda", attention_backend="triton"))


def test_the_width_policy_chooses_the_tree_and_the_step_is_reported_under_its_key():
    """The worker asks the width policy whether the batch may take a tree (tree_step.applies) and runs a tree step
    when the policy chooses the tree's key, reporting it under that key (the tree's own statistics; before issue #38
    item 4 it was reported as k = B-1, which fed tree rows into the chain's per-position statistics)."""
    pytest.importorskip("sglang")
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    from sglang_dflash.serving.worker import DFlashWorker

    begun, asked = [], []

    def choose(bs, tree_ok=False):
        asked.append(tree_ok)
        return 16 if tree_ok else 3

    control = SimpleNamespace(choose=choose, tree=16, step_begin=lambda bs, k: begun.append(k))
    stub = SimpleNamespace(block=16, _control=control, _tree_size=8, _oracle=None,
                           _tree_decode_step=lambda batch, state, prefix, bs, on_publish: "tree step")
    batch = _batch()
    batch.batch_size = lambda: 2
    batch.seq_lens = torch.tensor([5, 9])
    batch.spec_info = make_draft_input_v2(bonus_tokens=torch.tensor([1, 2]), new_seq_lens=batch.seq_lens)
    assert tree_step.applies(batch)
    assert DFlashWorker._decode_step(stub, batch, None) == "tree step" and begun == [16] and asked == [True]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_mask_is_the_kernels_own_tree(seed):
    """TreeVerify.kernel_mask (built once per tree verify from the tree's ancestor mask) is what the kernel would
    build from the parents on every layer's call (kernels/verify_attention.tree_ancestor_bits)."""
    from sglang_dflash.kernels.verify_attention import tree_ancestor_bits

    tree = _random_tree(3, 12, seed=seed)
    bits, depth = tree_step.TreeVerify.of(tree).kernel_mask
    want_bits, want_depth = tree_ancestor_bits(tree.parents.reshape(-1), torch.arange(4) * tree.size, tree.size)
    assert torch.equal(bits, want_bits) and torch.equal(depth, want_depth)
