"""The start-up refusal of attention backends this GPU cannot run (serving/startup.py ARCH_NEEDS), on CPU: the GPU's
compute capability is faked, the server arguments are a namespace, nothing loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_dflash.serving import compat, startup
from sglang_dflash.serving.startup import DFlashStartupError, check_architecture_first, check_attention_architecture

H100, B200, A100 = (9, 0), (10, 0), (8, 0)


def args(**flags):
    base = dict(device="cuda", attention_backend=None, prefill_attention_backend=None, decode_attention_backend=None,
                speculative_draft_attention_backend=None, speculative_algorithm="DFLASH")
    return SimpleNamespace(**(base | flags))


@pytest.fixture
def gpu(monkeypatch):
    def on(capability):
        monkeypatch.setattr(startup, "gpu_capability", lambda server_args: capability)
    return on


def refusal(**flags) -> str:
    with pytest.raises(DFlashStartupError) as e:
        check_attention_architecture(args(**flags))
    return str(e.value)


def test_the_seeds_trtllm_mha_on_hopper_names_flag_backend_capability_and_fix(gpu):
    gpu(H100)
    msg = refusal(attention_backend="trtllm_mha", speculative_draft_attention_backend="fa4")
    assert msg.startswith("--attention-backend trtllm_mha:") and "this GPU is 9.0" in msg
    assert msg.endswith("Fix: --attention-backend triton")
    if compat.TRTLLM_MHA_PREFILL_MAJORS == (10,):  # SGLang 0.5.17
        assert "for prefill on compute capability 10.x only" in msg
    check_attention_architecture(args(attention_backend="triton", speculative_draft_attention_backend="fa4"))


def test_split_flags_are_checked_by_their_own_name(gpu):
    gpu(A100)  # trtllm_mha decode runs on 9.x / 10.x / 12.x only
    msg = refusal(attention_backend="triton", decode_attention_backend="trtllm_mha")
    assert msg.startswith("--decode-attention-backend trtllm_mha:") and "this GPU is 8.0" in msg
    gpu(H100)
    check_attention_architecture(args(attention_backend="triton", decode_attention_backend="trtllm_mha"))
    assert refusal(prefill_attention_backend="trtllm_mla").startswith("--prefill-attention-backend trtllm_mla:")


def test_draft_fa3_on_blackwell_offers_triton_and_on_hopper_is_fine(gpu):
    gpu(B200)
    msg = refusal(speculative_draft_attention_backend="fa3")
    assert "for the draft on compute capability 8.x / 9.x only" in msg and "this GPU is 10.0" in msg
    assert msg.endswith("Fix: --speculative-draft-attention-backend triton")
    assert refusal(attention_backend="fa3").endswith("Fix: --attention-backend triton")
    gpu(H100)
    check_attention_architecture(args(attention_backend="fa3", speculative_draft_attention_backend="fa3"))


def test_draft_choices_follow_the_gpu(gpu):
    gpu(B200)
    assert "fa3" not in startup.supported_draft_backends(args())
    gpu(H100)
    assert {"triton", "fa3", "fa4"} <= set(startup.supported_draft_backends(args()))


def test_off_cuda_nothing_is_checked():
    check_attention_architecture(args(device="cpu", attention_backend="trtllm_mha"))


def test_the_hook_checks_dflash_servers_only_and_then_runs_sglangs_step(gpu):
    gpu(H100)
    ran = []
    step = lambda server_args: ran.append(server_args) or "sglang"  # noqa: E731
    plain = args(attention_backend="trtllm_mha", speculative_algorithm=None)
    assert check_architecture_first(step, plain) == "sglang" and ran == [plain]
    with pytest.raises(DFlashStartupError, match="trtllm_mha"):
        check_architecture_first(step, args(attention_backend="trtllm_mha", speculative_algorithm="dflash"))
    assert len(ran) == 1  # refused before SGLang's own step
