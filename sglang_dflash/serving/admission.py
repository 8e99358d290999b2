"""Prefill admission: our DFLASH server admits new requests as plain decoding does.

SGLang gives every DFLASH-family server a ``MinFreeSlotsDelayer`` (``sglang/srt/managers/min_free_slots_delayer.py``):
while requests are running, new ones are admitted only once min(4, max(2, (max_running_requests + 5) // 6)) request
slots are free, "batching them into one admission instead of one at a time ... when each admission is expensive (e.g.
DFlash's draft prefill)". Our worker has no draft prefill: the drafter's context K/V is written inside the target's
own prefill forward (``worker._prefill``), so an admission costs what it costs plain decoding, and the delay only holds
requests back. On an H100 at concurrency 128 with ``--max-running-requests 128`` the scheduler admitted 127 of a
round's 128 requests; the last one then waited for the other 127 to finish (free slots 1 < 4) and decoded alone for
~1.8 s, which cost 22-25% of the round's throughput in two of three runs, and the builtin worker alike
(``benchmarks/results/ttft-floor4-qwen3-8b-h100``). So the scheduler of our worker keeps no such delayer, unless the
operator asked for one with ``--min-free-slots-delay``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sglang_dflash")


def admit_as_plain_decoding(scheduler) -> bool:
    """Drop the scheduler's DFLASH default admission delay (module doc); an explicit --min-free-slots-delay stays.
    Called right after ``Scheduler.init_model_worker``, where SGLang builds it. Returns whether it dropped one."""
    algorithm = getattr(scheduler, "spec_algorithm", None)
    if algorithm is None or not algorithm.is_dflash() or getattr(scheduler, "min_free_slots_delayer", None) is None:
        return False
    from sglang.srt.runtime_context import get_schedule

    if get_schedule().min_free_slots_delay is not None:  # the operator's own setting
        return False
    scheduler.min_free_slots_delayer = None
    logger.info("sglang-dflash: new requests are admitted as in plain decoding (no DFLASH min-free-slots prefill "
                "delay: our worker has no separate draft prefill; --min-free-slots-delay N sets one)")
    return True
