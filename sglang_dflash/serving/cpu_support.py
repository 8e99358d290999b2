"""Running a real SGLang 0.5.17 server on a CPU-only machine: tiny checkpoints, a stub libcuda, a bounded launcher.

Used by tests/serving (CI on CPU) and by the GPU end-to-end script (the launcher and the checkpoints only).

Why a stub libcuda: the PyPI sglang-kernel wheel is CUDA-only and its library links ``libcuda.so.1``; a CPU host
has none, so ``import sgl_kernel`` fails. A stub whose driver entry points all answer CUDA_ERROR_NO_DEVICE lets
the wheel import while ``torch.cuda.is_available()`` stays False. It goes on LD_LIBRARY_PATH of the server only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# Driver symbols sgl_kernel's libraries import (nm -D --undefined-only), plus the usual init/query calls.
_STUB_SYMBOLS = (
    "cuInit cuDriverGetVersion cuDeviceGet cuDeviceGetCount cuDeviceGetName cuDeviceGetAttribute "
    "cuDeviceTotalMem_v2 cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRelease_v2 cuCtxGetCurrent cuCtxSetCurrent "
    "cuCtxPushCurrent_v2 cuCtxPopCurrent_v2 cuCtxGetDevice cuCtxFromGreenCtx cuDevResourceGenerateDesc "
    "cuDevSmResourceSplitByCount cuDeviceGetDevResource cuGreenCtxCreate cuGreenCtxDestroy "
    "cuGreenCtxGetDevResource cuPointerGetAttribute cuStreamCreate cuModuleLoadData cuModuleGetFunction "
    "cuLaunchKernel cuLaunchKernelEx cuFuncSetAttribute cuMemAlloc_v2 cuMemFree_v2 cuGetProcAddress "
    "cuGetProcAddress_v2 cuGetExportTable cuModuleUnload cuLibraryLoadData cuLibraryGetKernel"
).split()


def build_stub_libcuda(out_dir: str | Path) -> Path:
    """Compile a stub libcuda.so.1 into out_dir (gcc, < 1 s) and return out_dir. Idempotent."""
    out_dir = Path(out_dir)
    lib = out_dir / "libcuda.so.1"
    if lib.is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    src = ["/* stub CUDA driver: every call reports CUDA_ERROR_NO_DEVICE (100) */"]
    for name in _STUB_SYMBOLS:
        if name == "cuGetErrorString":
            continue
        src.append(f"int {name}() {{ return 100; }}")
    src.append('int cuGetErrorString(int e, const char **s) { if (s) *s = "no CUDA device (stub)"; return 0; }')
    src.append('int cuGetErrorName(int e, const char **s) { if (s) *s = "CUDA_ERROR_NO_DEVICE"; return 0; }')
    c_file = out_dir / "stub_cuda.c"
    c_file.write_text("\n".join(src) + "\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(c_file), "-Wl,-soname,libcuda.so.1"],
                   check=True, capture_output=True)
    return out_dir


# --------------------------------------------------------------------------------------------- tiny checkpoints
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512):
    """A byte-level BPE trained offline on torch's functional.py; ids 0..4 are SPECIALS (eos = 1, mask = 4)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    src = Path(torch.__file__).parent / "functional.py"
    text = [line for line in src.read_text().splitlines() if line.strip()]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT
    fast.save_pretrained(str(out_dir))
    return fast


def _fix_config_for_sglang(path: Path, dtype: str) -> None:
    """transformers 5 writes only rope_parameters; SGLang 0.5.17 reads rope_theta (falls back to 10000)."""
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg:
        cfg["rope_theta"] = rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")


def save_tiny_target(out_dir: str | Path, arch: str = "qwen3", hidden_size: int = 64, num_layers: int = 4,
                     peak: float = 8.0, seed: int = 0, vocab_size: int = 512, dtype: str = "float32",
                     tie_word_embeddings: bool = False):
    """A tiny random target (sglang_dflash.tiny) as an HF checkpoint directory with a tokenizer. Returns the model.

    ``tie_word_embeddings``: the (peak-scaled) lm_head becomes the embedding table too, for model classes that
    always compute logits with their embedding table (SGLang 0.5.17's Gemma3ForCausalLM)."""
    import torch

    from ..tiny import tiny_target

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab_size)
    model = tiny_target(arch, vocab_size=len(tok), hidden_size=hidden_size, num_layers=num_layers, seed=seed,
                        peak=peak, dtype=getattr(torch, dtype))
    if tie_word_embeddings:
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(model.get_output_embeddings().weight)
        model.config.tie_word_embeddings = True
        model.tie_weights()
    model.save_pretrained(str(out))
    _fix_config_for_sglang(out, dtype)
    return model


def save_drafter_dir(drafter, target_dir: str | Path, out_dir: str | Path, dtype: str = "float32",
                     mask_token: str | None = "<|mask|>") -> None:
    """Write a drafter (sglang_dflash.drafter.DFlashDrafter) in the published layout, with the target's tokenizer.
    mask_token: the name written next to mask_token_id (the tiny tokenizers' "<|mask|>"; None: id only)."""
    import shutil

    import torch

    from ..checkpoint import save_drafter

    out = Path(out_dir)
    save_drafter(drafter, out, dtype=getattr(torch, dtype))
    cfg = json.loads((out / "config.json").read_text())
    if mask_token:
        cfg["dflash_config"]["mask_token"] = mask_token
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    cfg.setdefault("rope_theta", 10000.0)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in Path(target_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, out / f.name)


# ------------------------------------------------------------------------------------------------- the server
@dataclass
class Server:
    """A launch_server process in its own process group; stop() kills that group by PID."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    argv: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def wait_healthy(self, timeout_s: float) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if not self.alive():
                raise RuntimeError(f"server exited with {self.proc.returncode} before /health; log tail:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not healthy after {timeout_s} s; log tail:\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> None:
        pgid = self.proc.pid  # start_new_session=True: the server leads its own group
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        t0 = time.time()
        while time.time() - t0 < grace_s:
            self.proc.poll()  # reap the leader: a zombie still counts as a member of its group
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def cpu_server_env(stub_dir: str | Path, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["LD_LIBRARY_PATH"] = f"{stub_dir}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    env.update(extra or {})
    return env


CPU_SERVER_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "8192",
                   "--max-running-requests", "24", "--disable-overlap-schedule", "--grammar-backend", "none",
                   "--sampling-backend", "pytorch", "--skip-server-warmup", "--mem-fraction-static", "0.5"]


def launch_server(model_path: str | Path, port: int, log_path: str | Path, extra_args: list[str] = (),
                  env: dict | None = None) -> Server:
    """Start `python -m sglang.launch_server` in a new session (own process group) and return at once."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", "127.0.0.1",
            "--port", str(port), *extra_args]
    log_path = Path(log_path)
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    return Server(proc, port, log_path, argv)
