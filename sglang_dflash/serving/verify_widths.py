"""The target's verify forward at several widths W = k + 1 (k drafts after the bonus), for adaptive speculation;
with SGLANG_DFLASH_SHORT_DRAFT, the drafter's pass too (role "draft": [bonus, MASK x k] at width k + 1).

SGLang captures the target's TARGET_VERIFY CUDA graphs at one width, ``--speculative-num-draft-tokens`` (= the
drafter's block size B). A step that verifies k < B - 1 drafts needs graphs of width k + 1: each extra width gets
its own ``DecodeCudaGraphRunner`` with its OWN attention backend instance, captured once at startup (a backend's
graph-metadata buffers are allocated and bound into the graphs at capture, so two runners cannot share one).

At run time :meth:`VerifyWidths.target_at` points the target's model runner at the width's graph runner and
backend for the duration of one verify, so the verify goes through SGLang's ordinary path (``prepare_for_verify``,
``forward_batch_generation``) unchanged; the triton / torch_native backends read the width from
``spec_info.draft_token_num``. Without graphs (CPU, ``--disable-cuda-graph``) every width simply runs eagerly on
the target's own backend, and a batch larger than the captured sizes does the same, as it does at width B.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from .errors import DFlashStartupError

logger = logging.getLogger("sglang_dflash")


class VerifyWidths:
    def __init__(self, model_runner, block: int, ks: list[int], role: str = "target verify"):
        self.model_runner, self.block, self.role = model_runner, block, role
        self.widths = sorted({k + 1 for k in ks})
        self._extra: dict[int, tuple[object, object]] = {}  # width -> (graph runner, attention backend), W != B
        self.graph_memory_gb = 0.0

    def capture(self) -> None:
        """Capture TARGET_VERIFY graphs for every width other than B (SGLang captured B already)."""
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
        from sglang.srt.utils import get_available_gpu_memory

        mr = self.model_runner
        if mr.decode_cuda_graph_runner is None:
            logger.info("sglang-dflash: no %s CUDA graphs, so widths %s run eagerly", self.role, self.widths)
            return
        for width in self.widths:
            if width == self.block:
                continue
            t0, before = time.perf_counter(), get_available_gpu_memory(mr.device, mr.gpu_id)
            backend = mr._get_attention_backend()
            try:
                runner = DecodeCudaGraphRunner(mr, attn_backend=backend, speculative_num_draft_tokens=width)
            except Exception as e:  # SGLang wraps a capture's OutOfMemoryError into a plain Exception
                if not _out_of_memory(e):
                    raise
                raise out_of_memory(width, self.widths, self.block, before, self.graph_memory_gb,
                                    getattr(mr.server_args, "mem_fraction_static", None), self.role) from e
            used = before - get_available_gpu_memory(mr.device, mr.gpu_id)
            self.graph_memory_gb += used
            self._extra[width] = (runner, backend)
            logger.info("sglang-dflash: captured %s graphs at width %d (bs %s) in %.1f s, %.2f GB",
                        self.role, width, list(runner.capture_bs), time.perf_counter() - t0, used)

    @contextlib.contextmanager
    def target_at(self, width: int):
        """Within this block the model runner (the target's; the drafter's for role "draft") runs at ``width`` (its
        graphs and attention backend)."""
        extra = self._extra.get(width)
        if extra is None:  # width B, or no graphs: SGLang's own runner / eager forward handle it
            yield
            return
        mr = self.model_runner
        saved = mr.decode_cuda_graph_runner, mr.attn_backend
        mr.decode_cuda_graph_runner, mr.attn_backend = extra
        try:
            yield
        finally:
            mr.decode_cuda_graph_runner, mr.attn_backend = saved


def _out_of_memory(e: BaseException) -> bool:
    return any(isinstance(x, torch.OutOfMemoryError) or "out of memory" in str(x).lower()
               for x in (e, e.__cause__, e.__context__) if x is not None)


def out_of_memory(width: int, widths: list[int], block: int, free_gb: float, captured_gb: float,
                  mem_fraction_static: float | None, role: str = "target verify") -> DFlashStartupError:
    """The start-up error for a GPU that has no room for the graphs of an extra verify width (SGLang plans its own
    graphs' memory, not these): what ran out, and the ways out."""
    lower = (f"--mem-fraction-static {max(mem_fraction_static - 0.05, 0.05):.2f} (now {mem_fraction_static:.2f}), "
             if mem_fraction_static else "a lower --mem-fraction-static, ")
    ks = ",".join(str(w - 1) for w in widths if w < width or w == block)  # the widths already captured
    return DFlashStartupError(
        f"out of GPU memory capturing the {role} CUDA graphs at width {width} ({free_gb:.2f} GB were free "
        f"after {captured_gb:.2f} GB of the other extra widths; widths {widths} = k + 1 for the adaptive worker's k "
        f"values). The KV cache takes what --mem-fraction-static gives it, and these graphs come out of the rest. "
        f"Fix: {lower}or a lower --cuda-graph-max-bs-decode, or fewer widths (SGLANG_DFLASH_WIDTHS={ks}, or "
        "SGLANG_DFLASH_ADAPTIVE=0 for the full block alone)"
        + (", or SGLANG_DFLASH_SHORT_DRAFT=0 (the drafter's pass at the full block only)" if role == "draft" else ""))

