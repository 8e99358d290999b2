"""Server-argument handling for DFLASH with our worker: everything that can be checked before a model loads.

Runs in the launcher process (SGLang's ``_handle_dflash`` step), so a bad setup stops the server with a
non-zero exit and one message naming the bad value and the fix, instead of failing later inside a scheduler.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from pathlib import Path

from ..config import DFlashConfig, DFlashConfigError
from . import compat
from .errors import DFlashStartupError

logger = logging.getLogger("sglang_dflash")

GPU_DRAFT_BACKENDS = ("triton", "fa3", "fa4", "flashinfer")
CPU_DRAFT_BACKENDS = ("torch_native",)


def _is_cpu(server_args) -> bool:
    return str(server_args.device or "").startswith("cpu")


def supported_draft_backends(server_args) -> tuple[str, ...]:
    if _is_cpu(server_args):
        return CPU_DRAFT_BACKENDS
    cc = gpu_capability(server_args)
    return tuple(b for b in GPU_DRAFT_BACKENDS if (b != "flashinfer" or importlib.util.find_spec("flashinfer"))
                 and (cc is None or cc[0] in ARCH_NEEDS.get(b, {}).get("draft", (cc[0],))))


# Attention backends that run on some GPU generations only: backend -> {role: compute-capability majors}, the roles
# being the target's prefill and decode and our worker's draft. SGLang 0.5.17's own rules: it checks the MLA ones
# and trtllm_mha prefill in its attention-backend step (naming no fix), fa3 and hpc_ops only once the model has
# loaded (layers/attention/attention_registry.py, hpc_ops_backend.py). fa4 runs on 8.x to 12.x (its vendored
# flash_attn.cute dispatches each), fa4 draft attention served on an H100 (benchmarks/results/fa4-draft-h100).
ARCH_NEEDS = {
    "trtllm_mha": {"prefill": compat.TRTLLM_MHA_PREFILL_MAJORS, "decode": (9, 10, 12)},
    "trtllm_mla": dict.fromkeys(("prefill", "decode"), (10, 11, 12)),
    "tokenspeed_mla": dict.fromkeys(("prefill", "decode"), (10, 11, 12)),
    "cutedsl_mla": {"decode": (10,)},
    "fa3": dict.fromkeys(("prefill", "decode", "draft"), (8, 9)),
    "hpc_ops": dict.fromkeys(("prefill", "decode"), (9,)),
}


def gpu_capability(server_args) -> tuple[int, int] | None:
    """The compute capability of the server's first GPU, or None off CUDA (the check then does not apply)."""
    if not str(server_args.device or "cuda").startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(int(getattr(server_args, "base_gpu_id", 0) or 0)))


def _attention_flags(args):
    """(flag, backend, role) of each attention backend set on the command line (the split flags win)."""
    prefill = ("--prefill-attention-backend", args.prefill_attention_backend) if args.prefill_attention_backend \
        else ("--attention-backend", args.attention_backend)
    decode = ("--decode-attention-backend", args.decode_attention_backend) if args.decode_attention_backend \
        else ("--attention-backend", args.attention_backend)
    draft = ("--speculative-draft-attention-backend", args.speculative_draft_attention_backend)
    return [(flag, backend, role) for (flag, backend), role in ((prefill, "prefill"), (decode, "decode"),
                                                                (draft, "draft")) if backend]


def check_attention_architecture(server_args) -> None:
    """Refuse, before any model loads, an attention backend that this GPU's generation cannot run (ARCH_NEEDS)."""
    cc = gpu_capability(server_args)
    if cc is None:
        return
    for flag, backend, role in _attention_flags(server_args):
        majors = ARCH_NEEDS.get(backend, {}).get(role)
        if majors is None or cc[0] in majors:
            continue
        fix = "fa4 (served on Hopper) or triton" if role == "draft" and cc[0] == 9 else "triton"
        raise DFlashStartupError(
            f"{flag} {backend}: SGLang {compat.SGLANG_VERSION} runs {backend} "
            f"{'for the draft' if role == 'draft' else f'for {role}'} on compute capability "
            f"{' / '.join(f'{m}.x' for m in majors)} only, and this GPU is {cc[0]}.{cc[1]}. Fix: {flag} {fix}")


def check_architecture_first(original, server_args, *args, **kwargs):
    """AROUND hook for SGLang's attention-backend step (``compat.ATTENTION_CHECKS_HOOK``): it runs before
    ``_handle_dflash`` and refuses some of these backends in its own words, without a fix; a DFLASH server gets
    ours first."""
    view = compat.args_view(server_args)
    if str(view.speculative_algorithm or "").upper() == "DFLASH":
        check_attention_architecture(view)
    return original(server_args, *args, **kwargs)


def resolve_draft_attention_backend(server_args) -> str:
    """The draft's attention backend: the flag if supported (error otherwise), else triton / torch_native."""
    server_args, record = compat.args_view(server_args), server_args  # reads see earlier resolution steps
    choices = supported_draft_backends(server_args)
    backend = server_args.speculative_draft_attention_backend
    if backend is None:
        backend = "torch_native" if _is_cpu(server_args) else "triton"
    elif backend not in choices:
        raise DFlashStartupError(
            f"--speculative-draft-attention-backend {backend!r} is not supported by the sglang-dflash worker on "
            f"device {server_args.device!r}. Fix: use one of {list(choices)}")
    compat.set_args(record, "sglang_dflash.resolve_draft_attention_backend",
                    speculative_draft_attention_backend=backend)
    return backend


# owner/name as the Hugging Face Hub spells a model id (no leading "/", ".", "~"; one slash)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def check_draft_model_path(path: str) -> None:
    """The drafter must be a local directory, or something that can be a Hub model id (owner/name): accepted
    online (the hub resolves it or says why not), and offline (HF_HUB_OFFLINE) only if it is cached. Otherwise SGLang's first use of the path (reading its config to resolve algorithm
    aliases) fails with huggingface_hub's "Repo id must be in the form ..." or a hub lookup error that never
    says the directory is missing; this says so, naming it."""
    p = Path(path).expanduser()
    if p.is_dir():
        return
    fix = ("Fix: pass the drafter's checkpoint directory (config.json + *.safetensors); the SmolLM2-135M-Instruct "
           "drafter ships inside this package (sglang_dflash/assets/SmolLM2-135M-Instruct-DFlash-b16), and "
           "`sglang-dflash serve --dry-run` prints a complete working command")
    if p.exists():
        raise DFlashStartupError(f"--speculative-draft-model-path {path!r} is a file, not a directory. {fix}")
    where = f"no such directory ({p.absolute()})"
    if not _REPO_ID.match(str(path)):
        raise DFlashStartupError(f"--speculative-draft-model-path {path!r}: {where}. {fix}")
    if _hub_offline() and not _in_hub_cache(str(path)):
        raise DFlashStartupError(f"--speculative-draft-model-path {path!r}: {where}, and not in the Hugging Face "
                                 f"cache as a model id (HF_HUB_OFFLINE is set, so it cannot be downloaded). {fix}")


def check_draft_path_before_alias(original, speculative_algorithm, speculative_draft_model_path, *args, **kwargs):
    """AROUND hook for SGLang's ``_resolve_speculative_algorithm_alias``: the first place that opens the drafter
    path (before ``_handle_dflash``), so the existence check must run here to come first."""
    if str(speculative_algorithm or "").upper() == "DFLASH" and speculative_draft_model_path is not None:
        check_draft_model_path(speculative_draft_model_path)
    return original(speculative_algorithm, speculative_draft_model_path, *args, **kwargs)


def load_draft_config(server_args) -> DFlashConfig:
    """The drafter's config, parsed once per process (`DFlashConfig.load`): here in the launcher, and in each
    scheduler process by the worker, whose draft model then gets the same object (draft_model.drafter_config)."""
    path = server_args.speculative_draft_model_path
    if path is None:
        raise DFlashStartupError("--speculative-algorithm DFLASH needs --speculative-draft-model-path. "
                                 "Fix: pass the drafter checkpoint directory")
    if not Path(path).is_dir():
        raise DFlashStartupError(f"--speculative-draft-model-path {path!r} is not a local directory. Fix: download "
                                 "the drafter (config.json + *.safetensors) and pass its directory")
    return DFlashConfig.load(path)


def check_draft_weight_files(server_args) -> None:
    """Every *.safetensors file of the drafter is whole (header parsed, size = the header's last byte): a cut
    download stops the launcher here, naming the file and the fix, before any model loads, instead of failing
    later in a scheduler with safetensors' own message. Reads the headers only (`checkpoint.check_safetensors_file`;
    the NaN / inf check runs as the weights load). Skipped for `--load-format dummy` drafters (random weights of a
    shape: the directory holds a config only)."""
    from ..checkpoint import check_safetensors_file, weight_files

    draft_format = getattr(server_args, "speculative_draft_load_format", None) or server_args.load_format
    if draft_format == "dummy":
        return
    for f in weight_files(server_args.speculative_draft_model_path):
        check_safetensors_file(f)


def _target_config(server_args):
    cfg_file = Path(server_args.model_path) / "config.json"
    if cfg_file.is_file():
        return json.loads(cfg_file.read_text())
    return compat.target_hf_config(server_args)


def check_mask_token(cfg: DFlashConfig, server_args) -> None:
    """A named mask token (dflash_config.mask_token) must exist in the tokenizer with the configured id."""
    name = (cfg.raw.get("dflash_config") or {}).get("mask_token") or cfg.raw.get("mask_token")
    if not name or server_args.skip_tokenizer_init:
        return
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(server_args.tokenizer_path or server_args.model_path,
                                            trust_remote_code=server_args.trust_remote_code)
    except Exception as e:  # the server's own tokenizer loading reports this better
        logger.warning("sglang-dflash: could not load the tokenizer to check the mask token (%s)", e)
        return
    tid = tok.convert_tokens_to_ids(name)
    if tid is None or tid == tok.unk_token_id and name != tok.unk_token:
        raise DFlashConfigError("dflash_config.mask_token", name, "is not a token of the target's tokenizer",
                                "use a drafter made for this target, or add the token to the tokenizer")
    if tid != cfg.mask_token_id:
        raise DFlashConfigError("dflash_config.mask_token_id", cfg.mask_token_id,
                                f"but the tokenizer maps mask_token {name!r} to id {tid}",
                                "make mask_token_id match the tokenizer")


LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"  # SGLang's own switch


def check_context_length(cfg: DFlashConfig, server_args) -> None:
    """The draft model is built for the target's context length; SGLang refuses a drafter whose own (derived from its
    config as SGLang derives any model's) is shorter, but only inside the scheduler, after the target has loaded.
    Say so here, with the two ways out."""
    from sglang.srt.utils.hf_transformers.common import get_context_length

    from types import SimpleNamespace

    drafter = get_context_length(SimpleNamespace(**cfg.raw))
    target = compat.target_context_len(server_args)
    if target <= drafter or os.environ.get(LONGER_CONTEXT_ENV, "").strip().lower() in ("1", "true"):
        return
    raise DFlashStartupError(
        f"the target's context length {target} exceeds the drafter's {drafter} (its config's "
        f"max_position_embeddings; {server_args.speculative_draft_model_path}), and SGLang builds the draft model "
        f"for the target's length. Fix: pass --context-length {drafter}, or set {LONGER_CONTEXT_ENV}=1 to let the "
        f"drafter run at positions past {drafter} (output stays exactly the target's; acceptance may fall there)")


def check_tensor_parallel(cfg: DFlashConfig, server_args) -> None:
    """The drafter's heads are split over the ranks as the target's are (draft_model.rank_heads)."""
    from .draft_model import rank_heads

    try:
        rank_heads(cfg, int(server_args.tp_size))
    except ValueError as e:
        raise DFlashStartupError(str(e)) from None
    if cfg.is_dflash2 and int(server_args.tp_size) > 1:
        raise DFlashStartupError(f"--tp-size {server_args.tp_size} with a DFlash2 drafter ({cfg.architecture}): its "
                                 "candidate selector needs the whole vocabulary's draft logits on one rank, and the "
                                 "sglang-dflash worker does not gather them yet. Fix: --tp-size 1, or a DFlash drafter")


def check_short_draft(cfg: DFlashConfig) -> None:
    """SGLANG_DFLASH_SHORT_DRAFT=1 (a narrow step drafts k + 1 positions) with a DFlash2 drafter: its convolutions
    run over whole blocks of block_size rows (dflash2.GroupedCausalConv), which a short draft pass is not."""
    from ..settings import SHORT_DRAFT, current

    if current().short_draft and cfg.is_dflash2:
        raise DFlashStartupError(f"{SHORT_DRAFT}=1 with a DFlash2 drafter ({cfg.architecture}): its convolutions run "
                                 f"over whole blocks of {cfg.block_size} positions, and a short draft pass has k + 1. "
                                 f"Fix: unset {SHORT_DRAFT}, or a DFlash drafter")


def check_tree(cfg: DFlashConfig, server_args) -> int:
    """SGLANG_DFLASH_TREE (tree verify, serving/tree_step.py): its size against the drafter's block, and the setups
    a tree verify cannot serve exactly, refused before any model loads. Returns the tree size (0: off). Hybrid
    (recurrent) targets are refused by the worker, which knows the model class."""
    from ..settings import TREE, SettingsError, tree_size

    try:
        size = tree_size(cfg.block_size)
    except SettingsError as e:
        raise DFlashStartupError(str(e)) from None
    if not size:
        return 0
    off = f"Fix: {TREE}=0 (the chain)"
    if cfg.is_dflash2:
        raise DFlashStartupError(f"{TREE}={size} with a DFlash2 drafter ({cfg.architecture}): its selector drafts one "
                                 f"path whose positions depend on each other, which a best-first tree of independent "
                                 f"positions does not describe. {off}, or a DFlash drafter")
    if int(server_args.tp_size) > 1:
        raise DFlashStartupError(f"{TREE}={size} at --tp-size {server_args.tp_size}: the tree is built from the whole "
                                 f"vocabulary's draft logits on one rank, not gathered across ranks yet. Fix: "
                                 f"--tp-size 1, or {TREE}=0")
    page = int(getattr(server_args, "page_size", None) or 1)
    if page != 1:
        raise DFlashStartupError(f"{TREE}={size} at --page-size {page}: a tree commit moves the accepted nodes' KV slots "
                                 f"to the path's positions, which a paged pool ties to their pages. Fix: --page-size 1, "
                                 f"or {TREE}=0")
    if not _is_cpu(server_args):
        from ..settings import VERIFY_ATTENTION, get

        flags = [(flag, backend) for flag, backend, role in _attention_flags(server_args) if role != "draft"]
        if not flags or any(backend != "triton" for _, backend in flags):
            given = ", ".join(f"{f} {b}" for f, b in flags) or "no --attention-backend (SGLang picks one)"
            raise DFlashStartupError(f"{TREE}={size} on GPU needs the target's attention on triton (our verify "
                                     f"kernel's tree mode plugs into SGLang's triton backend); got {given}. Fix: "
                                     f"--attention-backend triton, or {TREE}=0")
        if get(VERIFY_ATTENTION) == "sglang":
            raise DFlashStartupError(f"{TREE}={size} with {VERIFY_ATTENTION}=sglang: SGLang's verify kernel has no tree "
                                     f"mode. Fix: unset {VERIFY_ATTENTION}, or {TREE}=0")
    return size


REPLAY_SSM_FLAG = "--enable-linear-replayssm-spec"


def _replay_ssm_blocker(server_args) -> str | None:
    """Why SGLang's replay commit cannot serve this Gated DeltaNet target's DFLASH verify, or None when it can. The
    conditions SGLang checks for the flag (server_args.py ``_handle_linear_attn_backend``, which ran before this step
    with the flag off, so they are checked here), plus where its kernels and pools exist."""
    device = str(server_args.device or "cuda")
    if not device.startswith("cuda"):
        return f"--device {device}: the replay's verify and commit kernels are CUDA Triton kernels"
    if not compat.REPLAY_SSM_AUTO:
        return (f"SGLang {compat.SGLANG_VERSION} replays Gated DeltaNet state by a circular history the plugin has not "
                f"been checked against (docs/notes-replayssm.md); pass {REPLAY_SSM_FLAG} to use it")
    decode = server_args.linear_attn_decode_backend or server_args.linear_attn_backend
    if decode not in ("triton", "flashinfer"):
        return f"linear-attention decode backend {decode!r}: the replay needs triton or flashinfer"
    if getattr(server_args, "enable_linear_replayssm", False):
        return "--enable-linear-replayssm is on, and SGLang refuses both together (they share the ring)"
    if getattr(server_args, "disaggregation_mode", "null") == "prefill":
        return "a PD prefill server runs no verify"
    if getattr(server_args, "enable_unified_memory", False):
        return "--enable-unified-memory builds no replay window"
    from sglang.srt.speculative.ragged_verify import RaggedVerifyMode, read_ragged_verify_mode

    if read_ragged_verify_mode() is not RaggedVerifyMode.STATIC:
        return "SGLANG_RAGGED_VERIFY_MODE is not static, and the Gated DeltaNet ring-write needs the static layout"
    return None


def check_replay_ssm(server_args, record) -> bool:
    """Hybrid targets keep their concurrency (issue #44): on a Gated DeltaNet target (Qwen3.5, Qwen3-Next) SGLang's
    memory plan reserves, per running request, a full recurrent-state snapshot per draft position for the verify
    (16 states per request at a block of 16), which caps the running requests far below plain decoding's.
    ``--enable-linear-replayssm-spec`` replaces the snapshots by a record of each verified token's inputs, replayed at
    the commit (recurrent_state.py). Turned on here where it applies (`_replay_ssm_blocker`); elsewhere the snapshots
    stay, with a log line saying why. An operator's flag is kept as given (SGLang's flag is store_true: it cannot be
    set to false, so only "on" is an explicit choice). Returns whether the flag is on."""
    if getattr(server_args, "enable_linear_replayssm_spec", False):
        logger.info("sglang-dflash: %s given: hybrid targets commit their recurrent state by replay", REPLAY_SSM_FLAG)
        return True
    from types import SimpleNamespace

    from sglang.srt.configs.hybrid_arch import hybrid_gdn_config

    if hybrid_gdn_config(SimpleNamespace(hf_config=compat.target_hf_config(server_args))) is None:
        return False  # no Gated DeltaNet layers: nothing to replay
    from ..settings import REPLAY_SSM, get

    # on by default since its GPU equality run (benchmarks/results/floor-qwen3.5-replay-chain-h200); 0 is the way back
    reason = None if get(REPLAY_SSM) else f"{REPLAY_SSM}=0"
    reason = reason or _replay_ssm_blocker(server_args)
    if reason is not None:
        logger.info("sglang-dflash: hybrid (Gated DeltaNet) target: recurrent state snapshots per draft position "
                    "kept (%s off): %s", REPLAY_SSM_FLAG, reason)
        return False
    compat.set_args(record, "sglang_dflash.check_replay_ssm", enable_linear_replayssm_spec=True)
    logger.info("sglang-dflash: hybrid (Gated DeltaNet) target: %s turned on: the verify records each token's inputs "
                "and the commit replays the accepted ones, instead of a recurrent state snapshot per draft position "
                "and running request (the memory SGLang reserves for those goes to running requests)", REPLAY_SSM_FLAG)
    return True


def handle_dflash_args(original, server_args) -> None:
    """Replaces SGLang's ``_handle_dflash`` when our worker is selected (it also lifts the CUDA-only restriction)."""
    server_args, record = compat.args_view(server_args), server_args  # reads see earlier resolution steps
    check_attention_architecture(server_args)
    cfg = load_draft_config(server_args)
    check_draft_weight_files(server_args)
    cfg.validate_against_target(_target_config(server_args))
    check_mask_token(cfg, server_args)

    if server_args.pp_size != 1:
        raise DFlashStartupError(f"--pp-size {server_args.pp_size}: the sglang-dflash worker supports pp_size 1. "
                                 "Fix: drop --pp-size")
    if compat.dp_attention_enabled(server_args):
        raise DFlashStartupError("--enable-dp-attention is not supported by the sglang-dflash worker. "
                                 "Fix: drop it (tensor parallelism works)")
    from . import disagg
    from ..settings import current as settings

    disagg.check_at_launch(server_args, _target_config(server_args), pd_switch=settings().pd,
                           release_ok=compat.pd_release_ok(), oracle=bool(settings().oracle_drafts))
    check_tensor_parallel(cfg, server_args)
    tree = check_tree(cfg, server_args)
    check_short_draft(cfg)
    check_context_length(cfg, server_args)
    from .oracle_drafts import check_at_launch as check_oracle_drafts

    check_oracle_drafts(server_args, cfg.block_size)  # benchmarks only; refused early unless dummy weights
    if server_args.speculative_draft_window_size is not None:
        raise DFlashStartupError(f"--speculative-draft-window-size {server_args.speculative_draft_window_size}: "
                                 "not supported by the sglang-dflash worker yet. Fix: drop the flag "
                                 f"(or set {__package__}.plugin WORKER_ENV=builtin)")

    for flag in ("speculative_num_draft_tokens", "speculative_dflash_block_size"):
        value = getattr(server_args, flag, None)
        if value is not None and int(value) != cfg.block_size:
            raise DFlashStartupError(
                f"--{flag.replace('_', '-')} {value} does not match the drafter's block_size {cfg.block_size} "
                f"({server_args.speculative_draft_model_path}/config.json). Fix: pass "
                f"--{flag.replace('_', '-')} {cfg.block_size} or leave it out")
    # DFLASH verifies one chain of B tokens: EAGLE's steps/topk are fixed so that SGLang's KV accounting is right.
    source = "sglang_dflash.handle_dflash_args"
    compat.set_args(record, source, speculative_num_draft_tokens=cfg.block_size, speculative_num_steps=1,
                    speculative_eagle_topk=1)
    resolve_draft_attention_backend(record)
    check_replay_ssm(server_args, record)
    if server_args.max_running_requests is None and str(server_args.disaggregation_mode or "null") != "prefill":
        compat.set_args(record, source, max_running_requests=48)
        logger.info("sglang-dflash: --max-running-requests defaults to 48 with DFLASH (pass it to change)")
    if server_args.enable_mixed_chunk:
        compat.set_args(record, source, enable_mixed_chunk=False)
        logger.info("sglang-dflash: --enable-mixed-chunk is turned off (a DFLASH decode step is a verify block)")
    if tree:
        logger.info("sglang-dflash: tree verify of %d nodes (SGLANG_DFLASH_TREE) in qualifying steps; tree verifies "
                    "run eagerly (no CUDA graph replay: the verify graphs carry no tree mask)", tree)
