"""Where a request's time to first token goes, from the server's own Prometheus histograms (issue #34 item 1).

A server started with ``--enable-metrics`` serves ``/metrics``. ``bench --server-metrics`` reads it before and after
each level, and the difference of a histogram's ``_sum`` and ``_count`` is that level's mean. The stages, as
SGLang 0.5.17 times them (``srt/observability/req_time_stats.py``):

- ``request_process``: the scheduler received the request -> it entered the waiting queue;
- ``queue``: waiting queue -> its prefill batch was launched (``sglang:queue_time_seconds``): time spent behind
  the running batch's steps and behind other prefills;
- ``prefill_forward``: prefill launched -> its result processed, which under overlap scheduling comes after the
  next batch has been launched;
- ``ttft``: the client-facing time to first token, as the tokenizer manager times it.

With ttft above queue + prefill_forward, the difference lies in tokenization, detokenization or the stream.
"""

from __future__ import annotations

import urllib.request

# (metric family, stage label or None) -> the name this module reports it under
HISTOGRAMS = {
    ("sglang:time_to_first_token_seconds", None): "ttft",
    ("sglang:queue_time_seconds", None): "queue",
    ("sglang:per_stage_req_latency_seconds", "request_process"): "request_process",
    ("sglang:per_stage_req_latency_seconds", "prefill_forward"): "prefill_forward",
}


def parse(text: str) -> dict[str, tuple[float, float]]:
    """{name: (sum of seconds, count)} of the histograms above, summed over their other labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            suffix = "_sum" if sample.name.endswith("_sum") else "_count" if sample.name.endswith("_count") else None
            if suffix is None:
                continue
            base = sample.name[: -len(suffix)]
            name = HISTOGRAMS.get((base, sample.labels.get("stage")))
            if name is None:
                continue
            acc = out.setdefault(name, [0.0, 0.0])
            acc[0 if suffix == "_sum" else 1] += float(sample.value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def scrape(url: str, timeout: float = 10.0) -> dict[str, tuple[float, float]] | None:
    """The histograms of a running server, or None when it serves no /metrics (started without --enable-metrics)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
            return parse(r.read().decode())
    except OSError:
        return None


def level_means_ms(before: dict | None, after: dict | None) -> dict[str, float] | None:
    """Mean milliseconds per request of each stage between two scrapes (None if either is missing)."""
    if before is None or after is None:
        return None
    means = {}
    for name, (total, count) in after.items():
        t0, c0 = before.get(name, (0.0, 0.0))
        if count > c0:
            means[name] = round(1000.0 * (total - t0) / (count - c0), 2)
    return means
