"""The extra verify widths' CUDA graphs (serving/verify_widths.py): a GPU without room for them stops the start-up
with what ran out and the ways out, instead of SGLang's generic capture failure; other capture errors pass through.
SGLang's graph runner is replaced by stand-ins: no GPU here."""

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from sglang_dflash.serving import verify_widths  # noqa: E402
from sglang_dflash.serving.errors import DFlashStartupError  # noqa: E402


def _widths(monkeypatch, fail_at: int, error: BaseException):
    import sglang.srt.model_executor.runner.decode_cuda_graph_runner as runner_module
    import sglang.srt.utils as sglang_utils

    captured = []

    class Runner:  # SGLang's capture: its OutOfMemoryError (a RuntimeError) comes back wrapped in a plain Exception
        def __init__(self, mr, attn_backend, speculative_num_draft_tokens):
            if speculative_num_draft_tokens == fail_at:
                try:
                    raise error
                except RuntimeError as e:
                    raise Exception(f"Capture cuda graph failed: {e}\nPossible solutions: ...")
            captured.append(speculative_num_draft_tokens)
            self.capture_bs = [1, 2, 4]

    monkeypatch.setattr(runner_module, "DecodeCudaGraphRunner", Runner)
    monkeypatch.setattr(sglang_utils, "get_available_gpu_memory", lambda device, gpu_id: 3.5)
    mr = SimpleNamespace(decode_cuda_graph_runner=object(), device="cuda", gpu_id=0, _get_attention_backend=object,
                         server_args=SimpleNamespace(mem_fraction_static=0.8))
    return verify_widths.VerifyWidths(mr, 16, [0, 3, 7, 15]), captured


def test_out_of_memory_names_the_width_and_the_fixes(monkeypatch):
    widths, captured = _widths(monkeypatch, fail_at=8, error=torch.OutOfMemoryError("CUDA out of memory. Tried to "
                                                                                    "allocate 32.00 MiB"))
    with pytest.raises(DFlashStartupError) as e:
        widths.capture()
    msg = str(e.value)
    assert captured == [1, 4]
    assert "width 8" in msg and "--mem-fraction-static 0.75 (now 0.80)" in msg
    assert "SGLANG_DFLASH_WIDTHS=0,3,15" in msg and "SGLANG_DFLASH_ADAPTIVE=0" in msg


def test_other_capture_errors_pass_through(monkeypatch):
    widths, _ = _widths(monkeypatch, fail_at=4, error=RuntimeError("an illegal memory access was encountered"))
    with pytest.raises(Exception, match="illegal memory access") as e:
        widths.capture()
    assert not isinstance(e.value, DFlashStartupError)


def test_every_extra_width_captured(monkeypatch):
    widths, captured = _widths(monkeypatch, fail_at=-1, error=RuntimeError())
    widths.capture()
    assert captured == [1, 4, 8] and sorted(widths._extra) == [1, 4, 8]
