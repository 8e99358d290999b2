"""SGLang's CPU engine on a machine without a GPU: a stub libcuda, the server environment, the test servers' flags.

Used by the CPU server tests (tests/serving), the shape start-up tests, and `sglang-dflash serve` on CPU (the stub).

Why a stub libcuda: the PyPI sglang-kernel wheel is CUDA-only and its library links ``libcuda.so.1``; a CPU host
has none, so ``import sgl_kernel`` fails. A stub whose driver entry points all answer CUDA_ERROR_NO_DEVICE lets
the wheel import while ``torch.cuda.is_available()`` stays False. It goes on LD_LIBRARY_PATH of the server only.
"""

from __future__ import annotations

import os
import subprocess
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


def cpu_server_env(stub_dir: str | Path, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               # a stopped server's launcher reads its scheduler's SIGTERM exit as a crash and sleeps 5 s "to let GPU
               # activity settle" before py-spy and CUDA core dumps: ~6 s of every test server's stop, none of use
               SGLANG_PYSPY_DUMP_BEFORE_CRASH="0", SGLANG_CUDA_COREDUMP_BEFORE_CRASH="0")
    env["LD_LIBRARY_PATH"] = f"{stub_dir}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    env.update(extra or {})
    return env


# --sleep-on-idle: an idle SGLang scheduler otherwise busy-polls a whole core (measured: 0.5-1.0 core, 0.01 with
# it); on the 2-core CI machine every idle server (the shared baseline between comparisons, a test's plain server
# while its DFLASH server answers) halved the CPU left for the server under test. Wakes on the request's message.
CPU_SERVER_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "8192",
                   "--max-running-requests", "24", "--disable-overlap-schedule", "--grammar-backend", "none",
                   "--sampling-backend", "pytorch", "--skip-server-warmup", "--mem-fraction-static", "0.5",
                   "--sleep-on-idle"]
