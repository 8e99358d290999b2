"""benchmarks.server_metrics: a level's mean TTFT stages from two /metrics scrapes (issue #34 item 1)."""

from __future__ import annotations

import pytest

from benchmarks import server_metrics

pytest.importorskip("prometheus_client")


def _text(ttft_sum, ttft_n, queue_sum, queue_n, fwd_sum, fwd_n):
    return f"""# HELP sglang:time_to_first_token_seconds ttft
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{{model_name="m",le="+Inf"}} {ttft_n}
sglang:time_to_first_token_seconds_sum{{model_name="m"}} {ttft_sum}
sglang:time_to_first_token_seconds_count{{model_name="m"}} {ttft_n}
# HELP sglang:queue_time_seconds queue
# TYPE sglang:queue_time_seconds histogram
sglang:queue_time_seconds_sum{{model_name="m",engine_type="unified"}} {queue_sum}
sglang:queue_time_seconds_count{{model_name="m",engine_type="unified"}} {queue_n}
# HELP sglang:per_stage_req_latency_seconds stages
# TYPE sglang:per_stage_req_latency_seconds histogram
sglang:per_stage_req_latency_seconds_sum{{model_name="m",stage="prefill_forward"}} {fwd_sum}
sglang:per_stage_req_latency_seconds_count{{model_name="m",stage="prefill_forward"}} {fwd_n}
sglang:per_stage_req_latency_seconds_sum{{model_name="m",stage="decode_loop"}} 99.0
sglang:per_stage_req_latency_seconds_count{{model_name="m",stage="decode_loop"}} 3
"""


def test_level_means_from_two_scrapes():
    before = server_metrics.parse(_text(1.0, 10, 0.5, 10, 0.2, 10))
    after = server_metrics.parse(_text(1.8, 14, 0.9, 14, 0.28, 14))
    assert set(before) == {"ttft", "queue", "prefill_forward"}  # stages not asked for are left out
    means = server_metrics.level_means_ms(before, after)
    assert means == {"ttft": 200.0, "queue": 100.0, "prefill_forward": 20.0}
    assert server_metrics.level_means_ms(None, after) is None


def test_scrape_without_metrics_endpoint_is_none():
    assert server_metrics.scrape("http://127.0.0.1:9", timeout=1) is None
