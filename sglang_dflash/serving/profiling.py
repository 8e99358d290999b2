"""Named ranges in torch.profiler traces (SGLang's /start_profile), for the worker's phases."""

from __future__ import annotations

import contextlib

import torch


def phase(name: str):
    """A record_function range while a profiler runs, else nothing: a record_function is a dispatcher op call even
    with no profiler (~10 us per enter/exit pair; six per decode step on the host-bound path)."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()
