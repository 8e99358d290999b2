"""The target's verify forward at several widths W = k + 1 (k drafts after the bonus), for adaptive speculation.

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

logger = logging.getLogger("sglang_dflash")


class VerifyWidths:
    def __init__(self, model_runner, block: int, ks: list[int]):
        self.model_runner, self.block = model_runner, block
        self.widths = sorted({k + 1 for k in ks})
        self._extra: dict[int, tuple[object, object]] = {}  # width -> (graph runner, attention backend), W != B
        self.graph_memory_gb = 0.0

    def capture(self) -> None:
        """Capture TARGET_VERIFY graphs for every width other than B (SGLang captured B already)."""
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
        from sglang.srt.utils import get_available_gpu_memory

        mr = self.model_runner
        if mr.decode_cuda_graph_runner is None:
            logger.info("sglang-dflash: the target has no verify CUDA graphs, so widths %s run eagerly",
                        self.widths)
            return
        for width in self.widths:
            if width == self.block:
                continue
            t0, before = time.perf_counter(), get_available_gpu_memory(mr.device, mr.gpu_id)
            backend = mr._get_attention_backend()
            runner = DecodeCudaGraphRunner(mr, attn_backend=backend, speculative_num_draft_tokens=width)
            used = before - get_available_gpu_memory(mr.device, mr.gpu_id)
            self.graph_memory_gb += used
            self._extra[width] = (runner, backend)
            logger.info("sglang-dflash: captured target verify graphs at width %d (bs %s) in %.1f s, %.2f GB",
                        width, list(runner.capture_bs), time.perf_counter() - t0, used)

    @contextlib.contextmanager
    def target_at(self, width: int):
        """Within this block the target's model runner verifies at ``width`` (its graphs and attention backend)."""
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
