"""Fast checks of the CPU stand-ins and the request guard (no server)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.serving.cpu_ops import StreamlessIndices, verify_attention, verify_width


def _verify_batch(bs=2, block=16):
    return SimpleNamespace(batch_size=bs, positions=torch.arange(bs * block), seq_lens=torch.tensor([5, 9])[:bs],
                           spec_info=SimpleNamespace(draft_token_num=block))


def test_verify_width_comes_from_the_batch_not_from_q():
    # Regression: B used to be q.shape[0] // bs, and Gemma-3 hands attention q as [1, N, heads, dim]: B was 0
    # (bs > 1) or 1 (bs = 1), so verify rows past the first were never computed.
    fb = _verify_batch()
    assert verify_width(fb) == 16
    fb.spec_info = None  # no spec_info: tokens / requests
    assert verify_width(fb) == 16
    fb.spec_info = SimpleNamespace(draft_token_num=8)
    with pytest.raises(RuntimeError, match="block 8"):
        verify_width(fb)


def _naive_attention(q, keys, values, visible, scale):
    """One query row over the visible keys, written out: softmax(q k^T * scale) v, GQA by repeating kv heads."""
    rep = q.shape[0] // keys.shape[1]
    k, v = keys[visible].repeat_interleave(rep, 1), values[visible].repeat_interleave(rep, 1)  # [n, heads, dim]
    w = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", w, v)


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 4)])
@pytest.mark.parametrize("width", [1, 5])
def test_verify_attention_sees_what_each_row_may_see(causal, window, width):
    """cpu_ops.verify_attention against the rule written out row by row: a verify row at position p sees keys
    0..p (within the sliding window), a drafter block row (non-causal) sees every key of its request."""
    torch.manual_seed(0)
    heads, kv_heads, dim, slots = 4, 2, 8, 64
    k_cache, v_cache = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
    req_to_token = torch.randperm(slots).view(2, 32)  # each request's slots scattered through the pool
    prefix = torch.tensor([7, 12])
    pool_rows = torch.tensor([1, 0])
    q = torch.randn(2 * width, heads, dim)
    out = verify_attention(q, k_cache, v_cache, req_to_token, pool_rows, prefix, width, scale=0.3, causal=causal,
                           sliding_window=window)
    for i in range(2):
        slots_i = req_to_token[pool_rows[i], :prefix[i] + width]
        for j in range(width):
            pos, k_pos = int(prefix[i]) + j, torch.arange(len(slots_i))
            visible = (k_pos <= pos) if causal else torch.ones_like(k_pos, dtype=torch.bool)
            if window is not None:
                visible &= k_pos >= pos - window
            want = _naive_attention(q[i * width + j], k_cache[slots_i], v_cache[slots_i], visible, 0.3)
            torch.testing.assert_close(out[i * width + j], want, rtol=1e-5, atol=1e-5)


def test_streamless_indices():
    idx = torch.tensor([2, 0]).as_subclass(StreamlessIndices)
    idx.record_stream(torch.get_device_module("cpu").current_stream())  # a no-op instead of an error
    out = torch.arange(10, 13)[idx]
    assert type(out) is torch.Tensor and out.tolist() == [12, 10]
    with pytest.raises(Exception):
        torch.tensor([1]).record_stream(torch.get_device_module("cpu").current_stream())  # why the stand-in exists


def test_unapplied_sampling_controls():
    pytest.importorskip("sglang")
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_dflash.serving.plugin import unapplied_sampling_controls

    assert unapplied_sampling_controls(SamplingParams()) == []
    assert unapplied_sampling_controls(SamplingParams(temperature=0, frequency_penalty=0.0, presence_penalty=0.0,
                                                      repetition_penalty=1.0, min_new_tokens=0, min_p=0.1)) == []
    bad = unapplied_sampling_controls(SamplingParams(frequency_penalty=0.5, presence_penalty=-0.2,
                                                     repetition_penalty=1.1, min_new_tokens=3, regex="a+"),
                                      custom_logit_processor="x")
    # penalties, min_new_tokens and grammars are applied per block row (controls.py); custom processors are not
    assert bad == ["custom_logit_processor"]


def test_draft_forward_declares_no_input_embeds():
    """SGLang 0.5.17's decode graph runner captures a DFLASH draft model whose forward declares `input_embeds` with a
    static embeds buffer, refilled at replay only when the batch carries embeds (ours never does). Such a graph
    drafts from stale embeddings: still lossless, but acceptance collapses on GPU, where CPU tests cannot see it.
    Our forward therefore embeds input_ids itself and must not declare the parameter."""
    import inspect

    pytest.importorskip("sglang")
    from sglang_dflash.serving.draft_model import DFlashDraftModel

    assert "input_embeds" not in inspect.signature(DFlashDraftModel.forward).parameters


def test_extend_positions_per_request():
    pytest.importorskip("sglang")
    from sglang_dflash.serving.worker import _extend_positions

    # three requests: a fresh prompt of 3, a radix hit of 5 extended by 2, a chunk continuing at 2 with 4 tokens
    assert _extend_positions([0, 5, 2], [3, 2, 4], "cpu").tolist() == [0, 1, 2, 5, 6, 2, 3, 4, 5]
    assert _extend_positions([7], [1], "cpu").tolist() == [7]
