"""The decode step's commit, folded into the target's verify forward (and so into its CUDA graphs).

Commit = write the drafter's context K/V of every verified row (``DFlashDraftModel.write_context_kv``) at the rows'
KV slots. It needs only what the verify forward itself has: the captured target hidden states, the positions and
the slots (``out_cache_loc``). Run eagerly after the verify, it was ~20 small kernels per step (fc, norms, the K/V
projection, rope, one KV write per draft layer) whose launches are host time on the critical path: at c = 1 on an
8B-shaped pair the k = 0 step left the GPU idle ~1 ms per step (benchmarks/results/profile-*). Wrapping the target
model's ``forward`` puts them inside the forward, so SGLang's verify CUDA graphs (and ours at every width,
``verify_widths.py``) capture them, and a graphed step launches none of them.

Why this is exact: the write is the same function on the same tensors, in the same order relative to the step
(after the draft pass has used the block's K/V, before anything reads the draft cache again). In a graph, padded
rows carry ``out_cache_loc`` 0 and position 0 (SGLang's ZERO padding policy for graph inputs); slot 0 is the KV
pool's dummy slot, where the target's own padded K/V writes land as well.

Only ``TARGET_VERIFY`` forwards write (only our worker issues them); prefill keeps its explicit write in the worker,
because prefill graphs may call an inner module instead of the top-level forward.
"""

from __future__ import annotations

import functools

from .profiling import phase as _phase


class ContextCommitInVerify:
    """Wraps ``target_model.forward``; counts the writes it made (a graph replay makes them without Python, so the
    count grows only in eager forwards and at graph capture)."""

    def __init__(self, target_model, draft_model, draft_kv_pool):
        self.calls = 0
        inner = target_model.forward

        @functools.wraps(inner)  # keeps inspect.signature(model.forward), which SGLang's graph runner reads
        def forward(input_ids, positions, forward_batch, *args, **kwargs):
            out = inner(input_ids, positions, forward_batch, *args, **kwargs)
            if forward_batch.forward_mode.is_target_verify():
                hidden = getattr(out, "hidden_states", None)
                if hidden is None:
                    raise RuntimeError("DFLASH verify forward returned no captured hidden states, so the drafter's "
                                       "context K/V cannot be committed. Fix: the target's hidden capture must be on "
                                       "(set_dflash_layers_to_capture, serving/capture.py)")
                with _phase("dflash.commit"):
                    draft_model.write_context_kv(hidden, positions, forward_batch.out_cache_loc, draft_kv_pool())
                self.calls += 1
            return out

        target_model.forward = forward
