"""serving/kernel_warmup.py: SGLang's KV-slot writers (issue #34 item 1) and our tree accept (issue #48) compiled at
start-up, writing nothing the server reads."""

import pytest
import torch

pytest.importorskip("sglang")

from sglang_dflash.serving.kernel_warmup import _aligned_and_not, warm_kv_slot_kernels, warm_tree_accept  # noqa: E402,E501


def test_two_alignments():
    aligned, shifted = _aligned_and_not(5, torch.int64, "cpu")
    assert aligned.shape == shifted.shape == (5,)
    assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 == 8


def test_cpu_servers_have_nothing_to_warm():
    assert warm_kv_slot_kernels(torch.zeros((2, 64), dtype=torch.int32), 8) == 0
    assert not warm_tree_accept(16, torch.zeros((2, 64), dtype=torch.int32))


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
