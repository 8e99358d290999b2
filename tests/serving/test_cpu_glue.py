"""Fast checks of the CPU stand-ins and the request guard (no server)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.serving.cpu_ops import StreamlessIndices, torch_native_verify_lengths


def _verify_batch(bs=2, block=16):
    return SimpleNamespace(batch_size=bs, positions=torch.arange(bs * block), seq_lens=torch.tensor([5, 9])[:bs],
                           extend_prefix_lens=None, extend_seq_lens=None,
                           spec_info=SimpleNamespace(draft_token_num=block))


def test_verify_lengths_come_from_the_batch_not_from_q():
    # Regression: B used to be q.shape[0] // bs, and Gemma-3 hands attention q as [1, N, heads, dim]: B was 0
    # (bs > 1) or 1 (bs = 1), so verify rows past the first were never computed.
    fb = _verify_batch()
    with torch_native_verify_lengths(fb):
        assert fb.extend_seq_lens.tolist() == [16, 16]
        assert fb.extend_prefix_lens.tolist() == [5, 9]
        assert fb.seq_lens.tolist() == [21, 25]
    assert fb.seq_lens.tolist() == [5, 9] and fb.extend_seq_lens is None  # restored
    fb.spec_info = None  # no spec_info: tokens / requests
    with torch_native_verify_lengths(fb):
        assert fb.extend_seq_lens.tolist() == [16, 16]
    fb.spec_info = SimpleNamespace(draft_token_num=8)
    with pytest.raises(RuntimeError, match="block 8"):
        with torch_native_verify_lengths(fb):
            pass


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
