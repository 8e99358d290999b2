"""Benchmark suite: drive an SGLang server (native /generate API) over prompt sets and a concurrency sweep.

Modules: prompts (prompt sets -> JSONL), client (async closed-loop load), stats (percentiles, tau), bench (the
one command against a running server), driver (start/stop the three servers side by side), report (JSON,
markdown, PNG). See benchmarks/README.md.
"""
