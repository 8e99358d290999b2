"""A CPU stand-in for "this code can be recorded into a CUDA graph": run it under a dispatch mode that records
every aten op and refuse the ones a capture cannot take. No GPU is needed, so the tree head's code (draft_tree,
serving/tree_graphs.py) is checked on every CPU run; the H100 run captures it for real.

Refused: host reads of device values (``.item()``, ``.tolist()``, a tensor used as a Python bool), data-dependent
shapes (nonzero, boolean-mask indexing, unique, repeat_interleave without output_size), and Python values turned
into tensors (``torch.tensor(x)``, a Python scalar in torch.where or in an indexed write): on CUDA those are a
0-dim CPU tensor that the op copies to the device, a pageable host copy that stream capture rejects."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_REFUSED = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2",
            "unique_consecutive", "unique_dim", "lift_fresh", "lift_fresh_copy", "scalar_tensor", "is_nonzero",
            "masked_scatter"}


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.refused: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _REFUSED:
            self.refused.append(str(func))
        if name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])):
            self.refused.append(f"{func} with a boolean mask (data-dependent shape)")
        if name == "repeat_interleave" and (kwargs or {}).get("output_size") is None:
            self.refused.append(f"{func} without output_size")
        return func(*args, **(kwargs or {}))


def assert_capturable(fn, *args, **kwargs):
    """Run ``fn`` once under the recorder; fail naming every refused op. Returns fn's result."""
    rec = _Recorder()
    with rec:
        out = fn(*args, **kwargs)
    assert not rec.refused, f"not CUDA-graph capturable: {rec.refused}"
    return out
