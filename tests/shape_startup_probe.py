"""Subprocess body of tests/test_shape_startup.py: every shape through SGLang 0.5.17's own start-up code, on CPU.

    python tests/shape_startup_probe.py OUT_DIR  ->  one JSON object on the last stdout line

For each shape of `sglang_dflash.targets.shapes` (shrunk: few layers, small widths, every layer kind kept), with and without
DFLASH, it runs what a server start runs before the first forward, in the same order and with the same functions:
SGLang's CLI parser and `ServerArgs` post-init (with our plugin loaded, so our DFLASH start-up checks run), the
target's `ModelConfig`, then SGLang's `KVCacheConfigurator`: the pool sizing (`config_from_budget`, which picks the
hybrid-SWA / hybrid-linear / default pool configurator) and the pools themselves (`_init_pools`, e.g.
`_build_hybrid_swa_kv_pool`, where the Gemma-4 shape failed on an H100). With DFLASH, the draft's server-args copy
and `ModelConfig` as SGLang's draft worker derives them, and the draft's pools sharing the target's request table
and allocator. It records the K/V buffer shape of every layer, so the test can compare them with the shape. Under
SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1 + stub libcuda, as the test sets up) it also builds the target and draft
models with SGLang's loader (--load-format dummy) and records each attention layer's K/V heads and dims.

Then every launch/ preset's command (--method none and ours, with --dummy) through SGLang's ServerArgs post-init.

Own process: SGLang's process-wide config (`publish`) and plugin hooks must not leak into the pytest process.
Nothing here runs a model forward or reads weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path

# memory handed to the pool sizing (GB, as SGLang counts it); --max-total-tokens caps the KV pools at 256 tokens,
# the rest holds the Qwen3.5 shape's linear-attention state (per request, and per draft token with DFLASH)
BUDGET_GB = 64 / 1024


def _args(shape_dir: Path, spec: bool, attention_backend: str) -> list[str]:
    argv = ["--model-path", str(shape_dir / "target"), "--device", "cpu", "--load-format", "dummy",
            "--skip-tokenizer-init", "--dtype", "float32", "--attention-backend", attention_backend,
            "--max-total-tokens", "256", "--max-running-requests", "8"]
    if spec:
        argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(shape_dir / "draft"),
                 "--speculative-draft-load-format", "dummy", "--speculative-num-draft-tokens", "16",
                 "--speculative-draft-attention-backend", "torch_native"]
    return argv


def _layer_shapes(pool, n_layers: int) -> list:
    """[[k_heads, k_dim, v_heads, v_dim] or None (no KV in that layer: linear attention)] per layer."""
    out = []
    for i in range(n_layers):
        try:
            k, v = pool.get_key_buffer(i), pool.get_value_buffer(i)
        except Exception:  # noqa: BLE001 - layers without a KV buffer (linear attention) raise here
            out.append(None)
            continue
        out.append([k.shape[-2], k.shape[-1], v.shape[-2], v.shape[-1]])
    return out


def _configurator(model_config, server_args, *, draft: bool, **shared):
    import torch
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.model_executor.model_runner_components.load_model_utils import resolve_sliding_window_size
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algo = SpeculativeAlgorithm.from_string(server_args.speculative_algorithm)
    n = model_config.num_hidden_layers
    return KVCacheConfigurator(
        device="cpu", gpu_id=0, ps=ParallelState.trivial(), pp_group=None, model=None, model_config=model_config,
        server_args=server_args, kv_cache_dtype=torch.float32, model_dtype=torch.float32, page_size=1,
        sliding_window_size=resolve_sliding_window_size(None, model_config),
        spec_algorithm=algo, is_draft_worker=draft, post_capture_kv_active=False,
        spec_aux_config=resolve_spec_aux_hidden_state_config(server_args=server_args, model_config=model_config,
                                                             spec_algorithm=algo, is_draft_worker=draft),
        is_hybrid_swa=model_config.is_hybrid_swa, is_hybrid_swa_compress=model_config.is_hybrid_swa_compress,
        use_mla_backend=False, layer_info=ModelLayerInfo(start_layer=0, end_layer=n, num_effective_layers=n),
        forward_stream=None, **shared)


_DIST = {}  # torch.distributed is initialised once per process (tp = pp = 1 for every shape)


def _build_model(model_config, server_args) -> list:
    """The model as SGLang's loader builds it (--load-format dummy: random weights, no files) and, per layer id, what
    its attention layers (RadixAttention: the modules that write the KV pool) hold: [k_heads, qk_dim, v_heads,
    v_dim]. Needs SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1), else its layers reach for CUDA-only kernels."""
    import socket

    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.distributed.bootstrap import init_torch_distributed
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_loader import get_model

    if not _DIST:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            free_port = sock.getsockname()[1]
        init_torch_distributed(server_args=server_args, model_config=model_config, device="cpu",
                               ps=ParallelState.trivial(), dist_port=free_port, is_draft_worker=False,
                               local_omp_cpuid=None)
        _DIST["done"] = True
    model = get_model(model_config=model_config, load_config=LoadConfig(load_format="dummy"),
                      device_config=DeviceConfig("cpu"))
    _WEIGHTS[model_config.hf_config.architectures[0]] = _weight_facts(model)
    per_layer: dict[int, list] = {}
    for m in model.modules():
        if isinstance(m, RadixAttention):
            per_layer[m.layer_id] = [m.tp_k_head_num, m.qk_head_dim, m.tp_v_head_num, m.v_head_dim]
    return [per_layer.get(i) for i in range(model_config.num_hidden_layers)]


_WEIGHTS: dict[str, dict] = {}  # per model class, what the dummy load left in its weights (_weight_facts)


def _weight_facts(model) -> dict:
    """Whether the dummy weights were re-drawn like a model's (SGLANG_DFLASH_DUMMY_WEIGHTS=chain, which the test
    sets): every 1-D norm weight one constant far from SGLang's +-1e-3 (1, or a Gemma branch post-norm's
    1 / sqrt(2 L)), and two layers' first matrices not equal (SGLang's dummy draw repeats them); and whether the
    model's logits processor carries the chain head (targets only)."""
    import torch

    from sglang_dflash.targets.chain_head import ChainHead
    from sglang_dflash.targets.random_weights import norm_offset

    sd = model.state_dict()
    offsets = {f"{m}.weight": norm_offset(mod) for m, mod in model.named_modules()}
    # a (1 + weight) norm's unit weight is 0: compare what the norm scales by
    norms = [t + offsets.get(n, 0.0) for n, t in sd.items() if t.dim() == 1 and "norm" in n and t.is_floating_point()]
    layer0 = [n for n in sd if ".layers.0." in n and sd[n].dim() >= 2 and sd[n].is_floating_point()]
    twin = layer0[0].replace(".layers.0.", ".layers.1.") if layer0 else None
    hooks = getattr(getattr(model, "logits_processor", None), "_forward_hooks", {}) or {}
    return {"norms": len(norms), "norms_set": sum(bool(torch.all(t == t[0]) and t[0] > 0.05) for t in norms),
            "layers_differ": bool(twin in sd and not torch.equal(sd[layer0[0]], sd[twin])) if twin else None,
            "chain_head": any(isinstance(h, ChainHead) for h in hooks.values())}


def _model_facts(mc) -> dict:
    return {"arch": mc.hf_config.architectures[0], "layers": mc.num_hidden_layers,
            "hybrid_swa": bool(mc.is_hybrid_swa), "head_dim": mc.head_dim, "kv_heads": mc.get_num_kv_heads(1),
            "swa_head_dim": mc.swa_head_dim, "swa_kv_heads": mc.get_swa_num_kv_heads(1),
            "swa_layers": list(getattr(mc, "swa_attention_layer_ids", None) or []),
            "full_layers": list(getattr(mc, "full_attention_layer_ids", None) or [])}


class _CudaLiteralToCpu:
    """Stands in for `torch` inside sglang.srt.mem_cache.memory_pool: SGLang 0.5.17 allocates the speculative
    linear-attention (mamba) verify state with a literal device="cuda" (MambaPool.__init__), which a CPU machine
    cannot do; on a GPU that tensor lands on the GPU like the rest. Only that literal is redirected."""

    def __init__(self, torch_module):
        self._torch = torch_module

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def zeros(self, *args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return self._torch.zeros(*args, **kwargs)


def start(shape_dir: Path, spec: bool, attention_backend: str, build_models: bool = False) -> dict:
    """Server args, ModelConfig and KV pools of the target (and the DFLASH draft), as a server start builds them."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_context, get_parallel, publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.draft_worker_common import draft_server_args_copy, draft_server_args_overrides

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    server_args = ServerArgs.from_cli_args(parser.parse_args(_args(shape_dir, spec, attention_backend)))
    publish(server_args, role="scheduler")
    result = {"speculative_algorithm": server_args.speculative_algorithm}
    # tp = pp = dp = 1 without initialising torch.distributed (the pool code asks the parallel context for sizes)
    with get_parallel().override(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, pp_size=1, pp_rank=0,
                                 attn_cp_size=1, attn_dp_size=1, dcp_size=1, attn_dcp_size=1, moe_ep_size=1):
        target_mc = ModelConfig.from_server_args(server_args)
        result["target"] = _model_facts(target_mc)
        kvc = _configurator(target_mc, server_args, draft=False, req_to_token_pool=None,
                            token_to_kv_pool_allocator=None, memory_pool_config=None)
        budget_gb = BUDGET_GB
        if kvc.mambaish_config is not None:  # as _profile_available_bytes: the mamba state is reserved first
            budget_gb = kvc._handle_max_mamba_cache(budget_gb)
        pool_cfg = kvc.config_from_budget(int(budget_gb * (1 << 30)))
        pool_cfg.max_running_requests = kvc.resolve_max_num_reqs(pool_cfg.max_total_num_tokens)
        pools = kvc._init_pools(sizes=kvc._derive_pool_sizes(config=pool_cfg), req_to_token_pool=None,
                                token_to_kv_pool_allocator=None)
        result["target"].update(pool=type(pools.token_to_kv_pool).__name__,
                                max_total_num_tokens=pool_cfg.max_total_num_tokens,
                                kv=_layer_shapes(pools.token_to_kv_pool, target_mc.num_hidden_layers))
        if build_models:
            result["target"]["attn"] = _attempt_value(_build_model, target_mc, server_args)
            result["target"]["weights"] = _WEIGHTS.get(target_mc.hf_config.architectures[0])
        if spec:
            # as Scheduler.maybe_init_draft_worker + build_draft_tp_worker + TpModelWorker(is_draft_worker=True)
            draft_args = draft_server_args_copy(server_args, target_mc)
            draft_args.override("draft_worker.build", **draft_server_args_overrides(
                target_mc, server_args.speculative_draft_attention_backend))
            with get_context().preserve_config():
                get_context().set_server_args(draft_args)
                draft_mc = ModelConfig.from_server_args(draft_args, model_path=str(shape_dir / "draft"),
                                                        is_draft_model=True, context_length=target_mc.context_len)
                result["draft"] = _model_facts(draft_mc)
                dkvc = _configurator(draft_mc, draft_args, draft=True, req_to_token_pool=pools.req_to_token_pool,
                                     token_to_kv_pool_allocator=pools.token_to_kv_pool_allocator,
                                     memory_pool_config=pool_cfg)
                dpools = dkvc._init_pools(sizes=dkvc._derive_pool_sizes(config=pool_cfg),
                                          req_to_token_pool=pools.req_to_token_pool,
                                          token_to_kv_pool_allocator=pools.token_to_kv_pool_allocator)
                result["draft"].update(pool=type(dpools.token_to_kv_pool).__name__,
                                       kv=_layer_shapes(dpools.token_to_kv_pool, draft_mc.num_hidden_layers))
                if build_models:
                    from sglang_dflash.serving.worker import register_draft_model

                    register_draft_model()  # as our DFlashWorker does before SGLang loads the drafter
                    result["draft"]["attn"] = _attempt_value(_build_model, draft_mc, draft_args)
                    result["draft"]["weights"] = _WEIGHTS.get(draft_mc.hf_config.architectures[0])
    return result


def _attempt_value(fn, *args):
    """fn's value, or {"error": ...} (a model the CPU engine cannot build is a result, not a crash of the probe)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}


def _attempt(fn, *args) -> dict:
    try:
        return {"ok": True, **fn(*args)}
    except BaseException as e:  # noqa: BLE001 - every failure is a result the test reports with its traceback
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


def published_gemma4_text_view(out: Path, text_config: dict) -> dict:
    """ModelConfig facts of the published Gemma-4 layout (the multimodal wrapper around `text_config`), loaded by
    SGLang's own config code: the reference that our written text-only target must reproduce."""
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_dflash.targets.shapes import published_wrapper_config

    d = out / "published"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(published_wrapper_config(text_config)))
    mc = ModelConfig(model_path=str(d), dtype="float32")
    facts = _model_facts(mc)
    facts.update({k: getattr(mc.hf_text_config, k, None) for k in
                  ("head_dim", "v_head_dim", "swa_head_dim", "swa_v_head_dim", "num_key_value_heads",
                   "swa_num_key_value_heads", "layer_types", "sliding_window")})
    return facts


def preset_server_args(script: Path, method: str, dummy_dir: Path) -> dict:
    """A launch/ preset's command (--dummy: the shape's full-size configs, no weights) through SGLang's ServerArgs
    post-init, as launch_server builds it: argument checks, model-specific adjustments (they read the target's
    config), and with --method ours our DFLASH start-up checks against the drafter config. The presets are GPU
    commands: the device is given as cuda (post-init only reads it; nothing touches a GPU here)."""
    import shlex
    import subprocess

    from sglang.srt.server_args import ServerArgs

    out = subprocess.run(["bash", str(script), "--dry-run", "--method", method, "--dummy", str(dummy_dir)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    toks = shlex.split(out)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    server_args = ServerArgs.from_cli_args(parser.parse_args(toks[toks.index("-m") + 2:] + ["--device", "cuda"]))
    return {"speculative_algorithm": server_args.speculative_algorithm,
            "attention_backend": server_args.attention_backend,
            "draft_attention_backend": server_args.speculative_draft_attention_backend,
            "num_draft_tokens": server_args.speculative_num_draft_tokens,
            "replay_ssm": bool(server_args.enable_linear_replayssm_spec)}


def main(argv: list[str]) -> int:
    import torch
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.plugins import load_plugins

    from sglang_dflash.targets import shapes

    load_plugins()  # as launch_server and every SGLang process do: our DFLASH start-up checks are hooks
    memory_pool.torch = _CudaLiteralToCpu(torch)
    # the models themselves are built only under SGLang's CPU engine (the test sets it up when gcc can build the
    # stub libcuda it needs); models are built once per shape, in its DFLASH case (target and draft)
    build_models = os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"
    out = Path(argv[0])
    results = {"build_models": build_models}
    for name, shape in shapes.SHAPES.items():
        target, drafter = shapes.shrink_pair(shape)
        shape_dir = out / name
        shapes.write(dataclasses.replace(shape, target=target, drafter=drafter), shape_dir)
        # SGLang accepts only GPU attention backends for Gemma-4 and gpt-oss (server_args.py: triton, trtllm_mha,
        # fa3, ...); the others take the CPU backend. Nothing runs attention here, the choice only passes SGLang's
        # argument checks.
        backend = "triton" if target["model_type"] in ("gemma4_text", "gpt_oss") else "torch_native"
        for mode in ("plain", "dflash"):
            results[f"{name}/{mode}"] = _attempt(start, shape_dir, mode == "dflash", backend,
                                                 build_models and mode == "dflash")
        if target["model_type"] == "gemma4_text":
            results[f"{name}/published"] = _attempt(published_gemma4_text_view, shape_dir, target)
            # the config as it was written before the fix (HF naming only): SGLang's own failure, kept as evidence
            raw_dir = out / f"{name}-hf-naming"
            (raw_dir / "target").mkdir(parents=True, exist_ok=True)
            (raw_dir / "target" / "config.json").write_text(json.dumps(target))
            results[f"{name}/hf-naming"] = _attempt(start, raw_dir, False, backend)
    launch = Path(__file__).resolve().parents[1] / "launch"
    for script in sorted(launch.glob("*.sh")):
        if script.name == "common.sh":
            continue
        dummy_dir = out / "presets" / script.stem
        shapes.write(script.stem, dummy_dir)  # what `--dummy DIR` writes on first use (the preset name = shape name)
        for method in ("none", "ours"):
            results[f"preset:{script.stem}/{method}"] = _attempt(preset_server_args, script, method, dummy_dir)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
