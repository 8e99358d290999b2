"""Verify-attention kernel (``sglang_dflash.kernels``): Triton kernel == torch reference == naive dense attention.

* ``test_reference_matches_naive_dense``: the reference (per-request loop reading the paged pool) against one dense
  masked softmax over the whole batch built from the logical sequences, in float64 (catches a wrong mask, position
  or page-address convention in the reference itself).
* ``test_interpreted_kernel_matches_reference``: the Triton kernel under ``TRITON_INTERPRET=1`` on CPU, in a
  subprocess (the variable must be set before triton is first imported, which another test may already have done
  in this process), over head dims, GQA, 0-length prefixes, B = 1 and 16, ragged widths, page size 1 and 16,
  sliding windows, softcap, non-causal blocks, split-K on and off, attention sinks (gpt-oss: one extra logit per
  head in the denominator) on the single-split, direct-write and combined-split paths.
* ``test_gpu_kernel_matches_reference`` / ``..._sglang``: on CUDA only, the shapes that matter (head dims 64-512,
  GQA 1-8, contexts 1-32k, page 1 and 16, gpt-oss's sinks with and without its window) against the reference and
  against SGLang's own extend kernel.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import pytest
import torch
from _interpreter import run_interpreted

from sglang_dflash.kernels.reference import verify_attention_reference


@dataclass(frozen=True)
class Case:
    """One batch: request i has ``widths[i]`` block tokens over ``prefixes[i]`` cached tokens."""
    name: str
    prefixes: tuple
    widths: tuple
    kv_heads: int = 2
    group: int = 2
    dk: int = 64
    dv: int | None = None
    page: int = 1
    window_left: int = -1
    logit_cap: float = 0.0
    causal: bool = True
    max_splits: int = 2
    split_min: int = 16
    tree: bool = False  # blocks are random draft trees (tree_parents), not chains
    sinks: bool = False  # per-head attention sinks (``sink_values``)

    @property
    def head_dim_v(self) -> int:
        return self.dv or self.dk


def make_inputs(case: Case, device="cpu", dtype=torch.float32, seed=0):
    """Logical per-request K/V scattered into a pool the way SGLang's allocator would (pages owned per request)."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, dk, dv = case.kv_heads * case.group, case.kv_heads, case.dk, case.head_dim_v

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    pages_per_req = [-(-p // case.page) for p in case.prefixes]
    n_pages = sum(pages_per_req) + 3                      # spare pages: slots nobody owns must never be read
    page_order = torch.randperm(n_pages, generator=gen)
    slots, used = [], 0
    for p, n in zip(case.prefixes, pages_per_req):
        owned = page_order[used:used + n]
        used += n
        slots.append((owned[:, None] * case.page + torch.arange(case.page)).reshape(-1)[:p])
    kv_indices = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
    k_pool = rand(n_pages * case.page, hkv, dk)
    v_pool = rand(n_pages * case.page, hkv, dv)
    prefix_k = [k_pool[s] for s in slots]                 # the logical sequences, read before any reshaping
    prefix_v = [v_pool[s] for s in slots]
    if case.page > 1:                                     # SGLang's paged layout [pages, page, heads, dim]
        k_pool = k_pool.view(n_pages, case.page, hkv, dk)
        v_pool = v_pool.view(n_pages, case.page, hkv, dv)
    n_tok = sum(case.widths)
    qo = torch.tensor([0] + list(case.widths)).cumsum(0).to(torch.int32)
    kvp = torch.tensor([0] + list(case.prefixes)).cumsum(0).to(torch.int32)
    tensors = dict(q=rand(n_tok, hq, dk), k_extend=rand(n_tok, hkv, dk), v_extend=rand(n_tok, hkv, dv),
                   k_buffer=k_pool, v_buffer=v_pool, qo_indptr=qo, kv_indptr=kvp, kv_indices=kv_indices.long())
    tensors = {k: t.to(device) for k, t in tensors.items()}
    logical = dict(prefix_k=prefix_k, prefix_v=prefix_v)
    kwargs = dict(sm_scale=dk ** -0.5, causal=case.causal, window_left=case.window_left, logit_cap=case.logit_cap)
    if case.tree:  # block-local parents: token i's parent drawn from 0..i-1, so trees of every shape appear
        kwargs["tree_parents"] = torch.cat([
            torch.tensor([-1] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, w)]) for w in case.widths
        ]).to(device)
    if case.sinks:  # drawn last: the other cases' tensors stay what they were
        kwargs["sinks"] = sink_values(hq, gen).to(dtype).to(device)
    return tensors, logical, kwargs


def sink_values(hq: int, gen: torch.Generator) -> torch.Tensor:
    """Per-head sink logits: most near the scores' own range (scores here are ~N(0, 1) over tens of keys, so a sink
    of 2-6 takes a visible but partial share), one far above every score (the head attends to almost nothing:
    output ~0, and 2^(sink - max) unguarded would be ~2^70) and one far below (no effect)."""
    sinks = torch.randn(hq, generator=gen) * 2 + 3
    sinks[0] = 50.0
    if hq > 2:
        sinks[hq // 2] = -50.0
    return sinks


def tree_walk(parents: list[int]) -> tuple[list[set], list[int]]:
    """Ancestors-and-self and depth of each node, by walking parent links (independent of tree_block_mask)."""
    anc, depth = [], []
    for i in range(len(parents)):
        seen, j = set(), i
        while j >= 0:
            seen.add(j)
            j = parents[j]
        anc.append(seen)
        depth.append(len(seen) - 1)
    return anc, depth


def naive_dense_attention(tensors, logical, case: Case, sm_scale, tree_parents=None, sinks=None):
    """One float64 softmax over [all queries x all keys of the batch], masked to (own request, causal or tree,
    window). Sinks as a factor on it, not as a softmax column (the reference's way): sum_j e^s_j / (sum_j e^s_j +
    e^sink) = sigmoid(logsumexp(s) - sink)."""
    keys, vals, key_req, key_pos, key_node = [], [], [], [], []
    q_pos, q_tree = [], []
    qo = tensors["qo_indptr"].tolist()
    for b, (p, w) in enumerate(zip(case.prefixes, case.widths)):
        keys += [logical["prefix_k"][b], tensors["k_extend"][qo[b]:qo[b + 1]]]
        vals += [logical["prefix_v"][b], tensors["v_extend"][qo[b]:qo[b + 1]]]
        key_req += [b] * (p + w)
        if tree_parents is None:
            depth, anc = list(range(w)), [set(range(i + 1)) for i in range(w)]
        else:
            anc, depth = tree_walk(tree_parents[qo[b]:qo[b + 1]].tolist())
        key_pos += list(range(p)) + [p + d for d in depth]
        key_node += [-1] * p + list(range(w))  # -1: a prefix key, visible to every query of its request
        q_pos += [p + d for d in depth]
        q_tree += anc
    k = torch.cat(keys).double().repeat_interleave(case.group, 1)
    v = torch.cat(vals).double().repeat_interleave(case.group, 1)
    q_req = torch.tensor([b for b, w in enumerate(case.widths) for _ in range(w)])
    q_pos = torch.tensor(q_pos)
    key_req, key_pos = torch.tensor(key_req), torch.tensor(key_pos)
    allowed = q_req[:, None] == key_req[None, :]
    if tree_parents is not None:
        allowed &= torch.tensor([[node < 0 or node in a for node in key_node] for a in q_tree])
    elif case.causal:
        allowed &= key_pos[None, :] <= q_pos[:, None]
    if case.window_left >= 0:
        allowed &= q_pos[:, None] - key_pos[None, :] <= case.window_left
    s = torch.einsum("qhd,khd->hqk", tensors["q"].double(), k) * sm_scale
    if case.logit_cap > 0:
        s = case.logit_cap * torch.tanh(s / case.logit_cap)
    s = s.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    if sinks is not None:
        keep = torch.sigmoid(s.logsumexp(-1) - sinks.double()[:, None])     # [Hq, N]: the keys' share of the mass
        out = out * keep.T[:, :, None]
    return out


# Small enough for Triton's interpreter (seconds in all), wide enough to reach every branch of the kernel.
INTERPRETER_CASES = [
    Case("d64_g1_B1_empty_prefix", prefixes=(0, 37), widths=(1, 1), group=1, max_splits=1),
    Case("d64_g2_B4_splits", prefixes=(5, 70), widths=(4, 4), max_splits=4),
    Case("d128_g4_B16_page16", prefixes=(0, 50), widths=(16, 16), dk=128, group=4, kv_heads=1, page=16),
    Case("d64_g8_B16_one_split", prefixes=(33,), widths=(16,), group=8, kv_heads=1, max_splits=1),
    Case("d64_ragged_widths", prefixes=(20, 3, 45), widths=(7, 1, 16), group=2, max_splits=2),
    Case("d96_window", prefixes=(60, 10), widths=(8, 8), dk=96, window_left=12, max_splits=4),
    Case("d64_window_page16", prefixes=(40,), widths=(16,), page=16, window_left=20, max_splits=2),
    Case("d64_softcap_noncausal", prefixes=(30, 0), widths=(8, 8), logit_cap=5.0, causal=False),
    Case("d256_dv128_g2", prefixes=(24,), widths=(4,), dk=256, dv=128, kv_heads=1),
    Case("d512_g2_B16", prefixes=(20,), widths=(16,), dk=512, kv_heads=1, max_splits=2),
    Case("d64_tree_ragged", prefixes=(20, 0, 45), widths=(7, 1, 16), group=2, max_splits=2, tree=True),
    Case("d64_tree_B32_window_page16", prefixes=(40, 9), widths=(32, 11), page=16, window_left=5, max_splits=4,
         tree=True),
    # attention sinks (gpt-oss): MAX_SPLITS == 1 (the output written in the split kernel) ...
    Case("d64_g4_sinks_one_split", prefixes=(5, 40), widths=(4, 16), group=4, max_splits=1, sinks=True),
    # ... split launches: 4, 3 and 1 split (the last written directly, the others through the combine)
    Case("d64_sinks_splits", prefixes=(70, 33, 3), widths=(4, 16, 1), max_splits=4, sinks=True),
    # the gpt-oss k = 0 step: width 1, GQA 8, split and unsplit requests
    Case("d64_g8_B1_sinks", prefixes=(0, 37, 200), widths=(1, 1, 1), group=8, kv_heads=1, max_splits=4, sinks=True),
    # sliding window: one request's window in 3 splits, one's prefix shorter than its window (1 split)
    Case("d128_sinks_window_splits_page16", prefixes=(100, 9), widths=(16, 5), dk=128, page=16, window_left=40,
         max_splits=4, sinks=True),
    Case("d64_g8_sinks_window_one_split", prefixes=(60, 130), widths=(8, 16), group=8, kv_heads=1, window_left=31,
         max_splits=1, sinks=True),
    Case("d64_sinks_softcap_noncausal", prefixes=(30, 0), widths=(8, 8), logit_cap=5.0, causal=False, sinks=True),
    Case("d64_tree_sinks_window", prefixes=(20, 45), widths=(7, 16), window_left=9, max_splits=2, tree=True,
         sinks=True),
]


def _run_interpreter_cases() -> dict:
    from sglang_dflash.kernels.verify_attention import verify_attention

    errors = {}
    for case in INTERPRETER_CASES:
        tensors, _, kwargs = make_inputs(case)
        got = verify_attention(**tensors, **kwargs, max_q_len=max(case.widths), max_splits=case.max_splits,
                               split_min=case.split_min)
        want = verify_attention_reference(**tensors, **kwargs)
        errors[case.name] = (got.double() - want.double()).abs().max().item()
    return errors


@pytest.mark.parametrize("case", INTERPRETER_CASES + [
    Case("d64_noncausal_window_page16", prefixes=(40, 7), widths=(5, 16), page=16, window_left=9, causal=False),
], ids=lambda c: c.name)
def test_reference_matches_naive_dense(case):
    tensors, logical, kwargs = make_inputs(case, dtype=torch.float64)
    got = verify_attention_reference(**tensors, **kwargs)
    want = naive_dense_attention(tensors, logical, case, kwargs["sm_scale"], kwargs.get("tree_parents"),
                                 kwargs.get("sinks"))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_sinks_take_mass_from_the_keys_and_nothing_else():
    """A sink of -inf is no sink; a finite one scales each row of the sink-free output by the keys' share of the
    mass (no value row, no change to the keys' relative weights); the far-above head's output is ~0."""
    case = Case("sinks", prefixes=(12, 30), widths=(8, 16), group=4, window_left=6, sinks=True)
    tensors, _, kwargs = make_inputs(case, dtype=torch.float64)
    sinks = kwargs.pop("sinks")
    plain = verify_attention_reference(**tensors, **kwargs)
    torch.testing.assert_close(verify_attention_reference(**tensors, **kwargs, sinks=torch.full_like(sinks, -torch.inf)),
                               plain)
    with_sinks = verify_attention_reference(**tensors, **kwargs, sinks=sinks)
    ratio = with_sinks / plain                                           # [N, Hq, Dv]: one factor per (row, head)
    torch.testing.assert_close(ratio, ratio[:, :, :1].expand_as(ratio))
    assert (ratio > 0).all() and (ratio <= 1).all()                      # <= : 1 - e^-53 rounds to 1
    assert with_sinks[:, 0].abs().max() < 1e-15                          # sink 50 above scores ~N(0, 1)


def test_tree_mode_of_a_chain_is_the_causal_block_and_a_tree_is_not():
    """Parents i - 1 (a chain) give the causal result exactly; a real tree differs from it (the mask matters)."""
    case = Case("chain", prefixes=(12, 30), widths=(8, 16), window_left=6)
    tensors, _, kwargs = make_inputs(case, dtype=torch.float64)
    chain = torch.cat([torch.arange(w) - 1 for w in case.widths])
    causal = verify_attention_reference(**tensors, **kwargs)
    torch.testing.assert_close(verify_attention_reference(**tensors, **kwargs, tree_parents=chain), causal)
    star = torch.cat([torch.tensor([-1] + [0] * (w - 1)) for w in case.widths])  # every node a child of the root
    assert not torch.allclose(verify_attention_reference(**tensors, **kwargs, tree_parents=star), causal)


def test_tree_ancestor_bits_match_the_parent_walk():
    pytest.importorskip("triton")
    from sglang_dflash.kernels.verify_attention import tree_ancestor_bits

    case = Case("bits", prefixes=(0, 0, 0), widths=(32, 1, 9), tree=True)
    _, _, kwargs = make_inputs(case, seed=3)
    parents = kwargs["tree_parents"]
    qo = torch.tensor([0, 32, 33, 42])
    bits, depth = tree_ancestor_bits(parents, qo, 32)
    for b in range(3):
        anc, dep = tree_walk(parents[qo[b]:qo[b + 1]].tolist())
        for i, (a, d) in enumerate(zip(anc, dep)):
            assert int(bits[qo[b] + i]) == sum(1 << j for j in a) and int(depth[qo[b] + i]) == d


@pytest.fixture(scope="module")
def interpreter_errors():
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=lambda c: c.name)
def test_interpreted_kernel_matches_reference(case, interpreter_errors):
    assert interpreter_errors[case.name] < 1e-4, f"{case.name}: max |kernel - reference| = " \
                                                 f"{interpreter_errors[case.name]:.3g}"


# ------------------------------------------------------------------------------------------------------ plug-in
class _Mode:
    def __init__(self, verify):
        self.verify = verify

    def is_target_verify(self):
        return self.verify


class _Algo:
    def __init__(self, dflash):
        self.dflash = dflash

    def is_dflash(self):
        return self.dflash


class _Backend:
    """Stands in for TritonAttnBackend: forward_extend calls whatever self.extend_attention_fwd is at that moment."""

    def __init__(self):
        self.sglang_calls = 0
        self.extend_attention_fwd = self._sglang_extend

    def _sglang_extend(self, *args, **kwargs):
        self.sglang_calls += 1

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self.seen = self.extend_attention_fwd
        return "done"


class _Batch:
    def __init__(self, verify=True, dflash=True):
        self.forward_mode, self.spec_algorithm = _Mode(verify), _Algo(dflash)


@pytest.mark.parametrize("verify,dflash,env,ours", [
    (True, True, None, True), (True, True, "ours", True), (True, True, "sglang", False),
    (False, True, None, False), (True, False, None, False),
])
def test_hook_swaps_in_our_kernel_only_for_dflash_verify(monkeypatch, verify, dflash, env, ours):
    from sglang_dflash.serving.verify_kernel import KERNEL_ENV, _Dispatch, triton_forward_extend

    if env is None:
        monkeypatch.delenv(KERNEL_ENV, raising=False)
    else:
        monkeypatch.setenv(KERNEL_ENV, env)
    backend = _Backend()
    original_fn = backend.extend_attention_fwd
    assert triton_forward_extend(_Backend.forward_extend, backend, None, None, None, None,
                                 _Batch(verify, dflash)) == "done"
    assert isinstance(backend.seen, _Dispatch) is ours
    assert backend.extend_attention_fwd == original_fn, "the hook must put SGLang's function back"


def test_hook_rejects_unknown_switch(monkeypatch):
    from sglang_dflash.serving.verify_kernel import KERNEL_ENV, triton_forward_extend

    monkeypatch.setenv(KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="fast"):
        triton_forward_extend(_Backend.forward_extend, _Backend(), None, None, None, None, _Batch())


def _extend_args(case: Case, tensors, custom_mask=None):
    """Positional arguments as TritonAttnBackend.forward_extend passes them to extend_attention_fwd."""
    t = tensors
    out = torch.empty(t["q"].shape[0], t["q"].shape[1], case.head_dim_v)
    return (t["q"], t["k_extend"], t["v_extend"], out, t["k_buffer"], t["v_buffer"], t["qo_indptr"], t["kv_indptr"],
            t["kv_indices"], custom_mask, case.causal, None, max(case.widths), 1.0, 1.0), out


def test_dispatch_maps_sglang_arguments_onto_ours(monkeypatch):
    """SGLang's argument list reaches verify_attention as the same function (window, cap, causal, scale, out)."""
    import sglang_dflash.kernels.verify_attention as va
    from sglang_dflash.serving.verify_kernel import extend_compatible_verify

    case = Case("map", prefixes=(9, 4), widths=(5, 5), window_left=6, logit_cap=7.0, causal=False)
    tensors, _, kwargs = make_inputs(case)
    monkeypatch.setattr(va, "verify_attention", verify_attention_reference)   # same contract, runs on CPU
    args, out = _extend_args(case, tensors)
    got = extend_compatible_verify(pytest.fail, *args, sm_scale=kwargs["sm_scale"], logit_cap=case.logit_cap,
                                   sliding_window_size=case.window_left, page_size=1)
    assert got is out
    torch.testing.assert_close(out, verify_attention_reference(**tensors, **kwargs))


@pytest.mark.parametrize("extra", [dict(custom_mask=True), dict(xai_temperature_len=8),
                                   dict(skip_prefix=True), dict(max_len=40)], ids=lambda e: next(iter(e)))
def test_dispatch_leaves_what_it_cannot_serve_to_sglang(monkeypatch, extra):
    import sglang_dflash.kernels.verify_attention as va
    from sglang_dflash.serving.verify_kernel import extend_compatible_verify

    case = Case("defer", prefixes=(3,), widths=(4,))
    tensors, _, _ = make_inputs(case)
    monkeypatch.setattr(va, "verify_attention", lambda *a, **k: pytest.fail("our kernel ran"))
    args, _ = _extend_args(case, tensors, torch.ones(1, dtype=torch.bool) if extra.pop("custom_mask", 0) else None)
    if "max_len" in extra:
        args = args[:12] + (extra.pop("max_len"),) + args[13:]
    calls = []
    extend_compatible_verify(lambda *a, **k: calls.append(1), *args, **extra)
    assert calls == [1]


def test_dispatch_passes_sinks_to_our_kernel(monkeypatch):
    """A layer with attention sinks (gpt-oss) runs our kernel, sinks included, on a window layer and a full one."""
    import sglang_dflash.kernels.verify_attention as va
    from sglang_dflash.serving.verify_kernel import extend_compatible_verify

    for window in (-1, 5):
        case = Case("sinks_map", prefixes=(9, 4), widths=(5, 5), window_left=window, sinks=True)
        tensors, _, kwargs = make_inputs(case)
        monkeypatch.setattr(va, "verify_attention", verify_attention_reference)   # same contract, runs on CPU
        args, out = _extend_args(case, tensors)
        extend_compatible_verify(pytest.fail, *args, sm_scale=kwargs["sm_scale"], sliding_window_size=window,
                                 sinks=kwargs["sinks"], page_size=1)
        torch.testing.assert_close(out, verify_attention_reference(**tensors, **kwargs))
        no_sinks = {k: v for k, v in kwargs.items() if k != "sinks"}
        assert not torch.allclose(out, verify_attention_reference(**tensors, **no_sinks))


def _tree_verify(parents: torch.Tensor, width: int):
    """serving/tree_step.TreeVerify of equal-width blocks with these flat block-local parents (depth and mask are
    the CPU hook's; the GPU dispatch reads the kernel mask, built here as the kernel would build it)."""
    from sglang_dflash.kernels.verify_attention import tree_ancestor_bits
    from sglang_dflash.serving.tree_step import TreeVerify

    bs = parents.numel() // width
    qo_indptr = torch.arange(bs + 1) * width
    return TreeVerify(width, torch.zeros(bs, width, dtype=torch.long), torch.zeros(bs, width, width, dtype=torch.bool),
                      parents, tree_ancestor_bits(parents, qo_indptr, width))


def _reference_taking_the_mask(parents: torch.Tensor):
    """verify_attention's stand-in on CPU: takes the tree as the hook passes it (``tree_mask``, built once per tree),
    checks it is the parents' tree and answers with the reference's tree-mode attention."""
    def run(*args, tree_mask=None, tree_parents=None, **kwargs):
        assert tree_mask is not None and tree_parents is None, "the hook must pass the prebuilt tree mask"
        from sglang_dflash.kernels.verify_attention import tree_ancestor_bits

        want_bits, want_depth = tree_ancestor_bits(parents, args[5], kwargs["max_q_len"])  # args[5]: qo_indptr
        assert torch.equal(tree_mask[0], want_bits) and torch.equal(tree_mask[1], want_depth)
        return verify_attention_reference(*args, tree_parents=parents, **kwargs)
    return run


def test_dispatch_passes_a_tree_verify_to_our_kernels_tree_mode(monkeypatch):
    """While the worker runs a tree verify (tree_step.verifying), SGLang's arguments reach verify_attention with the
    tree's parents: the result is the reference's tree-mode attention, not the causal block's."""
    import sglang_dflash.kernels.verify_attention as va
    from sglang_dflash.serving import tree_step
    from sglang_dflash.serving.verify_kernel import extend_compatible_verify

    case = Case("tree_map", prefixes=(9, 4), widths=(6, 6), window_left=3, tree=True)
    tensors, _, kwargs = make_inputs(case)
    monkeypatch.setattr(va, "verify_attention", _reference_taking_the_mask(kwargs["tree_parents"]))  # runs on CPU
    args, out = _extend_args(case, tensors)
    tree = _tree_verify(kwargs["tree_parents"], 6)
    with tree_step.verifying(tree):
        extend_compatible_verify(pytest.fail, *args, sm_scale=kwargs["sm_scale"], sliding_window_size=3, page_size=1)
    assert tree.reads == 1
    torch.testing.assert_close(out, verify_attention_reference(**tensors, **kwargs))
    causal = {k: v for k, v in kwargs.items() if k != "tree_parents"}
    assert not torch.allclose(out, verify_attention_reference(**tensors, **causal))


def test_a_tree_verify_never_falls_back_to_sglangs_kernel(monkeypatch):
    """SGLang's kernels know no tree: a tree verify they would serve raises (a causal block = wrong tokens)."""
    from sglang_dflash.serving import tree_step
    from sglang_dflash.serving.verify_kernel import KERNEL_ENV, extend_compatible_verify, triton_forward_extend

    case = Case("tree_defer", prefixes=(3,), widths=(4,), tree=True)
    tensors, _, kwargs = make_inputs(case)
    args, _ = _extend_args(case, tensors, torch.ones(1, dtype=torch.bool))  # a custom mask: ours would defer
    with tree_step.verifying(_tree_verify(kwargs["tree_parents"], 4)) as tree:
        with pytest.raises(RuntimeError, match="needs our verify kernel's tree mode"):
            extend_compatible_verify(lambda *a, **k: pytest.fail("SGLang's kernel ran"), *args)
        monkeypatch.setenv(KERNEL_ENV, "sglang")
        with pytest.raises(RuntimeError, match="SGLANG_DFLASH_VERIFY_ATTENTION=sglang"):
            triton_forward_extend(_Backend.forward_extend, _Backend(), None, None, None, None, _Batch())
        tree.reads = 1  # the with block's own check (no layer claimed the tree) is not this test's


def test_dispatch_signature_is_sglangs_extend_signature():
    """The stand-in must accept exactly SGLang's extend_attention_fwd arguments (guards an SGLang upgrade)."""
    import inspect

    extend = pytest.importorskip("sglang.kernels.ops.attention.extend_attention")
    from sglang_dflash.serving.verify_kernel import extend_compatible_verify

    ours = list(inspect.signature(extend_compatible_verify).parameters)[1:]          # minus sglang_fn
    assert ours == list(inspect.signature(extend.extend_attention_fwd).parameters)


def test_triton_backend_reaches_extend_through_the_attribute_we_swap():
    """forward_extend must call ``self.extend_attention_fwd(...)``: that attribute is what the hook redirects."""
    import inspect

    backend = pytest.importorskip("sglang.srt.layers.attention.triton_backend")
    source = inspect.getsource(backend.TritonAttnBackend.forward_extend)
    assert "self.extend_attention_fwd(" in source


# ------------------------------------------------------------------------------------------------------------ GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU")
BF16_ATOL = 2e-2      # bf16 inputs, fp32 accumulation: observed error ~4e-3 at 32k keys


def gpu_cases():
    """Head dims 64-512 x GQA 1-8 x contexts 1-32k x page 1/16 (a spread, not the full product)."""
    cases = []
    for dk, group, kv_heads in ((64, 1, 8), (128, 4, 8), (128, 8, 4), (256, 2, 8), (512, 8, 2)):
        for ctx in (1, 1000, 32768):
            for page in (1, 16):
                bs = 1 if ctx > 8192 else 4
                cases.append(Case(f"d{dk}_g{group}_ctx{ctx}_p{page}", prefixes=(ctx,) * bs, widths=(16,) * bs,
                                  kv_heads=kv_heads, group=group, dk=dk, page=page, max_splits=None,
                                  split_min=256))
    cases.append(Case("d256_window1024_ctx4000", prefixes=(4000, 900), widths=(16, 16), dk=256, kv_heads=8,
                      group=2, window_left=1023, max_splits=None, split_min=256))
    cases.append(Case("d128_ragged_B1_B32", prefixes=(5000, 17, 0), widths=(1, 32, 9), dk=128, kv_heads=8, group=4,
                      max_splits=None, split_min=256))
    cases.append(Case("d128_softcap_noncausal", prefixes=(3000,), widths=(16,), dk=128, kv_heads=8, group=4,
                      logit_cap=30.0, causal=False, max_splits=None, split_min=256))
    # tree mode (issue #38): draft trees of 8 / 16 / 32 nodes over short and long prefixes
    cases.append(Case("d128_tree_mixed", prefixes=(1000, 17, 300), widths=(16, 8, 16), dk=128, kv_heads=8, group=4,
                      tree=True, max_splits=None, split_min=256))
    cases.append(Case("d64_tree32_ctx4000", prefixes=(4000,), widths=(32,), dk=64, kv_heads=8, group=1, tree=True,
                      max_splits=None, split_min=256))
    # attention sinks on the gpt-oss-20b shape (64 / 8 heads of dim 64; window 128 = window_left 127 on half the
    # layers): verify widths 16 and 1 (a plain step), one request (many splits) and four (fewer), short and long
    for window in (-1, 127):
        for ctx, width in ((1, 16), (1000, 16), (32768, 16), (4000, 1), (32768, 1)):
            bs = 1 if ctx > 8192 else 4
            cases.append(Case(f"gptoss_sinks_w{window}_ctx{ctx}_B{width}", prefixes=(ctx,) * bs, widths=(width,) * bs,
                              dk=64, kv_heads=8, group=8, window_left=window, sinks=True, max_splits=None,
                              split_min=256))
    cases.append(Case("gptoss_sinks_tree_window_ragged", prefixes=(5000, 17, 300), widths=(16, 8, 16), dk=64,
                      kv_heads=8, group=8, window_left=127, tree=True, sinks=True, max_splits=None, split_min=256))
    return cases


@needs_cuda
@pytest.mark.parametrize("case", gpu_cases(), ids=lambda c: c.name)
def test_gpu_kernel_matches_reference(case):
    from sglang_dflash.kernels.verify_attention import verify_attention

    tensors, _, kwargs = make_inputs(case, device="cuda", dtype=torch.bfloat16)
    got = verify_attention(**tensors, **kwargs, max_q_len=max(case.widths), max_splits=case.max_splits)
    want = verify_attention_reference(**tensors, **kwargs)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=BF16_ATOL)


@needs_cuda
@pytest.mark.parametrize("case", [c for c in gpu_cases() if c.page == 1 and c.logit_cap == 0 and not c.tree],
                         ids=lambda c: c.name)
def test_gpu_kernel_matches_sglang(case):
    """Same inputs through SGLang's triton extend kernel: the function we replace, called as its backend calls it
    (sinks included: its definition of them is the one ours must match)."""
    extend = pytest.importorskip("sglang.kernels.ops.attention.extend_attention")
    from sglang_dflash.kernels.verify_attention import verify_attention

    tensors, _, kwargs = make_inputs(case, device="cuda", dtype=torch.bfloat16)
    got = verify_attention(**tensors, **kwargs, max_q_len=max(case.widths))
    want = torch.empty_like(got)
    t = tensors
    extend.extend_attention_fwd(t["q"], t["k_extend"], t["v_extend"], want, t["k_buffer"], t["v_buffer"],
                                t["qo_indptr"], t["kv_indptr"], t["kv_indices"], None, case.causal, None,
                                max(case.widths), 1.0, 1.0, kwargs["sm_scale"], logit_cap=case.logit_cap,
                                sliding_window_size=case.window_left, sinks=kwargs.get("sinks"))
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=BF16_ATOL)


@needs_cuda
def test_gpu_tree_mask_is_read_from_static_buffers_in_a_cuda_graph():
    """What the tree verify graphs rely on (serving/tree_graphs.py): a CUDA graph captured with the tree mask in
    static buffers reads whatever the buffers hold at replay. Two different trees stored in turn into the same
    buffers, one graph replayed after each: each output is the reference's for the tree stored."""
    from sglang_dflash.kernels.verify_attention import tree_ancestor_bits, verify_attention

    case = Case("tree_graph", prefixes=(1000, 17, 300), widths=(16, 16, 16), dk=128, kv_heads=8, group=4, tree=True,
                max_splits=None, split_min=256)
    tensors, _, kwargs = make_inputs(case, device="cuda", dtype=torch.bfloat16, seed=1)
    other = make_inputs(case, device="cuda", dtype=torch.bfloat16, seed=2)[2]["tree_parents"]
    trees = [kwargs.pop("tree_parents"), other]
    assert not torch.equal(trees[0], trees[1])
    n_tok = sum(case.widths)
    bits, depth = torch.empty(n_tok, dtype=torch.int64, device="cuda"), torch.empty(n_tok, dtype=torch.int32,
                                                                                     device="cuda")
    out = torch.empty(n_tok, tensors["q"].shape[1], case.dk, dtype=torch.bfloat16, device="cuda")

    def store(parents):
        b, d = tree_ancestor_bits(parents, tensors["qo_indptr"], 16)
        bits.copy_(b)
        depth.copy_(d)

    def run():
        verify_attention(**tensors, **kwargs, max_q_len=16, out=out, tree_mask=(bits, depth))

    store(trees[1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for parents in trees:
        store(parents)
        graph.replay()
        want = verify_attention_reference(**tensors, **kwargs, tree_parents=parents)
        torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=BF16_ATOL)


if __name__ == "__main__" and "--interpret" in sys.argv:
    # Child of interpreter_errors(): TRITON_INTERPRET=1 is in the environment before anything imports triton.
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (it sets TRITON_INTERPRET=1)"
    torch.set_num_threads(1)
    print(json.dumps(_run_interpreter_cases()))
