"""serving/kernel_warmup.py: SGLang's KV-slot writers (issue #34 item 1) and our tree accept (issue #48) compiled at
start-up, writing nothing the server reads."""

import pytest
import torch

pytest.importorskip("sglang")

from sglang_dflash.serving.kernel_warmup import (  # noqa: E402
    _aligned_and_not, tree_accept_warmup_args, warm_kv_slot_kernels, warm_tree_accept)


def test_two_alignments():
    aligned, shifted = _aligned_and_not(5, torch.int64, "cpu")
    assert aligned.shape == shifted.shape == (5,)
    assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 == 8


def test_cpu_servers_have_nothing_to_warm():
    assert warm_kv_slot_kernels(torch.zeros((2, 64), dtype=torch.int32), 8) == 0
    assert not warm_tree_accept(16, torch.zeros((2, 64), dtype=torch.int32))


def test_tree_accept_warmup_compiles_the_variant_of_every_tree_step(monkeypatch):
    """With trees on, the start-up launch has the Triton specialisation key of every tree step's launch (Triton's own
    rule, read on CPU: constexprs, dtypes, 16-byte alignment, integers equal to 1 or divisible by 16), at any batch
    size, for a tree built eagerly and one from the tree CUDA graphs' static buffers; with trees off there is none.
    The kernel launch is recorded, not run."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from sglang_dflash.draft_tree import build_draft_tree
    from sglang_dflash.kernels import tree_accept as kernel
    from sglang_dflash.serving.tree_graphs import TreeBuffers

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((args, kwargs))

    def key(args, kwargs):
        return [native_specialize_impl(BaseBackend, a, False, True, True) for a in args], kwargs

    monkeypatch.setattr(kernel, "_tree_accept_kernel", Recorder())
    N, B, V = 12, 16, 50
    req_to_token = torch.zeros((64, 4100), dtype=torch.int32)  # row length neither 1 nor a multiple of 16
    assert tree_accept_warmup_args(0, req_to_token) is None  # trees off: nothing to compile
    kernel.tree_accept(*tree_accept_warmup_args(N, req_to_token))
    assert not req_to_token.any()  # the warm-up writes a scratch row, not the pool
    for bs in (1, 5, 16):
        eager = build_draft_tree(torch.randint(0, V, (bs,)), torch.randn(bs, B - 1, V), N)
        for tree in (eager, TreeBuffers(32, N, "cpu").tree(bs)):
            target_ids = torch.randn(bs * N, V).view(bs, N, -1).argmax(dim=-1)  # the worker's logits argmax
            seq_lens, req_pool_indices = torch.zeros(bs, dtype=torch.int64), torch.arange(bs)  # SGLang's: int64
            kernel.tree_accept(target_ids, tree, seq_lens, req_pool_indices, req_to_token)
    warm = key(*launches[0])
    assert warm[1]["BLOCK"] == 16 and len(launches) == 7
    assert all(key(*launch) == warm for launch in launches[1:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tree_accept_is_compiled_at_start_up_without_touching_the_pool():
    from sglang_dflash.kernels.tree_accept import _tree_accept_kernel

    req_to_token = torch.randint(0, 1000, (16, 4096), dtype=torch.int32, device="cuda")
    before = req_to_token.clone()
    assert not warm_tree_accept(0, req_to_token)  # trees off: nothing to compile
    assert warm_tree_accept(16, req_to_token)
    assert torch.equal(req_to_token, before)
    assert _compiled(_tree_accept_kernel) != 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_warmup_writes_nothing_and_leaves_no_compile_for_the_request_path():
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool, assign_req_to_token_pool_func

    dev = "cuda"
    req_to_token = torch.randint(0, 1000, (16, 4096), dtype=torch.int32, device=dev)
    before = req_to_token.clone()
    launches = warm_kv_slot_kernels(req_to_token, 128)
    assert launches == 2 * 8 + 2  # powers of two 1..128, two alignments each, and the prefill writer's two
    assert torch.equal(req_to_token, before)
    compiled = _compiled(assign_req_to_token_pool)
    # a batch of 7 (next power of two: 8) with an unaligned slots tensor, as the allocator can hand out
    rows = torch.arange(7, dtype=torch.int64, device=dev)
    start = torch.zeros(7, dtype=torch.int32, device=dev)
    end = torch.full((7,), 3, dtype=torch.int32, device=dev)
    slots = torch.arange(100, 122, dtype=torch.int64, device=dev)[1:]  # 21 slots at an 8-byte offset
    assign_req_to_token_pool_func(rows, req_to_token, start, end, slots, 7)
    assert req_to_token[:7, :3].flatten().tolist() == slots.tolist()
    if compiled is not None:
        assert _compiled(assign_req_to_token_pool) == compiled, "the request path compiled a new variant"


def _compiled(jit_fn) -> int | None:
    """Kernels a Triton JITFunction holds compiled (Triton 3.x: device_caches[device][0] is the kernel cache)."""
    caches = getattr(jit_fn, "device_caches", None)
    if caches is None:
        return None
    return sum(len(entry[0]) for entry in caches.values())
