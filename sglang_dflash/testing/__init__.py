"""Running real SGLang servers for tests and benchmarks: the one launcher, the CPU engine, tiny checkpoints.

Not used inside SGLang (that is sglang_dflash.serving). Every module here imports only the standard library at
module level, so this package imports cheaply.
"""

from .checkpoints import SPECIALS, build_tokenizer, save_drafter_dir, save_for_sglang, save_tiny_target
from .cpu_engine import CPU_SERVER_ARGS, build_stub_libcuda, cpu_server_env
from .server import WORKER_ENV, Server, free_port, launch_server, server_argv, worker_env

__all__ = ["SPECIALS", "build_tokenizer", "save_drafter_dir", "save_for_sglang", "save_tiny_target", "free_port", "CPU_SERVER_ARGS",
           "build_stub_libcuda", "cpu_server_env", "WORKER_ENV", "Server", "launch_server", "server_argv",
           "worker_env"]
