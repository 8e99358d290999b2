"""Subprocess body of tests/test_recurrent_state.py's memory-plan tests: the Qwen3.5-35B-A3B shape through SGLang
0.5.17's own server-argument resolution and KV-cache configurator, on CPU, for plain decoding, DFLASH with the state
snapshots, and DFLASH with --enable-linear-replayssm-spec.

    python tests/replay_pool_probe.py OUT_DIR  ->  one JSON object on the last stdout line

- "plan/<mode>": the exact shape (not shrunk): the recurrent-state budget SGLang's configurator solves
  (`_handle_max_mamba_cache` on a fixed budget: the memory is not allocated) and the running requests it then
  allows (`resolve_max_num_reqs`, --max-running-requests set high so that only the state cache caps it).
- "pools/<mode>": the shape shrunk (tests/shape_startup_probe.py), pools built as a server start builds them, with the
  hook our worker installs (recurrent_state.install_replay_pool_hook): SGLang refuses the replay pool for DFLASH on a
  non-KDA target unless it is lifted ("pools/dflash-replay-without-hook": SGLang's refusal, run first, before the hook
  is installed in this process). What the pool holds: snapshots per draft position, or the replay window.

Own process: SGLang's published config and our hooks must not leak into the pytest process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the worktree's package
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPE = "qwen3.5-35b-a3b"
PLAN_BUDGET_GB = 20.0  # what the configurator may spend on recurrent state + KV (the plan is solved, not allocated)
EXTRA_BUFFER = ["--mamba-radix-cache-strategy", "extra_buffer"]  # as launch/qwen3.5-35b-a3b.sh
MODES = {"plain": (False, EXTRA_BUFFER), "dflash": (True, EXTRA_BUFFER),
         "dflash-replay": (True, EXTRA_BUFFER + ["--enable-linear-replayssm-spec"])}


def _server_args(shape_dir: Path, spec: bool, extra: list[str], hook: bool = True):
    import shape_startup_probe as probe
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    from sglang_dflash.serving.recurrent_state import install_replay_pool_hook

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = probe._args(shape_dir, spec, "torch_native") + ["--max-running-requests", "512"] + extra
    server_args = ServerArgs.from_cli_args(parser.parse_args(argv))
    publish(server_args, role="scheduler")
    if spec and hook:
        install_replay_pool_hook(server_args)  # as DFlashWorker.__init__, before SGLang builds the target's pools
    return server_args


def _target_configurator(server_args):
    import shape_startup_probe as probe
    from sglang.srt.configs.model_config import ModelConfig

    mc = ModelConfig.from_server_args(server_args)
    return probe._configurator(mc, server_args, draft=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                               memory_pool_config=None)


def _single_rank():
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().override(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, pp_size=1, pp_rank=0,
                                   attn_cp_size=1, attn_dp_size=1, dcp_size=1, attn_dcp_size=1, moe_ep_size=1)


def plan(shape_dir: Path, spec: bool, extra: list[str]) -> dict:
    from sglang.srt.runtime_context import get_schedule

    server_args = _server_args(shape_dir, spec, extra)
    with _single_rank():
        kvc = _target_configurator(server_args)
        kvc._handle_max_mamba_cache(PLAN_BUDGET_GB)
        return {"flag": bool(server_args.enable_linear_replayssm_spec),
                "state_slots": int(get_schedule().max_mamba_cache_size),
                "running": int(kvc.resolve_max_num_reqs(10 ** 7))}


def pools(shape_dir: Path, spec: bool, extra: list[str], hook: bool = True) -> dict:
    import shape_startup_probe as probe

    server_args = _server_args(shape_dir, spec, extra, hook)
    with _single_rank():
        kvc = _target_configurator(server_args)
        budget_gb = kvc._handle_max_mamba_cache(probe.BUDGET_GB)
        cfg = kvc.config_from_budget(int(budget_gb * (1 << 30)))
        cfg.max_running_requests = kvc.resolve_max_num_reqs(cfg.max_total_num_tokens)
        built = kvc._init_pools(sizes=kvc._derive_pool_sizes(config=cfg), req_to_token_pool=None,
                                token_to_kv_pool_allocator=None)
        req_pool = built.req_to_token_pool
        out = {"flag": bool(server_args.enable_linear_replayssm_spec), "running": int(cfg.max_running_requests)}
        if spec:
            from sglang_dflash.serving.recurrent_state import replay_pool

            state = req_pool.get_speculative_mamba2_params_all_layers()
            out.update(replay_pool=replay_pool(req_pool), snapshots=state.intermediate_ssm is not None,
                       window=None if state.replayssm_rawv is None else list(state.replayssm_rawv.shape),
                       draft_tokens=int(server_args.speculative_num_draft_tokens))
        return out


def _attempt(fn, *args) -> dict:
    try:
        return {"ok": True, **fn(*args)}
    except BaseException as e:  # noqa: BLE001 - a failure is a result the test reports with its traceback
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


def main(argv: list[str]) -> int:
    import torch
    import shape_startup_probe as probe
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.plugins import load_plugins

    from sglang_dflash.targets import shapes

    load_plugins()  # as every SGLang process does: our DFLASH start-up steps are hooks
    memory_pool.torch = probe._CudaLiteralToCpu(torch)
    out = Path(argv[0])
    exact, shrunk = out / "exact", out / "shrunk"
    shapes.write(SHAPE, exact)
    target, drafter = shapes.shrink_pair(SHAPE)
    shapes.write(dataclasses.replace(shapes.SHAPES[SHAPE], target=target, drafter=drafter), shrunk)
    results = {}
    # SGLang's own refusal, first (before our hook is installed in this process): the evidence that the hook is needed
    results["pools/dflash-replay-without-hook"] = _attempt(pools, shrunk, *MODES["dflash-replay"], False)
    for mode, (spec, extra) in MODES.items():
        results[f"plan/{mode}"] = _attempt(plan, exact, spec, extra)
        results[f"pools/{mode}"] = _attempt(pools, shrunk, spec, extra)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
